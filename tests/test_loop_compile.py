"""How the decoding loops compile on the CPU (decoding/state.LoopJit): without while-loop invariant
code motion, so that XLA:CPU does not hoist a float32 copy of every scanned bfloat16 weight out of
the loop (held for the whole call), and with the memory-optimized scheduler, so that unrolled
layers do not convert every layer's weights at once; the default compilation, which does both,
is the broken variant, and so is the loop without the scheduler option for unrolled layers."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from specjax import testing
from specjax.decoding import autoregressive, state
from specjax.models import Prompt, llama
from specjax.sampling import Warp


def _bf16_llama(scan: bool):
  cfg = llama.LlamaConfig(vocab_size=256, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2,
                          head_dim=32, d_ff=512, dtype="bfloat16", scan_layers=scan)
  model = llama.Llama(cfg)
  return model, testing._spread(model.init_params(jax.random.PRNGKey(0)))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU compilation is what is tested")
@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_the_cpu_loop_keeps_no_float32_copy_of_bfloat16_weights(monkeypatch, scan):
  model, params = _bf16_llama(scan)
  calls = []
  real_call = state.LoopJit.__call__

  def record(self, *args, **kwargs):
    calls.append((self, args, kwargs))
    return real_call(self, *args, **kwargs)

  monkeypatch.setattr(state.LoopJit, "__call__", record)
  gen = autoregressive.generate(model, params, Prompt.from_lists([[1, 5, 7], [1, 9]]),
                                jax.random.PRNGKey(0), max_new_tokens=8, warp=Warp(0.0),
                                eos_id=None)
  assert np.asarray(gen.lengths).tolist() == [8, 8]
  (loop, args, kwargs), = calls
  assert loop is autoregressive._run
  temp = lambda jitted: jitted.lower(*args, **kwargs).compile().memory_analysis(
      ).temp_size_in_bytes
  kernels = [x for path, x in jax.tree_util.tree_leaves_with_path(params)
             if "kernel" in jax.tree_util.keystr(path)]
  f32_bytes = sum(4 * x.size for x in kernels)              # every dense kernel as float32
  assert loop.jitted(*args, **kwargs) is loop._cpu_16bit
  default, cpu = temp(loop._default), temp(loop._cpu_16bit)
  assert default >= f32_bytes, (default, f32_bytes)         # XLA's default: hoisted copies
  assert cpu < f32_bytes / 2, (cpu, f32_bytes)              # what the CPU loop compiles to
  assert dataclasses.is_dataclass(gen)
  if not scan:   # float32 weights' options (XLA's scheduler): every unrolled layer's copy at once
    assert temp(loop._cpu) >= 0.75 * f32_bytes, (temp(loop._cpu), cpu, f32_bytes)


def test_the_cpu_loop_options_follow_the_weights_dtype():
  """16-bit float leaves anywhere in a loop's arguments take the memory-optimized scheduler;
  float32 and int8 weights keep XLA's (decoding/state.py says why)."""
  f32, bf16 = np.zeros(3, np.float32), jax.numpy.zeros(3, jax.numpy.bfloat16)
  assert not state.has_16bit_floats({"w": f32, "q": np.zeros(3, np.int8), "n": 3, "s": "x"})
  assert state.has_16bit_floats(({"w": f32}, [bf16]))
  assert state.has_16bit_floats(jax.ShapeDtypeStruct((2,), np.float16))
  if jax.default_backend() == "cpu":
    assert state.loop_compiler_options({"w": f32}) is state.CPU_LOOP_OPTIONS
    assert state.loop_compiler_options({"w": bf16}) is state.CPU_16BIT_LOOP_OPTIONS



@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU compilation is what is tested")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_bfloat16_head_is_converted_a_block_of_rows_at_a_time(monkeypatch, tied):
  """XLA:CPU converts a 16-bit head to float32 for its product; models/head_product.py multiplies
  it in blocks of vocabulary rows, so the loop holds one block's copy, not the whole head's (the
  broken variant, one product, holds the whole copy), and the tokens are the same."""
  from specjax.models import head_product
  cfg = llama.LlamaConfig(vocab_size=8192, d_model=128, num_layers=1, num_heads=4,
                          num_kv_heads=2, head_dim=32, d_ff=256, dtype="bfloat16",
                          tie_word_embeddings=tied)
  model = llama.Llama(cfg)
  params = testing._spread(model.init_params(jax.random.PRNGKey(0)))
  head_f32 = 4 * cfg.vocab_size * cfg.d_model
  calls = []
  real_call = state.LoopJit.__call__
  monkeypatch.setattr(state.LoopJit, "__call__",
                      lambda self, *a, **k: calls.append((self, a, k)) or real_call(self, *a, **k))
  temps, tokens = [], []
  for rows in (1000, cfg.vocab_size):             # blocked (a ragged last block), then one product
    monkeypatch.setattr(head_product, "BLOCK_ROWS", rows)
    jax.clear_caches()                            # BLOCK_ROWS is read when the loop is traced
    gen = autoregressive.generate(model, params, Prompt.from_lists([[1, 5, 7]]),
                                  jax.random.PRNGKey(0), max_new_tokens=6, warp=Warp(1.0),
                                  eos_id=None)
    loop, args, kwargs = calls[-1]
    assert loop.jitted(*args, **kwargs) is loop._cpu_16bit
    temps.append(loop.lower(*args, **kwargs).compile().memory_analysis().temp_size_in_bytes)
    tokens.append(np.asarray(gen.tokens).tolist())
  blocked, whole = temps
  assert whole >= head_f32, (whole, head_f32)
  assert blocked <= whole - head_f32 / 2, (blocked, whole, head_f32)
  assert tokens[0] == tokens[1]


@pytest.mark.parametrize("vocab_axis", [0, 1])
def test_the_blocked_head_product_gives_the_one_products_logits(monkeypatch, vocab_axis):
  from specjax.models import head_product
  monkeypatch.setattr(head_product, "BLOCK_ROWS", 96)
  keys = jax.random.split(jax.random.PRNGKey(1))
  hidden = jax.random.normal(keys[0], (2, 3, 64), jax.numpy.bfloat16)           # [B, T, D]
  kernel = jax.random.normal(keys[1], (1000, 64) if vocab_axis == 0 else (64, 1000),
                             jax.numpy.bfloat16)
  spec = "...d,vd->...v" if vocab_axis == 0 else "...d,dv->...v"
  want = jax.numpy.einsum(spec, hidden, kernel, preferred_element_type=jax.numpy.float32)
  got = jax.jit(lambda h, w: head_product.logits(h, w, vocab_axis))(hidden, kernel)
  assert got.shape == (2, 3, 1000) and got.dtype == np.float32
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-5)
