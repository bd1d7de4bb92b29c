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
"""

from __future__ import annotations

import functools
from typing import Iterable

import jax
import jax.numpy as jnp
import optax

from specjax.distill import losses
from specjax.models import draft_head


def smooth_l1(x: jax.Array, y: jax.Array) -> jax.Array:
  """[..., D] -> [...]: the mean over D of Huber(x - y) with delta 1 (EAGLE's regression)."""
  return jnp.mean(optax.huber_loss(x.astype(jnp.float32), y.astype(jnp.float32)), axis=-1)


def head_loss(head_params, head: draft_head.DraftHead, target, target_params,
              tokens: jax.Array, mask: jax.Array, key: jax.Array, *, noise: float = 0.1,
              feature_weight: float = 1.0, divergence: str = "fkl"):
  """tokens [B, L], mask [B, L] (1 where a token is real) -> (scalar loss, metrics). noise:
  the width of the uniform noise added to the input features."""
  batch, length = tokens.shape
  cache = target.init_cache(batch, length)
  p_logits, h, _ = target.extend_entries(target_params, tokens, cache)  # [B, L, V], [B, L, D]
  p_logits, h = jax.lax.stop_gradient(p_logits), jax.lax.stop_gradient(h)
  features = h[:, :-1] + noise * jax.random.uniform(key, h[:, :-1].shape, h.dtype, -0.5, 0.5)
  params = draft_head.with_target(head_params, target_params)
  q_logits, f, _ = head.extend(params, features, tokens[:, 1:], head.init_cache(batch, length))
  pair = (mask[:, 1:] * mask[:, :-1]).astype(jnp.float32)             # [B, L-1] both real
  regression = losses.sequence_mean(smooth_l1(f, h[:, 1:]), pair)      # [B]
  div = losses.get(divergence).per_sequence(q_logits, p_logits[:, 1:], None, pair)  # [B]
  agree = jnp.argmax(q_logits, -1) == jnp.argmax(p_logits[:, 1:], -1)
  top1 = jnp.sum(agree * pair) / jnp.maximum(jnp.sum(pair), 1.0)
  loss = jnp.mean(feature_weight * regression + div)
  return loss, {"loss": loss, "regression": jnp.mean(regression), "divergence": jnp.mean(div),
                "top1": top1}


def train(head: draft_head.DraftHead, target, target_params, batches: Iterable, *, steps: int,
          learning_rate: float = 1e-3, seed: int = 0, head_params=None, **loss_args):
  """Train the head for `steps` steps on `batches` (an iterable of (tokens [B, L], mask
  [B, L])) with AdamW. head_params: where to start (None: a fresh head). Returns (head params,
  the metrics of every step as a list of dicts of floats)."""
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
  grads, metrics = jax.grad(head_loss, has_aux=True)(params, head, target, target_params, tokens,
                                                     mask, key, **loss_args)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, metrics
