"""The typed model contract (models.Model): every family and the toy models state what the loops,
sharding and loading read (position bound, decoder start, heads, layout, quant), so nothing
probes a model's config for them; and the decoder-only families are configurations of one
transformer."""

from __future__ import annotations

import dataclasses

import jax

from specjax import testing
from specjax.decoding import sharded, state
from specjax.models import Model, llama, transformer


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


def test_gpt2_and_the_llama_family_are_configurations_of_one_transformer():
  """One module, each family's switches and param names: GPT-2's LayerNorms (ln_1, ln_2, ln_f),
  learned positions and wi / wo MLP; Qwen3's RMSNorms, q/k norms and SwiGLU (wi_0, wi_1, wo)."""
  gpt2, _, qwen = _families()
  assert type(gpt2.module) is type(qwen.module) is transformer.Transformer
  g, q = gpt2.config.arch(), dataclasses.replace(qwen.config, qk_norm=True).arch()
  assert (g.norm, g.rope, g.mlp, g.num_kv_heads) == ("layer", None, "gelu_new", g.num_heads)
  assert (q.norm, q.mlp, q.num_kv_heads, q.rope) == ("rms", transformer.SWIGLU, 2, qwen.config.rope)
  shapes = lambda model: jax.eval_shape(model.init_params, jax.random.PRNGKey(0))
  gp = shapes(gpt2)
  qp = shapes(llama.Llama(dataclasses.replace(qwen.config, qk_norm=True)))
  assert {"token_embed", "pos_embed", "ln_f"} <= set(gp) and "final_norm" in qp
  assert {"ln_1", "ln_2"} <= set(gp["layers"]) and set(gp["layers"]["mlp"]) == {"wi", "wo"}
  assert set(qp["layers"]["mlp"]) == {"wi_0", "wi_1", "wo"}
  assert {"q_norm", "k_norm"} <= set(qp["layers"]["attention"])
  assert qp["layers"]["attention"]["key"]["kernel"].shape[-2:] == (8, 32)    # out_in: Hkv*Dh=8
