"""Llama-family decoder-only LM (Hugging Face `llama`, `mistral`, `qwen2`, `qwen3`) behind the
model contract (specjax/models/__init__.py): a configuration of the one transformer
(models/transformer.py; `LlamaConfig.arch`).

Pre-norm blocks: RMSNorm -> grouped-query self-attention with rotary position embeddings ->
residual; RMSNorm -> SwiGLU MLP (down(silu(gate(x)) * up(x))) -> residual; a final RMSNorm and a
tied or untied LM head. The family differs only in switches of `LlamaConfig`: q/k/v (and output)
projection biases (qwen2; llama's `attention_bias`), RMSNorm of every query and key head before
the rotation (qwen3's q_norm / k_norm), an explicit head_dim (qwen3), the rotary frequencies
(`Rope`: HF rope types default, linear, llama3) and a sliding attention window (mistral).

Positions are per row, as in decoder.py: the T new tokens of row b sit at lengths[b] .. +T-1 and
are rotated by those positions, so a rolled-back row is re-extended at the right angles. The KV
cache holds the Hkv key/value heads only ([L, B, Hkv, S, Dh], keys already rotated); the query
heads are grouped onto them inside attention.attend.

The layers are stacked ([L] leading axis on every per-layer param) and run under `nn.scan`, so
compile time does not grow with depth; with `scan_layers=False` they are layers_0 ... (the same
leaves without [L]) run by a Python loop, faster on XLA:CPU (models/layers.py). Params are a plain
nested dict:
  token_embed/embedding [V,D]; final_norm/scale [D]; lm_head/kernel [D,V] (only when untied);
  layers/attention/{query [D,H*Dh], key, value [D,Hkv*Dh], out [H*Dh,D]}/{kernel, bias?} [L,...];
  layers/attention/{q_norm,k_norm}/scale [L,Dh] (qwen3); layers/{attention_norm,mlp_norm}/scale
  [L,D]; layers/mlp/{wi_0 (gate), wi_1 (up)}/kernel [L,D,F], layers/mlp/wo/kernel [L,F,D].
The kernels under `layers` are shown [in, out]; with layout="out_in" each is [out, in]
(models/dense_layout.py). models/convert/llama.py names the HF tensor of every leaf for import
and export.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specjax.models import dense_layout, quant, transformer
from specjax.models import kv_cache as kvc
from specjax.models.decoder_only import DecoderOnly
from specjax.models.sub_vocab import SubVocab
from specjax.models.transformer import Rope  # noqa: F401  (LlamaConfig.rope's type, re-exported)

Params = Any

_DTYPES = ("float32", "bfloat16")
_PRECISIONS = ("default", "high", "highest")
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")   # HF model_type of each family member


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Hyperparameters of a Llama-family LM. Defaults are Llama-2-7B."""
  vocab_size: int = 32000
  d_model: int = 4096
  num_layers: int = 32
  num_heads: int = 32
  num_kv_heads: int = 32
  head_dim: int = 128
  d_ff: int = 11008
  rms_norm_eps: float = 1e-5
  rope: Rope = Rope()
  max_position_embeddings: int = 4096    # informative (exported): rotary positions have no table
  sliding_window: int | None = None      # every layer sees the last W positions (mistral)
  qkv_bias: bool = False
  out_bias: bool = False
  mlp_bias: bool = False
  qk_norm: bool = False                  # RMSNorm over Dh of every query and key head (qwen3)
  tie_word_embeddings: bool = False
  bos_token_id: int | None = 1
  eos_token_id: int | tuple[int, ...] | None = 2
  pad_token_id: int | None = None
  model_type: str = "llama"              # the HF family, for export
  dtype: str = "float32"                 # params and activations; logits are always float32
  precision: str = "highest"             # of every matmul: float32 stays float32 on TF32 GPUs
  scan_layers: bool = True               # stacked + nn.scan, or layers_i + a loop: models/layers.py
  head_subset: SubVocab | None = None    # the head scores only these ids (models/sub_vocab.py)
  quant: str = ""                        # "int8": int8 dense layers (models/quant.py)
  layout: str = "in_out"                 # dense kernels [in, out] or "out_in" [out, in]; not an
                                         # HF field (models/dense_layout.py)

  def __post_init__(self):
    if self.dtype not in _DTYPES:
      raise ValueError(f"dtype '{self.dtype}' is not supported; use one of {_DTYPES}.")
    if self.precision not in _PRECISIONS:
      raise ValueError(f"precision '{self.precision}' is not supported; use one of {_PRECISIONS}.")
    if self.quant not in quant.QUANTS:
      raise ValueError(f"quant '{self.quant}' is not supported; use one of {quant.QUANTS}.")
    dense_layout.check(self.layout, self.quant)
    if self.model_type not in MODEL_TYPES:
      raise ValueError(f"model_type '{self.model_type}' is not one of {MODEL_TYPES}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                       f"{self.num_kv_heads} (grouped-query attention shares each KV head "
                       f"among num_heads / num_kv_heads query heads).")
    if self.head_dim % 2:
      raise ValueError(f"head_dim {self.head_dim} must be even (rotary embeddings rotate pairs).")

  def arch(self) -> transformer.Arch:
    """The family as a configuration of the one transformer: RMSNorm (attention_norm, mlp_norm,
    final_norm), rotary positions, SwiGLU (wi_0, wi_1, wo), grouped-query heads, and the
    member's switches (biases, qk_norm, sliding window)."""
    return transformer.Arch(
        vocab_size=self.vocab_size, d_model=self.d_model, num_layers=self.num_layers,
        num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
        d_ff=self.d_ff, norm="rms", norm_eps=self.rms_norm_eps,
        norm_names=("attention_norm", "mlp_norm", "final_norm"), mlp=transformer.SWIGLU,
        rope=self.rope, qkv_bias=self.qkv_bias, out_bias=self.out_bias, mlp_bias=self.mlp_bias,
        qk_norm=self.qk_norm, sliding_window=self.sliding_window,
        tie_word_embeddings=self.tie_word_embeddings, dtype=self.dtype,
        precision=self.precision, scan_layers=self.scan_layers, head_subset=self.head_subset,
        quant=self.quant, layout=self.layout)


# ---------------------------------------------------------------------------------------------
# The model object the decoding loop sees.


@dataclasses.dataclass(frozen=True)
class Llama(DecoderOnly):
  """Frozen, hashable wrapper (a static jit argument) exposing the model contract."""
  config: LlamaConfig
  is_encoder_decoder: bool = dataclasses.field(default=False, init=False)

  @property
  def heads(self) -> tuple[int, int]:
    return self.config.num_heads, self.config.num_kv_heads

  @property
  def module(self) -> transformer.Transformer:
    return transformer.Transformer(self.config.arch())

  def init_cache(self, batch: int, max_len: int, enc_len: int = 0) -> kvc.KVCache:
    """Buffers [L, B, Hkv, S, Dh]: only the key/value heads are cached."""
    cfg = self.config
    del enc_len  # decoder-only: no encoder
    return kvc.init_cache(layers=cfg.num_layers, batch=batch, max_len=max_len,
                          heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=self.dtype)


# ---------------------------------------------------------------------------------------------
# Hugging Face import / export (dispatched to by hf_import.py).

