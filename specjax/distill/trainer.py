"""DistillSpec / pretraining trainer: one pure `train_step`, jitted with shardings over the mesh.

The same step serves distillation (a teacher and a divergence loss) and pretraining/fine-tuning
(no teacher, the NLL loss). Data per step follows Alg. A.2 (`distill.data`). Params and optimizer
state are placed by `specjax.sharding`'s rules table; batches are split over 'data' and, on a pod,
each host feeds only its rows. Checkpoints (Orbax) make a killed run resume exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax import checkpoint as ckpt_lib
from specjax import sharding
from specjax.distill import data as data_lib
from specjax.distill import losses as losses_lib
from specjax.models import score

log = logging.getLogger(__name__)


@flax.struct.dataclass(kw_only=True)
class TrainState:
  step: jax.Array          # [] int32, completed steps
  params: Any              # student params
  opt_state: Any           # optax state (mirrors params)
  rng: jax.Array           # [2] uint32, base key; step keys are fold_in(rng, step)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything the loop needs; built from the config at the edge (specjax.app.builders)."""
  steps: int = 300_000
  batch_size: int = 32
  learning_rate: float = 3e-4
  warmup_steps: int = 5_000
  decay_start: int = 150_000        # constant LR until here, then cosine to final_lr_ratio * LR
  final_lr_ratio: float = 0.1
  optimizer: str = "adafactor"      # adafactor | adamw
  param_scale: bool = True          # Adafactor multiply_by_parameter_scale
  loss: str = "fkl"
  beta: float = 0.5                 # JSD[beta]
  lambda1: float = 0.0
  lambda2: float = 1.0
  temperature: float = 1.0          # sampling temperature of generated outputs
  seed: int = 0
  log_every: int = 100
  checkpoint_every: int = 1_000
  keep_checkpoints: int = 3
  async_checkpoint: bool = True
  eval_every: int = 0               # 0: no eval hook
  mesh_data: int = -1
  mesh_model: int = 1
  progress: bool = True


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


def make_optimizer(cfg: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
  schedule = paper_schedule(cfg.learning_rate, cfg.steps, cfg.warmup_steps, cfg.decay_start,
                            cfg.final_lr_ratio)
  if cfg.optimizer == "adafactor":
    return optax.adafactor(schedule, multiply_by_parameter_scale=cfg.param_scale), schedule
  if cfg.optimizer == "adamw":
    return optax.adamw(schedule), schedule
  raise ValueError(f"unknown optimizer '{cfg.optimizer}'; use adafactor or adamw")


def train_step(state: TrainState, batch, teacher_params, *, student, teacher, loss, optimizer,
               schedule):
  """One optimizer step on `batch` (pure). Returns (new state, metrics dict of scalars)."""
  prompt, targets, mask = batch.prompt, batch.targets, batch.mask
  teacher_logits = None
  if teacher is not None:
    teacher_logits = jax.lax.stop_gradient(score(teacher, teacher_params, prompt, targets)[0])

  def loss_fn(params):
    student_logits, _ = score(student, params, prompt, targets)            # [B, L, V]
    return loss(student_logits, teacher_logits, targets, mask), student_logits

  (value, student_logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {"loss": value, "lr": schedule(state.step), "tokens": jnp.sum(mask),
             "grad_norm": optax.tree.norm(grads)}
  if teacher_logits is not None:
    tvd = jnp.mean(losses_lib.tvd(student_logits, teacher_logits, mask))
    metrics.update(tvd=tvd, accept=1.0 - tvd)
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
  return new_state, metrics


def check_vocab(student, teacher) -> None:
  if teacher is not None and student.vocab_size != teacher.vocab_size:
    raise ValueError(
        f"teacher vocab {teacher.vocab_size} != student vocab {student.vocab_size}: token-level "
        f"distillation compares distributions over the same ids. Use a draft with the target's "
        f"tokenizer (same vocab_size), or the cross-vocabulary rules for decoding only.")


class MetricsLog:
  """metrics.jsonl (one JSON per logged step), and each record to `show` (default: the log);
  process 0 only. The app layer passes a progress display as `show`."""

  def __init__(self, workdir: Path, show: Callable[[dict], None] | None = None):
    self.active = jax.process_index() == 0
    self.path = Path(workdir) / "metrics.jsonl"
    self.show = show or (lambda record: log.info("%s", format_record(record)))

  def write(self, step: int, metrics: dict) -> None:
    if not self.active:
      return
    record = {"step": int(step), **{k: _scalar(v) for k, v in metrics.items()}}
    with self.path.open("a") as f:
      f.write(json.dumps(record) + "\n")
    self.show(record)


def format_record(record: dict) -> str:
  return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items())


def _scalar(v):
  if isinstance(v, str):
    return v
  v = np.asarray(v)
  return v.item() if v.dtype.kind in "iub" else float(v)


@dataclasses.dataclass
class Trainer:
  """Owns the mesh, the jitted step and the loop. `teacher=None` means pretraining (NLL)."""
  cfg: TrainConfig
  student: Any
  teacher: Any
  source: Any                          # .batch(step) -> Batch (global batch), deterministic
  workdir: Path
  eos_id: int
  pad_id: int = 0
  model_desc: str = ""
  eval_fn: Callable[[int, TrainState], dict] | None = None
  mesh: Any = None
  show: Callable[[dict], None] | None = None   # each logged record (default: the log)

  def __post_init__(self):
    cfg = self.cfg
    check_vocab(self.student, self.teacher)
    self.workdir = Path(self.workdir)
    self.mesh = self.mesh or sharding.make_mesh(cfg.mesh_data, cfg.mesh_model)
    sharding.check_batch(cfg.batch_size, self.mesh)
    self.loss = losses_lib.get(cfg.loss, cfg.beta if cfg.loss == "jsd" else None)
    if self.loss.needs_teacher and self.teacher is None:
      raise ValueError(f"loss '{cfg.loss}' needs a teacher; pretraining uses loss=nll")
    self.optimizer, self.schedule = make_optimizer(cfg)
    self.mixture = data_lib.Mixture(cfg.lambda1, cfg.lambda2, cfg.temperature, cfg.seed)
    self.sampler = (data_lib.Sampler(self.student, self.teacher, self.eos_id, cfg.temperature,
                                     self.pad_id) if self.mixture.needs_generation else None)

  # -- placement -------------------------------------------------------------------------------
  def state_shardings(self, state: TrainState):
    p_sh = sharding.param_shardings(state.params, self.mesh)
    o_sh = sharding.opt_state_shardings(state.opt_state, state.params, self.mesh)
    rep = sharding.replicated(self.mesh)
    return TrainState(step=rep, params=p_sh, opt_state=o_sh, rng=rep)

  def init_state(self, params) -> TrainState:
    """Fresh state from the student's initial params, placed on the mesh."""
    def build(p):
      return TrainState(step=jnp.zeros((), jnp.int32), params=p,
                        opt_state=self.optimizer.init(p), rng=jax.random.PRNGKey(self.cfg.seed))
    abstract = jax.eval_shape(build, params)
    out_sh = self.state_shardings(abstract)
    params = jax.device_put(params, sharding.param_shardings(params, self.mesh))
    return jax.jit(build, out_shardings=out_sh)(params)

  def place_batch(self, batch):
    """The global batch from the source -> this host's rows -> a global array over 'data'."""
    rows = batch.targets.shape[0]
    if rows != self.cfg.batch_size:
      raise ValueError(f"data source gave {rows} rows but batch_size is {self.cfg.batch_size}")
    if jax.process_count() > 1:
      rows = sharding.host_slice(rows)
      local = jax.tree_util.tree_map(lambda x: np.asarray(x)[rows], batch)
      return sharding.shard_batch(local, self.mesh, local=True)
    return sharding.shard_batch(batch, self.mesh)

  def compiled_step(self, state: TrainState, batch, teacher_params):
    fn = functools.partial(train_step, student=self.student, teacher=self.teacher, loss=self.loss,
                           optimizer=self.optimizer, schedule=self.schedule)
    state_sh = self.state_shardings(state)
    batch_sh = jax.tree_util.tree_map(lambda _: sharding.batch_sharding(self.mesh), batch)
    teacher_sh = (None if teacher_params is None
                  else sharding.param_shardings(teacher_params, self.mesh))
    return jax.jit(fn, in_shardings=(state_sh, batch_sh, teacher_sh),
                   out_shardings=(state_sh, sharding.replicated(self.mesh)), donate_argnums=0)

  # -- the loop --------------------------------------------------------------------------------
  def abstract_state(self, params) -> TrainState:
    def build(p):
      return TrainState(step=jnp.zeros((), jnp.int32), params=p,
                        opt_state=self.optimizer.init(p), rng=jax.random.PRNGKey(self.cfg.seed))
    abstract = jax.eval_shape(build, params)
    return jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract, self.state_shardings(abstract))

  def resume_or_init(self, ckpt: ckpt_lib.Checkpointer, params) -> TrainState:
    """The latest checkpoint of this workdir if any (a run resumes by default), else fresh."""
    restored = ckpt.restore(_as_dict(self.abstract_state(params)))
    if restored is None:
      return self.init_state(params)
    state, meta = restored
    if jax.process_index() == 0:
      log.info("resuming from %s at step %d", ckpt.workdir, meta["step"])
    return TrainState(**state)

  def run(self, student_params, teacher_params=None,
          on_step: Callable[[int, TrainState], None] | None = None) -> TrainState:
    """Train from the workdir's latest checkpoint (or from `student_params`) to cfg.steps."""
    cfg = self.cfg
    fp = ckpt_lib.fingerprint(student_params, self.model_desc)
    ckpt = ckpt_lib.Checkpointer(self.workdir, fp, every=cfg.checkpoint_every,
                                 keep=cfg.keep_checkpoints, async_save=cfg.async_checkpoint)
    state = self.resume_or_init(ckpt, student_params)
    if teacher_params is not None:
      teacher_params = jax.device_put(teacher_params,
                                      sharding.param_shardings(teacher_params, self.mesh))
    metrics_log = MetricsLog(self.workdir, self.show)
    step_fn, window = None, _Window()
    meta = {"model": self.model_desc, "config": dataclasses.asdict(cfg)}
    try:
      for step in range(int(state.step), cfg.steps):
        batch = self.place_batch(self.source.batch(step))
        key = jax.random.fold_in(state.rng, step)
        batch, source = data_lib.mixed_batch(self.mixture, self.sampler, step, batch,
                                             state.params, teacher_params, key)
        step_fn = step_fn or self.compiled_step(state, batch, teacher_params)
        state, metrics = step_fn(state, batch, teacher_params)
        done = step + 1
        window.add(metrics["tokens"])
        extra = {}
        if self.eval_fn and cfg.eval_every and done % cfg.eval_every == 0:
          started = time.perf_counter()
          extra = self.eval_fn(done, state)
          window.start += time.perf_counter() - started      # tokens/s counts training only
        if done % cfg.log_every == 0 or done == cfg.steps or extra:
          metrics_log.write(done, {**metrics, **extra, "source": source,
                           "tokens_per_s": window.rate(metrics["loss"])})
        ckpt.save(done, _as_dict(state), dict(meta, data_step=done))
        if on_step is not None:
          on_step(done, state)
      if ckpt.latest_step() != cfg.steps:
        ckpt.save(cfg.steps, _as_dict(state), dict(meta, data_step=cfg.steps), force=True)
    finally:
      ckpt.close()
    return state


class _Window:
  """Tokens/s between two logged steps, without a host sync on unlogged steps."""

  def __init__(self):
    self.counts, self.start = [], time.perf_counter()

  def add(self, tokens) -> None:
    self.counts.append(tokens)

  def rate(self, sync) -> float:
    jax.block_until_ready(sync)
    now = time.perf_counter()
    total = float(sum(int(c) for c in self.counts))
    rate = total / max(now - self.start, 1e-9)
    self.counts, self.start = [], now
    return rate


def _as_dict(state: TrainState) -> dict:
  return {"step": state.step, "params": state.params, "opt_state": state.opt_state,
          "rng": state.rng}


def on_policy_eval(trainer: Trainer, batch, teacher_params, key) -> Callable[[int, TrainState], dict]:
  """An eval hook: TVD between teacher and student on student samples of a fixed batch
  (the on-policy TVD of Theorem 4.1; 1 - TVD is the predicted acceptance rate)."""
  sampler = data_lib.Sampler(trainer.student, trainer.teacher, trainer.eos_id,
                             trainer.cfg.temperature, trainer.pad_id)
  batch = trainer.place_batch(batch)
  if teacher_params is not None:
    teacher_params = jax.device_put(teacher_params,
                                    sharding.param_shardings(teacher_params, trainer.mesh))

  @functools.partial(jax.jit, static_argnums=(0, 1))
  def tvd(student, teacher, s_params, t_params, b):
    s_logits = score(student, s_params, b.prompt, b.targets)[0]
    t_logits = score(teacher, t_params, b.prompt, b.targets)[0]
    return jnp.mean(losses_lib.tvd(s_logits, t_logits, b.mask))

  def hook(step: int, state: TrainState) -> dict:
    sampled = sampler(data_lib.STUDENT, batch, state.params, teacher_params, key)
    value = float(tvd(trainer.student, trainer.teacher, state.params, teacher_params, sampled))
    return {"eval_tvd": value, "eval_accept": 1.0 - value}
  return hook
