"""Attention over the KV cache and a block's own entries, shared by the decoder, T5 and Llama.

Keys and values come in segments (the cache, read only, then the block's new entries) attended
under one softmax, so that a pass never writes the cache before attending to it: the caller
writes every layer's new entries once, after the stack (kv_cache.append). All segments are
heads-first [B, Hkv, S_i, Dh], the cache's layout (see kv_cache).

Grouped-query attention: the segments may hold fewer heads (Hkv) than the queries (H); query
head h reads key/value head h // (H / Hkv), as Hugging Face's `repeat_kv`. The queries are
grouped [B, T, Hkv, G, Dh] rather than the keys repeated, so the cache is read as it lies
(Hkv = H is plain multi-head attention, G = 1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def attend(q: jax.Array, segments, scale: float | None = None, precision=None) -> jax.Array:
  """q [B,T,H,Dh]; segments: (k, v [B,Hkv,S_i,Dh], mask [B|1,T|1,S_i] bool, bias [B|1,H,T,S_i]
  or None); scale multiplies the scores (None: 1, as T5, which folds it into its initialisation);
  precision: of both products (None: the backend default) -> [B,T,H*Dh]."""
  batch, num_new, heads, head_dim = q.shape
  kv_heads = segments[0][0].shape[1]
  q = q.reshape(batch, num_new, kv_heads, heads // kv_heads, head_dim)       # [B, T, Hkv, G, Dh]
  low = jnp.finfo(jnp.float32).min
  scores = []
  for k, _, mask, bias in segments:
    s = jnp.einsum("btkgd,bksd->bkgts", q, k, precision=precision,
                   preferred_element_type=jnp.float32)                       # [B, Hkv, G, T, S_i]
    s = s if scale is None else s * scale
    if bias is not None:                      # [B|1, H, T, S_i] grouped as the scores
      s = s + bias.reshape(bias.shape[:1] + (kv_heads, -1) + bias.shape[2:])
    scores.append(jnp.where(mask[:, None, None], s, low))
  # One softmax over all segments, without concatenating them: XLA:GPU made the concatenation a
  # kernel of its own in every layer of every step (docs/results.md, "Attention without
  # concatenations"). A shared maximum and a shared sum give the same values.
  maxima = [s.max(-1, keepdims=True, initial=low) for s in scores]          # [B, Hkv, G, T, 1]
  top = jax.lax.stop_gradient(functools.reduce(jnp.maximum, maxima))
  exps = [jnp.exp(s - top) for s in scores]
  total = sum(e.sum(-1, keepdims=True) for e in exps)                        # [B, Hkv, G, T, 1]
  out = 0
  for (_, v, _, _), e in zip(segments, exps):
    out = out + jnp.einsum("bkgts,bksd->btkgd", (e / total).astype(v.dtype), v,
                           precision=precision)                              # [B, T, Hkv, G, Dh]
  return out.reshape(batch, num_new, heads * head_dim)


def heads_first(x: jax.Array) -> jax.Array:
  """[B, S, H, Dh] (a projection's layout) -> [B, H, S, Dh] (the cache's)."""
  return jnp.swapaxes(x, 1, 2)
