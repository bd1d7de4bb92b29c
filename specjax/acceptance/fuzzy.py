"""Fuzzy speculative decoding (FSD, Holsman et al.; papers/fsd.md): accept the leading drafts whose
divergence Div(p_j, q_j) < T, then emit one token drawn from the target's own warped p.

  d_j = Div(p_j, q_j)               # p_j, q_j: target / draft distributions at the same context
  n   = number of leading d_j < T   # the draft token itself is never looked at
  y   ~ warp(p_n)                   # after a rejection AND as the bonus token: p, not (p - q)+

The decision is deterministic (no uniform), so the output is not the target's law: the paper's
bound is Div(P_T, P_FSD) <= N * %MD * T. T = 0 (strict `<`) is target-only decoding; T = inf
accepts every draft, also where d = inf (distributions with zeros: KL, or warped top-k).

* threshold: one float, or a tuple with one float per batch row (the rule stays hashable, i.e. a
  static jit argument, so one compiled batch sweeps thresholds: row b uses threshold[b]).
* divergence: a name of specjax.divergences (kl = KL(p||q), rkl = KL(q||p), js, js_m, js_distance,
  tv; NAME_topk lumps everything outside p's top-k ids, k = `k`). The paper's numbers used js_m.
* divergence_on="raw" (the authors' code): divergences on the temperature-1 softmax, sampling on
  the warped one. To give verify both, q_log_probs / p_log_probs return [warped | raw] log-probs
  concatenated on the last axis (2V wide); "warped" uses the warped distributions only (V wide).
* The draft proposes its argmax (HF forces greedy drafting); sample_draft=True samples warped q.
* mode="random" is the paper's ablation (Fig. 6): accept each draft iff u_j <= T, u_j ~ U(0, 1),
  so E[n] = sum_{j<=L} T^j; T is then a probability, in [0, 1]. Also registered as `fuzzy_random`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from specjax import divergences as dv
from specjax import sampling
from specjax.acceptance import base
from specjax.acceptance.registry import register

MODES = ("divergence", "random")
DIVERGENCE_ON = ("raw", "warped")


def _as_thresholds(value) -> float | tuple[float, ...]:
  """A float or a tuple of floats (lists from configs become tuples, so the rule stays hashable)."""
  if isinstance(value, (list, tuple)):
    if not value:
      raise ValueError("fuzzy threshold is an empty sequence: give a float or one float per row")
    values = tuple(float(v) for v in value)
  else:
    values = (float(value),)
  if any(math.isnan(v) or v < 0 for v in values):
    raise ValueError(f"fuzzy threshold must be >= 0 (0 = target only, inf = accept all), "
                     f"got {value}")
  return values if isinstance(value, (list, tuple)) else values[0]


def _as_tuple(threshold: float | tuple[float, ...]) -> tuple[float, ...]:
  return threshold if isinstance(threshold, tuple) else (threshold,)


@register("fuzzy")
@dataclasses.dataclass(frozen=True)
class Fuzzy(base.Rule):
  """FSD: accept draft j iff Div(p_j, q_j) < threshold (row-wise), resample from warped p."""
  needs_draft_law: ClassVar[str] = ("fuzzy SD accepts on a divergence between p and q, and a "
                                    "one-hot q is no draft distribution (KL(p||q) is infinite)")
  threshold: float | tuple[float, ...] = 0.5
  divergence: str = "js_m"
  k: int = 50                    # top-k size for the NAME_topk divergences
  divergence_on: str = "raw"
  inclusive: bool = False        # True: accept iff Div <= T (the authors' code); False: < (paper)
  sample_draft: bool = False
  mode: str = "divergence"
  traced: ClassVar[tuple[str, ...]] = ("threshold",)   # a sweep over thresholds compiles once

  def __post_init__(self):
    object.__setattr__(self, "threshold", _as_thresholds(self.threshold))
    if self.mode not in MODES:
      raise ValueError(f"fuzzy mode must be one of {MODES}, got {self.mode!r}")
    if self.mode == "random" and not all(t <= 1 for t in _as_tuple(self.threshold)):
      raise ValueError(f"{self.rule_name} threshold (mode='random') is an acceptance probability: "
                       f"it must be in [0, 1], got {self.threshold}")
    if self.divergence.endswith("_topk") and not self.k >= 1:
      raise ValueError(f"fuzzy k (top-k size of {self.divergence}) must be >= 1, got {self.k!r}")
    if self.divergence_on not in DIVERGENCE_ON:
      raise ValueError(f"fuzzy divergence_on must be one of {DIVERGENCE_ON}, got "
                       f"{self.divergence_on!r}")
    self.divergence_fn()           # validates the name (and k for NAME_topk)

  def divergence_fn(self) -> dv.Divergence:
    topk = self.divergence.endswith("_topk")
    return dv.get(self.divergence, self.k if topk else None)

  def thresholds(self, batch: int) -> jax.Array:
    """[B] f32 per-row thresholds."""
    if not isinstance(self.threshold, tuple):      # one value (a float, or traced)
      return jnp.full((batch,), self.threshold, jnp.float32)
    if len(self.threshold) != batch:
      raise ValueError(f"fuzzy threshold has {len(self.threshold)} values for a batch of {batch} "
                       f"rows: give one float, or exactly one float per row")
    return jnp.asarray(self.threshold, jnp.float32)

  # ---------------------------------------------------------------- distributions

  def _pack(self, logits: jax.Array, warp: sampling.Warp) -> jax.Array:
    warped = warp.log_probs(logits)
    if self.divergence_on == "warped":
      return warped
    return jnp.concatenate([warped, dv.log_probs(logits).astype(jnp.float32)], axis=-1)

  def _split(self, logp: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Packed log-probs -> (warped [..., V], for the divergence [..., V])."""
    if self.divergence_on == "warped":
      return logp, logp
    vocab = logp.shape[-1] // 2
    return logp[..., :vocab], logp[..., vocab:]

  def q_log_probs(self, q_logits, warp):
    return self._pack(q_logits, warp)

  def p_log_probs(self, p_logits, warp):
    return self._pack(p_logits, warp)

  def propose(self, q_logp, keys):
    warped, _ = self._split(q_logp)
    if self.sample_draft:
      return sampling.categorical(warped, keys)
    return sampling.argmax(warped)

  # ---------------------------------------------------------------- verification

  def divergences(self, p_logp: jax.Array, q_logp: jax.Array) -> jax.Array:
    """Div(p, q) over the last axis from packed log-probs ([..., V] or [..., 2V]) -> [...] f32,
    at least 0: equal p and q gave KL, JS or js_m of -1e-8 in float32 rounding, which the strict
    `< 0` of threshold 0 (target only) accepted."""
    d = self.divergence_fn()(self._split(p_logp)[1], self._split(q_logp)[1])
    return jnp.maximum(d, 0.0)

  def rejection_log_probs(self, p_n: jax.Array, q_n: jax.Array) -> jax.Array:
    """The law of the token emitted after a rejection: FSD uses the target's own warped p."""
    del q_n
    return p_n

  def verify(self, draft_tokens, draft_len, q_logp, p_logp, keys, rule_state):
    batch, num = draft_tokens.shape
    thresholds = self.thresholds(batch)[:, None]                         # [B, 1]
    uniforms, sample_keys = base.verify_streams(keys, num)               # [B, K]
    if self.mode == "random":
      accept = uniforms <= thresholds
    else:
      d = self.divergences(p_logp[:, :num], q_logp)                      # [B, K]
      within = d <= thresholds if self.inclusive else d < thresholds
      accept = within | (thresholds == jnp.inf)                          # T = inf: even d = inf
    n = base.prefix_accepted(accept, draft_len)
    p_n, _ = self._split(base.take_position(p_logp, n))                  # [B, V] warped
    q_n, _ = self._split(base.take_position(q_logp, n))
    rejected = (n < draft_len)[:, None]
    law = jnp.where(rejected, self.rejection_log_probs(p_n, q_n), p_n)
    return n, sampling.categorical(law, sample_keys), rule_state


@register("fuzzy_random")
@dataclasses.dataclass(frozen=True)
class FuzzyRandom(Fuzzy):
  """FSD's random-acceptance baseline: accept each draft with probability `threshold`."""
  mode: str = "random"
