"""Temperature / top-k / top-p warping, sampling from log-probs, and the per-row key discipline.

Every random draw in specjax is tied to (row, position), never to the batch: row b uses
`fold_in(key, b)` and the draw for output position t of that row uses `fold_in(row_key, t)`. That
is what makes row b of a batch identical to a single-row run with the same row key, whatever the
other rows do (docs/design.md §4).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np


def argmax(x: jax.Array) -> jax.Array:
  """jnp.argmax(x, axis=-1) as int32, the same index (the first maximum; the first NaN where
  there is one), computed as two plain reductions: the maximum, then the smallest index that
  holds it. XLA:CPU runs jnp.argmax's single reduction over (value, index) pairs without
  vectorising it: 0.8 ms for one row of a 151,936-token vocabulary against 0.16 ms here, and a
  greedy block of speculative decoding takes eight of them (docs/results.md)."""
  nan = jnp.isnan(x)              # XLA:CPU's maximum may skip NaNs: they are found on their own
  top = jnp.max(x, axis=-1, keepdims=True)
  hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == top)
  ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  return jnp.min(jnp.where(hit, ids, x.shape[-1]), axis=-1)


_TINY = float(np.finfo(np.float32).tiny)       # float32's smallest normal: 1 / _TINY is finite


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Warp:
  """How logits become the sampling distribution; applied identically to target and draft.

  temperature 0 means greedy: a one-hot argmax distribution (log-prob 0 at the argmax, -inf
  elsewhere), so that ratio tests and residuals need no special case. top_k 0 and top_p 1 are off.

  Each value is one number for every row, or a tuple with one per row of the batch (a row's
  value applies to that row alone, as vLLM's per-request sampling parameters): logits of shape
  [B, ..., V] then meet value b on row b. Rows may mix greedy (0) and sampled temperatures, and
  top_k / top_p on and off.

  A pytree: temperature, top_k and top_p are its leaves, so the decoding loops take a Warp as a
  traced argument and another temperature, top_p or top_k reuses the compiled program. What
  changes the program is static (the tree's aux data): greedy or not (every row greedy), top_p
  on or off (for any row), top_k's bucket k_max (top_k_bucket of the largest row value: 0 when
  off, else the next power of two), and whether values are per row. lax.top_k needs a static
  k and a traced one would sort the whole vocabulary at every step: the loop takes the k_max
  largest logits and keeps those >= the k-th of them (top_k 3 and 4 share one program, 5
  compiles another).
  """
  temperature: float | tuple[float, ...] = 1.0
  top_k: int | tuple[int, ...] = 0
  top_p: float | tuple[float, ...] = 1.0

  def __post_init__(self):
    temperature = _values("temperature", self.temperature, float)
    top_k = _values("top_k", self.top_k, int)
    top_p = _values("top_p", self.top_p, float)
    rows = {len(v) for v in (temperature, top_k, top_p) if isinstance(v, tuple)}
    if len(rows) > 1:
      raise ValueError(f"per-row values of different lengths {sorted(rows)}: give every per-row "
                       f"value one entry per row of the batch")
    for t in _each(temperature):
      if not 0 <= t < math.inf:          # inf would sample uniformly, whatever the model says
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t}")
    for k in _each(top_k):
      if k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {k}")
    for p in _each(top_p):
      if not 0 < p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p}")
    # One dtype per leaf whatever the caller passed (1 or 1.0): one compiled program for both.
    object.__setattr__(self, "temperature", temperature)
    object.__setattr__(self, "top_k", top_k)
    object.__setattr__(self, "top_p", top_p)
    object.__setattr__(self, "_static",
                       (all(t == 0 for t in _each(temperature)),
                        top_k_bucket(max(_each(top_k))), any(p < 1 for p in _each(top_p))))

  def tree_flatten(self):
    return tuple(_leaf(v) for v in (self.temperature, self.top_k, self.top_p)), self._static

  @classmethod
  def tree_unflatten(cls, static, leaves):
    warp = object.__new__(cls)           # traced leaves: no checks (they were made on the host)
    object.__setattr__(warp, "temperature", leaves[0])
    object.__setattr__(warp, "top_k", leaves[1])
    object.__setattr__(warp, "top_p", leaves[2])
    object.__setattr__(warp, "_static", static)
    return warp

  @property
  def greedy(self) -> bool:
    return self._static[0]

  @property
  def rows(self) -> int | None:
    """The batch size the per-row values are for; None when every value is one number."""
    for v in (self.temperature, self.top_k, self.top_p):
      if np.ndim(v):
        return np.shape(v)[0]
    return None

  def log_probs(self, logits: jax.Array) -> jax.Array:
    """logits [B, ..., V] -> warped float32 log-probs [B, ..., V] (-inf outside the kept set, no
    NaN). With one value for every row, logits may have any leading shape [..., V]."""
    logits = logits.astype(jnp.float32)
    if self.greedy:
      return _one_hot_log_probs(logits)
    t = _per_row(self.temperature, logits)
    # The largest logit is taken off before dividing, so the largest z is exactly 0 whatever the
    # temperature: logits / 1e-10 overflowed to +inf log-probs once XLA fused the division, and
    # the rules then accepted every draft token. A temperature below float32's smallest normal
    # (whose reciprocal would be inf) divides as that normal: the law is the argmax's either way.
    shifted = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    if jnp.ndim(t):                          # per row: greedy rows (0) take the one-hot
      z = jnp.where(t > 0, shifted / jnp.where(t > 0, jnp.maximum(t, _TINY), 1.0),
                    _one_hot_log_probs(logits))
    else:                                    # one value: > 0 here (0 compiles the greedy path)
      z = shifted / jnp.maximum(t, _TINY)
    if self._static[1]:                                                   # top_k > 0
      k = _per_row(self.top_k, logits)
      masked = _top_k_mask(z, k, self._static[1])
      z = jnp.where(k > 0, masked, z) if jnp.ndim(k) else masked   # per row: 0 is off
    if self._static[2]:                                                   # top_p < 1
      p = _per_row(self.top_p, logits)
      masked = _top_p_mask(z, p)
      z = jnp.where(p < 1, masked, z) if jnp.ndim(p) else masked     # per row: 1 is off
    # Every row's largest z is exactly 0 (shifted above; the masks keep the top token; a greedy
    # row's one-hot is 0 there), so normalizing needs no second max over the vocabulary.
    return z - jnp.log(jnp.sum(jnp.exp(z), axis=-1, keepdims=True))

  def sample(self, logits: jax.Array, keys: jax.Array) -> jax.Array:
    """logits [B, V], keys [B] (one per row) -> int32 [B]."""
    if self.greedy:
      return argmax(logits)
    return categorical(self.log_probs(logits), keys)


def _values(name: str, value, kind: type):
  """A warp value as one number of `kind`, or a non-empty tuple of them (one per row)."""
  if isinstance(value, (list, tuple)) or (hasattr(value, "ndim") and jnp.ndim(value) == 1):
    value = tuple(kind(v) for v in value)
    if not value:
      raise ValueError(f"{name}=(): give one value, or one per row")
    return value
  return kind(value)


def _each(value) -> tuple:
  return value if isinstance(value, tuple) else (value,)


def _leaf(value):
  """A host value as the loop's argument: a number, or a [B] array of per-row values."""
  if isinstance(value, tuple):
    return np.asarray(value, np.float32 if isinstance(value[0], float) else np.int32)
  return value


def _per_row(value, logits: jax.Array) -> jax.Array:
  """A warp value shaped to broadcast over logits [B, ..., V]: [B] -> [B, 1, ..., 1]."""
  value = jnp.asarray(value)
  if value.ndim == 0:
    return value
  if logits.shape[0] != value.shape[0]:
    raise ValueError(f"per-row warp values for {value.shape[0]} rows met logits of shape "
                     f"{logits.shape}: give one value per row of the batch")
  return value.reshape(value.shape + (1,) * (logits.ndim - 1))


def top_k_bucket(k: int) -> int:
  """The static k_max a loop compiles for top_k = k: 0 (off) for 0, else the next power of two.
  Example: 1 -> 1, 3 -> 4, 4 -> 4, 5 -> 8."""
  return 0 if k <= 0 else 1 << (int(k) - 1).bit_length()


def _top_k_mask(z: jax.Array, k, k_max: int) -> jax.Array:
  """z [..., V] with every entry below its k-th largest set to -inf; k (traced, 1 <= k <=
  k_max; one number, or shaped to broadcast over z's leading axes) is read from the k_max
  largest (lax.top_k's static k). k >= V masks nothing: the k-th largest is then clipped to the
  smallest entry. The k-th largest is the same float as lax.top_k(z, k)'s last, so the law
  equals a static-k mask's exactly."""
  z = jax.lax.optimization_barrier(z)      # one copy: the compare below reads top_k's own bits
  top = jax.lax.top_k(z, min(k_max, z.shape[-1]))[0]                   # [..., k_max] descending
  index = jnp.clip(jnp.asarray(k, jnp.int32) - 1, 0, top.shape[-1] - 1)
  index = jnp.broadcast_to(index, top.shape[:-1] + (1,))                # [..., 1]
  kth = jnp.take_along_axis(top, index, axis=-1)                        # [..., 1]
  return jnp.where(z < kth, -jnp.inf, z)


def _one_hot_log_probs(logits: jax.Array) -> jax.Array:
  best = argmax(logits)[..., None]                                       # [..., 1]
  ids = jnp.arange(logits.shape[-1])
  return jnp.where(ids == best, 0.0, -jnp.inf).astype(jnp.float32)


def _top_p_mask(z: jax.Array, top_p) -> jax.Array:
  """Keep the smallest set of most likely tokens whose mass reaches top_p (one number, or shaped
  to broadcast over z's leading axes; edge ties kept)."""
  # The cutoff is one of logp's own entries, compared with them by value, so logp must be computed
  # once: XLA may compute it again for the compare, in another fusion with another rounding, and
  # the cutoff token itself then falls out of the kept set. (On an H200 a per-row top_p kept one
  # token fewer than the same warp alone: the suspected cause; not yet rerun there.)
  logp = jax.lax.optimization_barrier(jax.nn.log_softmax(z, axis=-1))
  desc = jnp.flip(jnp.sort(logp, axis=-1), axis=-1)                      # [..., V] descending
  before = jnp.cumsum(jnp.exp(desc), axis=-1) - jnp.exp(desc)           # mass strictly above
  # At least the top token: a top_p below float32's smallest normal is 0 on the device (flushed)
  # and kept nothing, so the cutoff at index -1 kept everything.
  kept = jnp.maximum(jnp.sum(before < top_p, axis=-1, keepdims=True), 1)
  cutoff = jnp.take_along_axis(desc, kept - 1, axis=-1)                 # [..., 1]
  return jnp.where(logp < cutoff, -jnp.inf, z)


_BLOCK = 64   # vocabulary entries per block of the two-level sampler


def categorical(log_probs: jax.Array, keys: jax.Array) -> jax.Array:
  """Sample one token per row: log_probs [B, V] (may hold -inf), keys [B] -> int32 [B].

  Inverse-CDF sampling in two levels: pick a block of _BLOCK entries with probability equal to its
  mass, then an entry within it. Two uniforms per row instead of the V of Gumbel-max, which on
  XLA:CPU cost more than a draft model's forward pass (~75 us for V = 2000 vs ~10 us here). The
  law is the same chain rule exactly; zero-probability entries are never chosen.
  """
  lp = log_probs.astype(jnp.float32)
  batch, vocab = lp.shape
  blocks = -(-vocab // _BLOCK)
  w = jnp.exp(lp - jnp.max(lp, axis=-1, keepdims=True))                  # [B, V] in [0, 1]
  w = jnp.pad(w, ((0, 0), (0, blocks * _BLOCK - vocab))).reshape(batch, blocks, _BLOCK)
  u = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, (2,), jnp.float32))(keys)   # [B, 2] in (0, 1]
  block = _inverse_cdf(jnp.sum(w, axis=-1), u[:, 0])                     # [B]
  inside = _inverse_cdf(jnp.take_along_axis(w, block[:, None, None], axis=1)[:, 0], u[:, 1])
  return (block * _BLOCK + inside).astype(jnp.int32)


def _inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
  """weights [B, N] >= 0, u [B] in (0, 1] -> first index i with w_i > 0 and cdf_i >= u * total.

  cumsum adds left to right, so a zero weight repeats its predecessor's cdf and cannot be the first
  to reach the threshold; `w > 0` keeps that true under any summation order."""
  cdf = jnp.cumsum(weights, axis=-1)                                     # [B, N]
  hit = (cdf >= (u * cdf[:, -1])[:, None]) & (weights > 0)
  return jnp.argmax(hit, axis=-1).astype(jnp.int32)


def is_key_batch(key: jax.Array) -> bool:
  """True for per-row keys ([B] typed keys or [B, 2] raw uint32), False for one key."""
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key.ndim == 1
  return key.ndim == 2


@functools.partial(jax.jit, static_argnums=1)   # eager vmap of fold_in costs ~3 ms per call
def row_keys(key: jax.Array, batch: int) -> jax.Array:
  """Row b's key is fold_in(key, b): independent of the batch size and of the other rows."""
  return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(batch, dtype=jnp.uint32))


def as_row_keys(key: jax.Array, batch: int) -> jax.Array:
  """Accept one key (expanded with row_keys) or per-row keys [B] (used as they are)."""
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if not is_key_batch(key):
    return row_keys(key, batch)
  if key.shape[0] != batch:
    raise ValueError(f"got {key.shape[0]} per-row keys for a batch of {batch} rows: pass one key "
                     f"or exactly one key per row")
  return key


def position_keys(keys: jax.Array, positions: jax.Array) -> jax.Array:
  """keys [B], positions [B] int -> fold_in(keys[b], positions[b]) [B]."""
  return jax.vmap(jax.random.fold_in)(keys, positions.astype(jnp.uint32))


def fold_rows(keys: jax.Array, data: int) -> jax.Array:
  """fold_in the same constant into every row key: derive a sub-stream per purpose."""
  return jax.vmap(lambda k: jax.random.fold_in(k, data))(keys)


def fold_table(keys: jax.Array, count: int) -> jax.Array:
  """keys [B] -> [B, count]: column i is fold_rows(keys, i), all derived in one PRNG call (one
  threefry in a compiled program instead of `count`, each a few hundred instructions to
  compile)."""
  data = jnp.arange(count, dtype=jnp.uint32)
  return jax.vmap(lambda k: jax.vmap(lambda i: jax.random.fold_in(k, i))(data))(keys)


def fit_width(logits: jax.Array, width: int) -> jax.Array:
  """logits [..., V] -> [..., width]: cut past `width`, or padded with the dtype's lowest finite
  value (no probability under any warp, and still finite for nonfinite_rows). For a draft that
  shares the target's tokenizer but pads its embedding to another row count (Qwen2.5-7B: 152,064
  rows, 0.5B: 151,936): no tokenizer id lies past either width."""
  have = logits.shape[-1]
  if have >= width:
    return logits[..., :width]
  pad = jnp.full(logits.shape[:-1] + (width - have,), jnp.finfo(logits.dtype).min, logits.dtype)
  return jnp.concatenate([logits, pad], axis=-1)


def nonfinite_rows(logits: jax.Array) -> jax.Array:
  """[B] True where a row of logits [B, ...] holds NaN or +inf (-inf is a legitimate logit: a
  masked token). One float max per row, which XLA propagates NaN through: on XLA:CPU it costs
  about half a boolean any() over the same logits (25 against 57 us at [1, 5, 32000])."""
  return ~(jnp.max(logits, axis=tuple(range(1, logits.ndim))) < jnp.inf)
