"""An EAGLE-style draft head (Li et al., EAGLE, ICML'24): one decoder layer of the target's own
shape that drafts from the target's features.

At stream position t the head reads h_t, the target's last hidden state (after its final norm:
what its LM head reads), and e(x_{t+1}), the target's embedding of the token that follows:

  z_t = fc([h_t ; e(x_{t+1})])          [B, T, 2D] -> [B, T, D]
  f_t = norm(layer(z_t))                one pre-norm block of the target's configuration, with
                                        its own KV cache (L = 1) and rotary positions
  logits(x_{t+2}) = lm_head(f_t)        the target's LM head (tied or not), or a sub-vocabulary

f_t is trained to be h_{t+1} (a regression) and its logits to match the target's distribution of
x_{t+2} (DistillSpec's divergence; distill/head.py); at draft step >= 2 the head reads its own
f as the feature. The head's params hold fc, the layer and the norm; the target's token_embed
and lm_head are passed in beside them at call time (`with_target`), never copied.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from specjax.models import kv_cache as kvc
from specjax.models import transformer

SHARED = ("token_embed", "lm_head")       # the target's params the head reads
LAYER = "layer"


class HeadModule(nn.Module):
  """features [B,T,D] (h_t), tokens [B,T] (x_{t+1}), the cache's k / v [1,B,Hkv,S,Dh] (read
  only), lengths [B] -> (f [B,T,D], logits [B,T,V] f32, new k, v [1,B,T,Hkv,Dh]); select [B]
  keeps one position per row ([B,D], [B,V])."""
  arch: transformer.Arch

  @nn.compact
  def __call__(self, features, tokens, k, v, lengths, select=None):
    a = self.arch
    dt = jnp.dtype(a.dtype)
    embed = transformer.Table("embedding", (a.vocab_size, a.d_model), a.init_std, a.dtype,
                              name="token_embed")()                            # [V, D]
    x = jnp.take(embed, tokens, axis=0, mode="clip").astype(dt)                # [B, T, D]
    z = transformer.dense(a, a.d_model, True, "fc")(
        jnp.concatenate([features.astype(dt), x], axis=-1))                    # [B, T, D]
    positions = kvc.positions(lengths, tokens.shape[1])
    rotary = None if a.rope is None else transformer.rotary_angles(a.rope.inv_freq(a.head_dim),
                                                            positions, dt)
    context = (rotary, transformer.masks(a, positions, lengths, k.shape[3]))
    z, (new_k, new_v) = transformer.Layer(a, name=LAYER)(z, (k[0], v[0]), context)
    each = isinstance(context[1], transformer.EachPosition)
    f = transformer.norm(a, a.norm_names[2], each)(z)                          # [B, T, D]
    if select is not None:
      f = jnp.take_along_axis(f, select[:, None, None], axis=1)[:, 0]          # [B, D]
    return f, transformer.logits(a, f, embed), new_k[None], new_v[None]


@dataclasses.dataclass(frozen=True)
class DraftHead:
  """The head for a decoder-only target of configuration `arch` (the target's Arch: the head
  takes its layer shape, norm, rotary and head). Frozen and hashable: a static jit argument."""
  arch: transformer.Arch
  is_encoder_decoder: bool = dataclasses.field(default=False, init=False)
  decoder_start_id: int = dataclasses.field(default=0, init=False)

  @classmethod
  def for_target(cls, target) -> "DraftHead":
    """The head of a decoder-only target model (its module's Arch, one unrolled layer); a
    ValueError for an encoder-decoder."""
    if target.is_encoder_decoder:
      raise ValueError(f"a draft head is built on a decoder-only target's layers; "
                       f"{type(target).__name__} is an encoder-decoder")
    arch = dataclasses.replace(target.module.arch, num_layers=1, scan_layers=False)
    return cls(arch=arch)

  @property
  def n_positions(self) -> int | None:
    return None       # the head has no position table: its rotary angles (if any) are relative

  @property
  def heads(self) -> tuple[int, int]:
    return self.arch.num_heads, self.arch.num_kv_heads

  @property
  def layout(self) -> str:
    return self.arch.layout

  @property
  def quant(self) -> str:
    return self.arch.quant

  @property
  def vocab_size(self) -> int:
    return self.arch.vocab_size

  @property
  def hidden_size(self) -> int:
    return self.arch.d_model

  @property
  def dtype(self):
    return jnp.dtype(self.arch.dtype)

  @property
  def module(self) -> HeadModule:
    return HeadModule(self.arch)

  @functools.partial(jax.jit, static_argnums=0)
  def init_params(self, rng: jax.Array) -> dict:
    """The head's own params (fc, layer, the final norm): the target's shared ones left out."""
    cache = self.init_cache(1, 1)
    variables = self.module.init(rng, jnp.zeros((1, 1, self.arch.d_model), self.dtype),
                                 jnp.zeros((1, 1), jnp.int32), cache.k, cache.v, cache.lengths)
    return {k: v for k, v in variables["params"].items() if k not in SHARED}

  def init_cache(self, batch: int, max_len: int, enc_len: int = 0) -> kvc.KVCache:
    """Buffers [1, B, Hkv, S, Dh]."""
    del enc_len
    a = self.arch
    return kvc.init_cache(layers=1, batch=batch, max_len=max_len, heads=a.num_kv_heads,
                          head_dim=a.head_dim, dtype=self.dtype)

  def extend(self, params, features: jax.Array, tokens: jax.Array, cache: kvc.KVCache,
             select: jax.Array | None = None):
    """params: with_target(head params, target params). features [B,T,D] and tokens [B,T] at
    positions lengths[b]+t -> (logits [B,T,V] f32, f [B,T,D], cache with the T entries written);
    select [B]: position select[b] only ([B,1,V], [B,1,D])."""
    kvc.check_capacity(tokens.shape[1], cache.capacity, "head block")
    f, logits, k, v = self.module.apply({"params": params}, features, tokens, cache.k, cache.v,
                                        cache.lengths, select=select)
    if select is not None:
      f, logits = f[:, None], logits[:, None]
    return logits, f, kvc.append(cache, k, v)


def with_target(head_params: dict, target_params: dict) -> dict:
  """The head's params with the target's embedding and LM head beside them (the same arrays)."""
  return {**head_params, **{k: target_params[k] for k in SHARED if k in target_params}}


def check_fits(head: DraftHead, head_params: Any, target) -> None:
  """ValueError naming the sizes when a head's params were trained for another target."""
  fc = head_params.get("fc", {}).get("kernel") if isinstance(head_params, dict) else None
  if fc is None:
    raise ValueError("these params hold no draft head (no fc kernel): train one with "
                     "`python -m train.distill --config.distill.student=head`")
  d = target.hidden_size
  if sorted(fc.shape) != sorted((2 * d, d)):
    raise ValueError(f"this draft head was trained for a target of hidden size "
                     f"{min(fc.shape)}; the target has {d}: train a head for this target")
