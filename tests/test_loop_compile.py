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
