"""Attention over the KV cache and a block's own entries, shared by the decoder and T5.

Keys and values come in segments (the cache, read only, then the block's new entries) attended
under one softmax, so that a pass never writes the cache before attending to it: the caller
writes every layer's new entries once, after the stack (kv_cache.append). All segments are
heads-first [B, H, S_i, Dh], the cache's layout (see kv_cache).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attend(q: jax.Array, segments, scale: float | None = None) -> jax.Array:
  """q [B,T,H,Dh]; segments: (k, v [B,H,S_i,Dh], mask [B|1,T|1,S_i] bool, bias [B|1,H,T,S_i] or
  None); scale multiplies the scores (None: 1, as T5, which folds it into its initialisation)
  -> [B,T,H*Dh]."""
  low = jnp.finfo(jnp.float32).min
  scores = []
  for k, _, mask, bias in segments:
    s = jnp.einsum("bthd,bhsd->bhts", q, k, preferred_element_type=jnp.float32)
    s = s if scale is None else s * scale
    s = s if bias is None else s + bias
    scores.append(jnp.where(mask[:, None], s, low))
  probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)       # [B, H, T, sum S_i]
  out, start = 0, 0
  for k, v, _, _ in segments:
    part = probs[..., start:start + k.shape[2]].astype(v.dtype)
    out = out + jnp.einsum("bhts,bhsd->bthd", part, v)                     # [B, T, H, Dh]
    start += k.shape[2]
  return out.reshape(out.shape[:2] + (-1,))


def heads_first(x: jax.Array) -> jax.Array:
  """[B, S, H, Dh] (a projection's layout) -> [B, H, S, Dh] (the cache's)."""
  return jnp.swapaxes(x, 1, 2)
