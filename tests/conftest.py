"""Settings shared by every test."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile

import jax
import pytest

# XLA:CPU spends most of a test's time compiling (each test builds its own small loops): in
# LLVM's optimisation passes, and in the fusion emitters (XLA:CPU's newer code generator for
# fused loops; the older elemental emitter compiles a loop in half the time). Both change how
# fast the code runs, and together at most the last bit of a float (tests that compare two
# programs bit for bit say so). The test suite runs without them on the CPU: about 45% less
# wall time. XLA:CPU also splits a program's code into 32 parts that LLVM compiles on parallel
# threads, each with its own set-up; with one test process per core there is no idle core to
# run them on, and one part compiles a loop's code in less CPU (the same tokens at O0).
# Set before the backend starts (it reads XLA_FLAGS once); subprocesses inherit it.
# SPECJAX_TEST_LLVM_OPT=1 keeps XLA's defaults.
if os.environ.get("JAX_PLATFORMS") == "cpu" and not os.environ.get("SPECJAX_TEST_LLVM_OPT"):
  os.environ["XLA_FLAGS"] = " ".join(filter(None, [
      os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
      "--xla_llvm_disable_expensive_passes=true", "--xla_cpu_use_fusion_emitters=false",
      "--xla_cpu_parallel_codegen_split_count=1"]))

# Many tests compile the same programs (the same tiny models, shapes and rules): one persistent
# compilation cache for the whole run, made by the first process (pytest-xdist's controller, whose
# environment its workers and every subprocess inherit) and removed at its end. A run that sets
# JAX_COMPILATION_CACHE_DIR keeps its own.
_OWN_COMPILE_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ:
  _OWN_COMPILE_CACHE = tempfile.mkdtemp(prefix="specjax-test-compile-")
  os.environ.update(JAX_COMPILATION_CACHE_DIR=_OWN_COMPILE_CACHE,
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def pytest_collection_finish(session):
  """Python's cyclic garbage collector walks every live object in its oldest generation, and a
  test process holds millions (jax, flax, transformers, then the traced and compiled programs):
  the modules and tests collected so far are frozen out of its walks, and its younger
  generations are collected less often (each pass of tracing allocates and frees a great many
  small objects)."""
  gc.freeze()
  gc.set_threshold(10_000, 20, 1_000)


def pytest_unconfigure(config):
  if _OWN_COMPILE_CACHE and "PYTEST_XDIST_WORKER" not in os.environ:
    shutil.rmtree(_OWN_COMPILE_CACHE, ignore_errors=True)


def _memory_maps() -> int:
  try:
    with open(f"/proc/{os.getpid()}/maps") as f:
      return sum(1 for _ in f)
  except OSError:                                   # not Linux: no such limit to watch
    return 0


def _max_memory_maps() -> int:
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):
    return 0


@pytest.fixture(scope="module", autouse=True)
def compiled_programs_released():
  """Each program XLA:CPU compiles stays mapped (its code and data, a few memory maps each)
  for as long as JAX's caches hold it, and a test worker compiles thousands. Past the kernel's
  vm.max_map_count (65,530 by default) the next mapping fails inside XLA and the worker dies
  with a segfault or an abort in a compile. After a module, a worker past half the limit drops
  its compiled programs (later ones reload from the persistent compilation cache)."""
  yield
  limit = _max_memory_maps()
  if limit and _memory_maps() > limit // 2:
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session", autouse=True)
def highest_matmul_precision():
  """float32 matmuls run as TF32 on NVIDIA GPUs by default (~1e-3 off), which breaks the parity
  tests (1e-4 and tighter); pin them to full float32 for the session and, through the
  environment, for the subprocesses that CLI and multi-device tests start."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv("JAX_DEFAULT_MATMUL_PRECISION", "highest")
    with jax.default_matmul_precision("highest"):
      yield


@pytest.fixture(scope="session", autouse=True)
def dense_layout_pinned():
  """specjax.load's layout="auto" measures which dense layout is faster on the machine
  (models/layout_choice.py), and quant="auto" picks int8 by the CPU's flags: pin them to in_out
  and float weights, here and in subprocesses, so that no test's models depend on the machine
  (tests/test_dense_layout.py and tests/test_quant.py unset them to test the choices)."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv("SPECJAX_DENSE_LAYOUT", "in_out")
    patch.setenv("SPECJAX_QUANT", "off")            # quant="auto" keeps float weights
    yield


@pytest.fixture(scope="session", autouse=True)
def no_pair_built_in_a_test():
  """Building the embedded pair trains three models (about 15 minutes on 2 cores): a test that
  reaches it in-process (a load it did not stub) would hang the suite on a machine without the
  pair in its cache, and pass quickly on one that has it. Fail at once instead. The README's
  commands build the pair at a small step scale in subprocesses (tests/test_readme.py)."""
  from specjax.app import zoo

  def refuse(name, *args, **kwargs):
    raise RuntimeError(f"a test reached the build of the embedded pair {name!r} in-process: stub "
                       f"the load (and resolve.checkpoint_dir) it goes through")
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(zoo, "build", refuse)
    yield


def pytest_runtest_logreport(report):
  """With SPECJAX_FAILURES=FILE, each failure's id and traceback is appended to FILE as it
  happens, so that a run cut short by a time limit (tools/gpu_check.sh) still names them."""
  path = os.environ.get("SPECJAX_FAILURES")
  if report.failed and path and not os.environ.get("PYTEST_XDIST_WORKER"):
    with open(path, "a") as f:
      f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")
