"""Lossy ("lenient") speculative decoding, DistillSpec §2: accept with min(1, f(p, eps) / q).

  f_lin(p, eps) = p / eps      f_sq(p, eps) = p / eps**2      f_exp(p, eps) = p ** eps

All three equal p at eps = 1, where the rule is `exact` (same key -> same tokens). Smaller eps
accepts more; as eps -> 0 the output law tends to the draft's. The residual stays
norm(max(0, p - q)) and the bonus token comes from p, as Alg. A.1 is printed. The induced law of
one position is pi_eps(v) = min(q_v, f(p_v)) + (1 - sum_w min(q_w, f(p_w))) norm(max(0, p - q))(v).
f is applied in log space (log p - log eps, log p - 2 log eps, eps * log p): no overflow, no NaN
at p = 0.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from specjax.acceptance import base
from specjax.acceptance.registry import register

KINDS = ("lin", "sq", "exp")


def log_lenience(log_p: jax.Array, kind: str, eps: float) -> jax.Array:
  """log f(p, eps) from log p (f32)."""
  if kind == "lin":
    return log_p - jnp.log(jnp.float32(eps))
  if kind == "sq":
    return log_p - 2.0 * jnp.log(jnp.float32(eps))
  return jnp.float32(eps) * log_p


def lenient_law(p: jax.Array, q: jax.Array, kind: str, eps: float) -> jax.Array:
  """pi_eps [..., V] from probabilities p, q [..., V] (reference for tests and analysis)."""
  f = jnp.exp(log_lenience(jnp.log(p), kind, eps))
  kept = jnp.minimum(q, f)
  residual = jnp.maximum(p - q, 0.0)
  residual = residual / jnp.maximum(jnp.sum(residual, -1, keepdims=True), 1e-30)
  return kept + (1.0 - jnp.sum(kept, -1, keepdims=True)) * residual


@register("lenient")
@dataclasses.dataclass(frozen=True)
class Lenient(base.Rule):
  """DistillSpec's lossy SD. kind in {"lin", "sq", "exp"}, eps in (0, 1]."""
  eps: float = 1.0
  kind: str = "lin"
  traced: ClassVar[tuple[str, ...]] = ("eps",)    # a sweep over eps compiles once

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"lenient kind must be one of {KINDS}, got {self.kind!r}")
    if not 0 < self.eps <= 1:
      raise ValueError(f"lenient eps must be in (0, 1] (1 = lossless), got {self.eps}")

  def verify(self, draft_tokens, draft_len, q_logp, p_logp, keys, rule_state):
    log_f = lambda log_p: log_lenience(log_p, self.kind, self.eps)
    n, nxt = base.rejection_verify(draft_tokens, draft_len, q_logp, p_logp, keys, log_f)
    return n, nxt, rule_state
