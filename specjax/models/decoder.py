"""A GPT-2 compatible decoder-only LM that follows the model contract (specjax/models/__init__.py).

Pre-norm transformer blocks with learned absolute position embeddings, so that Hugging Face `gpt2`
checkpoints load unchanged (`hf_import.load_model`) and logits match `GPT2LMHeadModel`. The same
code serves the DistillSpec LM1B pair (`lm1b_config`) trained from scratch.

Every forward pass is `extend`: the T new tokens of row b sit at absolute positions
lengths[b] .. lengths[b]+T-1, their keys/values are written into the explicit `KVCache` there, and
attention is causal over the cache. `prefill` is `extend` from an empty cache plus a gather of the
last prompt position of each row.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from specjax.models import attention, dense_layout, layers, quant
from specjax.models import kv_cache as kvc
from specjax.models.decoder_only import DecoderOnly
from specjax.models.sub_vocab import SubVocab

Params = Any

_ACTIVATIONS = {
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_fast": functools.partial(jax.nn.gelu, approximate=True),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}
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
    if self.activation not in _ACTIVATIONS:
      raise ValueError(f"activation '{self.activation}' is not supported; use one of "
                       f"{sorted(_ACTIVATIONS)}.")
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
# Linen modules.


def _init(std: float):
  return nn.initializers.normal(stddev=std)


class _Table(nn.Module):
  """One named weight matrix (embedding tables, untied LM head), read as a raw array."""
  leaf: str
  shape: tuple[int, int]
  std: float
  dtype: str

  @nn.compact
  def __call__(self):
    return self.param(self.leaf, _init(self.std), self.shape, jnp.dtype(self.dtype))


def _dense(cfg: DecoderConfig, features: int, *, name: str, kernel_init) -> nn.Module:
  return quant.dense(features, quant=cfg.quant, dtype=jnp.dtype(cfg.dtype),
                     precision=cfg.precision, kernel_init=kernel_init, name=name,
                     layout=cfg.layout)


class _Attention(nn.Module):
  cfg: DecoderConfig

  @nn.compact
  def __call__(self, x, k_buf, v_buf, mask):
    """x [B,T,D]; k_buf, v_buf [B,H,S,Dh] one layer of the cache (read only); mask = (old [B,1,S]
    cache entries < lengths, new [T,T] causal). Returns the output and this block's k, v
    [B,T,H,Dh]: the caller writes every layer's entries in one go (no per-layer buffer copies)."""
    cfg = self.cfg
    batch, num_new, _ = x.shape
    heads, head_dim = cfg.num_heads, cfg.head_dim
    dense = functools.partial(_dense, cfg, heads * head_dim, kernel_init=_init(0.02))
    q = dense(name="query")(x).reshape(batch, num_new, heads, head_dim)          # [B, T, H, Dh]
    k = dense(name="key")(x).reshape(batch, num_new, heads, head_dim)
    v = dense(name="value")(x).reshape(batch, num_new, heads, head_dim)
    old_mask, new_mask = mask
    segments = [(k_buf, v_buf, old_mask, None),                                  # the cache
                (attention.heads_first(k), attention.heads_first(v), new_mask[None], None)]
    ctx = attention.attend(q, segments, scale=1.0 / math.sqrt(head_dim),
                           precision=cfg.precision)                              # [B, T, H*Dh]
    out = _dense(cfg, cfg.d_model, name="out",
                 kernel_init=_init(0.02 / math.sqrt(2 * cfg.num_layers)))(ctx)        # [B, T, D]
    return out, k, v


class _Mlp(nn.Module):
  cfg: DecoderConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    dense = functools.partial(_dense, cfg)
    h = dense(cfg.d_ff, name="wi", kernel_init=_init(0.02))(x)
    h = _ACTIVATIONS[cfg.activation](h)                                        # [B, T, F]
    return dense(cfg.d_model, name="wo",
                 kernel_init=_init(0.02 / math.sqrt(2 * cfg.num_layers)))(h)


class _Block(nn.Module):
  """One layer; `_Blocks` scans it over the stacked params and the cache's layer axis, or the
  unstacked layout calls each layers_i in turn (layers.run)."""
  cfg: DecoderConfig

  @nn.compact
  def __call__(self, x, layer_cache, mask):
    """x [B,T,D] (the scan carry); layer_cache = (k_buf, v_buf) [B,H,S,Dh], this layer's slice of
    the cache; mask as _Attention's, the same for every layer -> (x, (k, v) [B,T,H,Dh])."""
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    norm = functools.partial(nn.LayerNorm, epsilon=cfg.layer_norm_epsilon, dtype=dt, param_dtype=dt)
    attn, k, v = _Attention(cfg, name="attention")(norm(name="ln_1")(x), *layer_cache, mask)
    x = x + attn
    x = x + _Mlp(cfg, name="mlp")(norm(name="ln_2")(x))
    return x, (k, v)


# One compiled layer whatever the depth: params get a leading [L] axis, the cache is read layer by
# layer as a scanned input, and the block's new entries come out stacked [L, B, T, H, Dh].
_IN_AXES = (0, nn.broadcast)      # (this layer's cache slice, the mask shared by every layer)
_Blocks = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True},
                  in_axes=_IN_AXES)


class _Transformer(nn.Module):
  """tokens [B,T] at positions lengths[b]+t -> (final-normed hidden, logits f32, and the block's
  new keys and values [L,B,T,H,Dh], which the caller writes into the cache).

  `select` ([B] indices into T, or None) keeps only one position per row before the LM head, so
  that prefill does not compute [B,P,V] logits it throws away.
  """
  cfg: DecoderConfig

  @nn.compact
  def __call__(self, tokens, k, v, lengths, select=None):
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    num_new = tokens.shape[1]
    wte = _Table("embedding", (cfg.vocab_size, cfg.d_model), 0.02, cfg.dtype,
                 name="token_embed")()                                         # [V, D]
    wpe = _Table("position_embedding", (cfg.n_positions, cfg.d_model), 0.01, cfg.dtype,
                 name="pos_embed")()                                           # [N, D]
    pos = kvc.positions(lengths, num_new)                                      # [B, T]
    x = (jnp.take(wte, tokens, axis=0, mode="clip")
         + jnp.take(wpe, pos, axis=0, mode="clip")).astype(dt)                  # [B, T, D]
    mask = (jnp.arange(k.shape[3])[None, None, :] < lengths[:, None, None],     # [B, 1, S]
            jnp.tril(jnp.ones((num_new, num_new), bool)))                      # [T, T]
    if cfg.scan_layers:
      blocks = _Blocks(cfg, name=layers.STACKED)
    else:
      blocks = [_Block(cfg, name=layers.layer_name(i)) for i in range(cfg.num_layers)]
    x, (new_k, new_v) = layers.run(blocks, _IN_AXES, x, (k, v), mask)        # [L, B, T, H, Dh]
    hidden = nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=dt, param_dtype=dt,
                          name="ln_f")(x)                                      # [B, T, D]
    if select is not None:
      hidden = jnp.take_along_axis(hidden, select[:, None, None], axis=1)[:, 0]  # [B, D]
    if cfg.quant == "int8":
      logits = quant.int8_logits(hidden, cfg.vocab_size, cfg.head_subset)       # [..., V]
    elif cfg.head_subset is not None:
      head = _Table("kernel", (cfg.d_model, cfg.head_subset.size), 0.02, cfg.dtype,
                    name="lm_head")()                                          # [D, K]
      logits = cfg.head_subset.logits(hidden, head, cfg.precision)              # [..., V]
    elif cfg.tie_word_embeddings:
      logits = jnp.einsum("...d,vd->...v", hidden, wte, precision=cfg.precision,
                          preferred_element_type=jnp.float32)
    else:
      head = _Table("kernel", (cfg.d_model, cfg.vocab_size), 0.02, cfg.dtype,
                    name="lm_head")()                                          # [D, V]
      logits = jnp.einsum("...d,dv->...v", hidden, head, precision=cfg.precision,
                          preferred_element_type=jnp.float32)
    return hidden, logits, new_k, new_v


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
  def module(self) -> _Transformer:
    return _Transformer(self.config)

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
