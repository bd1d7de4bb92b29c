"""Llama-family decoder-only LM (Hugging Face `llama`, `mistral`, `qwen2`, `qwen3`) behind the
model contract (specjax/models/__init__.py).

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
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import attention, dense_layout, layers, quant
from specjax.models import kv_cache as kvc
from specjax.models.decoder_only import DecoderOnly
from specjax.models.sub_vocab import SubVocab

Params = Any

_DTYPES = ("float32", "bfloat16")
_PRECISIONS = ("default", "high", "highest")
ROPE_TYPES = ("default", "linear", "llama3")
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")   # HF model_type of each family member


@dataclasses.dataclass(frozen=True)
class Rope:
  """Rotary frequencies theta^(-2i/Dh), rescaled by HF rope type `linear` (all divided by
  factor) or `llama3` (long wavelengths divided by factor, short ones kept, smooth in between)."""
  theta: float = 10000.0
  kind: str = "default"
  factor: float = 1.0
  low_freq_factor: float = 1.0              # llama3 only
  high_freq_factor: float = 4.0             # llama3 only
  original_max_positions: int = 8192        # llama3 only: the pre-training context

  def __post_init__(self):
    if self.kind not in ROPE_TYPES:
      raise ValueError(f"rope scaling type '{self.kind}' is not supported; specjax.models.llama "
                       f"supports {ROPE_TYPES} (no rope_scaling means 'default').")

  def inv_freq(self, head_dim: int) -> np.ndarray:
    """[Dh/2] float32 angular frequencies, computed as transformers does (float32)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    freq = (np.float32(1.0) / np.float32(self.theta) ** exponents).astype(np.float32)
    if self.kind == "linear":
      return (freq / np.float32(self.factor)).astype(np.float32)
    if self.kind == "llama3":
      return self._llama3(freq)
    return freq

  def _llama3(self, freq: np.ndarray) -> np.ndarray:
    low_freq_wavelen = self.original_max_positions / self.low_freq_factor
    high_freq_wavelen = self.original_max_positions / self.high_freq_factor
    wavelen = np.float32(2 * math.pi) / freq
    scaled = np.where(wavelen > low_freq_wavelen, freq / np.float32(self.factor), freq)
    smooth = ((self.original_max_positions / wavelen - self.low_freq_factor)
              / (self.high_freq_factor - self.low_freq_factor))
    smoothed = (1 - smooth) * scaled / np.float32(self.factor) + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


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


# ---------------------------------------------------------------------------------------------
# Linen modules.


def _init(std: float):
  return nn.initializers.normal(stddev=std)


def _dense(cfg: LlamaConfig, features: int, use_bias: bool, name: str) -> nn.Module:
  return quant.dense(features, quant=cfg.quant, dtype=jnp.dtype(cfg.dtype),
                     precision=cfg.precision, use_bias=use_bias, kernel_init=_init(0.02),
                     name=name, layout=cfg.layout)


class _RMSNorm(nn.Module):
  """HF's Llama RMSNorm: statistics in float32, the normalised x rounded back to the input dtype,
  then scaled (the same rounding as transformers in bfloat16)."""
  eps: float
  dtype: str

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.dtype(self.dtype))
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    return scale * normed.astype(x.dtype)


class _Table(nn.Module):
  """One named weight matrix (embedding table, untied LM head), read as a raw array."""
  leaf: str
  shape: tuple[int, int]
  dtype: str

  @nn.compact
  def __call__(self):
    return self.param(self.leaf, _init(0.02), self.shape, jnp.dtype(self.dtype))


def _rotary(inv_freq: np.ndarray, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """positions [B,T] -> (cos, sin) [B,T,1,Dh/2] in the activation dtype (as transformers)."""
  angles = positions.astype(jnp.float32)[..., None] * inv_freq                # [B, T, Dh/2]
  return (jnp.cos(angles)[:, :, None].astype(dtype), jnp.sin(angles)[:, :, None].astype(dtype))


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [B,T,H,Dh]: rotate the pairs (i, i + Dh/2) by the position's angles (HF rotate_half)."""
  x1, x2 = jnp.split(x, 2, axis=-1)                                           # [B, T, H, Dh/2]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _masks(cfg: LlamaConfig, positions: jax.Array, lengths: jax.Array, capacity: int):
  """Which keys each query sees: (cache [B,T|1,S], block's own [1,T,T]). Causal; with a sliding
  window W also only keys at most W-1 positions back (HF's sliding-window mask)."""
  num_new = positions.shape[1]
  slots = jnp.arange(capacity)
  old = slots[None, None, :] < lengths[:, None, None]                         # [B, 1, S]
  offsets = jnp.arange(num_new)
  new = offsets[None, :] <= offsets[:, None]                                  # [T, T]
  if cfg.sliding_window is not None:
    old = old & (slots[None, None, :] > positions[:, :, None] - cfg.sliding_window)  # [B, T, S]
    new = new & (offsets[None, :] > offsets[:, None] - cfg.sliding_window)
  return old, new[None]


class _Attention(nn.Module):
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x, k_buf, v_buf, rotary, masks):
    """x [B,T,D]; k_buf, v_buf [B,Hkv,S,Dh] this layer's cache (read only); rotary (cos, sin)
    [B,T,1,Dh/2]. Returns the output [B,T,D] and the block's rotated k, v [B,T,Hkv,Dh]."""
    cfg = self.cfg
    batch, num_new, _ = x.shape
    heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = _dense(cfg, heads * head_dim, cfg.qkv_bias, "query")(x)
    q = q.reshape(batch, num_new, heads, head_dim)                             # [B, T, H, Dh]
    k = _dense(cfg, kv_heads * head_dim, cfg.qkv_bias, "key")(x)
    k = k.reshape(batch, num_new, kv_heads, head_dim)                          # [B, T, Hkv, Dh]
    v = _dense(cfg, kv_heads * head_dim, cfg.qkv_bias, "value")(x)
    v = v.reshape(batch, num_new, kv_heads, head_dim)
    if cfg.qk_norm:
      q = _RMSNorm(cfg.rms_norm_eps, cfg.dtype, name="q_norm")(q)
      k = _RMSNorm(cfg.rms_norm_eps, cfg.dtype, name="k_norm")(k)
    q, k = _rotate(q, *rotary), _rotate(k, *rotary)
    old_mask, new_mask = masks
    segments = [(k_buf, v_buf, old_mask, None),                                # the cache
                (attention.heads_first(k), attention.heads_first(v), new_mask, None)]
    ctx = attention.attend(q, segments, scale=1.0 / math.sqrt(head_dim),
                           precision=cfg.precision)                            # [B, T, H*Dh]
    return _dense(cfg, cfg.d_model, cfg.out_bias, "out")(ctx), k, v


class _Mlp(nn.Module):
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    gate = _dense(cfg, cfg.d_ff, cfg.mlp_bias, "wi_0")(x)                    # [B, T, F]
    up = _dense(cfg, cfg.d_ff, cfg.mlp_bias, "wi_1")(x)
    return _dense(cfg, cfg.d_model, cfg.mlp_bias, "wo")(jax.nn.silu(gate) * up)


class _Layer(nn.Module):
  """One block; `nn.scan` runs it over the stacked params and this layer's slice of the cache (or
  the unstacked layout calls each layers_i in turn, layers.run)."""
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x, layer_cache, context):
    """x [B,T,D]; layer_cache (k, v) [B,Hkv,S,Dh]; context (rotary, masks), the same for every
    layer -> (x, (k, v) [B,T,Hkv,Dh])."""
    cfg = self.cfg
    rotary, masks = context
    norm = functools.partial(_RMSNorm, cfg.rms_norm_eps, cfg.dtype)
    attn, k, v = _Attention(cfg, name="attention")(norm(name="attention_norm")(x), *layer_cache,
                                                   rotary, masks)
    x = x + attn
    x = x + _Mlp(cfg, name="mlp")(norm(name="mlp_norm")(x))
    return x, (k, v)


_IN_AXES = (0, nn.broadcast)      # (this layer's cache slice, the context shared by every layer)
_Layers = nn.scan(_Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                  in_axes=_IN_AXES)


class _Transformer(nn.Module):
  """tokens [B,T] at positions lengths[b]+t -> (final-normed hidden, logits f32, and the block's
  new keys and values [L,B,T,Hkv,Dh], which the caller writes into the cache).

  `select` ([B] indices into T, or None) keeps only one position per row before the LM head.
  """
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, tokens, k, v, lengths, select=None):
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    embed = _Table("embedding", (cfg.vocab_size, cfg.d_model), cfg.dtype,
                   name="token_embed")()                                       # [V, D]
    x = jnp.take(embed, tokens, axis=0, mode="clip").astype(dt)                # [B, T, D]
    positions = kvc.positions(lengths, tokens.shape[1])                        # [B, T]
    context = (_rotary(cfg.rope.inv_freq(cfg.head_dim), positions, dt),
               _masks(cfg, positions, lengths, k.shape[3]))
    if cfg.scan_layers:
      blocks = _Layers(cfg, name=layers.STACKED)
    else:
      blocks = [_Layer(cfg, name=layers.layer_name(i)) for i in range(cfg.num_layers)]
    x, (new_k, new_v) = layers.run(blocks, _IN_AXES, x, (k, v), context)     # k, v [L,B,T,Hkv,Dh]
    hidden = _RMSNorm(cfg.rms_norm_eps, cfg.dtype, name="final_norm")(x)       # [B, T, D]
    if select is not None:
      hidden = jnp.take_along_axis(hidden, select[:, None, None], axis=1)[:, 0]  # [B, D]
    if cfg.quant == "int8":
      logits = quant.int8_logits(hidden, cfg.vocab_size, cfg.head_subset)       # [..., V]
    elif cfg.head_subset is not None:
      head = _Table("kernel", (cfg.d_model, cfg.head_subset.size), cfg.dtype,
                    name="lm_head")()                                          # [D, K]
      logits = cfg.head_subset.logits(hidden, head, cfg.precision)              # [..., V]
    elif cfg.tie_word_embeddings:
      logits = jnp.einsum("...d,vd->...v", hidden, embed, precision=cfg.precision,
                          preferred_element_type=jnp.float32)
    else:
      head = _Table("kernel", (cfg.d_model, cfg.vocab_size), cfg.dtype, name="lm_head")()  # [D, V]
      logits = jnp.einsum("...d,dv->...v", hidden, head, precision=cfg.precision,
                          preferred_element_type=jnp.float32)
    return hidden, logits, new_k, new_v


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
  def module(self) -> _Transformer:
    return _Transformer(self.config)

  def init_cache(self, batch: int, max_len: int, enc_len: int = 0) -> kvc.KVCache:
    """Buffers [L, B, Hkv, S, Dh]: only the key/value heads are cached."""
    cfg = self.config
    del enc_len  # decoder-only: no encoder
    return kvc.init_cache(layers=cfg.num_layers, batch=batch, max_len=max_len,
                          heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=self.dtype)


# ---------------------------------------------------------------------------------------------
# Hugging Face import / export (dispatched to by hf_import.py).

