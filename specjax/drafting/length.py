"""Draft-length policies: how many tokens a model drafter proposes per row and block.

A policy is asked twice per drafting step, with the step's q [B, V] and the acceptance rule
(its traced values) and rule state, so that a policy can follow thresholds that verification
learns (AdaSD's tau_g lives in the rule's state):

  keep(q, step, rule, rule_state) -> bool[B]        before draft `step`: False ends the row's block
  stop_after(q, step, rule, rule_state, logits) -> bool[B]
                                                    after draft `step`: True offers it, then ends
                                                    (logits [B, V_d]: the draft's raw logits)

A rule names the policy it was written with (`Rule.draft_length`); `for_rule` builds it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from specjax import divergences as dv


@dataclasses.dataclass(frozen=True)
class Fixed:
  """Every live row drafts gamma tokens (the loop unrolls the draft steps)."""
  variable: ClassVar[bool] = False

  def keep(self, q_logp, step, rule, rule_state) -> jax.Array:
    del step, rule, rule_state
    return jnp.ones(q_logp.shape[:1], bool)

  def stop_after(self, q_logp, step, rule, rule_state, logits=None) -> jax.Array:
    del step, rule, rule_state, logits
    return jnp.zeros(q_logp.shape[:1], bool)


@dataclasses.dataclass(frozen=True)
class EntropyStop:
  """AdaSD's window (papers/adasd.md §6.4, §7), read from the adaptive rule: at most
  rule.max_window drafts; the draft whose entropy exceeds tau_g (rule.thresholds(rule_state)[0])
  is offered, then drafting stops, never before rule.min_window drafts; rule.entropy_stop False
  keeps the full window."""
  variable: ClassVar[bool] = True

  def keep(self, q_logp, step, rule, rule_state) -> jax.Array:
    del rule_state
    return jnp.broadcast_to(step < rule.max_window, q_logp.shape[:1])

  def stop_after(self, q_logp, step, rule, rule_state, logits=None) -> jax.Array:
    del logits
    if not rule.entropy_stop:
      return jnp.zeros(q_logp.shape[:1], bool)
    tau_g, _ = rule.thresholds(rule_state)
    return (step + 1 >= rule.min_window) & (dv.entropy_log_probs(q_logp) > tau_g)


@dataclasses.dataclass(frozen=True)
class ConfidenceStop:
  """`inner`'s window (the rule's own policy: gamma drafts, AdaSD's entropy stop), also ended
  after a draft the draft model is unsure of: its top probability (the softmax of its raw
  logits, whatever the warp) below `threshold`. That draft is still offered. Hugging Face's
  assistant_confidence_threshold, with a fixed threshold."""
  threshold: float
  inner: Any = Fixed()
  variable: ClassVar[bool] = True

  def keep(self, q_logp, step, rule, rule_state) -> jax.Array:
    return self.inner.keep(q_logp, step, rule, rule_state)

  def stop_after(self, q_logp, step, rule, rule_state, logits=None) -> jax.Array:
    z = logits.astype(jnp.float32)                                        # [B, V_d]
    top = jnp.exp(jnp.max(z, axis=-1) - jax.nn.logsumexp(z, axis=-1))    # [B]
    return self.inner.stop_after(q_logp, step, rule, rule_state, logits) | (top < self.threshold)


POLICIES = {"fixed": Fixed(), "entropy": EntropyStop()}


def for_rule(rule):
  """The policy `rule` was written with (its class's `draft_length`)."""
  name = rule.draft_length
  if name not in POLICIES:
    raise ValueError(f"rule {rule.rule_name or type(rule).__name__!r} declares draft_length "
                     f"{name!r}: the draft-length policies are {', '.join(POLICIES)}")
  return POLICIES[name]
