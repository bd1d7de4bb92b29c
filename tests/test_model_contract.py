"""The typed model contract (models.Model): every family and the toy models state what the loops,
sharding and loading read (position bound, decoder start, heads, layout, quant), so nothing
probes a model's config for them."""

from __future__ import annotations

import dataclasses

from specjax import testing
from specjax.decoding import sharded, state
from specjax.models import Model, llama


def _families():
  gpt2, _ = testing.tiny_decoder(n_positions=96)
  t5, _ = testing.tiny_t5()
  qwen = llama.Llama(llama.LlamaConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=8,
                                       num_kv_heads=2, head_dim=4, d_ff=64, layout="out_in"))
  return gpt2, t5, qwen


def test_every_family_and_toy_model_is_a_model():
  gpt2, t5, qwen = _families()
  toy = testing.ToyAR(vocab_size=5, num_positions=3)
  for model in (gpt2, t5, qwen, toy):
    assert isinstance(model, Model), type(model).__name__

  @dataclasses.dataclass(frozen=True)
  class NoHeads:                      # the contract's values missing: not a Model
    vocab_size: int = 4
  assert not isinstance(NoHeads(), Model)


def test_the_contracts_values_are_each_familys_own():
  gpt2, t5, qwen = _families()
  assert (gpt2.n_positions, t5.n_positions, qwen.n_positions) == (96, None, None)
  assert state.position_limit(gpt2) == 96 and state.position_limit(t5) is None
  assert t5.decoder_start_id == t5.config.decoder_start_token_id and gpt2.decoder_start_id == 0
  assert qwen.heads == (8, 2) and gpt2.heads == (gpt2.config.num_heads,) * 2
  assert sharded.model_units(qwen) == {"heads": 2, "kv_heads": 2}
  assert (qwen.layout, gpt2.layout, t5.layout) == ("out_in", "in_out", "in_out")
  assert (qwen.quant, t5.quant) == ("", "")
  assert testing.ToyAR(vocab_size=5, num_positions=3).heads is None
