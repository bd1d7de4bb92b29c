"""Attention over the KV cache and a block's own entries, shared by the decoder, T5 and Llama.

Keys and values come in segments (the cache, read only, then the block's new entries) attended
under one softmax, so that a pass never writes the cache before attending to it: the caller
writes every layer's new entries once, after the stack (kv_cache.append). All segments are
heads-first [B, Hkv, S_i, Dh], the cache's layout (see kv_cache).

Grouped-query attention: the segments may hold fewer heads (Hkv) than the queries (H); query
head h reads key/value head h // (H / Hkv), as Hugging Face's `repeat_kv`. The queries are
grouped [B, T, Hkv, G, Dh] rather than the keys repeated, so the cache is read as it lies
(Hkv = H is plain multi-head attention, G = 1).

`attend_each_position` is the width-invariant form: each query position attends on its own over
one segment (the cache with the block written at its positions; specjax's CPU kernel reads the
two where they lie), so a position's output is the
same bits whether it came in a pass of one position or of T, and whatever the cache's capacity.
Batched products over T positions, a cache/block split and one reduction over S all change the
order of float sums with T or S (about 1e-7 apart).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax.models import cpu_kernels, layer_view
from specjax.models import kv_cache as kvc


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


# Keys per step of attend_each_position's loop; its segment's length is padded to a multiple.
CHUNK = 128


def attend_each_position(q: jax.Array, cache: tuple[jax.Array, jax.Array],
                         block: tuple[jax.Array, jax.Array], positions: jax.Array,
                         lengths: jax.Array, window: int | None = None,
                         scale: float | None = None, precision=None) -> jax.Array:
  """`attend`, with each query position on its own: q [B,T,H,Dh]; cache (k, v) [B,Hkv,S,Dh] read
  only (or layer_view.LayerOf of one layer of the stacked cache), row b's keys at the slots
  below lengths[b]; block (k, v) [B,T,Hkv,Dh] the block's own,
  at slots lengths[b] .. lengths[b]+T-1; positions [B,T] the queries' slots (a query sees the
  slots <= its own, and > its own - window) -> [B,T,H*Dh].

  A position's output is the same bits in a pass of any width T and a cache of any capacity S: a
  lax.map over T runs one program per position over one segment (the cache with the block
  written, its length padded to a multiple of CHUNK), and each runs an online softmax over the
  chunks of CHUNK keys up to its own slot, in order, so neither T nor S changes an operand's
  shape or the order of a sum (batched products over T, or one reduction over S, round
  differently for each T and S). On the CPU, in float32, specjax's kernel computes the same
  function with the same invariance without XLA's loops, reading the cache and the block where
  they lie (models/cpu_kernels.attend_each_position)."""
  batch, num_new, heads, head_dim = q.shape
  if (jax.default_backend() == "cpu" and cpu_kernels.status().active
      and all(x.dtype == jnp.float32 for x in (q, *cache, *block))):
    out = cpu_kernels.attend_each_position(q, *cache, *block, positions, lengths, window, scale)
    return out.reshape(batch, num_new, heads * head_dim)
  k, v = (kvc.with_block(layer_view.read(buf), new, lengths, CHUNK)
          for buf, new in zip(cache, block))
  kv_heads = k.shape[1]
  low = jnp.finfo(jnp.float32).min

  def chunk(c, carry, q_t, pos_t):
    top, total, acc = carry                            # [B,Hkv,G], [B,Hkv,G], [B,Hkv,G,Dh]
    k_c = jax.lax.dynamic_slice_in_dim(k, c * CHUNK, CHUNK, axis=2)          # [B,Hkv,C,Dh]
    v_c = jax.lax.dynamic_slice_in_dim(v, c * CHUNK, CHUNK, axis=2)
    slots = c * CHUNK + jnp.arange(CHUNK)
    seen = slots[None, :] <= pos_t[:, None]                                  # [B, C]
    if window is not None:
      seen = seen & (slots[None, :] > pos_t[:, None] - window)
    s = jnp.einsum("bkgd,bkcd->bkgc", q_t, k_c, precision=precision,
                   preferred_element_type=jnp.float32)                       # [B,Hkv,G,C]
    s = jnp.where(seen[:, None, None], s if scale is None else s * scale, low)
    new_top = jax.lax.stop_gradient(jnp.maximum(top, s.max(-1)))
    e = jnp.where(seen[:, None, None], jnp.exp(s - new_top[..., None]), 0.0)
    rescale = jnp.exp(top - new_top)          # 1 exactly where the chunk saw nothing new
    acc = acc * rescale[..., None] + jnp.einsum("bkgc,bkcd->bkgd", e.astype(v.dtype), v_c,
                                                precision=precision)
    return new_top, total * rescale + e.sum(-1), acc

  def one(args):
    q_t, pos_t = args                                                        # [B,H,Dh], [B]
    q_t = q_t.reshape(batch, kv_heads, heads // kv_heads, head_dim)         # [B,Hkv,G,Dh]
    start = (jnp.full(q_t.shape[:-1], low, jnp.float32),
             jnp.zeros(q_t.shape[:-1], jnp.float32), jnp.zeros(q_t.shape, jnp.float32))
    chunks = jnp.max(pos_t) // CHUNK + 1      # a row past its own last chunk adds exact zeros
    _, total, acc = jax.lax.fori_loop(
        0, chunks, lambda c, carry: chunk(c, carry, q_t, pos_t), start)
    return (acc / total[..., None]).astype(q.dtype).reshape(batch, heads * head_dim)

  out = jax.lax.map(one, (jnp.swapaxes(q, 0, 1), jnp.swapaxes(positions, 0, 1)))   # [T,B,H*Dh]
  return jnp.swapaxes(out, 0, 1)


def heads_first(x: jax.Array) -> jax.Array:
  """[B, S, H, Dh] (a projection's layout) -> [B, H, S, Dh] (the cache's)."""
  return jnp.swapaxes(x, 1, 2)
