"""T5 encoder-decoder (original T5 and T5 v1.1) behind the model contract of DESIGN.md §3.

`prefill` encodes the right-padded prompt once and stores the cross-attention keys/values of every
decoder layer in the KVCache; `extend` only runs the decoder. Decoder relative-position buckets come
from ABSOLUTE per-row positions (query lengths[b]+t, key s), so a verify block of T tokens, T
single-token calls, and a rewound-then-re-extended cache all see the same biases.

Params are a plain nested dict, laid out by ONE table (`param_table`, which also names the HF
tensors) used by `init_params` and by models/convert/t5.py's import and export:
  shared/embedding [V,D]; lm_head/kernel [D,V] (only when untied);
  {encoder,decoder}/relpos_bias [buckets,H]; {encoder,decoder}/final_norm/scale [D];
  and each stack's layers stacked under one subtree with a leading [L] axis (run by `nn.scan`):
  layers/{self_attn,cross_attn}/{query,key,value}/kernel [L,D,H*Dh], .../out/kernel [L,H*Dh,D];
  layers/{self_attn,cross_attn,mlp}_norm/scale [L,D]; layers/mlp/{wi | wi_0,wi_1}/kernel
  [L,D,F], layers/mlp/wo/kernel [L,F,D] (cross_attn* in the decoder only).
With `scan_layers=False` each stack holds layers_0 ... instead (the same leaves without [L]),
run by a Python loop: faster on XLA:CPU (models/layers.py).

Tying is decided by the params: with `lm_head` present the head is untied, else the shared
embedding is used. `T5Config.tie_word_embeddings` only says what `init_params` creates and what the
export writes; this is needed because transformers >= 5 re-saves v1.1 checkpoints with
`tie_word_embeddings: true` next to a distinct `lm_head.weight` (scaling then comes from
`scale_decoder_outputs`).
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

from specjax.models import ModelBase, Prompt
from specjax.models import attention, head_product, hf_tensors
from specjax.models import layers as layouts
from specjax.models import kv_cache as kvc

Params = dict[str, Any]
_DTYPES = ("float32", "bfloat16")
_PRECISIONS = ("default", "high", "highest")
_ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),        # HF "gelu" is the erf form
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),     # tanh approximation
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "silu": jax.nn.silu,
}


@dataclasses.dataclass(frozen=True)
class T5Config:
  vocab_size: int = 32128
  d_model: int = 512
  d_kv: int = 64                       # per-head width; num_heads * d_kv need not equal d_model
  d_ff: int = 2048
  num_heads: int = 8
  num_layers: int = 6                  # encoder layers
  num_decoder_layers: int = 6
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  feed_forward_proj: str = "relu"      # "relu" (T5) or "gated-gelu" (v1.1, gelu_new); "[gated-]act"
  tie_word_embeddings: bool = True     # T5: tied; v1.1: separate lm_head
  scale_decoder_outputs: bool | None = None   # None: same as tie_word_embeddings (HF convention)
  layer_norm_epsilon: float = 1e-6
  pad_token_id: int = 0
  eos_token_id: int = 1
  decoder_start_token_id: int = 0
  dtype: str = "float32"               # params and activations; logits are always float32
  # Of every matmul. "highest": float32 stays float32 where the backend would round it (TF32 on
  # NVIDIA GPUs, ~1e-3); "default" is the faster choice for bfloat16 weights. Not an HF field.
  precision: str = "highest"
  # Stacked layers under nn.scan, or layers_0 ... in a Python loop: models/layers.py. Not an HF
  # field.
  scan_layers: bool = True

  def __post_init__(self):
    if self.scale_decoder_outputs is None:     # normalise, so that equal models compare equal
      object.__setattr__(self, "scale_decoder_outputs", self.tie_word_embeddings)
    if self.dtype not in _DTYPES:
      raise ValueError(f"T5 dtype '{self.dtype}' is not supported; use one of {_DTYPES}.")
    if self.precision not in _PRECISIONS:
      raise ValueError(f"T5 precision '{self.precision}' is not supported; use one of "
                       f"{_PRECISIONS}.")
    if self.activation not in _ACTIVATIONS or len(self.feed_forward_proj.split("-")) > 2 or (
        "-" in self.feed_forward_proj and not self.is_gated):
      raise ValueError(f"feed_forward_proj '{self.feed_forward_proj}' is not supported; use "
                       f"'relu', 'gated-gelu' or '[gated-]ACT' with ACT in {sorted(_ACTIVATIONS)}.")
    if self.relative_attention_num_buckets < 4:
      raise ValueError("relative_attention_num_buckets must be >= 4 (half of the bidirectional "
                       f"buckets are exact offsets); got {self.relative_attention_num_buckets}.")

  @property
  def is_gated(self) -> bool:
    return self.feed_forward_proj.startswith("gated-")

  @property
  def activation(self) -> str:
    """HF `dense_act_fn`: "gated-gelu" means gelu_new for backward compatibility, as in HF."""
    if self.feed_forward_proj == "gated-gelu":
      return "gelu_new"
    return self.feed_forward_proj.split("-")[-1]


def relative_position_bucket(rel: jax.Array, *, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> jax.Array:
  """Mesh-TF/HF bucketing of rel = key_pos - query_pos: exact for small |rel|, log-spaced up to
  max_distance, then clipped. Float32 log, truncated, exactly as HF computes it.

  Example (unidirectional, 32 buckets, max_distance 128): rel 0 -> 0, -5 -> 5, -20 -> 17,
  -200 -> 31, +3 (a future key, masked anyway) -> 0.
  """
  buckets = jnp.zeros_like(rel)
  if bidirectional:
    num_buckets //= 2
    buckets = buckets + (rel > 0).astype(rel.dtype) * num_buckets
    rel = jnp.abs(rel)
  else:
    rel = -jnp.minimum(rel, 0)
  max_exact = num_buckets // 2
  scaled = (jnp.log(jnp.maximum(rel, 1).astype(jnp.float32) / max_exact)
            / np.float32(math.log(max_distance / max_exact)) * (num_buckets - max_exact))
  large = jnp.minimum(max_exact + scaled.astype(rel.dtype), num_buckets - 1)
  return buckets + jnp.where(rel < max_exact, rel, large)


class _Attention(nn.Module):
  cfg: T5Config

  def setup(self):
    cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
    inner = cfg.num_heads * cfg.d_kv
    dense = functools.partial(nn.Dense, use_bias=False, dtype=dt, param_dtype=dt,
                              precision=cfg.precision)
    self.query, self.key, self.value = dense(inner), dense(inner), dense(inner)
    self.out = dense(cfg.d_model)

  def _heads(self, x):
    return x.reshape(x.shape[:2] + (self.cfg.num_heads, self.cfg.d_kv))

  def project_kv(self, x):
    """x [B,S,D] -> keys, values [B,S,H,Dh]."""
    return self._heads(self.key(x)), self._heads(self.value(x))

  def project_kv_heads_first(self, x):
    """x [B,S,D] -> keys, values [B,H,S,Dh]: the cache layout, which attention reads."""
    return tuple(attention.heads_first(t) for t in self.project_kv(x))

  def __call__(self, x, segments):
    ctx = attention.attend(self._heads(self.query(x)), segments, precision=self.cfg.precision)
    return self.out(ctx)                                                  # [B, T, D]


class _Mlp(nn.Module):
  cfg: T5Config

  @nn.compact
  def __call__(self, x):
    cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
    dense = functools.partial(nn.Dense, use_bias=False, dtype=dt, param_dtype=dt,
                              precision=cfg.precision)
    act = _ACTIVATIONS[cfg.activation]
    if cfg.is_gated:
      h = act(dense(cfg.d_ff, name="wi_0")(x)) * dense(cfg.d_ff, name="wi_1")(x)
    else:
      h = act(dense(cfg.d_ff, name="wi")(x))
    return dense(cfg.d_model, name="wo")(h)


def _norm(cfg: T5Config) -> nn.RMSNorm:
  """T5 layer norm: RMS only (no mean, no bias), statistics in float32."""
  dt = jnp.dtype(cfg.dtype)
  return nn.RMSNorm(epsilon=cfg.layer_norm_epsilon, dtype=dt, param_dtype=dt)


class _EncoderLayer(nn.Module):
  cfg: T5Config

  def setup(self):
    self.self_attn_norm, self.self_attn = _norm(self.cfg), _Attention(self.cfg)
    self.mlp_norm, self.mlp = _norm(self.cfg), _Mlp(self.cfg)

  def __call__(self, x, mask, bias):
    """x [B,E,D] (the scan carry); mask [B,E,E], bias [1,H,E,E], the same for every layer."""
    h = self.self_attn_norm(x)
    k, v = self.self_attn.project_kv_heads_first(h)
    x = x + self.self_attn(h, [(k, v, mask, bias)])
    return x + self.mlp(self.mlp_norm(x)), None


class _DecoderLayer(nn.Module):
  cfg: T5Config

  def setup(self):
    self.self_attn_norm, self.self_attn = _norm(self.cfg), _Attention(self.cfg)
    self.cross_attn_norm, self.cross_attn = _norm(self.cfg), _Attention(self.cfg)
    self.mlp_norm, self.mlp = _norm(self.cfg), _Mlp(self.cfg)

  def cross_kv(self, carry, enc_out):
    """A scan step that carries nothing: enc_out [B,E,D] -> cross keys, values [B,H,E,Dh]."""
    return carry, self.cross_attn.project_kv_heads_first(enc_out)

  def __call__(self, x, layer_cache, masks, biases, cross_mask):
    """x [B,T,D] (the scan carry); layer_cache = (k_buf, v_buf [B,H,S,Dh], cross_k, cross_v
    [B,H,E,Dh]), this layer's slice of the cache, read only; masks and biases: (cache entries,
    this block's entries). Returns x and the block's k, v [B,T,H,Dh]."""
    k_buf, v_buf, cross_k, cross_v = layer_cache
    h = self.self_attn_norm(x)
    k, v = self.self_attn.project_kv(h)                                  # [B, T, H, Dh]
    own = (attention.heads_first(k), attention.heads_first(v))
    x = x + self.self_attn(h, [(k_buf, v_buf, masks[0], biases[0]), (*own, masks[1], biases[1])])
    x = x + self.cross_attn(self.cross_attn_norm(x), [(cross_k, cross_v, cross_mask, None)])
    return x + self.mlp(self.mlp_norm(x)), (k, v)


# The scan in_axes of each layer method's non-carry arguments (layouts.run slices the same ones):
# the encoder's mask and bias are every layer's; a decoder layer reads its slice of the cache and
# shares the masks, biases, cross mask and (cross_kv) the encoder output.
_ENCODER_AXES = {"__call__": (nn.broadcast, nn.broadcast)}
_DECODER_AXES = {"__call__": (0, nn.broadcast, nn.broadcast, nn.broadcast),
                 "cross_kv": (nn.broadcast,)}


def _scanned(layer: type[nn.Module], num_layers: int, **in_axes):
  """`layer` with its params stacked [L, ...] and each method in `in_axes` (name -> the scan
  in_axes of its non-carry arguments) run under one lax.scan, so depth does not add compile time."""
  scan = dict(variable_axes={"params": 0}, split_rngs={"params": True}, length=num_layers)
  return nn.scan(layer, methods={method: dict(scan, in_axes=axes)
                                 for method, axes in in_axes.items()})


class _Stack(nn.Module):
  """Encoder or decoder: relative-position table (shared by all layers), layers, final norm."""
  cfg: T5Config
  decoder: bool

  def setup(self):
    cfg = self.cfg
    self.relpos_bias = self.param("relpos_bias", nn.initializers.zeros,
                                  (cfg.relative_attention_num_buckets, cfg.num_heads),
                                  jnp.dtype(cfg.dtype))
    if self.decoder:
      layer, num_layers, axes = _DecoderLayer, cfg.num_decoder_layers, _DECODER_AXES
    else:
      layer, num_layers, axes = _EncoderLayer, cfg.num_layers, _ENCODER_AXES
    if cfg.scan_layers:
      self.layers = _scanned(layer, num_layers, **axes)(cfg)
    else:
      self.layers = [layer(cfg) for _ in range(num_layers)]     # named layers_0 ... by Flax
    self.final_norm = _norm(cfg)

  def _run(self, method: str, carry, *args):
    """self.layers' `method` over every layer (scanned or looped): (carry, outputs [L, ...])."""
    axes = (_DECODER_AXES if self.decoder else _ENCODER_AXES)[method]
    return layouts.run(self.layers, axes, carry, *args, method=method)

  def bias(self, query_pos, key_pos):
    """query_pos [B|1,T], key_pos [S] absolute positions -> f32 bias [B|1,H,T,S]."""
    buckets = relative_position_bucket(
        key_pos[None, None, :] - query_pos[:, :, None], bidirectional=not self.decoder,
        num_buckets=self.cfg.relative_attention_num_buckets,
        max_distance=self.cfg.relative_attention_max_distance)
    return jnp.take(self.relpos_bias, buckets, axis=0).astype(jnp.float32).transpose(0, 3, 1, 2)

  def encode(self, x, enc_mask):
    """x [B,E,D] embedded prompt, enc_mask [B,E] -> [B,E,D]; padded keys are masked."""
    pos = jnp.arange(x.shape[1], dtype=jnp.int32)
    bias = self.bias(pos[None], pos)                                      # [1, H, E, E]
    mask = jnp.broadcast_to(enc_mask[:, None, :], (x.shape[0], x.shape[1], x.shape[1]))
    x, _ = self._run("__call__", x, mask, bias)
    return self.final_norm(x)

  def cross_kv(self, enc_out):
    """enc_out [B,E,D] -> cross keys, values [L,B,H,E,Dh]."""
    _, (k, v) = self._run("cross_kv", None, enc_out)
    return k, v

  def decode(self, x, cache: kvc.KVCache):
    """x [B,T,D] embedded tokens at positions lengths[b]+t -> (hidden [B,T,D], the block's new
    k, v [L,B,T,H,Dh]); the cache is read, not written."""
    num_new, capacity = x.shape[1], cache.capacity
    cached = jnp.arange(capacity, dtype=jnp.int32)
    masks = (cached[None, None, :] < cache.lengths[:, None, None],            # [B, 1, S]
             jnp.tril(jnp.ones((1, num_new, num_new), bool)))                  # [1, T, T]
    own = jnp.arange(num_new, dtype=jnp.int32)      # relative positions are all the bias needs
    biases = (self.bias(kvc.positions(cache.lengths, num_new), cached),       # [B, H, T, S]
              self.bias(own[None], own))                                     # [1, H, T, T]
    cross_mask = cache.enc_mask[:, None, :]                                    # [B, 1, E]
    layer_caches = (cache.k, cache.v, cache.cross_k, cache.cross_v)          # [L, B, H, S|E, Dh]
    x, (k, v) = self._run("__call__", x, layer_caches, masks, biases, cross_mask)
    return self.final_norm(x), k, v


class _T5Module(nn.Module):
  cfg: T5Config

  def setup(self):
    cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
    self.shared = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dt, param_dtype=dt)
    self.encoder = _Stack(cfg, decoder=False)
    self.decoder = _Stack(cfg, decoder=True)
    self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=jnp.float32, param_dtype=dt,
                            precision=cfg.precision)

  def encode_kv(self, tokens, enc_mask):
    """tokens [B,E], enc_mask [B,E] -> cross keys, values [L,B,H,E,Dh]."""
    return self.decoder.cross_kv(self.encoder.encode(self.shared(tokens), enc_mask))

  def decode(self, tokens, cache: kvc.KVCache, select=None):
    """tokens [B,T] -> (logits [B,T,V] f32, hidden [B,T,D], new k, v [L,B,T,H,Dh]); select [B]
    keeps position select[b] only (T = 1 in logits and hidden)."""
    hidden, k, v = self.decoder.decode(self.shared(tokens), cache)
    if select is not None:
      hidden = jnp.take_along_axis(hidden, select[:, None, None], axis=1)         # [B, 1, D]
    if self.has_variable("params", "lm_head"):
      return self.lm_head(hidden), hidden, k, v
    scaled = hidden * (self.cfg.d_model ** -0.5) if self.cfg.scale_decoder_outputs else hidden
    logits = head_product.logits(scaled, self.shared.embedding, 0, self.cfg.precision)
    return logits, hidden, k, v                                                # logits [B,T,V]



# ---------------------------------------------------------------------------------------------
# The model object the decoding loop sees.


@dataclasses.dataclass(frozen=True)
class T5(ModelBase):
  """Frozen, hashable wrapper (a static jit argument) exposing the model contract."""
  config: T5Config
  is_encoder_decoder: bool = dataclasses.field(default=True, init=False)

  @property
  def decoder_start_id(self) -> int:
    return self.config.decoder_start_token_id

  @property
  def module(self) -> _T5Module:
    return _T5Module(self.config)

  @functools.partial(jax.jit, static_argnums=0)
  def init_params(self, rng: jax.Array) -> Params:
    """T5 (mesh-tf / HF) initialisation, layout in the module docstring; lm_head iff untied.

    Every tensor is a slice of ONE normal draw: on CPU each separate draw costs ~0.5 s of XLA
    compile, and a T5 has ~100 tensors. (The draw is params-sized; for a huge model init sharded,
    or import a checkpoint.)"""
    cfg = self.config
    paths = list(param_table(cfg, untied=not cfg.tie_word_embeddings))
    specs = [leaf_spec(cfg, path) for path in paths]
    sizes = [math.prod(shape) if std is not None else 0 for shape, std in specs]
    noise = jax.random.normal(rng, (sum(sizes),), jnp.float32)
    params: Params = {}
    offset = 0
    for path, (shape, std), size in zip(paths, specs, sizes):
      if std is None:
        value = jnp.ones(shape, self.dtype)
      else:
        value = (noise[offset:offset + size].reshape(shape) * std).astype(self.dtype)
      hf_tensors.tree_set(params, path, value)
      offset += size
    return layouts.to_layout(params, cfg.scan_layers)

  def init_cache(self, batch: int, max_len: int, enc_len: int = 0) -> kvc.KVCache:
    """Self-attention buffers for max_len decoder positions (the start token included) and
    cross-attention buffers for an encoder of enc_len positions (the padded prompt width)."""
    cfg = self.config
    if enc_len < 1:
      raise ValueError(f"T5.init_cache needs enc_len >= 1 (the padded prompt width), got "
                       f"{enc_len}.")
    cache = kvc.init_cache(layers=cfg.num_decoder_layers, batch=batch, max_len=max_len,
                           heads=cfg.num_heads, head_dim=cfg.d_kv, dtype=self.dtype)
    cross = jnp.zeros((cfg.num_decoder_layers, batch, cfg.num_heads, enc_len, cfg.d_kv), self.dtype)
    return cache.replace(cross_k=cross, cross_v=cross, enc_mask=jnp.zeros((batch, enc_len), bool))

  @functools.partial(jax.jit, static_argnums=0)
  def prefill(self, params: Params, prompt: Prompt, cache: kvc.KVCache):
    """Encodes the right-padded prompt (pads masked), stores cross K/V and enc_mask, ingests the
    decoder start token -> (logits[B,V] f32, hidden[B,D], cache with lengths == 1)."""
    batch, width = prompt.tokens.shape
    enc_len = cache.enc_mask.shape[1]
    if batch != cache.lengths.shape[0]:
      raise ValueError(f"prompt batch {batch} != cache batch {cache.lengths.shape[0]}: build the "
                       f"cache with model.init_cache({batch}, ...).")
    kvc.check_capacity(width, enc_len, "prompt (encoder)")
    tokens = jnp.pad(prompt.tokens, ((0, 0), (0, enc_len - width)),
                     constant_values=self.config.pad_token_id)
    enc_mask = jnp.arange(enc_len, dtype=jnp.int32)[None, :] < prompt.lengths[:, None]   # [B, E]
    cross_k, cross_v = self.module.apply({"params": params}, tokens, enc_mask,
                                         method=_T5Module.encode_kv)
    dt = cache.k.dtype
    cache = cache.replace(cross_k=cross_k.astype(dt), cross_v=cross_v.astype(dt), enc_mask=enc_mask,
                          lengths=jnp.zeros_like(cache.lengths))
    start = jnp.full((batch, 1), self.config.decoder_start_token_id, jnp.int32)
    logits, hidden, cache = self.extend(params, start, cache)
    return logits[:, 0], hidden[:, 0], cache

  @functools.partial(jax.jit, static_argnums=0)
  def extend_entries(self, params: Params, tokens: jax.Array, cache: kvc.KVCache,
                     select: jax.Array | None = None):
    """tokens [B,T] at decoder positions lengths[b]+t -> (logits[B,T,V] f32, hidden[B,T,D]
    (final-normed, before the output scaling), the block's (k, v) [L,B,T,H,Dh]); the cache is
    read, not written. select [B]: position select[b] only ([B,1,V], [B,1,D]). Capacity
    (lengths + T <= S) is the caller's host-side check."""
    kvc.check_capacity(tokens.shape[1], cache.capacity, "extend block")
    if cache.cross_k is None or cache.enc_mask is None:
      raise ValueError("T5.extend needs a cache from T5.init_cache(batch, max_len, enc_len) "
                       "filled by T5.prefill (it holds the encoder keys/values).")
    logits, hidden, k, v = self.module.apply({"params": params}, tokens.astype(jnp.int32), cache,
                                             select, method=_T5Module.decode)
    return logits, hidden, (k, v)

def param_table(cfg: T5Config, untied: bool) -> dict[tuple[str, ...], tuple[str, bool]]:
  """THE parameter layout: our param path -> (HF tensor name, transposed?). Used by init, import
  and export. Leaves under {encoder,decoder}/layers are stacked [L, ...]; their HF name has `{i}`
  for the layer. torch Linear weights are [out, in], ours [in, out]."""
  names = {("shared", "embedding"): ("shared.weight", False)}
  if untied:
    names[("lm_head", "kernel")] = ("lm_head.weight", True)
  ff = ("wi_0", "wi_1", "wo") if cfg.is_gated else ("wi", "wo")
  for stack in ("encoder", "decoder"):
    names[(stack, "relpos_bias")] = (
        f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", False)
    names[(stack, "final_norm", "scale")] = (f"{stack}.final_layer_norm.weight", False)
    subs = [("self_attn", "SelfAttention")]
    subs += [("cross_attn", "EncDecAttention")] if stack == "decoder" else []
    ours = (stack, "layers")
    for j, (attn, hf_attn) in enumerate(subs):
      hf = f"{stack}.block.{{i}}.layer.{j}"
      for proj, hf_proj in zip(("query", "key", "value", "out"), "qkvo"):
        names[ours + (attn, proj, "kernel")] = (f"{hf}.{hf_attn}.{hf_proj}.weight", True)
      names[ours + (f"{attn}_norm", "scale")] = (f"{hf}.layer_norm.weight", False)
    hf = f"{stack}.block.{{i}}.layer.{len(subs)}"
    for proj in ff:
      names[ours + ("mlp", proj, "kernel")] = (f"{hf}.DenseReluDense.{proj}.weight", True)
    names[ours + ("mlp_norm", "scale")] = (f"{hf}.layer_norm.weight", False)
  return names
def stacked_layers(cfg: T5Config, path: tuple[str, ...]) -> int | None:
  """L of a stacked leaf ({encoder,decoder}/layers/...), None for the others."""
  if path[1:2] != ("layers",):
    return None
  return cfg.num_layers if path[0] == "encoder" else cfg.num_decoder_layers
def leaf_spec(cfg: T5Config, path: tuple[str, ...]) -> tuple[tuple[int, ...], float | None]:
  """(shape, init std) of a param, [L] first when stacked; std None means ones (norm scales).
  Stds as mesh-tf / HF T5."""
  name = path[-2] if path[-1] == "kernel" else path[-1]
  d, f, inner = cfg.d_model, cfg.d_ff, cfg.num_heads * cfg.d_kv
  shape, std = {
      "embedding": ((cfg.vocab_size, d), 1.0), "lm_head": ((d, cfg.vocab_size), 1.0),
      "relpos_bias": ((cfg.relative_attention_num_buckets, cfg.num_heads), d ** -0.5),
      "query": ((d, inner), (d * cfg.d_kv) ** -0.5), "key": ((d, inner), d ** -0.5),
      "value": ((d, inner), d ** -0.5), "out": ((inner, d), inner ** -0.5),
      "wi": ((d, f), d ** -0.5), "wi_0": ((d, f), d ** -0.5), "wi_1": ((d, f), d ** -0.5),
      "wo": ((f, d), f ** -0.5), "scale": ((d,), None),
  }[name]
  layers = stacked_layers(cfg, path)
  return ((layers,) + shape if layers else shape), std
