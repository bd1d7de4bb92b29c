"""How the decoding loops compile on the CPU (decoding/state.LoopJit): without while-loop invariant
code motion, so that XLA:CPU does not hoist a float32 copy of every scanned bfloat16 weight out of
the loop (held for the whole call); the default compilation, which does, is the broken variant."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from specjax import testing
from specjax.decoding import autoregressive, state
from specjax.models import Prompt, llama
from specjax.sampling import Warp


def _bf16_llama():
  cfg = llama.LlamaConfig(vocab_size=256, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2,
                          head_dim=32, d_ff=512, dtype="bfloat16", scan_layers=True)
  model = llama.Llama(cfg)
  return model, testing._spread(model.init_params(jax.random.PRNGKey(0)))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU compilation is what is tested")
def test_the_cpu_loop_keeps_no_float32_copy_of_bfloat16_weights(monkeypatch):
  model, params = _bf16_llama()
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
  default, cpu = temp(loop._default), temp(loop._cpu)
  assert default >= f32_bytes, (default, f32_bytes)         # XLA's default: hoisted copies
  assert cpu < f32_bytes / 2, (cpu, f32_bytes)              # what the CPU loop compiles to
  assert dataclasses.is_dataclass(gen)
