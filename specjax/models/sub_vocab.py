"""A sub-vocabulary: K of a model's V token ids, and a draft head that scores only those (FR-Spec,
Zhao et al. 2025: most of a small draft's step reads its output layer, 136M of the 494M
parameters of Qwen2.5-0.5B's step sit in its 151,936 x 896 head).

A model whose config carries a `SubVocab` computes logits for the K ids with a [D, K] head and
returns them scattered into [.., V] with -inf elsewhere, so the draft still speaks the target's
vocabulary and every rule sees q = 0 outside the subset. Exact SD stays lossless: the residual
max(p - q, 0) runs over all V ids, so the target's mass outside the subset is drawn from there;
acceptance is capped by the target's mass on the subset.

Hashability (model configs are static jit arguments): `eq=False`, so a SubVocab hashes and
compares by identity; its ids become constants of the compiled programs. Reuse one object.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import head_product


@dataclasses.dataclass(frozen=True, eq=False)
class SubVocab:
  """`ids` [K] int32: sorted, unique token ids below `vocab_size` (V)."""
  ids: np.ndarray
  vocab_size: int

  def __post_init__(self):
    ids = np.asarray(self.ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"a sub-vocabulary is a non-empty 1-D array of token ids, got "
                       f"{ids.dtype}{ids.shape}")
    if ids.min() < 0 or ids.max() >= self.vocab_size or np.any(np.diff(ids) <= 0):
      raise ValueError(f"a sub-vocabulary's ids must be sorted, unique and in 0..{self.vocab_size - 1}")
    object.__setattr__(self, "ids", ids.astype(np.int32))

  @property
  def size(self) -> int:
    return int(self.ids.size)

  @classmethod
  def most_frequent(cls, counts: np.ndarray, k: int, always: Iterable[int] = ()) -> "SubVocab":
    """The ids of `always` (e.g. the stop ids) and the most frequent others of `counts` [V] (ties
    to the lower id), k ids in all."""
    counts = np.asarray(counts)
    always = sorted({int(i) for i in always})
    if not len(always) <= k <= counts.size:
      raise ValueError(f"k={k}: choose from {max(len(always), 1)} to {counts.size} ids")
    score = counts.astype(np.float64)
    score[always] = np.inf
    order = np.argsort(-score, kind="stable")[:k]
    return cls(ids=np.sort(order), vocab_size=int(counts.size))

  def head_rows(self, table: jax.Array) -> jax.Array:
    """The head kernel [D, K] from an embedding table [V, D] (tied heads)."""
    return jnp.take(table, jnp.asarray(self.ids), axis=0).T

  def head_columns(self, kernel: jax.Array) -> jax.Array:
    """The head kernel [D, K] from a full head kernel [D, V]."""
    return jnp.take(kernel, jnp.asarray(self.ids), axis=1)

  def expand(self, logits: jax.Array) -> jax.Array:
    """logits [..., K] -> [..., V]: the K scores at their ids, -inf elsewhere."""
    full = jnp.full(logits.shape[:-1] + (self.vocab_size,), -jnp.inf, logits.dtype)
    return full.at[..., jnp.asarray(self.ids)].set(logits)

  def logits(self, hidden: jax.Array, kernel: jax.Array, precision) -> jax.Array:
    """hidden [..., D] and the head kernel [D, K] -> float32 logits [..., V]."""
    return self.expand(head_product.logits(hidden, kernel, 1, precision))
