"""specjax's CPU kernels (models/cpu_kernels.py): the int8 product gives the same integers as
XLA's for every shape and instruction-set path and is used by [out, in] int8 layers (the int4
product: tests/test_int4.py); attention one position at a time is attention, and the same bits
in a pass of any width; and a clear account of which kernel runs when they cannot be built."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import platform
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import cpu_kernels, kv_cache, quant

needs_compiler = pytest.mark.skipif(
    jax.default_backend() != "cpu" or not (shutil.which("c++") or shutil.which("g++")),
    reason="specjax's CPU kernels are built for the CPU backend with a C++ compiler")

# (M, K, N): one row; every row count of a pass (1-8) and past it (a prompt: tiles, 8 rows a
# pass on avx512-vnni); K not a multiple of 4 or 16 (a block's last entries on avx512-vnni, the
# tail of a row on avx2) and N not a multiple of the 16-row block (the rows after the last
# block), N below one block; activations past the kernel's L1 budget (rows x K > 16 KiB: two
# blocks, or avx2's G rows, side by side), with K % 4 left over and in a prompt's tiles too.
# Prompts (M > 8) with K a multiple of 64 run on AMX where the CPU has it: one 16-row tile or
# part of one, pairs of row tiles and one left over, an odd number of blocks, and several L2
# tiles of blocks (K = 1536: 10 blocks a tile).
SHAPES = [(1, 64, 16), (2, 100, 37), (5, 130, 7), (8, 1536, 513), (9, 200, 300),
          (17, 96, 40), (3, 2304, 64), (4, 4200, 37), (5, 4200, 38), (7, 4100, 19),
          (10, 192, 50), (11, 130, 29), (40, 1536, 300), (6, 99, 33), (3, 1538, 48),
          (5, 4098, 40), (20, 2101, 70), (9, 64, 16), (16, 128, 48), (37, 640, 409),
          (70, 1536, 352), (33, 256, 15)]


def _operands(m, k, n, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.integers(-127, 128, (m, k), dtype=np.int8)
  q[0, :3] = (127, -127, 0)                       # the extremes of quantized activations
  w = rng.integers(-127, 128, (n, k), dtype=np.int8)
  return q, w, q.astype(np.int64) @ w.astype(np.int64).T


def _stored(w):
  """An [out, in] int8 kernel as this machine's int8 kernel reads it (quant.blocked_layout)."""
  return quant.block_int8(jnp.asarray(w)) if quant.blocked_layout() else jnp.asarray(w)


@needs_compiler
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_the_kernel_gives_the_integer_product(m, k, n):
  assert cpu_kernels.status().active, cpu_kernels.status().why
  q, w, want = _operands(m, k, n)
  got = jax.jit(cpu_kernels.int8_dot)(jnp.asarray(q), _stored(w))
  assert got.dtype == jnp.int32 and got.shape == (m, n)
  np.testing.assert_array_equal(np.asarray(got), want)


def _amx_permitted() -> bool:
  """Whether Linux lets this process use AMX's tile registers (arch_prctl's
  ARCH_REQ_XCOMP_PERM for XTILEDATA, asked here apart from the kernels)."""
  libc = ctypes.CDLL(None, use_errno=True)
  return libc.syscall(158, 0x1023, 18) == 0       # SYS_arch_prctl on x86-64


@needs_compiler
def test_prompts_run_on_amx_where_the_cpu_and_the_os_have_it():
  """The kernels report AMX exactly where this CPU has amx_int8 and amx_tile and Linux permits
  it (the products above then ran on it; test_each_instruction_set_path runs a build without
  it)."""
  flags = cpu_kernels.cpu_flags().split()
  has = {"amx_int8", "amx_tile", "avx512_vnni"} <= set(flags) and platform.machine() == "x86_64"
  assert cpu_kernels.status().amx == (has and _amx_permitted())
  assert ("AMX" in cpu_kernels.status().describe()) == cpu_kernels.status().amx


@needs_compiler
def test_under_vmap_and_inside_a_loop():
  q, w, want = _operands(3, 128, 40)
  w = _stored(w)
  stacked = jnp.stack([jnp.asarray(q), jnp.asarray(q[::-1])])
  got = jax.jit(jax.vmap(cpu_kernels.int8_dot, in_axes=(0, None)))(stacked, jnp.asarray(w))
  np.testing.assert_array_equal(np.asarray(got[1]), want[::-1])
  body = lambda i, acc: acc + cpu_kernels.int8_dot(jnp.asarray(q), jnp.asarray(w))
  total = jax.jit(lambda: jax.lax.fori_loop(0, 3, body, jnp.zeros((3, 40), jnp.int32)))()
  np.testing.assert_array_equal(np.asarray(total), 3 * want)


@needs_compiler
@pytest.mark.parametrize("march, isa, needs", [("x86-64", "generic", ""),
                                               ("haswell", "avx2", "avx2"),
                                               ("icelake-server", "avx512-vnni", "amx_int8")])
def test_each_instruction_set_path(tmp_path, monkeypatch, march, isa, needs):
  """The paths a CPU without AVX-512 VNNI compiles (the build uses -march=native, so this
  machine's own path is the tests above), and on a CPU with AMX its VNNI path for prompts (a
  build without AMX), built as $SPECJAX_KERNEL_MARCH asks."""
  if needs and needs not in cpu_kernels.cpu_flags().split():
    pytest.skip(f"this CPU has no {needs}: its own build is this path, or it cannot run it")
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  monkeypatch.setenv(cpu_kernels.MARCH_ENV, march)
  flags = cpu_kernels.build_flags()
  assert f"-march={march}" in flags and "-march=native" not in flags
  prefix = f"specjax_{isa.replace('-', '_')}"
  assert cpu_kernels._register(cpu_kernels._build(flags), prefix) == isa
  assert not cpu_kernels._REGISTERED[prefix][1]                 # no AMX in any of these builds
  for m, k, n in SHAPES:
    q, w, want = _operands(m, k, n, seed=1)
    call = jax.ffi.ffi_call(f"{prefix}_int8_dot", jax.ShapeDtypeStruct((m, n), jnp.int32))
    stored = quant.block_int8(w) if isa in cpu_kernels.BLOCKED_ISAS else w
    np.testing.assert_array_equal(np.asarray(jax.jit(call)(q, stored[None], jnp.int32(0))),
                                  want)
  # int4 (quant.int4_matmul's product): the same numbers as this machine's own build
  rng = np.random.default_rng(2)
  for m, k, n in [(1, 128, 16), (3, 192, 33), (9, 896, 40)]:
    packed, scale = quant.pack_int4(jnp.asarray(rng.standard_normal((n, k)), jnp.float32))
    q = jnp.asarray(rng.integers(-127, 128, (m, k), dtype=np.int8))
    call = jax.ffi.ffi_call(f"{prefix}_int4_dot", jax.ShapeDtypeStruct((m, n), jnp.float32))
    stored = quant.block_int4(packed, scale) if isa in cpu_kernels.BLOCKED_ISAS else (packed,
                                                                                     scale)
    want = np.asarray(q, np.float64) @ np.asarray(quant.dequantize_int4(packed, scale),
                                                  np.float64).T
    stacks = [x[None] for x in stored]
    np.testing.assert_allclose(np.asarray(jax.jit(call)(q, *stacks, jnp.int32(0))), want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())


@needs_compiler
@pytest.mark.parametrize("rows", [1, 5])
def test_out_in_int8_layers_give_xla_s_bits(monkeypatch, rows):
  """int8_matmul of an [out, in] kernel on specjax's kernel equals XLA's product of the same
  kernel bit for bit (the model-level check: tests/test_quant.py's out_in test)."""
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((rows, 96)), jnp.float32)
  kernel = jnp.asarray(rng.integers(-127, 128, (40, 96), dtype=np.int8))
  scale = jnp.asarray(rng.random(40) + 0.5, jnp.float32)
  product = lambda w: jax.jit(lambda x: quant.int8_matmul(x, w, scale, transposed=True))(x)
  ours = product(_stored(kernel))
  monkeypatch.setattr(cpu_kernels, "status", lambda: cpu_kernels.Status(False, "test"))
  assert not quant.blocked_layout()
  xla = product(kernel)
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(xla))


@pytest.mark.parametrize("lead, n, k", [((), 37, 99), ((2,), 48, 8), ((), 5, 6), ((3,), 32, 130)])
def test_the_blocked_layout_is_a_reordering(lead, n, k):
  """block_int8 keeps the shape and moves each entry where cpu_kernels.cc reads it (16 rows'
  entries four at a time, each block's last K % 4 entries after, the rows past the last block
  as they are); unblock_int8 undoes it."""
  w = np.random.default_rng(3).integers(-127, 128, (*lead, n, k), dtype=np.int8)
  blocked = np.asarray(quant.block_int8(jnp.asarray(w)))
  assert blocked.shape == w.shape
  flat = blocked.reshape(*lead, n * k)
  k4, full = k // 4 * 4, n // 16 * 16
  for row, col in [(0, 0), (1, 2), (15, 5), (17, min(k - 1, 9)), (full - 1, k - 1), (n - 1, k - 1)]:
    if row < 0 or row >= n:
      continue
    if row >= full:
      at = row * k + col
    elif col < k4:
      at = row // 16 * 16 * k + col // 4 * 64 + row % 16 * 4 + col % 4
    else:
      at = row // 16 * 16 * k + 16 * k4 + row % 16 * (k - k4) + col - k4
    assert flat[..., at].tolist() == w[..., row, col].tolist(), (row, col)
  np.testing.assert_array_equal(np.asarray(quant.unblock_int8(jnp.asarray(blocked))), w)


@pytest.mark.parametrize("isa, blocked", [("avx512-vnni", True), ("avx2", False),
                                           ("generic", False)])
def test_only_the_vnni_build_reads_blocked_weights(monkeypatch, isa, blocked):
  """quantize_kernel stores [out, in] int8 kernels blocked exactly where the kernel reads them
  so (its avx512-vnni build), and plain elsewhere (other builds, XLA's product)."""
  w = jnp.asarray(np.random.default_rng(4).standard_normal((32, 8)), jnp.float32)
  monkeypatch.setattr(cpu_kernels, "status", lambda: cpu_kernels.Status(False, "test"))
  assert not quant.blocked_layout()
  plain = np.asarray(quant.quantize_kernel.__wrapped__(w, True)[0])
  monkeypatch.setattr(cpu_kernels, "status", lambda: cpu_kernels.Status(True, "built", isa))
  assert quant.blocked_layout() is blocked
  got = np.asarray(quant.quantize_kernel.__wrapped__(w, True)[0])
  np.testing.assert_array_equal(got, np.asarray(quant.block_int8(plain)) if blocked else plain)


@pytest.fixture
def fresh_status():
  """status() decided again in the test, and again after it (for the tests that follow)."""
  cpu_kernels._decided.cache_clear()
  yield
  cpu_kernels._decided.cache_clear()


def test_the_environment_chooses_and_a_failed_build_says_why(monkeypatch, tmp_path, caplog,
                                                             fresh_status):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  monkeypatch.setenv("SPECJAX_INT8_KERNEL", "xla")
  assert not cpu_kernels.status().active
  assert cpu_kernels.status().describe() == "XLA's product ($SPECJAX_INT8_KERNEL=xla)"
  cpu_kernels._decided.cache_clear()
  monkeypatch.setenv("SPECJAX_INT8_KERNEL", "fast")
  with pytest.raises(ValueError, match=r"\$SPECJAX_INT8_KERNEL='fast': use one of xla, specjax"):
    cpu_kernels.status()
  monkeypatch.delenv("SPECJAX_INT8_KERNEL")
  monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
  with caplog.at_level(logging.WARNING, logger="specjax.models.cpu_kernels"):
    status = cpu_kernels.status()
  assert not status.active and "could not be built" in status.why
  assert "install a C++ compiler (g++) or set $CXX" in caplog.text
  with pytest.raises(RuntimeError, match="not in use"):
    cpu_kernels.int8_dot(jnp.zeros((1, 4), jnp.int8), jnp.zeros((2, 4), jnp.int8))
  cpu_kernels._decided.cache_clear()
  monkeypatch.setenv("SPECJAX_INT8_KERNEL", "specjax")
  with pytest.raises(RuntimeError, match="SPECJAX_INT8_KERNEL=specjax, but specjax's int8 CPU "
                                         "kernel could not be built"):
    cpu_kernels.status()


def test_a_march_that_is_not_one_is_refused(monkeypatch):
  monkeypatch.setenv(cpu_kernels.MARCH_ENV, "native -fplugin=x.so")
  with pytest.raises(ValueError, match="SPECJAX_KERNEL_MARCH.*is not a -march value"):
    cpu_kernels.build_flags()
  monkeypatch.setenv(cpu_kernels.MARCH_ENV, "")
  assert cpu_kernels.build_flags() == cpu_kernels._FLAGS


def test_gcc_alone_is_given_its_vectorizer_cost_model():
  gcc = "c++ (Debian 12.2.0-14+deb12u1) 12.2.0\nCopyright (C) 2022 Free Software Foundation, Inc."
  clang = "Debian clang version 14.0.6\nTarget: x86_64-pc-linux-gnu\nThread model: posix"
  assert cpu_kernels._is_gcc(gcc) and not cpu_kernels._is_gcc(clang)


@needs_compiler
def test_a_march_the_compiler_refuses_is_named_with_its_error(monkeypatch, tmp_path, caplog,
                                                              fresh_status):
  """Probe round 6: the advice was to install g++, and the compiler's error was cut at its
  start ("rguments to '-march=' switch are: ...")."""
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  monkeypatch.setenv(cpu_kernels.MARCH_ENV, "banana")
  with caplog.at_level(logging.WARNING, logger="specjax.models.cpu_kernels"):
    assert not cpu_kernels.status().active
  assert "banana" in cpu_kernels.status().why and "error" in cpu_kernels.status().why
  assert "check $SPECJAX_KERNEL_MARCH='banana' (a -march value this compiler takes), or unset " \
      "it" in caplog.text


@needs_compiler
def test_a_compile_error_is_reported_and_nothing_is_kept(monkeypatch, tmp_path):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  with pytest.raises(RuntimeError, match="exited with"):
    cpu_kernels._build(cpu_kernels._FLAGS + ("-fno-such-flag",))
  assert not list((tmp_path / "kernels").iterdir())            # no half-built library kept


@needs_compiler
def test_threads_deciding_at_once_decide_once(monkeypatch, fresh_status):
  """Two threads tracing int8 layers at once (e.g. a background compile) build and register the
  kernel once; a decision made again in the process keeps the registered library."""
  import threading
  built = []
  real = cpu_kernels._build
  monkeypatch.setattr(cpu_kernels, "_build", lambda flags: built.append(1) or real(flags))
  threads = [threading.Thread(target=cpu_kernels.status) for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert built == [1] and cpu_kernels.status().active


# ---------------------------------------------------------- attention, one position at a time

def _attention_operands(seed: int, batch=2, num_new=5, heads=6, kv_heads=2, head_dim=64,
                        slots=256):
  """q [B, T, H, Dh]; a cache (k, v) [B, Hkv, S, Dh] whose slots past each row's length hold
  junk (as rejected drafts leave them); the block's (k, v) [B, T, Hkv, Dh]; positions [B, T];
  lengths [B] (rows at different lengths)."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  q = normal(batch, num_new, heads, head_dim)
  cache = normal(batch, kv_heads, slots, head_dim), normal(batch, kv_heads, slots, head_dim)
  block = normal(batch, num_new, kv_heads, head_dim), normal(batch, num_new, kv_heads, head_dim)
  lengths = jnp.asarray([40, 130][:batch], jnp.int32)
  return q, cache, block, lengths[:, None] + jnp.arange(num_new, dtype=jnp.int32), lengths


def _written(cache, block, lengths):
  """The cache with the block written at each row's length: [B, Hkv, S, Dh] each."""
  return tuple(kv_cache.write_layers(buf[None], new[None], lengths)[0]
               for buf, new in zip(cache, block))


@needs_compiler
@pytest.mark.parametrize("window", [None, 20])
def test_the_attention_kernel_is_attention(window):
  """Grouped-query attention of each query over the slots up to its own (within the window), the
  cache's below the row's length and the block's after, as attention.attend computes it batched
  over the cache with the block written, within float32 rounding."""
  from specjax.models import attention
  q, cache, block, positions, lengths = _attention_operands(0)
  got = jax.jit(lambda *a: cpu_kernels.attend_each_position(*a, window=window, scale=0.125))(
      q, *cache, *block, positions, lengths)
  k, v = _written(cache, block, lengths)
  slots = jnp.arange(k.shape[2])
  seen = slots[None, None, :] <= positions[:, :, None]
  if window:
    seen = seen & (slots[None, None, :] > positions[:, :, None] - window)
  want = attention.attend(q, [(k, v, seen, None)], scale=0.125,
                          precision=jax.lax.Precision.HIGHEST).reshape(q.shape)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)


@needs_compiler
@pytest.mark.parametrize("kernel", [True, False])
def test_attention_gives_a_position_the_same_bits_in_any_pass_and_cache(monkeypatch, kernel):
  """What keeps greedy SD over a quantized target on its own tokens: each position as a decoding
  step gives it (the block's earlier entries already in the cache, the position alone), in a
  pass of five, and in a cache of another capacity, bit for bit, on specjax's kernel and on
  XLA's loop per position (where the kernel is not built); the two agree within rounding."""
  from specjax.models import attention
  q, cache, block, positions, lengths = _attention_operands(1)
  attend = lambda *a: jax.jit(
      lambda *a: attention.attend_each_position(*a, window=None, scale=0.125))(*a)
  on_kernel = np.asarray(attend(q, cache, block, positions, lengths))
  if not kernel:
    monkeypatch.setattr(cpu_kernels, "status", lambda: cpu_kernels.Status(False, "pinned"))
  wide = np.asarray(attend(q, cache, block, positions, lengths))
  np.testing.assert_allclose(wide, on_kernel, rtol=1e-5, atol=2e-6)
  for t in range(q.shape[1]):
    earlier = _written(cache, tuple(x[:, :t] for x in block), lengths)
    alone = attend(q[:, t:t + 1], earlier, tuple(x[:, t:t + 1] for x in block),
                   positions[:, t:t + 1], lengths + t)
    np.testing.assert_array_equal(np.asarray(alone)[:, 0], wide[:, t])
  pad = jnp.zeros(cache[0].shape[:2] + (128,) + cache[0].shape[3:], jnp.float32)
  larger = (jnp.concatenate([cache[0], pad], 2), jnp.concatenate([cache[1], pad + 1.0], 2))
  np.testing.assert_array_equal(np.asarray(attend(q, larger, block, positions, lengths)), wide)


@needs_compiler
def test_a_layer_of_a_stack_is_read_in_place():
  """Each kernel given a whole stack [L, ...] and a layer's index (models/layer_view.LayerOf,
  what the layer loops pass so that no layer's weights or cache are copied) computes what it
  computes from that layer's slice, bit for bit, for every layer, with the index traced inside a
  loop; an index outside the stack is an error, not a read past it."""
  from specjax.models.layer_view import LayerOf
  rng = np.random.default_rng(5)
  q = jnp.asarray(_operands(3, 192, 40)[0])
  int8 = jnp.stack([_stored(_operands(3, 192, 40, seed=s)[1]) for s in range(3)])   # [3, N, K]
  weights = [quant.pack_int4(jnp.asarray(rng.standard_normal((40, 192)), jnp.float32))
             for _ in range(3)]
  if quant.blocked_layout():
    weights = [quant.block_int4(*w) for w in weights]
  packed, scales = (jnp.stack(x) for x in zip(*weights))                  # [3, N, K/2], [3, N, 3]
  a_q, cache, block, positions, lengths = _attention_operands(2)
  caches = tuple(jnp.stack([c, c[::-1] * 0.5, -c]) for c in cache)         # [3, B, Hkv, S, Dh]

  def every_layer(stack_of):
    return jax.jit(lambda: jax.lax.map(stack_of, jnp.arange(3, dtype=jnp.int32)))()

  in_place = every_layer(lambda i: cpu_kernels.int8_dot(q, LayerOf(int8, i)))
  int4 = every_layer(lambda i: cpu_kernels.int4_dot(q, LayerOf(packed, i), LayerOf(scales, i)))
  attend = every_layer(lambda i: cpu_kernels.attend_each_position(
      a_q, LayerOf(caches[0], i), LayerOf(caches[1], i), *block, positions, lengths))
  for i in range(3):
    np.testing.assert_array_equal(np.asarray(in_place[i]),
                                  np.asarray(jax.jit(cpu_kernels.int8_dot)(q, int8[i])))
    np.testing.assert_array_equal(
        np.asarray(int4[i]), np.asarray(jax.jit(cpu_kernels.int4_dot)(q, packed[i], scales[i])))
    np.testing.assert_array_equal(np.asarray(attend[i]), np.asarray(jax.jit(
        cpu_kernels.attend_each_position)(a_q, caches[0][i], caches[1][i], *block, positions,
                                          lengths)))
  with pytest.raises(jax.errors.JaxRuntimeError, match="layer index out of range"):
    jax.block_until_ready(jax.jit(lambda i: cpu_kernels.int8_dot(q, LayerOf(int8, i)))(3))


def test_a_float_model_never_builds_the_kernels(monkeypatch):
  """Training or decoding a float model never asks for the kernels (status() compiles them on
  first use, seconds of C++): a prefill and a two-position pass run with status() broken,
  scanned and unrolled; a quantized format still asks."""
  from specjax.models import Prompt, decoder

  def no_kernels():
    raise AssertionError("a float model asked for specjax's CPU kernels")

  monkeypatch.setattr(cpu_kernels, "status", no_kernels)
  cfg = decoder.DecoderConfig(vocab_size=64, n_positions=32, d_model=32, num_layers=2,
                              num_heads=4, d_ff=64, bos_token_id=1, eos_token_id=1,
                              pad_token_id=0)
  for scan in (True, False):
    model = decoder.Decoder(dataclasses.replace(cfg, scan_layers=scan))
    params = model.init_params(jax.random.PRNGKey(0))
    logits, _, cache = model.prefill(params, Prompt.from_lists([[1, 5, 7]]),
                                     model.init_cache(1, 16))
    step = model.extend(params, jnp.asarray([[9, 3]], jnp.int32), cache)[0]   # a 2-wide pass
    assert logits.shape == (1, 64) and np.isfinite(np.asarray(step)).all()
  with pytest.raises(AssertionError, match="asked for"):
    quant.reads_in_place("int4", "out_in")


@needs_compiler
def test_builders_at_once_compile_once(monkeypatch, tmp_path):
  """A second builder waits for the first one's lock and finds the library built."""
  import threading
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  compiled, started = [], threading.Event()

  def slow_compile(compiler, flags, library):
    compiled.append(library)
    started.set()
    time.sleep(0.5)                      # the second builder arrives while this one compiles
    library.write_bytes(b"built")

  monkeypatch.setattr(cpu_kernels, "_compile", slow_compile)
  first = threading.Thread(target=cpu_kernels._build)
  first.start()
  started.wait(timeout=30)
  second = cpu_kernels._build()
  first.join()
  assert len(compiled) == 1 and second == compiled[0] and second.read_bytes() == b"built"
