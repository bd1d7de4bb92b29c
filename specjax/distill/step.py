"""One DistillSpec / pretraining optimizer step, pure: the state, the optimizer and its schedule
(Table B.1), and `train_step`, which the trainer jits with the mesh's shardings.

The step checks its own results on the device: a step whose loss, gradient norm or new params are
not finite is not applied (params and optimizer state stay those of the step before, as
`optax.apply_if_finite` would), and the state records the first such step and what was not
finite (`Divergence`). The loop reads that record only where it must (before a checkpoint, at a
log or eval point), so a step never waits on the host for its check, and a divergence between two
reads is still reported at the step where it happened.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from specjax.distill import head as head_lib
from specjax.distill import losses as losses_lib
from specjax.models import score
from specjax.models.draft_head import DraftHead

# What a step's `bad_quantity` code names (0: all finite); checked in this order.
QUANTITIES = (None, "loss", "gradient norm", "params")


@flax.struct.dataclass(kw_only=True)
class TrainState:
  step: jax.Array          # [] int32, completed steps
  params: Any              # student params
  opt_state: Any           # optax state (mirrors params)
  rng: jax.Array           # [2] uint32, base key; step keys are fold_in(rng, step)
  bad_step: jax.Array      # [] int32, the first step (1-based) that was not finite; 0: none yet
  bad_quantity: jax.Array  # [] int32, its QUANTITIES index; 0: none yet


def healthy() -> dict:
  """The divergence fields of a state that has not diverged (not checkpointed: a restored state
  starts healthy, since only checked states are saved)."""
  return {"bad_step": jnp.zeros((), jnp.int32), "bad_quantity": jnp.zeros((), jnp.int32)}


def paper_schedule(peak: float, total: int, warmup: int, decay_start: int,
                   final_ratio: float = 0.1) -> optax.Schedule:
  """Table B.1: linear 0 -> peak over `warmup`, constant to `decay_start`, cosine to final_ratio.

  Paper values (3e-4, 300k, 5k, 150k): steps 0, 2.5k, 5k, 150k, 225k, 300k ->
  0, 1.5e-4, 3e-4, 3e-4, 1.65e-4, 3e-5.
  """
  decay_start = max(decay_start, warmup)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, peak, max(warmup, 1)),
       optax.constant_schedule(peak),
       optax.cosine_decay_schedule(peak, max(total - decay_start, 1), alpha=final_ratio)],
      boundaries=[warmup, decay_start])


def make_optimizer(cfg) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """cfg: a trainer.TrainConfig (its learning-rate fields and `optimizer`, `param_scale`)."""
  schedule = paper_schedule(cfg.learning_rate, cfg.steps, cfg.warmup_steps, cfg.decay_start,
                            cfg.final_lr_ratio)
  if cfg.optimizer == "adafactor":
    return optax.adafactor(schedule, multiply_by_parameter_scale=cfg.param_scale), schedule
  if cfg.optimizer == "adamw":
    return optax.adamw(schedule), schedule
  raise ValueError(f"unknown optimizer '{cfg.optimizer}'; use adafactor or adamw")


def train_step(state: TrainState, batch, teacher_params, *, student, teacher, loss, optimizer,
               schedule):
  """One optimizer step on `batch` (pure). Returns (new state, metrics dict of [] scalars).

  A non-finite step (or any step after one) leaves params and optimizer state as they were; the
  step counter advances, so the loop's step and the state's stay in line."""
  prompt, targets, mask = batch.prompt, batch.targets, batch.mask
  teacher_logits = None
  if isinstance(student, DraftHead):     # an EAGLE-style head: it reads the teacher's features
    cached = batch.teacher               # the teacher's outputs from a cache, else its pass here
    outputs = cached if cached is not None else head_lib.teacher_outputs(teacher, teacher_params,
                                                                         batch)
    (value, extra), grads = jax.value_and_grad(head_lib.head_loss, has_aux=True)(
        state.params, student, teacher_params, outputs, targets, mask,
        jax.random.fold_in(state.rng, state.step), loss=loss)
    student_logits = None
  else:
    if teacher is not None:
      teacher_logits, _ = jax.lax.stop_gradient(
          score(teacher, teacher_params, prompt, targets))                  # [B, L, V]

    def loss_fn(params):
      student_logits, _ = score(student, params, prompt, targets)            # [B, L, V]
      return loss(student_logits, teacher_logits, targets, mask), student_logits

    (value, student_logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    extra = {}
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  grad_norm = optax.tree.norm(grads)
  quantity = non_finite_code(value, grad_norm, params)
  keep = (quantity > 0) | (state.bad_step > 0)       # this step or an earlier one diverged
  params, opt_state = _unless(keep, (params, opt_state), (state.params, state.opt_state))
  first_bad = (quantity > 0) & (state.bad_step == 0)
  metrics = {"loss": value, "lr": schedule(state.step), "tokens": jnp.sum(mask),
             "grad_norm": grad_norm, **extra}
  if student_logits is not None and teacher_logits is not None:
    tvd = jnp.mean(losses_lib.tvd(student_logits, teacher_logits, mask))
    metrics.update(tvd=tvd, accept=1.0 - tvd)
  new_state = state.replace(
      step=state.step + 1, params=params, opt_state=opt_state,
      bad_step=jnp.where(first_bad, state.step + 1, state.bad_step),
      bad_quantity=jnp.where(first_bad, quantity, state.bad_quantity))
  return new_state, metrics


def non_finite_code(loss: jax.Array, grad_norm: jax.Array, params) -> jax.Array:
  """[] int32: the QUANTITIES index of the first of loss, gradient norm, params that is not
  finite; 0 when all are."""
  return jnp.select([~jnp.isfinite(loss), ~jnp.isfinite(grad_norm), ~all_finite(params)],
                    [1, 2, 3], 0).astype(jnp.int32)


def all_finite(tree) -> jax.Array:
  """[] bool: every element of every leaf is finite."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]))


def _unless(keep: jax.Array, new, old):
  """`old` where `keep`, else `new`, leaf by leaf (an elementwise select XLA fuses into the
  update, instead of a cond that would hold both branches' buffers)."""
  return jax.tree_util.tree_map(lambda n, o: jnp.where(keep, o, n), new, old)
