"""DistillSpec token-level losses (distillspec.md §3.1).

A divergence loss maps `(student_logits[B,L,V], teacher_logits[B,L,V], mask[B,L]) -> [B]`: the
per-token divergence D(teacher || student), averaged over each sequence's valid tokens. The batch
loss is the mean of those per-sequence values, so padding never changes it. The teacher side is
wrapped in stop_gradient: gradients flow only into the student. Loss temperature is 1 whatever the
decoding temperature.

SeqKD (black-box KD) is FKL against the one-hot sampled teacher token, i.e. the NLL of the batch
targets; the same NLL is the pretraining / fine-tuning loss.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from specjax import divergences


def sequence_mean(per_token: jax.Array, mask: jax.Array) -> jax.Array:
  """[B, L] values, [B, L] mask -> [B] mean over each row's valid tokens (0 for an empty row)."""
  mask = mask.astype(per_token.dtype)
  return jnp.sum(per_token * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0)


def _token_divergence(fn, student_logits, teacher_logits, mask):
  teacher_logits = jax.lax.stop_gradient(teacher_logits)
  return sequence_mean(fn(teacher_logits, student_logits), mask)        # [B]


def fkl(student_logits, teacher_logits, mask):
  """KL(P || Q): mode-covering; white-box SupKD / GKD default."""
  return _token_divergence(divergences.kl, student_logits, teacher_logits, mask)


def rkl(student_logits, teacher_logits, mask):
  """KL(Q || P): mode-seeking."""
  return _token_divergence(divergences.rkl, student_logits, teacher_logits, mask)


def jsd(student_logits, teacher_logits, mask, beta: float = 0.5):
  """JSD[beta](P || Q), m = beta P + (1 - beta) Q."""
  fn = functools.partial(divergences.jsd_beta, beta=beta)
  return _token_divergence(fn, student_logits, teacher_logits, mask)


def tvd(student_logits, teacher_logits, mask):
  """1/2 sum |P - Q|: 1 - TVD is the expected acceptance of one draft token."""
  return _token_divergence(divergences.tv, student_logits, teacher_logits, mask)


def nll(student_logits, targets, mask):
  """[B] mean -log Q(y_t) over valid tokens; targets are constants (sampled or ground truth)."""
  logp = divergences.log_probs(student_logits)                            # [B, L, V]
  token = jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), -1)[..., 0]
  return sequence_mean(-token, mask)


@dataclasses.dataclass(frozen=True)
class Loss:
  """A named loss. `needs_teacher=False` lets the trainer skip the teacher forward pass."""
  name: str
  fn: Callable
  needs_teacher: bool = True
  beta: float | None = None

  def per_sequence(self, student_logits, teacher_logits, targets, mask) -> jax.Array:
    """[B] per-sequence loss."""
    if not self.needs_teacher:
      return self.fn(student_logits, targets, mask)
    if teacher_logits is None:
      raise ValueError(f"loss '{self.name}' needs teacher logits (configure a teacher model)")
    if self.beta is not None:
      return self.fn(student_logits, teacher_logits, mask, beta=self.beta)
    return self.fn(student_logits, teacher_logits, mask)

  def __call__(self, student_logits, teacher_logits, targets, mask) -> jax.Array:
    """Scalar batch loss: the mean of the per-sequence losses."""
    return jnp.mean(self.per_sequence(student_logits, teacher_logits, targets, mask))


LOSSES = {
    "fkl": Loss("fkl", fkl),
    "rkl": Loss("rkl", rkl),
    "jsd": Loss("jsd", jsd, beta=0.5),
    "tvd": Loss("tvd", tvd),
    "seqkd": Loss("seqkd", nll, needs_teacher=False),
    "nll": Loss("nll", nll, needs_teacher=False),
}


def get(name: str, beta: float | None = None) -> Loss:
  """A loss by name; `jsd` takes beta (default 0.5, 'jsd' is JSD[0.5])."""
  if name not in LOSSES:
    raise ValueError(f"unknown distillation loss '{name}'; known: {', '.join(LOSSES)}")
  loss = LOSSES[name]
  if beta is not None and name == "jsd":
    if not 0.0 < beta < 1.0:
      raise ValueError(f"jsd beta must lie in (0, 1), got {beta}")
    loss = dataclasses.replace(loss, beta=float(beta))
  return loss
