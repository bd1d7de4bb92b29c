"""specjax's own CPU kernels, built once per machine with its C++ compiler and called from XLA
through the FFI: the products of int8 layers stored [out, in] and of int4 layers
(models/quant.py), and attention one query position at a time (models/attention.py).

Why: a decoding step reads every weight once, so an int8 step should cost a quarter of a float32
one. XLA:CPU's s8 x s8 -> s32 product reads int8 weights at about 10-13 GB/s on a 2-core AVX-512
machine, where its float32 product streams 33-43 GB/s, and it has a slow path for a one-row
product. `cpu_kernels.cc` streams the weights once and multiplies every activation row by them
(AVX-512 VNNI, AVX2, or plain C++, as the compiler's -march=native finds the CPU), splitting
the rows over XLA's intra-op threads; its AVX-512 VNNI build reads int8 and int4 weights in a
blocked layout (quant.block_int8, block_int4) that gives 16 rows' sums per multiply-add, and
where the CPU has AMX (Intel Xeon since Sapphire Rapids) and Linux lets the process use it, runs
a prompt's int8 products (more than 8 rows) on AMX's tile multiply, from the same layout,
1.6-2.8x faster than VNNI (`Status.amx`; docs/results.md). Its int8 sums are the same int32
numbers XLA's product gives (exact integer arithmetic), so a model's outputs are the same bits
with either kernel.
XLA has no int4 product on the CPU at all: without this kernel int4 layers are dequantized to
float32 inside every step (quant.int4_matmul), correct and several times slower. A quantized
model attends one query position at a time so that a verify pass gives each position a decoding
step's bits (attention.attend_each_position); in XLA that is a loop per position and per chunk
of keys, which cost a 4-position verify pass of the 1.5B target about 10 ms; the kernel runs each
(row, position, key/value head) with the same code, every sum in slot order.

Building: the first use compiles cpu_kernels.cc with $CXX (else c++ or g++) at -O2 -march=native
against jax's FFI headers, into CACHE/kernels/ under a key of the source, the compiler's
version, the CPU's flags and jaxlib's version (CACHE: $SPECJAX_CACHE, else ~/.cache/specjax).
About 10 s on 2 cores, once; only a quantized model asks for it (quant.reads_in_place).
$SPECJAX_KERNEL_MARCH, if set, replaces -march=native (e.g. "haswell": the AVX2 build on an
AVX-512 machine, with XLA_FLAGS=--xla_cpu_max_isa=AVX2 for XLA's own code, to see what a CPU
without AVX-512 runs). $SPECJAX_INT8_KERNEL chooses for all three:
"xla" (XLA's int8 product, int4 weights dequantized in each step, XLA's loop per position),
"specjax" (these kernels; an error when they cannot be built), unset: these kernels when they
build, else XLA's with a warning that says why and what to install.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import filelock
import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import layer_view

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cc")
PREFIX = "specjax"               # the FFI targets PREFIX_int8_dot, PREFIX_int4_dot, PREFIX_attend
ENV = "SPECJAX_INT8_KERNEL"
MARCH_ENV = "SPECJAX_KERNEL_MARCH"   # the build's -march (default native)
KERNELS = ("xla", "specjax")     # the values of $SPECJAX_INT8_KERNEL
# -O2, not -O3: -O3 compiled 2-3x longer (its unrolling of every template instance) for kernels
# no faster; the loops over register arrays that must unroll say so (#pragma GCC unroll), and
# GCC, whose -O2 vectorizes only loops without a remainder, gets -O3's cost model for that.
_FLAGS = ("-O2", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
_GCC_FLAGS = ("-fvect-cost-model=dynamic",)
_BUILD_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class Status:
  """Whether int8 products of [out, in] kernels, int4 products and attention one position at a
  time run on specjax's kernels (`active`), and a line saying which and why (`describe`), with
  the instruction set they were built for ("" if not) and whether a prompt's int8 products (more
  than 8 rows) run on AMX (`amx`: built for a CPU with it, and the OS lets the process use it)."""
  active: bool
  why: str
  isa: str = ""
  amx: bool = False

  def describe(self) -> str:
    if self.active:
      return f"specjax's CPU kernel ({self.isa}{', AMX for prompts' if self.amx else ''})"
    return f"XLA's product ({self.why})"


# The builds that read int8 and int4 weights in quant.block_int8's and block_int4's layout
# (cpu_kernels.cc); the others read the plain [N, K] matrices.
BLOCKED_ISAS = ("avx512-vnni",)


def reads_blocked() -> bool:
  """Whether this process's kernels read [out, in] int8 and int4 weights in the blocked layout
  (quant.block_int8, block_int4): they are in use and built for an instruction set of
  BLOCKED_ISAS."""
  return status().active and status().isa in BLOCKED_ISAS


def int8_dot(q: jax.Array, kernel) -> jax.Array:
  """q [M, K] int8 times kernel [N, K] int8 (an [out, in] int8 layer; in quant.block_int8's
  layout where reads_blocked()), or a layer_view.LayerOf of a stack of them, read in place ->
  int32 [M, N], on specjax's kernel (where status().active). vmap runs it once per mapped
  element."""
  stack, index = layer_view.stack_and_index(kernel)
  return _call("int8_dot", jax.ShapeDtypeStruct((q.shape[0], kernel.shape[0]), jnp.int32))(
      q, stack, index)


def int4_dot(q: jax.Array, packed, scale) -> jax.Array:
  """q [M, K] int8 times an int4 layer (packed uint8 [N, K / 2], scale float32 [N, K / 64]; the
  packing is quant.pack_int4's, in quant.block_int4's layout where reads_blocked(); or both
  layer_view.LayerOf of one layer's stacks, read in place) -> float32 [M, N]: sum over groups g
  of scale[n, g] x the exact integer sum of the group, on specjax's kernel (where
  status().active). K a multiple of 64."""
  packed_stack, index = layer_view.stack_and_index(packed)
  scale_stack, _ = layer_view.stack_and_index(scale)
  return _call("int4_dot", jax.ShapeDtypeStruct((q.shape[0], packed.shape[0]), jnp.float32))(
      q, packed_stack, scale_stack, index)


def attend_each_position(q: jax.Array, k, v, k_new: jax.Array, v_new: jax.Array,
                         positions: jax.Array, lengths: jax.Array, window: int | None = None,
                         scale: float | None = None) -> jax.Array:
  """models/attention.attend_each_position on specjax's kernel (where status().active), float32
  only: q [B, T, H, Dh]; the cache's k, v [B, Hkv, S, Dh] (read only: the slots below lengths[b]
  of row b), or layer_view.LayerOf of one layer of the stacked cache [L, B, Hkv, S, Dh], read in
  place; the block's k_new, v_new [B, T, Hkv, Dh] (slots lengths[b] .. lengths[b] + T - 1);
  positions int32 [B, T] (each query sees the slots <= its own and > its own - window), lengths
  int32 [B] -> [B, T, H, Dh]. Each (row, position, key/value head) runs the same code, every sum
  in slot order, so a position's output is the same bits in a pass of any width and a cache of
  any capacity; the cache is read where it lies, never copied with the block written."""
  index = jnp.asarray(k.index if isinstance(k, layer_view.LayerOf) else 0, jnp.int32)
  k, v = (x.stack if isinstance(x, layer_view.LayerOf) else x for x in (k, v))
  return _call("attend", jax.ShapeDtypeStruct(q.shape, jnp.float32))(
      q, k, v, index, k_new, v_new, positions.astype(jnp.int32),
      lengths.astype(jnp.int32), window=np.int64(window or 0),
      scale=np.float32(1.0 if scale is None else scale))


def _call(name: str, result: jax.ShapeDtypeStruct):
  """The FFI call of the kernel PREFIX_name returning `result` (vmap: once per mapped element);
  a RuntimeError naming the reason where the kernels are not in use."""
  if not status().active:
    raise RuntimeError(f"specjax's CPU kernels are not in use: {status().why}")
  return jax.ffi.ffi_call(f"{PREFIX}_{name}", result, vmap_method="sequential")


_DECIDING = threading.Lock()


def status() -> Status:
  """The kernel for this process, decided once: $SPECJAX_INT8_KERNEL, else built (or found
  built) and registered with XLA, else XLA's product with the reason logged as a warning."""
  with _DECIDING:                   # two threads tracing at once build and register it once
    return _decided()


@functools.cache
def _decided() -> Status:
  pinned = os.environ.get(ENV, "")
  if pinned and pinned not in KERNELS:
    raise ValueError(f"${ENV}={pinned!r}: use one of {', '.join(KERNELS)}, or unset it "
                     f"(specjax's kernel where it builds)")
  if pinned == "xla":
    return Status(False, f"${ENV}=xla")
  try:
    isa = _register(_build(build_flags()), PREFIX)
  except (OSError, RuntimeError, subprocess.SubprocessError) as err:
    if pinned == "specjax":
      raise RuntimeError(f"${ENV}=specjax, but specjax's int8 CPU kernel could not be built: "
                         f"{err}") from None
    march = os.environ.get(MARCH_ENV, "").strip()
    fix = (f"check ${MARCH_ENV}={march!r} (a -march value this compiler takes), or unset it"
           if march else "install a C++ compiler (g++) or set $CXX")
    log.warning("int8 products use XLA's kernel, about 2x slower here, and int4 layers are "
                "dequantized in every step: specjax's CPU kernels could not be built (%s); %s",
                err, fix)
    return Status(False, f"specjax's kernel could not be built: {err}")
  return Status(True, "built", isa, _REGISTERED[PREFIX][1])


def _compiler() -> str:
  found = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
  if not found:
    raise RuntimeError("no C++ compiler found (c++, g++ or $CXX)")
  return found


def build_flags() -> tuple[str, ...]:
  """The compiler flags of the kernels' build: _FLAGS with -march=$SPECJAX_KERNEL_MARCH where
  that is set."""
  march = os.environ.get(MARCH_ENV, "").strip()
  if not march:
    return _FLAGS
  if not march.replace("-", "").replace("_", "").replace(".", "").isalnum():
    raise ValueError(f"${MARCH_ENV}={march!r} is not a -march value: use one such as haswell, "
                     f"znver2 or x86-64-v3, or unset it (-march=native)")
  return tuple(f"-march={march}" if f == "-march=native" else f for f in _FLAGS)


def _build(flags: tuple[str, ...] = _FLAGS) -> Path:
  """The compiled kernel: CACHE/kernels/quant-KEY.so, compiled with `flags` when absent (module
  docstring), built by one process at a time."""
  compiler = _compiler()
  version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                           timeout=60, check=True).stdout
  flags = flags + (_GCC_FLAGS if _is_gcc(version) else ())
  key = hashlib.sha256("\0".join([SOURCE.read_text(encoding="utf-8"), version, cpu_flags(),
                                  jax.__version__, " ".join(flags)]).encode()).hexdigest()[:16]
  root = Path(os.environ.get("SPECJAX_CACHE") or Path.home() / ".cache" / "specjax")
  library = root / "kernels" / f"quant-{key}.so"
  if library.exists():
    return library
  library.parent.mkdir(parents=True, exist_ok=True)
  # Processes that start together (test workers, two decodes) build it once: the others wait.
  (root / "locks").mkdir(exist_ok=True)
  lock = filelock.FileLock(str(root / "locks" / f"kernels-{key}.lock"))
  try:
    lock.acquire(timeout=0)
  except filelock.Timeout:
    log.info("waiting for another process building specjax's CPU kernels into %s ...",
             library.parent)
    lock.acquire(timeout=_BUILD_TIMEOUT_S)
  try:
    if not library.exists():
      _compile(compiler, flags, library)
  finally:
    lock.release()
  return library


def _is_gcc(version: str) -> bool:
  """Whether `compiler --version` printed GCC's banner (clang's takes no GCC-only flags)."""
  return "Free Software Foundation" in version and "clang" not in version.lower()


def _compile(compiler: str, flags: tuple[str, ...], library: Path) -> None:
  """Compiles SOURCE into `library`, under a temporary name renamed at the end, so that no
  process ever loads half a file."""
  tmp = library.with_name(f".{library.name}.{os.getpid()}.tmp")
  command = [compiler, *flags, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(tmp)]
  log.info("building specjax's CPU kernels (once per machine): %s", " ".join(command))
  done = subprocess.run(command, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
  if done.returncode != 0:
    tmp.unlink(missing_ok=True)
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    raise RuntimeError(f"{Path(compiler).name} exited with {done.returncode}: "
                       f"{' '.join(errors[:3]) if errors else done.stderr.strip()[-600:]}")
  os.replace(tmp, library)


# prefix -> the instruction set of the library behind it, and whether it runs prompts on AMX
_REGISTERED: dict[str, tuple[str, bool]] = {}


def _register(library: Path, prefix: str) -> str:
  """Loads the kernels, registers them with XLA:CPU as PREFIX_int8_dot, PREFIX_int4_dot and
  PREFIX_attend;
  returns their instruction set. A prefix is registered once per process (XLA refuses a second
  library under one name): later calls return the first one's instruction set."""
  if prefix not in _REGISTERED:
    lib = ctypes.cdll.LoadLibrary(str(library))
    lib.SpecjaxIsa.restype = ctypes.c_char_p
    for name, handler in (("int8_dot", lib.SpecjaxInt8Dot), ("int4_dot", lib.SpecjaxInt4Dot),
                          ("attend", lib.SpecjaxAttend)):
      jax.ffi.register_ffi_target(f"{prefix}_{name}", jax.ffi.pycapsule(handler), platform="cpu")
    _REGISTERED[prefix] = lib.SpecjaxIsa().decode(), bool(lib.SpecjaxAmx())
  return _REGISTERED[prefix][0]


def cpu_flags() -> str:
  """The CPU's feature flags (the first `flags` line of /proc/cpuinfo; elsewhere the processor
  name): which kernels a CPU runs, XLA's or this module's, depends on them (AVX2, AVX-512,
  VNNI, AMX)."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("flags"):
          return " ".join(sorted(line.partition(":")[2].split()))
  except OSError:
    pass
  return platform.processor() or platform.machine()
