"""The one decoder-only transformer: GPT-2, Llama, Mistral, Qwen2 and Qwen3 are configurations of
it (`Arch`, which decoder.DecoderConfig.arch() and llama.LlamaConfig.arch() build).

Pre-norm blocks: norm -> self-attention -> residual; norm -> MLP -> residual; a final norm and a
tied or untied LM head. The switches:
  norm          LayerNorm with bias (GPT-2) or RMSNorm (Llama), and the three norms' names
  positions     a learned table added to the embeddings (GPT-2), or rotary angles applied to
                queries and keys (`Rope`: default, linear, llama3)
  mlp           an activation between two dense layers (GPT-2: wi, wo) or SwiGLU
                (down(silu(gate(x)) * up(x)): wi_0, wi_1, wo)
  attention     grouped-query heads (num_kv_heads <= num_heads), q/k/v and output biases,
                RMSNorm of each query and key head (qk_norm, Qwen3), a sliding window (Mistral)
  init          normal(init_std), the learned positions at pos_init_std, and GPT-2's
                out-projection scaling 1/sqrt(2L)
The param names are each family's own (the Hugging Face conversion tables in models/convert/ and
the sharding rules read them), so a configuration keeps its param tree.

Positions are per row: the T new tokens of row b sit at lengths[b] .. lengths[b]+T-1; a rolled
back row is re-extended at the right positions. The KV cache holds the key/value heads only
([L, B, Hkv, S, Dh], keys already rotated); query heads are grouped onto them in attention.attend.
The layers are stacked ([L] leading axis) and run under `nn.scan`, or unrolled (layers_0 ...,
faster for float weights on XLA:CPU): models/layers.py. Where specjax's CPU kernels run the
quantized products, the stacked layers run under a lax.scan that hands the kernels the whole
weight stacks and cache with the layer's index (`_scan_in_place`), so nothing is copied.
Kernels are [in, out], or [out, in] with layout="out_in" (models/dense_layout.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import attention, head_product, layer_view, layers, quant
from specjax.models import kv_cache as kvc
from specjax.models.sub_vocab import SubVocab

ACTIVATIONS = {
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_fast": functools.partial(jax.nn.gelu, approximate=True),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}
SWIGLU = "swiglu"
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
class Arch:
  """Every switch and size of the one transformer (a family's config builds it: `arch()`)."""
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  d_ff: int
  norm: str                               # "layer" (with bias) or "rms"
  norm_eps: float
  norm_names: tuple[str, str, str]        # (before attention, before the MLP, final)
  mlp: str                                # an ACTIVATIONS name (wi, wo) or SWIGLU (wi_0, wi_1, wo)
  rope: Rope | None = None                # rotary positions; None: a learned table
  n_positions: int = 0                    # the learned table's rows (rope None)
  qkv_bias: bool = False
  out_bias: bool = False
  mlp_bias: bool = False
  qk_norm: bool = False
  sliding_window: int | None = None
  init_std: float = 0.02
  pos_init_std: float = 0.01
  scaled_out_init: bool = False           # GPT-2: out and wo kernels at init_std / sqrt(2L)
  tie_word_embeddings: bool = False
  dtype: str = "float32"                  # params and activations; logits are always float32
  precision: str = "highest"
  scan_layers: bool = True
  head_subset: SubVocab | None = None
  quant: str = ""
  layout: str = "in_out"

  @property
  def width_invariant(self) -> bool:
    """Whether a position's logits are the same bits in a pass of any width, so that greedy SD
    writes exactly the target's own tokens. int8 needs it: its activations are rounded to
    integers, so a last-bit difference (~1e-7) between a verify pass and a decoding step can
    become a whole quantisation step and flip a near-tie. Its integer products are exact in
    any order, and attention runs one position at a time (attention.attend_each_position);
    float models keep the batched, two-segment attention (their dense products vary in the
    last bits with the width anyway, far below a near-tie's margin in practice), and so do
    int8 models off the CPU, which multiply by their weights alone (quant.rounds_activations)."""
    return self.quant in ("int8", "int4") and quant.rounds_activations()


def _init(std: float):
  return nn.initializers.normal(stddev=std)


def dense(a: Arch, features: int, use_bias: bool, name: str, std: float | None = None):
  return quant.dense(features, quant=a.quant, dtype=jnp.dtype(a.dtype), precision=a.precision,
                     use_bias=use_bias, kernel_init=_init(a.init_std if std is None else std),
                     name=name, layout=a.layout)


def _out_std(a: Arch) -> float:
  return a.init_std / math.sqrt(2 * a.num_layers) if a.scaled_out_init else a.init_std


def by_position(fn, x: jax.Array, each: bool):
  """fn(x) for x [B,T,...], or (each) fn of one position x[:, t] at a time (lax.map over T; fn
  may return a tuple): a reduction over a row then takes the same steps whatever T, where
  XLA:CPU splits the reduction of several rows otherwise than one row's (a last-bit
  difference that the width-invariant models must not have: Arch.width_invariant)."""
  if not each:
    return fn(x)
  out = jax.lax.map(fn, jnp.swapaxes(x, 0, 1))
  return jax.tree.map(lambda y: jnp.swapaxes(y, 0, 1), out)


class _RMSNorm(nn.Module):
  """HF's Llama RMSNorm: statistics in float32, the normalised x rounded back to the input dtype,
  then scaled (the same rounding as transformers in bfloat16). each_position: by_position."""
  eps: float
  dtype: str
  each_position: bool = False

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.dtype(self.dtype))
    x32 = x.astype(jnp.float32)
    inv = by_position(lambda r: jax.lax.rsqrt(jnp.mean(jnp.square(r), axis=-1, keepdims=True)
                                              + self.eps), x32, self.each_position)
    return scale * (x32 * inv).astype(x.dtype)


class _LayerNorm(nn.Module):
  """nn.LayerNorm's arithmetic (float32 statistics, variance as E[x^2] - E[x]^2, params `scale`
  and `bias`), with its statistics optionally by_position."""
  eps: float
  dtype: str
  each_position: bool = False

  @nn.compact
  def __call__(self, x):
    dt, width = jnp.dtype(self.dtype), x.shape[-1]
    scale = self.param("scale", nn.initializers.ones, (width,), dt)
    bias = self.param("bias", nn.initializers.zeros, (width,), dt)

    def stats(r):   # rsqrt too: XLA:CPU's rsqrt of a few values can round otherwise than of one
      mean = jnp.mean(r, axis=-1, keepdims=True)
      var = jnp.maximum(0.0, jnp.mean(jnp.square(r), axis=-1, keepdims=True) - jnp.square(mean))
      return mean, jax.lax.rsqrt(var + self.eps)

    mean, inv = by_position(stats, x.astype(jnp.float32), self.each_position)
    return ((x - mean) * (inv * scale) + bias).astype(dt)


def norm(a: Arch, name: str, each_position: bool = False) -> nn.Module:
  """The arch's norm (RMSNorm or LayerNorm) named `name`; each_position: by_position."""
  cls = _RMSNorm if a.norm == "rms" else _LayerNorm
  return cls(a.norm_eps, a.dtype, each_position, name=name)


class Table(nn.Module):
  """One named weight matrix (embedding tables, untied LM head), read as a raw array."""
  leaf: str
  shape: tuple[int, int]
  std: float
  dtype: str

  @nn.compact
  def __call__(self):
    return self.param(self.leaf, _init(self.std), self.shape, jnp.dtype(self.dtype))


def rotary_angles(inv_freq: np.ndarray, positions: jax.Array,
                  dtype) -> tuple[jax.Array, jax.Array]:
  """positions [B,T] -> (cos, sin) [B,T,1,Dh/2] in the activation dtype (as transformers)."""
  angles = positions.astype(jnp.float32)[..., None] * inv_freq                # [B, T, Dh/2]
  return (jnp.cos(angles)[:, :, None].astype(dtype), jnp.sin(angles)[:, :, None].astype(dtype))


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [B,T,H,Dh]: rotate the pairs (i, i + Dh/2) by the position's angles (HF rotate_half)."""
  # As pairs [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin], written with a reversal of the pair
  # axis rather than a concatenation: elementwise, so it fuses into its neighbours everywhere.
  pairs = x.reshape(x.shape[:-1] + (2, x.shape[-1] // 2))                    # [B, T, H, 2, Dh/2]
  signed_sin = sin[..., None, :] * jnp.array([[-1], [1]], sin.dtype)        # [B, T, 1, 2, Dh/2]
  out = pairs * cos[..., None, :] + jnp.flip(pairs, axis=-2) * signed_sin
  return out.reshape(x.shape)


class Segmented(NamedTuple):
  """Masks of the two-segment attention: the cache [B,T|1,S] and the block's own [1,T,T]."""
  cache: jax.Array
  block: jax.Array


class EachPosition(NamedTuple):
  """What the width-invariant attention needs: the rows' lengths [B] (where the block is
  written) and the block's positions [B,T] (each sees the slots up to its own)."""
  lengths: jax.Array
  positions: jax.Array


def masks(a: Arch, positions: jax.Array, lengths: jax.Array, capacity: int):
  """Which keys each query sees, causal; with a sliding window W also only keys at most W-1
  positions back (HF's sliding-window mask) -> EachPosition where `Arch.width_invariant` and the
  block follows a cache (capacity > 0: a prefill's width is the same with or without a draft),
  else Segmented."""
  num_new = positions.shape[1]
  slots = jnp.arange(capacity)
  window = a.sliding_window
  if a.width_invariant and capacity > 0:
    return EachPosition(lengths, positions)
  old = slots[None, None, :] < lengths[:, None, None]                         # [B, 1, S]
  offsets = jnp.arange(num_new)
  new = offsets[None, :] <= offsets[:, None]                                  # [T, T]
  if window is not None:
    old = old & (slots[None, None, :] > positions[:, :, None] - window)       # [B, T, S]
    new = new & (offsets[None, :] > offsets[:, None] - window)
  return Segmented(old, new[None])


class _Attention(nn.Module):
  arch: Arch

  @nn.compact
  def __call__(self, x, k_buf, v_buf, rotary, masks):
    """x [B,T,D]; k_buf, v_buf [B,Hkv,S,Dh] this layer's cache (read only); rotary (cos, sin)
    [B,T,1,Dh/2] or None. Returns the output [B,T,D] and the block's (rotated) k, v
    [B,T,Hkv,Dh]: the caller writes every layer's entries in one go."""
    a = self.arch
    batch, num_new, _ = x.shape
    heads, kv_heads, head_dim = a.num_heads, a.num_kv_heads, a.head_dim
    q = dense(a, heads * head_dim, a.qkv_bias, "query")(x)
    q = q.reshape(batch, num_new, heads, head_dim)                             # [B, T, H, Dh]
    k = dense(a, kv_heads * head_dim, a.qkv_bias, "key")(x)
    k = k.reshape(batch, num_new, kv_heads, head_dim)                          # [B, T, Hkv, Dh]
    v = dense(a, kv_heads * head_dim, a.qkv_bias, "value")(x)
    v = v.reshape(batch, num_new, kv_heads, head_dim)
    if a.qk_norm:
      each = isinstance(masks, EachPosition)
      q = _RMSNorm(a.norm_eps, a.dtype, each, name="q_norm")(q)
      k = _RMSNorm(a.norm_eps, a.dtype, each, name="k_norm")(k)
    if rotary is not None:
      q, k = _rotate(q, *rotary), _rotate(k, *rotary)
    scale = 1.0 / math.sqrt(head_dim)
    if isinstance(masks, EachPosition):
      ctx = attention.attend_each_position(q, (k_buf, v_buf), (k, v), masks.positions,
                                           masks.lengths, a.sliding_window, scale,
                                           a.precision)                        # [B, T, H*Dh]
    else:
      k_buf, v_buf = layer_view.read(k_buf), layer_view.read(v_buf)
      segments = [(k_buf, v_buf, masks.cache, None),                           # the cache
                  (attention.heads_first(k), attention.heads_first(v), masks.block, None)]
      ctx = attention.attend(q, segments, scale=scale, precision=a.precision)  # [B, T, H*Dh]
    return dense(a, a.d_model, a.out_bias, "out", _out_std(a))(ctx), k, v


class _Mlp(nn.Module):
  arch: Arch

  @nn.compact
  def __call__(self, x):
    a = self.arch
    if a.mlp == SWIGLU:
      gate = dense(a, a.d_ff, a.mlp_bias, "wi_0")(x)                       # [B, T, F]
      up = dense(a, a.d_ff, a.mlp_bias, "wi_1")(x)
      h = jax.nn.silu(gate) * up
    else:
      h = ACTIVATIONS[a.mlp](dense(a, a.d_ff, a.mlp_bias, "wi")(x))         # [B, T, F]
    return dense(a, a.d_model, a.mlp_bias, "wo", _out_std(a))(h)


class Layer(nn.Module):
  """One block; `nn.scan` runs it over the stacked params and this layer's slice of the cache (or
  the unstacked layout calls each layers_i in turn, layers.run)."""
  arch: Arch

  @nn.compact
  def __call__(self, x, layer_cache, context):
    """x [B,T,D]; layer_cache (k, v) [B,Hkv,S,Dh]; context (rotary, masks), the same for every
    layer -> (x, (k, v) [B,T,Hkv,Dh])."""
    a = self.arch
    rotary, masks = context
    each = isinstance(masks, EachPosition)
    before_attention, before_mlp, _ = a.norm_names
    attn, k, v = _Attention(a, name="attention")(norm(a, before_attention, each)(x),
                                                 *layer_cache, rotary, masks)
    x = x + attn
    x = x + _Mlp(a, name="mlp")(norm(a, before_mlp, each)(x))
    return x, (k, v)


_IN_AXES = (0, nn.broadcast)      # (this layer's cache slice, the context shared by every layer)
_Layers = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                  in_axes=_IN_AXES)


class Transformer(nn.Module):
  """tokens [B,T] at positions lengths[b]+t, k / v the cache buffers [L,B,Hkv,S,Dh] (read only)
  -> (final-normed hidden [B,T,D], logits [B,T,V] f32, and the block's new keys and values
  [L,B,T,Hkv,Dh], which the caller writes into the cache).

  `select` ([B] indices into T, or None) keeps only one position per row before the LM head, so
  that prefill does not compute [B,P,V] logits it throws away ([B,D] and [B,V] then).
  """
  arch: Arch

  @nn.compact
  def __call__(self, tokens, k, v, lengths, select=None):
    a = self.arch
    dt = jnp.dtype(a.dtype)
    embed = Table("embedding", (a.vocab_size, a.d_model), a.init_std, a.dtype,
                   name="token_embed")()                                       # [V, D]
    positions = kvc.positions(lengths, tokens.shape[1])                        # [B, T]
    x = jnp.take(embed, tokens, axis=0, mode="clip")
    rotary = None
    if a.rope is None:
      table = Table("position_embedding", (a.n_positions, a.d_model), a.pos_init_std, a.dtype,
                     name="pos_embed")()                                       # [N, D]
      x = x + jnp.take(table, positions, axis=0, mode="clip")
    else:
      rotary = rotary_angles(a.rope.inv_freq(a.head_dim), positions, dt)
    x = x.astype(dt)                                                           # [B, T, D]
    context = (rotary, masks(a, positions, lengths, k.shape[3]))
    in_place = reads_in_place(a)
    if a.scan_layers and in_place and not self.is_initializing():
      x, (new_k, new_v) = _scan_in_place(a, self.variables["params"][layers.STACKED], x, k, v,
                                         context)
    else:
      if a.scan_layers:
        blocks = _Layers(a, name=layers.STACKED)
      else:
        blocks = [Layer(a, name=layers.layer_name(i)) for i in range(a.num_layers)]
      take = _cache_in_place if in_place else None
      x, (new_k, new_v) = layers.run(blocks, _IN_AXES, x, (k, v), context,
                                     take=take)                                # [L,B,T,Hkv,Dh]
    hidden = norm(a, a.norm_names[2], isinstance(context[1], EachPosition))(x)  # [B, T, D]
    if select is not None:
      hidden = jnp.take_along_axis(hidden, select[:, None, None], axis=1)[:, 0]  # [B, D]
    return hidden, logits(a, hidden, embed), new_k, new_v


def reads_in_place(a: Arch) -> bool:
  """Whether the model's layers hand specjax's CPU kernels whole stacks and a layer index
  (models/layer_view.py): its quantized weights and its KV cache are then read where they lie,
  never sliced (a slice passed to a kernel is a copy). Where its products run on the kernels:
  quant.reads_in_place."""
  return quant.reads_in_place(a.quant, a.layout)


def _cache_in_place(cache: jax.Array, i: int) -> layer_view.LayerOf:
  """Layer i of the stacked cache [L,B,Hkv,S,Dh] for layers.run's unrolled loop, unsliced."""
  return layer_view.LayerOf(cache, jnp.int32(i))


def _scan_in_place(a: Arch, stacked: dict, x: jax.Array, k: jax.Array, v: jax.Array, context):
  """The stacked layers under a lax.scan over the layer index, the quantized weights and the
  cache passed to the kernels whole with the index (layer_view.in_place), where `nn.scan` would
  slice (copy) them: x [B,T,D], k, v [L,B,Hkv,S,Dh] -> (x, (new k, new v) [L,B,T,Hkv,Dh])."""
  layer = Layer(a, parent=None)

  def body(x, i):
    cache = (layer_view.LayerOf(k, i), layer_view.LayerOf(v, i))
    return layer.apply({"params": layer_view.in_place(stacked, i)}, x, cache, context)

  return jax.lax.scan(body, x, jnp.arange(a.num_layers, dtype=jnp.int32))


def logits(a: Arch, hidden: jax.Array, embed: jax.Array) -> jax.Array:
  """hidden [..., D] -> f32 logits [..., V]: int8 or int4, a sub-vocabulary head, tied or
  untied."""
  if a.quant:
    return quant.quantized_logits(hidden, a.vocab_size, a.quant, a.head_subset, a.precision,
                                  a.layout)
  if a.head_subset is not None:
    head = Table("kernel", (a.d_model, a.head_subset.size), a.init_std, a.dtype,
                  name="lm_head")()                                            # [D, K]
    return a.head_subset.logits(hidden, head, a.precision)
  if a.tie_word_embeddings:
    return head_product.logits(hidden, embed, 0, a.precision)                 # embed [V, D]
  head = Table("kernel", (a.d_model, a.vocab_size), a.init_std, a.dtype, name="lm_head")()
  return head_product.logits(hidden, head, 1, a.precision)                    # [D, V]
