"""A GPT-2 compatible decoder-only LM that follows the model contract (specjax/models/__init__.py):
a configuration of the one transformer (models/transformer.py; `DecoderConfig.arch`).

Pre-norm blocks with learned absolute position embeddings, so that Hugging Face `gpt2`
checkpoints load unchanged (`hf_import.load_model`) and logits match `GPT2LMHeadModel`. The same
code serves the DistillSpec LM1B pair (`lm1b_config`) trained from scratch.

Every forward pass is `extend`: the T new tokens of row b sit at absolute positions
lengths[b] .. lengths[b]+T-1, their keys/values are written into the explicit `KVCache` there, and
attention is causal over the cache. `prefill` is `extend` from an empty cache plus a gather of the
last prompt position of each row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specjax.models import dense_layout, quant, transformer
from specjax.models import kv_cache as kvc
from specjax.models.decoder_only import DecoderOnly
from specjax.models.sub_vocab import SubVocab

Params = Any

_DTYPES = ("float32", "bfloat16")
_PRECISIONS = ("default", "high", "highest")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Hyperparameters of the GPT-2 style LM. Defaults are HF `gpt2` (124M)."""
  vocab_size: int = 50257
  n_positions: int = 1024          # max sequence length (size of the position table)
  d_model: int = 768
  num_layers: int = 12
  num_heads: int = 12
  d_ff: int = 3072
  layer_norm_epsilon: float = 1e-5
  activation: str = "gelu_new"
  tie_word_embeddings: bool = True
  bos_token_id: int = 50256
  eos_token_id: int = 50256
  pad_token_id: int = 50256
  dtype: str = "float32"           # params and activations; logits are always float32
  # Of every matmul. "highest": float32 stays float32 where the backend would round it (TF32 on
  # NVIDIA GPUs, ~1e-3); "default" is the faster choice for bfloat16 weights. Not an HF field.
  precision: str = "highest"
  # Per-layer params stacked [L, ...] under `layers` and run by nn.scan (compile time independent
  # of depth), or layers_0 ... run by a Python loop (XLA:CPU decodes faster): models/layers.py.
  # Not an HF field.
  scan_layers: bool = True
  head_subset: SubVocab | None = None   # the head scores only these ids (models/sub_vocab.py)
  quant: str = ""                       # "int8": int8 dense layers (models/quant.py)
  # The layers' dense kernels [in, out] or "out_in" [out, in] (models/dense_layout.py; GPT-2's
  # Conv1D weights are [in, out], so out_in transposes them on import). Not an HF field.
  layout: str = "in_out"

  def __post_init__(self):
    if self.precision not in _PRECISIONS:
      raise ValueError(f"precision '{self.precision}' is not supported; use one of {_PRECISIONS}.")
    if self.activation not in transformer.ACTIVATIONS:
      raise ValueError(f"activation '{self.activation}' is not supported; use one of "
                       f"{sorted(transformer.ACTIVATIONS)}.")
    if self.dtype not in _DTYPES:
      raise ValueError(f"dtype '{self.dtype}' is not supported; use one of {_DTYPES}.")
    if self.quant not in quant.QUANTS:
      raise ValueError(f"quant '{self.quant}' is not supported; use one of {quant.QUANTS}.")
    dense_layout.check(self.layout, self.quant)
    if self.d_model % self.num_heads:
      raise ValueError(f"d_model {self.d_model} is not divisible by num_heads {self.num_heads}.")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  def arch(self) -> transformer.Arch:
    """GPT-2 as a configuration of the one transformer: LayerNorm (ln_1, ln_2, ln_f), learned
    positions, an activation MLP (wi, wo), biases everywhere, out-projections initialised at
    0.02 / sqrt(2L)."""
    return transformer.Arch(
        vocab_size=self.vocab_size, d_model=self.d_model, num_layers=self.num_layers,
        num_heads=self.num_heads, num_kv_heads=self.num_heads, head_dim=self.head_dim,
        d_ff=self.d_ff, norm="layer", norm_eps=self.layer_norm_epsilon,
        norm_names=("ln_1", "ln_2", "ln_f"), mlp=self.activation, n_positions=self.n_positions,
        qkv_bias=True, out_bias=True, mlp_bias=True, scaled_out_init=True,
        tie_word_embeddings=self.tie_word_embeddings, dtype=self.dtype,
        precision=self.precision, scan_layers=self.scan_layers, head_subset=self.head_subset,
        quant=self.quant, layout=self.layout)


def lm1b_config(size: str, **overrides) -> DecoderConfig:
  """The DistillSpec LM1B pair (Appendix B): 'target' (~234M) and 'draft' (~33M), T5 32k vocab.

  Token ids follow the T5 SentencePiece model (pad 0 doubles as BOS, eos 1). LM1B uses 128 input
  and 128 output tokens, hence 256 positions. With GPT-2's plain GELU MLP and tied embeddings the
  pair has 184M / 25M parameters; the paper's 234M / 33M imply a gated FFN (papers/distillspec.md).
  """
  sizes = {
      "target": dict(d_model=1024, d_ff=4096, num_layers=12, num_heads=16),
      "draft": dict(d_model=512, d_ff=1024, num_layers=4, num_heads=4),
  }
  if size not in sizes:
    raise ValueError(f"unknown LM1B size '{size}'; use one of {sorted(sizes)}.")
  base = dict(vocab_size=32128, n_positions=256, bos_token_id=0, eos_token_id=1, pad_token_id=0)
  return DecoderConfig(**{**base, **sizes[size], **overrides})


# ---------------------------------------------------------------------------------------------
# The model object the decoding loop sees.


@dataclasses.dataclass(frozen=True)
class Decoder(DecoderOnly):
  """Frozen, hashable wrapper (a static jit argument) exposing the model contract."""
  config: DecoderConfig
  is_encoder_decoder: bool = dataclasses.field(default=False, init=False)

  @property
  def n_positions(self) -> int:
    return self.config.n_positions

  @property
  def module(self) -> transformer.Transformer:
    return transformer.Transformer(self.config.arch())

  def init_cache(self, batch: int, max_len: int, enc_len: int = 0) -> kvc.KVCache:
    cfg = self.config
    if max_len > cfg.n_positions:
      raise ValueError(
          f"cache of {max_len} positions exceeds the model's n_positions={cfg.n_positions} "
          f"(its position-embedding table): use a cache of at most {cfg.n_positions} positions "
          f"(a shorter prompt, fewer new tokens, or a smaller max_len).")
    del enc_len  # decoder-only: no encoder
    return kvc.init_cache(layers=cfg.num_layers, batch=batch, max_len=max_len,
                          heads=cfg.num_heads, head_dim=cfg.head_dim, dtype=self.dtype)


# ---------------------------------------------------------------------------------------------
# Hugging Face GPT-2 import / export (dispatched to by hf_import.py).
