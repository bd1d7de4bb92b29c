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
(models/dense_layout.py). One table (`_hf_names`) names the HF tensor of every leaf for import
and export.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import attention, dense_layout, hf_tensors, layers, quant
from specjax.models import kv_cache as kvc
from specjax.models.decoder_only import DecoderOnly
from specjax.models.sub_vocab import SubVocab

Params = Any

_DTYPES = ("float32", "bfloat16")
_PRECISIONS = ("default", "high", "highest")
ROPE_TYPES = ("default", "linear", "llama3")


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

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MODEL_CLASS = Llama
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _rope_from_hf(hf_config: dict) -> Rope:
  """transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_theta` next to
  `rope_scaling` (null, or a dict whose type is `rope_type` or, older still, `type`)."""
  rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
  if rope.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0)) != 1.0:
    raise ValueError("partial_rotary_factor != 1 is not supported by specjax.models.llama.")
  kind = rope.get("rope_type", rope.get("type", "default"))
  scaling = {}
  if kind in ("linear", "llama3"):
    scaling["factor"] = float(rope["factor"])
  if kind == "llama3":
    scaling.update(low_freq_factor=float(rope["low_freq_factor"]),
                   high_freq_factor=float(rope["high_freq_factor"]),
                   original_max_positions=int(rope.get("original_max_position_embeddings",
                                                       hf_config["max_position_embeddings"])))
  theta = float(rope.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
  return Rope(theta=theta, kind=kind, **scaling)


def _rope_to_hf(rope: Rope) -> dict | None:
  if rope.kind == "default":
    return None
  out = {"rope_type": rope.kind, "factor": rope.factor}
  if rope.kind == "llama3":
    out.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
               original_max_position_embeddings=rope.original_max_positions)
  return out


def _switches(model_type: str, hf_config: dict) -> dict:
  """The family's architecture switches: biases, qk-norm, sliding window."""
  attention_bias = bool(hf_config.get("attention_bias", False))
  if hf_config.get("use_sliding_window", False):
    raise ValueError(f"{model_type} with use_sliding_window=true (per-layer windows) is not "
                     f"supported by specjax.models.llama.")
  return {
      "llama": dict(qkv_bias=attention_bias, out_bias=attention_bias,
                    mlp_bias=bool(hf_config.get("mlp_bias", False))),
      "mistral": dict(sliding_window=hf_config.get("sliding_window")),
      "qwen2": dict(qkv_bias=True),
      "qwen3": dict(qkv_bias=attention_bias, out_bias=attention_bias, qk_norm=True),
  }[model_type]


def _token_ids(value):
  """HF writes eos_token_id as an int or a list; a tuple keeps the config hashable."""
  return tuple(value) if isinstance(value, list) else value


def model_from_hf_config(hf_config: dict, dtype: str) -> Llama:
  """LlamaConfig / MistralConfig / Qwen2Config / Qwen3Config dict -> Llama; refuses the options
  this implementation does not have (other rope types, other activations)."""
  model_type = hf_config.get("model_type")
  if model_type not in MODEL_TYPES:
    raise ValueError(f"model_type '{model_type}' is not supported by specjax.models.llama; it "
                     f"reads {MODEL_TYPES}.")
  if hf_config.get("hidden_act", "silu") not in ("silu", "swish"):
    raise ValueError(f"hidden_act '{hf_config['hidden_act']}' is not supported; the Llama "
                     f"family's SwiGLU MLP uses 'silu'.")
  d_model, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
  return Llama(LlamaConfig(
      vocab_size=hf_config["vocab_size"], d_model=d_model,
      num_layers=hf_config["num_hidden_layers"], num_heads=heads,
      num_kv_heads=hf_config.get("num_key_value_heads") or heads,
      head_dim=hf_config.get("head_dim") or d_model // heads,
      d_ff=hf_config["intermediate_size"], rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
      rope=_rope_from_hf(hf_config),
      max_position_embeddings=hf_config.get("max_position_embeddings", 4096),
      tie_word_embeddings=hf_config.get("tie_word_embeddings", False),
      bos_token_id=hf_config.get("bos_token_id"),
      eos_token_id=_token_ids(hf_config.get("eos_token_id")),
      pad_token_id=hf_config.get("pad_token_id"), model_type=model_type, dtype=dtype,
      **_switches(model_type, hf_config)))


def _hf_names(model: Llama) -> dict[str, tuple[str, ...]]:
  """HF tensor name -> specjax param path. Per-layer names carry `{i}`; their params sit under
  `layers` with a leading [L] axis."""
  cfg = model.config
  names = {"model.embed_tokens.weight": ("token_embed", "embedding"),
           "model.norm.weight": ("final_norm", "scale")}
  if not cfg.tie_word_embeddings:
    names["lm_head.weight"] = ("lm_head", "kernel")
  layer = "model.layers.{i}"
  linears = [("self_attn.q_proj", ("attention", "query"), cfg.qkv_bias),
             ("self_attn.k_proj", ("attention", "key"), cfg.qkv_bias),
             ("self_attn.v_proj", ("attention", "value"), cfg.qkv_bias),
             ("self_attn.o_proj", ("attention", "out"), cfg.out_bias),
             ("mlp.gate_proj", ("mlp", "wi_0"), cfg.mlp_bias),
             ("mlp.up_proj", ("mlp", "wi_1"), cfg.mlp_bias),
             ("mlp.down_proj", ("mlp", "wo"), cfg.mlp_bias)]
  for hf, ours, has_bias in linears:
    names[f"{layer}.{hf}.weight"] = ("layers", *ours, "kernel")
    if has_bias:
      names[f"{layer}.{hf}.bias"] = ("layers", *ours, "bias")
  names[f"{layer}.input_layernorm.weight"] = ("layers", "attention_norm", "scale")
  names[f"{layer}.post_attention_layernorm.weight"] = ("layers", "mlp_norm", "scale")
  if cfg.qk_norm:
    names[f"{layer}.self_attn.q_norm.weight"] = ("layers", "attention", "q_norm", "scale")
    names[f"{layer}.self_attn.k_norm.weight"] = ("layers", "attention", "k_norm", "scale")
  return names


def _set(tree: dict, path: tuple[str, ...], value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...]):
  for key in path:
    tree = tree[key]
  return tree


def _transposed(cfg: LlamaConfig, path: tuple[str, ...]) -> bool:
  """Whether the leaf at `path` is the transpose of its HF tensor: HF Linear weights are
  [out, in]; the LM head is [D, V] and the layers' Dense kernels [in, out] in the "in_out"
  layout, [out, in] (HF's own, no transpose) in "out_in" (models/dense_layout.py)."""
  return path[-1] == "kernel" and (cfg.layout == dense_layout.IN_OUT or path[0] == "lm_head")


def _read(tensors: Mapping[str, np.ndarray], name: str, path: tuple[str, ...],
          shape: tuple[int, ...], cfg: LlamaConfig, dtype) -> np.ndarray:
  """One tensor, checked against the config's shape, as our layout in the model dtype."""
  if name not in tensors:
    raise ValueError(f"checkpoint lacks tensor '{name}': does its config.json match the "
                     f"weights?")
  tensor = np.asarray(tensors[name])
  transpose = _transposed(cfg, path)
  want = shape[::-1] if transpose else shape
  if tensor.shape != tuple(want):
    raise ValueError(f"checkpoint tensor '{name}' has shape {tensor.shape} but the config "
                     f"implies {tuple(want)}.")
  return (tensor.T if transpose else tensor).astype(dtype)


def params_from_hf(model: Llama, tensors: Mapping[str, np.ndarray]) -> Params:
  """HF tensors -> params. `tensors` may be lazy (each lookup reads a file): every tensor is
  read once and cast to the model dtype on its own, per-layer ones straight into their [L, ...]
  stack, so no float32 copy of the whole model is built (then split per layer if the model has
  scan_layers=False). Extra tensors are ignored."""
  cfg = model.config
  shapes = jax.eval_shape(layers.with_scan(model).init_params, jax.random.PRNGKey(0))
  dtype = model.dtype
  names = _hf_names(model)
  expected = [n.format(i=i) for n, path in names.items()
              for i in (range(cfg.num_layers) if path[0] == "layers" else [0])]
  hf_tensors.check_names(tensors, expected, "Llama-family",
                         f"does its config.json (num_hidden_layers={cfg.num_layers}, "
                         f"tie_word_embeddings={cfg.tie_word_embeddings}) match the weights?")
  if not cfg.scan_layers:
    return _params_unrolled(tensors, names, shapes, cfg, dtype)
  params: dict = {}
  for name, path in names.items():
    shape = _get(shapes, path).shape
    if path[0] != "layers":
      _set(params, path, jnp.asarray(_read(tensors, name, path, shape, cfg, dtype)))
      continue
    stacked = np.empty(shape, dtype)                                           # [L, ...]
    for i in range(cfg.num_layers):
      stacked[i] = _read(tensors, name.format(i=i), path, shape[1:], cfg, dtype)
    _set(params, path, jnp.asarray(stacked))
  return layers.to_layout(params, cfg.scan_layers, free_stacked=True)


def _params_unrolled(tensors: Mapping[str, np.ndarray], names: dict, shapes, cfg: LlamaConfig,
                     dtype) -> Params:
  """The unrolled layout (layers_0 ... layers_{L-1}) straight from the tensors: each one is put
  on the device as stored, then transposed, cast and checked for NaN / inf there in one compiled
  call (hf_tensors.to_param), so the host makes no converted copy, no stack and no split."""
  params: dict = {}
  checks = hf_tensors.FiniteChecks(tensors)
  for name, path in names.items():
    shape = _get(shapes, path).shape
    per_layer = path[0] == "layers"
    transpose = _transposed(cfg, path)
    for i in range(cfg.num_layers) if per_layer else (None,):
      hf_name, where = ((name.format(i=i), (layers.layer_name(i), *path[1:])) if per_layer
                        else (name, path))
      want = shape[1:] if per_layer else shape
      raw = hf_tensors.raw_tensor(tensors, hf_name)
      expect = tuple(want[::-1] if transpose else want)
      if raw.shape != expect:
        raise ValueError(f"checkpoint tensor '{hf_name}' has shape {raw.shape} but the config "
                         f"implies {expect}.")
      value, bad = hf_tensors.to_param(raw, transpose, jnp.dtype(dtype))
      checks.add(hf_name, bad)
      _set(params, where, value)
  checks.raise_if_any()
  return params


def params_to_hf(model: Llama, params: Params) -> dict[str, np.ndarray]:
  """params (either layer layout) -> the tensors LlamaForCausalLM (etc.).save_pretrained writes,
  in the param dtype; the exact inverse of params_from_hf."""
  params = layers.stack(params)
  out = {}
  for name, path in _hf_names(model).items():
    value = np.asarray(_get(params, path))
    per_layer = ([(name.format(i=i), value[i]) for i in range(model.config.num_layers)]
                 if path[0] == "layers" else [(name, value)])
    transpose = _transposed(model.config, path)
    for hf_name, tensor in per_layer:
      out[hf_name] = np.ascontiguousarray(tensor.T if transpose else tensor)
  return out


def hf_config(model: Llama) -> dict:
  """config.json contents that transformers loads as the config's model_type; refuses a config
  that family cannot express (e.g. qwen2 without q/k/v biases)."""
  cfg = model.config
  out = {
      "model_type": cfg.model_type, "architectures": [_ARCHITECTURES[cfg.model_type]],
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
      "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
      "rope_theta": cfg.rope.theta, "rope_scaling": _rope_to_hf(cfg.rope),
      "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
      "eos_token_id": (list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple)
                       else cfg.eos_token_id),
      "pad_token_id": cfg.pad_token_id, "attention_dropout": 0.0, "initializer_range": 0.02,
  }
  out.update({"llama": {"attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias},
              "mistral": {"sliding_window": cfg.sliding_window},
              "qwen2": {"use_sliding_window": False},
              "qwen3": {"attention_bias": cfg.qkv_bias, "use_sliding_window": False},
              }[cfg.model_type])
  rebuilt = model_from_hf_config(out, cfg.dtype).config    # without the specjax-only settings
  if dataclasses.replace(rebuilt, precision=cfg.precision, scan_layers=cfg.scan_layers,
                         layout=cfg.layout) != cfg:
    raise ValueError(f"this LlamaConfig cannot be written as HF model_type '{cfg.model_type}' "
                     f"(its biases / qk_norm / sliding window differ from that family's): {cfg}")
  return out
