"""AdaSD (Lu, Hong, Liu; papers/adasd.md): an entropy-driven draft window and a JS-distance
acceptance test, both with thresholds learned online from the row's own history.

  generation:   stop drafting when the draft entropy H(q_j) > tau_g = mean entropy of the
                rejected drafts so far (+inf until the first rejection)
  verification: accept x_j iff u_j < p_j(x_j) / q_j(x_j) (speculative sampling)
                           or D_j < tau_v, D = sqrt(JS(p_j, q_j)) in base 2 (in [0, 1]),
                tau_v = midpoint of the mean D of accepted and the mean D of rejected drafts
                (0 until both are non-empty); after a rejection the next token comes from
                norm(max(0, p - q)) (non-empty: both tests failed, so p(x) < q(x)), else the bonus
                token from p.

The history lives in rule_state as running sums per row (reset per generate call, i.e. per
prompt); only verified drafts are recorded: the accepted ones and the first rejected one.

Window: the drafter's length policy, drafting/length.EntropyStop (this rule's `draft_length`),
reads the window's fields and `thresholds(rule_state)` from here. The loop's gamma is the static
maximum; the policy stops a row after max_window (20) drafts, and the drafter after
max_new_tokens - generated - 1 (what a block can still commit besides its correction or bonus
token). After draft j is proposed from q_j, a draft whose entropy exceeds tau_g is offered, then
drafting stops, as the paper (and HF stopping criteria) keep the stopping token; the first
min_window drafts never stop the block.

Ablations: js_accept=False is Gen-Only (tau_v = 0: exact SD with the entropy window, lossless);
entropy_stop=False with max_window=5 is Verify-Only. tau_v_rule picks the paper's appendix
variants: "midpoint" (AdaSD), "accepted_mean" (A), "pooled" (B, the count-weighted mean of both).
record="sd" labels the history by the speculative test alone instead of the final decision.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar
import math

import flax.struct
import jax
import jax.numpy as jnp

from specjax import divergences as dv
from specjax import sampling
from specjax.acceptance import base
from specjax.acceptance.registry import register

TAU_V_RULES = ("midpoint", "accepted_mean", "pooled")
RECORDS = ("final", "sd")


@flax.struct.dataclass
class AdaState:
  """Running sums per row, [B] each: the paper's lists L_Ja, L_Jr, L_He as (sum, count)."""
  sum_d_acc: jax.Array    # f32, JS distance of accepted drafts
  n_acc: jax.Array        # i32
  sum_d_rej: jax.Array    # f32, JS distance of rejected drafts
  sum_h_rej: jax.Array    # f32, draft entropy (nats) of rejected drafts
  n_rej: jax.Array        # i32 (one count for both rejected lists)

  @classmethod
  def zeros(cls, batch: int) -> "AdaState":
    f, i = jnp.zeros((batch,), jnp.float32), jnp.zeros((batch,), jnp.int32)
    return cls(sum_d_acc=f, n_acc=i, sum_d_rej=f, sum_h_rej=f, n_rej=i)


def _mean(total: jax.Array, count: jax.Array) -> jax.Array:
  return total / jnp.maximum(count, 1).astype(jnp.float32)


@register("adaptive")
@dataclasses.dataclass(frozen=True)
class Adaptive(base.Rule):
  """AdaSD with the open choices of papers/adasd.md §7 as fields (defaults: the chosen ones)."""
  needs_draft_law: ClassVar[str] = ("AdaSD stops drafting on q's entropy and accepts on the "
                                    "JS distance to q, which a one-hot q leaves at 0 and at "
                                    "their maximum")
  max_window: int = 20
  min_window: int = 1
  entropy_stop: bool = True      # False: fixed window of max_window drafts (Verify-Only)
  js_accept: bool = True         # False: tau_v = 0, exact speculative sampling (Gen-Only)
  tau_g_init: float = math.inf   # before the first rejection
  tau_v_init: float = 0.0        # before both accepted and rejected drafts exist
  tau_v_rule: str = "midpoint"
  record: str = "final"
  draft_length: ClassVar[str] = "entropy"   # drafting/length.EntropyStop reads thresholds()
  # The windows and initial thresholds are compared, never shapes: a sweep compiles once.
  traced: ClassVar[tuple[str, ...]] = ("max_window", "min_window", "tau_g_init", "tau_v_init")

  def __post_init__(self):
    if not 1 <= self.min_window <= self.max_window:
      raise ValueError(f"adaptive needs 1 <= min_window <= max_window, got min_window "
                       f"{self.min_window}, max_window {self.max_window}")
    if self.tau_v_rule not in TAU_V_RULES:
      raise ValueError(f"adaptive tau_v_rule must be one of {TAU_V_RULES}, got {self.tau_v_rule!r}")
    if self.record not in RECORDS:
      raise ValueError(f"adaptive record must be one of {RECORDS}, got {self.record!r}")
    for name in ("tau_g_init", "tau_v_init"):
      if math.isnan(getattr(self, name)):
        raise ValueError(f"adaptive {name} must be a number (inf allowed), got nan")

  def init_state(self, batch: int) -> AdaState:
    return AdaState.zeros(batch)

  def thresholds(self, s: AdaState) -> tuple[jax.Array, jax.Array]:
    """(tau_g [B], tau_v [B]) in force for the next block."""
    tau_g = jnp.where(s.n_rej > 0, _mean(s.sum_h_rej, s.n_rej), jnp.float32(self.tau_g_init))
    both = (s.n_acc > 0) & (s.n_rej > 0)
    if self.tau_v_rule == "midpoint":
      value, ready = 0.5 * (_mean(s.sum_d_acc, s.n_acc) + _mean(s.sum_d_rej, s.n_rej)), both
    elif self.tau_v_rule == "accepted_mean":
      value, ready = _mean(s.sum_d_acc, s.n_acc), s.n_acc > 0
    else:
      value, ready = _mean(s.sum_d_acc + s.sum_d_rej, s.n_acc + s.n_rej), both
    tau_v = jnp.where(ready, value, jnp.float32(self.tau_v_init))
    return tau_g.astype(jnp.float32), tau_v.astype(jnp.float32)

  def decide(self, sd_accept, dist, ent, draft_len, s: AdaState) -> tuple[jax.Array, AdaState]:
    """One verification from the per-draft evidence [B, K]: the speculative test's outcome, the JS
    distance D and the draft entropy H -> (n accepted [B], updated history)."""
    n = self.accepted(sd_accept, dist, draft_len, s)
    return n, self.record_history(n, sd_accept, dist, ent, draft_len, s)

  def accepted(self, sd_accept, dist, draft_len, s: AdaState) -> jax.Array:
    """n [B]: the leading drafts that pass the speculative test or have D < tau_v."""
    _, tau_v = self.thresholds(s)
    accept = sd_accept
    if self.js_accept:
      accept = accept | (dist < tau_v[:, None])
    return base.prefix_accepted(accept, draft_len)

  def record_history(self, n, sd_accept, dist, ent, draft_len, s: AdaState) -> AdaState:
    """Add the verified drafts' D (accepted and first rejected) and H (first rejected) to s."""
    j = jnp.arange(dist.shape[1])[None, :]
    kept = j < n[:, None]                                                # accepted drafts
    first_rejected = (j == n[:, None]) & (n < draft_len)[:, None]
    if self.record == "sd":
      acc_mask, rej_mask = kept & sd_accept, (kept & ~sd_accept) | first_rejected
    else:
      acc_mask, rej_mask = kept, first_rejected
    total = lambda mask, x: jnp.sum(jnp.where(mask, x, 0.0), axis=1)
    count = lambda mask: jnp.sum(mask, axis=1).astype(jnp.int32)
    return AdaState(sum_d_acc=s.sum_d_acc + total(acc_mask, dist), n_acc=s.n_acc + count(acc_mask),
                    sum_d_rej=s.sum_d_rej + total(rej_mask, dist),
                    sum_h_rej=s.sum_h_rej + total(rej_mask, ent), n_rej=s.n_rej + count(rej_mask))

  def verify(self, draft_tokens, draft_len, q_logp, p_logp, keys, rule_state):
    num = draft_tokens.shape[1]
    uniforms, sample_keys = base.verify_streams(keys, num)               # same streams as exact
    log_q = base.take_tokens(q_logp, draft_tokens)                       # [B, K]
    log_p = base.take_tokens(p_logp[:, :num], draft_tokens)
    sd_accept = base.ratio_accept(uniforms, log_p, log_q)               # q(x) = 0: rejected
    dist = dv.js_distance_log_probs(p_logp[:, :num], q_logp)             # [B, K]
    n = self.accepted(sd_accept, dist, draft_len, rule_state)
    p_n, q_n = base.take_position(p_logp, n), base.take_position(q_logp, n)
    if self.record == "final":
      # Only the first rejected draft's entropy is recorded: one row per batch row, not K.
      ent = jnp.broadcast_to(dv.entropy_log_probs(q_n)[:, None], dist.shape)
    else:
      ent = dv.entropy_log_probs(q_logp)                                 # [B, K]
    rule_state = self.record_history(n, sd_accept, dist, ent, draft_len, rule_state)
    rejected = (n < draft_len)[:, None]
    law = jnp.where(rejected, base.residual_log_probs(p_n, q_n), p_n)
    return n, sampling.categorical(law, sample_keys), rule_state
