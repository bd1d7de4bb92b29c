"""Training an EAGLE-style draft head (models/draft_head.py) against its frozen target.

Per sequence x_0 .. x_{L-1} the target gives its features h_t (last hidden state, after the
final norm) and its distribution p_t of x_{t+1}. The head reads (h_t, x_{t+1}) for t < L-1 and
predicts f_t, trained towards h_{t+1}, with its logits trained towards p_{t+1}:

  loss = feature_weight * smooth_l1(f_t, h_{t+1}) + divergence(p_{t+1} || head(f_t))

(EAGLE's regression plus DistillSpec's divergence, `divergence` any of distill/losses.py: FKL by
default). Draft step >= 2 reads the head's own f, which differs from h; the head is trained
with uniform noise on its input features (EAGLE-1's remedy, one forward per step), not with
EAGLE-3's multi-step unrolling (k forwards per step), to keep a CPU step cheap. The target's
features and logits are computed under stop_gradient: only the head's params are trained.

The target's outputs (`TeacherOutputs`) come from its pass in the step, or from a cache written
once (distill/features.py) that keeps its features and its top-k log-probs with the rest of the
vocabulary lumped into one bin: the divergence is then taken over those k+1 bins, the head's
distribution lumped the same way (`divergences.lump_at`). That is the divergence of the two
distributions seen through the partition, a lower bound on the full one (data processing),
equal to it when the top-k ids hold all of the target's mass.
"""

from __future__ import annotations

import functools
from typing import Iterable

import flax.struct
import jax
import jax.numpy as jnp
import optax

from specjax import divergences
from specjax.distill import losses
from specjax.models import draft_head, score


def smooth_l1(x: jax.Array, y: jax.Array) -> jax.Array:
  """[..., D] -> [...]: the mean over D of Huber(x - y) with delta 1 (EAGLE's regression)."""
  return jnp.mean(optax.huber_loss(x.astype(jnp.float32), y.astype(jnp.float32)), axis=-1)


NOISE = 0.1            # the width of the uniform noise on the head's input features
FEATURE_WEIGHT = 0.1   # the regression's weight beside the divergence


@flax.struct.dataclass(kw_only=True)
class TeacherOutputs:
  """The target's outputs over a batch's targets [B, L]: position i is the target's step that
  predicted targets[i]. hidden [B, L, D]: its feature there (after the final norm). logp: its
  logits [B, L, V], or with `ids` [B, L, k] its log-probs over k+1 bins [B, L, k+1] (those ids,
  then the rest of the vocabulary lumped: `divergences.top_k_lumped`)."""
  hidden: jax.Array
  logp: jax.Array
  ids: jax.Array | None = None

  def head_side(self, q_logits: jax.Array) -> jax.Array:
    """The head's logits [B, L-1, V] at positions 1.. -> what the divergence compares with
    logp[:, 1:]: the logits themselves, or lumped over the same bins [B, L-1, k+1]."""
    return q_logits if self.ids is None else divergences.lump_at(q_logits, self.ids[:, 1:])

  def top1(self) -> jax.Array:
    """[B, L] int32: the target's most likely next token at each position."""
    return jnp.argmax(self.logp, -1) if self.ids is None else self.ids[..., 0]


def teacher_outputs(target, target_params, batch, top_k: int = 0) -> TeacherOutputs:
  """The target's pass over a Batch (prompt, targets [B, L]) -> TeacherOutputs, with full
  logits (top_k 0) or its top_k log-probs and the rest lumped (what a cache stores)."""
  logits, hidden = jax.lax.stop_gradient(score(target, target_params, batch.prompt,
                                               batch.targets))                # [B, L, V / D]
  if not top_k:
    return TeacherOutputs(hidden=hidden, logp=logits)
  logp, ids = divergences.top_k_lumped(logits, top_k)
  return TeacherOutputs(hidden=hidden, logp=logp, ids=ids)


def head_loss(head_params, head: draft_head.DraftHead, target_params, teacher: TeacherOutputs,
              targets: jax.Array, mask: jax.Array, key: jax.Array, *, loss: losses.Loss,
              feature_weight: float = FEATURE_WEIGHT, noise: float = NOISE):
  """The head's loss on one batch of the target's outputs (`teacher`, over targets [B, L] with
  mask [B, L]) -> (scalar loss, metrics). The head reads (hidden[i], targets[i]) and is scored
  against the target's distribution at i+1 (loss: a distill/losses.py Loss) and hidden[i+1]
  (smooth L1)."""
  teacher = jax.lax.stop_gradient(teacher)
  batch, length = targets.shape
  features = teacher.hidden[:, :-1]
  features = features + noise * jax.random.uniform(key, features.shape, features.dtype, -0.5, 0.5)
  params = draft_head.with_target(head_params, target_params)
  q_logits, f, _ = head.extend(params, features, targets[:, :-1],
                               head.init_cache(batch, length - 1))          # [B, L-1, V / D]
  pair = (mask[:, 1:] * mask[:, :-1]).astype(jnp.float32)             # [B, L-1] both real
  regression = losses.sequence_mean(smooth_l1(f, teacher.hidden[:, 1:]), pair)        # [B]
  div = loss.per_sequence(teacher.head_side(q_logits), teacher.logp[:, 1:], targets[:, 1:],
                          pair)                                                         # [B]
  agree = jnp.argmax(q_logits, -1) == teacher.top1()[:, 1:]
  top1 = jnp.sum(agree * pair) / jnp.maximum(jnp.sum(pair), 1.0)
  value = jnp.mean(feature_weight * regression + div)
  return value, {"regression": jnp.mean(regression), "divergence": jnp.mean(div), "top1": top1}


def train(head: draft_head.DraftHead, target, target_params, batches: Iterable, *, steps: int,
          learning_rate: float = 1e-3, seed: int = 0, head_params=None, **loss_args):
  """Train the head for `steps` steps on `batches` (an iterable of (tokens [B, L], mask
  [B, L])) with AdamW and the forward KL (loss_args: head_loss's feature_weight and noise).
  head_params: where to start (None: a fresh head). Returns (head params, the metrics of every
  step as a list of dicts of floats). train.distill --config.train.student=head is the
  configured, resumable form."""
  key = jax.random.PRNGKey(seed)
  params = head.init_params(key) if head_params is None else head_params
  optimizer = optax.adamw(learning_rate)
  opt_state = optimizer.init(params)
  step = jax.jit(functools.partial(_step, head, target, optimizer, loss_args=loss_args))
  history = []
  for i, (tokens, mask) in zip(range(steps), batches):
    params, opt_state, metrics = step(params, opt_state, target_params, jnp.asarray(tokens),
                                      jnp.asarray(mask), jax.random.fold_in(key, i))
    history.append({k: float(v) for k, v in metrics.items()})
  return params, history


def _step(head, target, optimizer, params, opt_state, target_params, tokens, mask, key, *,
          loss_args):
  # Position t of the target's pass over tokens predicts tokens[t+1] from its feature h_t.
  logits, hidden, _ = target.extend_entries(target_params, tokens,
                                            target.init_cache(*tokens.shape))
  teacher = TeacherOutputs(hidden=hidden[:, :-1], logp=logits[:, :-1])
  grads, metrics = jax.grad(head_loss, has_aux=True)(
      params, head, target_params, teacher, tokens[:, 1:], mask[:, 1:], key,
      loss=losses.get("fkl"), **loss_args)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, metrics
