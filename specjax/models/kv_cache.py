"""The explicit KV cache shared by every model: fixed buffers plus per-row lengths.

Buffers are [L, B, H, S, Dh] (heads before positions): the attention dot products then have their
batch axes (B, H) leading and contract or keep Dh last, which XLA:CPU runs without transposing
the cache (the [L, B, S, H, Dh] layout cost a copy of every layer's keys and values per pass,
half the attention time at S = 128). Entries handed to `append` are [L, B, T, H, Dh], the layout
a model's projections produce.

Row b holds `lengths[b]` valid entries. `extend` writes the T new keys/values of row b at
positions lengths[b] .. lengths[b]+T-1 and advances `lengths`; entries past a row's length are
stale, masked out of attention, and overwritten later. Rollback is therefore only
`cache.replace(lengths=new_lengths)` (see `rollback`).

Sharded decoding (decoding/sharded.py) sets `layout`, the buffers' sharding: every write is then
one batched scatter of entries laid out like the cache, so rows stay on their devices (the
row-by-row form below indexes rows statically and moves each row's entries between devices) and
the cache is never regathered (entries computed split another way move instead: T positions,
not S).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec


@flax.struct.dataclass(kw_only=True)
class KVCache:
  k: jax.Array                         # [L, B, H, S, Dh] self-attention keys
  v: jax.Array                         # [L, B, H, S, Dh] self-attention values
  lengths: jax.Array                   # [B] int32, valid entries per row
  cross_k: jax.Array | None = None     # [L, B, H, E, Dh] encoder keys (T5 only)
  cross_v: jax.Array | None = None     # [L, B, H, E, Dh] encoder values (T5 only)
  enc_mask: jax.Array | None = None    # [B, E] bool, valid encoder positions (T5 only)
  layout: Any = flax.struct.field(pytree_node=False, default=None)   # k/v sharding (module doc)

  @property
  def capacity(self) -> int:
    return self.k.shape[3]


def init_cache(*, layers: int, batch: int, max_len: int, heads: int, head_dim: int,
               dtype=jnp.float32) -> KVCache:
  shape = (layers, batch, heads, max_len, head_dim)
  return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                 lengths=jnp.zeros((batch,), jnp.int32))


def rollback(cache: KVCache, lengths: jax.Array) -> KVCache:
  """Forget every entry of row b at or past `lengths[b]`.

  Example: lengths [7, 9] after verifying 4 drafts per row, rollback to [5, 9] keeps all of row 1
  and the first 5 entries of row 0; row 0's next extend overwrites positions 5, 6, ...
  """
  return cache.replace(lengths=lengths.astype(jnp.int32))


def write_layer(buf: jax.Array, new: jax.Array, lengths: jax.Array) -> jax.Array:
  """Write new[b] ([T, H, Dh]) into buf[b] ([H, S, Dh]) at position lengths[b]; buf is
  [B, H, S, Dh]."""
  def one(row_buf, row_new, start):
    row_new = jnp.swapaxes(row_new, 0, 1).astype(row_buf.dtype)         # [H, T, Dh]
    return jax.lax.dynamic_update_slice(row_buf, row_new, (0, start, 0))
  return jax.vmap(one)(buf, new, lengths)


ROWWISE_MAX_BATCH = 8


def write_layers(buf: jax.Array, new: jax.Array, lengths: jax.Array,
                 layout: NamedSharding | None = None) -> jax.Array:
  """write_layer for every layer at once: buf [L, B, H, S, Dh], new [L, B, T, H, Dh].

  Small batches (the latency-bound case) write row by row with scalar-offset
  dynamic_update_slice, which XLA performs in place inside the decoding loop; the batched form
  (any batch with a `layout`, the sharding of buf) lowers to a scatter that copies the whole
  buffer each call on XLA:CPU (cost linear in the cache size).
  """
  batch = buf.shape[1]
  if layout is not None:
    layers, rows, heads, _, dims = layout.spec
    like_buf = NamedSharding(layout.mesh, PartitionSpec(layers, rows, None, heads, dims))
    new = jax.lax.with_sharding_constraint(new, like_buf)                 # [L, B, T, H, Dh]
    out = jax.vmap(write_layer, in_axes=(0, 0, None))(buf, new, lengths)
    return jax.lax.with_sharding_constraint(out, layout)
  if batch > ROWWISE_MAX_BATCH:
    return jax.vmap(write_layer, in_axes=(0, 0, None))(buf, new, lengths)
  new = jnp.swapaxes(new, 2, 3).astype(buf.dtype)                       # [L, B, H, T, Dh]
  for b in range(batch):
    buf = jax.lax.dynamic_update_slice(buf, new[:, b:b + 1], (0, b, 0, lengths[b], 0))
  return buf


def with_block(buf: jax.Array, new: jax.Array, lengths: jax.Array, multiple: int = 1) -> jax.Array:
  """One layer's buffer [B, H, S, Dh] (read only) -> a copy, its positions padded with zeros to
  a multiple of `multiple`, with the block's entries new [B, T, H, Dh] written at lengths[b] ..
  lengths[b]+T-1 (the one segment of models/attention.attend_each_position)."""
  pad = -buf.shape[2] % multiple
  buf = jnp.pad(buf, ((0, 0), (0, 0), (0, pad), (0, 0))) if pad else buf
  return write_layers(buf[None], new[None], lengths)[0]


def append(cache: KVCache, k: jax.Array, v: jax.Array) -> KVCache:
  """Write the T new entries k, v [L,B,T,H,Dh] of row b at lengths[b] and advance lengths by T."""
  layout = cache.layout
  return cache.replace(k=write_layers(cache.k, k, cache.lengths, layout),
                       v=write_layers(cache.v, v, cache.lengths, layout),
                       lengths=cache.lengths + k.shape[2])


def positions(lengths: jax.Array, num_new: int) -> jax.Array:
  """Absolute positions of the next `num_new` tokens of each row: [B, T]."""
  return lengths[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None, :]


class CacheOverflowError(ValueError):
  """A sequence longer than the cache; carries `needed`, `capacity` and `what`."""

  def __init__(self, needed: int, capacity: int, what: str):
    super().__init__(f"{what} needs {needed} cache positions but the cache holds {capacity}: "
                     f"use a larger cache, or a shorter prompt / fewer new tokens")
    self.needed, self.capacity, self.what = needed, capacity, what


def check_capacity(needed: int, capacity: int, what: str = "sequence") -> None:
  """Host-side guard: dynamic_update_slice clamps silently, so overflow must be refused up front."""
  if needed > capacity:
    raise CacheOverflowError(needed, capacity, what)
