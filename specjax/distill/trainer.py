"""DistillSpec / pretraining trainer: one pure `train_step`, jitted with shardings over the mesh.

The same step serves distillation (a teacher and a divergence loss) and pretraining/fine-tuning
(no teacher, the NLL loss). Data per step follows Alg. A.2 (`distill.data`). Params and optimizer
state are placed by `specjax.sharding`'s rules table; batches are split over 'data' and, on a pod,
each host feeds only its rows. Checkpoints (Orbax) make a killed run resume exactly.

Progress goes to the log from the first second: the state's initialisation, each compilation of
the update step (ahead of time, once per batch shape) and each first generation (which compiles the
sampler), with their times. Every step is timed by phase (data, on-policy generation, update;
each phase waits for its device work, so the split is real time), and each logged record carries
the window's tokens/s, per-phase seconds and MFU (`throughput`). The first step is always logged.
On a cold start the update step compiles in a background thread while the first on-policy batch
is generated (and the sampler compiled).

A step whose loss, gradient norm or params are not finite raises `TrainingDivergedError` before
anything of it is saved; Ctrl-C ends the current step, checkpoints it and raises
`TrainingInterrupted`; a resumed run marks metrics.jsonl and drops the records of the steps it
is about to train again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import signal
import threading
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
from specjax.data.cache import atomic_write_bytes
from specjax.distill import data as data_lib
from specjax.distill import losses as losses_lib
from specjax.distill import throughput
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
  eval_at_start: bool = False       # also evaluate before the first step (the draft as given)
  eval_prompts: int = 8             # held-out prompts of the speculative-decoding eval
  mesh_data: int = -1
  mesh_model: int = 1
  progress: bool = True

  def __post_init__(self):
    if self.steps < 0:
      raise ValueError(f"steps must be >= 0, got {self.steps}")
    for name in ("batch_size", "log_every", "eval_prompts"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    for name in ("warmup_steps", "eval_every", "learning_rate"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
    if not math.isfinite(self.learning_rate):
      raise ValueError(f"learning_rate must be a finite number, got {self.learning_rate}")
    for name in ("checkpoint_every", "keep_checkpoints"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


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
             "grad_norm": optax.tree.norm(grads), PARAMS_FINITE: all_finite(params)}
  if teacher_logits is not None:
    tvd = jnp.mean(losses_lib.tvd(student_logits, teacher_logits, mask))
    metrics.update(tvd=tvd, accept=1.0 - tvd)
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
  return new_state, metrics


PARAMS_FINITE = "params_finite"      # a check of the step, not a logged metric


def all_finite(tree) -> jax.Array:
  """[] bool: every element of every leaf is finite."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]))


def non_finite_quantity(metrics: dict) -> str | None:
  """What of a step's results is nan or inf ('loss', 'gradient norm', 'params'), or None."""
  if not math.isfinite(float(metrics["loss"])):
    return "loss"
  if not math.isfinite(float(metrics["grad_norm"])):
    return "gradient norm"
  if not bool(metrics[PARAMS_FINITE]):
    return "params"
  return None


class TrainingDivergedError(ValueError):
  """A step's loss, gradients or params became non-finite. Nothing of that step was saved: the
  workdir's checkpoints are the good ones from before (`last_good`: the latest one's step)."""

  def __init__(self, step: int, quantity: str, workdir: Path, last_good: int | None):
    self.step, self.quantity, self.workdir, self.last_good = step, quantity, workdir, last_good
    kept = (f"the last good checkpoint (step {last_good}) is kept in {workdir / 'checkpoints'}"
            if last_good is not None else "no checkpoint was saved")
    super().__init__(f"training diverged at step {step}: the {quantity} is not finite (nan or "
                     f"inf); nothing of step {step} was saved and {kept}")


class TrainingInterrupted(KeyboardInterrupt):
  """Ctrl-C: the loop stopped after `step` and saved a checkpoint of it in `workdir`."""

  def __init__(self, step: int, workdir: Path):
    self.step, self.workdir = step, workdir
    super().__init__(f"interrupted: a checkpoint of step {step} is saved in {workdir}; run the "
                     f"same command again to resume from it")


class StopRequest:
  """Ctrl-C while `installed`: the first SIGINT asks the loop to stop after the current step
  (which then saves a checkpoint); a second one interrupts at once, as Python would. Installed
  only in the main thread (the only one that receives signals)."""

  def __init__(self):
    self.requested = False

  @contextlib.contextmanager
  def installed(self):
    if threading.current_thread() is not threading.main_thread():
      yield self
      return
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, self._handle)
    try:
      yield self
    finally:
      signal.signal(signal.SIGINT, previous)

  def _handle(self, signum, frame) -> None:
    if self.requested:
      raise KeyboardInterrupt
    self.requested = True
    log.warning("interrupted: stopping after this step and saving a checkpoint (Ctrl-C again to "
                "stop at once, without saving)")


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
    self._append(record)
    self.show(record)

  def resume(self, step: int) -> None:
    """A run resuming from the checkpoint of `step`: the records of later steps (logged before
    the previous run stopped, and about to be trained again) and any half-written last line are
    dropped, and {"event": "resume", "step": step} marks the place."""
    if not self.active:
      return
    kept = []
    if self.path.exists():
      for line in self.path.read_text().splitlines():
        try:
          record = json.loads(line)
        except json.JSONDecodeError:          # the last line of a killed run
          continue
        if record.get("step", 0) <= step:
          kept.append(line + "\n")
    atomic_write_bytes(self.path, "".join(kept).encode())
    self._append({"event": "resume", "step": int(step)})

  def _append(self, record: dict) -> None:
    with self.path.open("a") as f:            # one short line per append: written whole
      f.write(json.dumps(record, allow_nan=False) + "\n")


FIRST_FIELDS = ("step", "loss", "source")


def format_record(record: dict) -> str:
  """One console line: step, loss and source first, then the rest in the record's order."""
  keys = [k for k in FIRST_FIELDS if k in record] + [k for k in record if k not in FIRST_FIELDS]
  return " ".join(f"{k}={record[k]:.4g}" if isinstance(record[k], float) else f"{k}={record[k]}"
                  for k in keys)


def count_text(n: float) -> str:
  """12345678 -> '12.3M' (parameter counts in log lines)."""
  for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
    if n >= scale:
      return f"{n / scale:.3g}{unit}"
  return f"{n:.0f}"


def _scalar(v):
  """A JSON value: strings kept, ints and bools plain, floats plain or None when not finite
  (strict JSON has no NaN)."""
  if isinstance(v, str):
    return v
  v = np.asarray(v)
  if v.dtype.kind in "iub":
    return v.item()
  return float(v) if np.isfinite(v) else None


class PhaseClock:
  """Seconds per phase of one step; `with clock("update"): ...` adds the block's wall time."""

  def __init__(self):
    self.seconds: dict[str, float] = {}

  @contextlib.contextmanager
  def __call__(self, phase: str):
    started = time.perf_counter()
    try:
      yield
    finally:
      self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started


def batch_shape(batch) -> tuple[int, int, int]:
  """(rows, prompt width, target width) of a batch."""
  rows, width = batch.targets.shape
  return rows, batch.prompt.tokens.shape[1], width


def _shape_key(tree) -> tuple:
  return tuple((x.shape, str(x.dtype)) for x in jax.tree_util.tree_leaves(tree))


@dataclasses.dataclass
class Trainer:
  """Owns the mesh, the compiled step and the loop. `teacher=None` means pretraining (NLL)."""
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
  tick: Callable[[dict], None] | None = None   # every step: step, total, loss, step_s

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
    self.steps_run = 0                 # steps trained by the last `run`
    self._updates: dict[tuple, Any] = {}
    self._sampled: set[tuple] = set()
    self._evaluated = False

  # -- placement -------------------------------------------------------------------------------
  def state_shardings(self, state: TrainState):
    p_sh = sharding.param_shardings(state.params, self.mesh)
    o_sh = sharding.opt_state_shardings(state.opt_state, state.params, self.mesh)
    rep = sharding.replicated(self.mesh)
    return TrainState(step=rep, params=p_sh, opt_state=o_sh, rng=rep)

  def _build_state(self, params) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=self.optimizer.init(params), rng=jax.random.PRNGKey(self.cfg.seed))

  def init_state(self, params) -> TrainState:
    """Fresh state from the student's initial params, placed on the mesh."""
    started = time.perf_counter()
    out_sh = self.state_shardings(jax.eval_shape(self._build_state, params))
    params = jax.device_put(params, sharding.param_shardings(params, self.mesh))
    state = jax.block_until_ready(jax.jit(self._build_state, out_shardings=out_sh)(params))
    log.info("initialised the training state (%s optimizer) in %.1fs", self.cfg.optimizer,
             time.perf_counter() - started)
    return state

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

  def place_params(self, params):
    return None if params is None else jax.device_put(
        params, sharding.param_shardings(params, self.mesh))

  def compiled_step(self, state: TrainState, batch, teacher_params):
    """`train_step` jitted with the mesh's shardings (the state is donated)."""
    fn = functools.partial(train_step, student=self.student, teacher=self.teacher, loss=self.loss,
                           optimizer=self.optimizer, schedule=self.schedule)
    state_sh = self.state_shardings(state)
    batch_sh = jax.tree_util.tree_map(lambda _: sharding.batch_sharding(self.mesh), batch)
    teacher_sh = (None if teacher_params is None
                  else sharding.param_shardings(teacher_params, self.mesh))
    return jax.jit(fn, in_shardings=(state_sh, batch_sh, teacher_sh),
                   out_shardings=(state_sh, sharding.replicated(self.mesh)), donate_argnums=0)

  def update_for(self, state: TrainState, batch, teacher_params):
    """The update step compiled for this batch's shapes: compiled ahead of time (and logged) the
    first time a shape is seen, so step timings never include compilation. A compilation started
    by `compile_ahead` is waited for."""
    key = _shape_key(batch)
    if key not in self._updates:
      self._updates[key] = self._compile_update(*_abstract_tree((state, batch, teacher_params)))
    if isinstance(self._updates[key], Background):
      self._updates[key] = self._updates[key].result()
    return self._updates[key]

  def compile_ahead(self, state: TrainState, batch, teacher_params) -> None:
    """Start compiling the update step for this batch's shapes in a background thread (XLA
    compiles without holding the GIL), so that it overlaps the step's on-policy generation, which
    compiles and runs the sampler: on a cold start the two compilations are the largest part of
    the time to the first step. Sampled batches keep the dataset batch's shapes."""
    key = _shape_key(batch)
    if key not in self._updates:
      args = _abstract_tree((state, batch, teacher_params))   # shapes only: no buffer shared
      self._updates[key] = Background(self._compile_update, *args)

  def _compile_update(self, state, batch, teacher_params):
    started = time.perf_counter()
    rows, prompt, target = batch_shape(batch)
    log.info("compiling the update step for %d rows x (%d prompt + %d target) tokens ...", rows,
             prompt, target)
    jitted = self.compiled_step(state, batch, teacher_params)
    compiled = jitted.lower(state, batch, teacher_params).compile()
    log.info("compiled the update step in %.1fs", time.perf_counter() - started)
    return compiled

  # -- one step --------------------------------------------------------------------------------
  def sampled_batch(self, step: int, batch, state: TrainState, teacher_params):
    """Alg. A.2's batch for `step` (dataset, student or teacher outputs), waited for; the first
    generation of each model and shape (which compiles the sampler) is logged with its time."""
    source = self.mixture.source(step)
    first = source != data_lib.FIXED and (source, _shape_key(batch)) not in self._sampled
    started = time.perf_counter()
    if first:
      rows, _, target = batch_shape(batch)
      log.info("first %s-sampled batch: generating %d x %d tokens (compiles the sampler) ...",
               source, rows, target)
      self._sampled.add((source, _shape_key(batch)))
    key = jax.random.fold_in(state.rng, step)
    batch, source = data_lib.mixed_batch(self.mixture, self.sampler, step, batch, state.params,
                                         teacher_params, key)
    jax.block_until_ready(batch)
    if first:
      log.info("first %s-sampled batch ready in %.1fs", source, time.perf_counter() - started)
    return batch, source

  def one_step(self, step: int, state: TrainState, teacher_params):
    """Data -> generation -> update for `step`, each phase timed to its end on the device.
    Returns (state, metrics, the batch's source, seconds per phase, (rows, prompt, target))."""
    clock = PhaseClock()
    with clock("data"):
      batch = jax.block_until_ready(self.place_batch(self.source.batch(step)))
    if self.mixture.source(step) != data_lib.FIXED:
      self.compile_ahead(state, batch, teacher_params)
    with clock("generate"):
      batch, source = self.sampled_batch(step, batch, state, teacher_params)
    update = self.update_for(state, batch, teacher_params)
    with clock("update"):
      state, metrics = update(state, batch, teacher_params)
      jax.block_until_ready(metrics)
    return state, metrics, source, clock.seconds, batch_shape(batch)

  # -- the loop --------------------------------------------------------------------------------
  def abstract_state(self, params) -> TrainState:
    abstract = jax.eval_shape(self._build_state, params)
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
    """Train from the workdir's latest checkpoint (or from `student_params`) to cfg.steps. A
    checkpoint already at or past cfg.steps leaves everything as it is (`steps_run` == 0)."""
    cfg = self.cfg
    self.steps_run = 0
    signature = ckpt_lib.ModelSignature.of(student_params, self.model_desc)
    ckpt = ckpt_lib.Checkpointer(self.workdir, signature, every=cfg.checkpoint_every,
                                 keep=cfg.keep_checkpoints, async_save=cfg.async_checkpoint)
    try:
      state = self.resume_or_init(ckpt, student_params)
      if int(state.step) >= cfg.steps:
        self._nothing_to_do(ckpt, int(state.step))
        return state
      flops = throughput.FlopModel(
          throughput.ParamCount.of(student_params),
          None if teacher_params is None else throughput.ParamCount.of(teacher_params))
      self._announce(state, flops)
      with StopRequest().installed() as stop:
        state = self._loop(state, ckpt, self.place_params(teacher_params), flops, on_step, stop)
      if ckpt.latest_step() != cfg.steps:
        ckpt.save(cfg.steps, _as_dict(state), self._meta(cfg.steps), force=True)
    finally:
      ckpt.close()
    return state

  def _nothing_to_do(self, ckpt: ckpt_lib.Checkpointer, step: int) -> None:
    if ckpt.latest_step() is None:
      log.info("nothing to do: steps is %d", self.cfg.steps)
    else:
      log.info("nothing to do: the checkpoint in %s is at step %d and steps is %d (raise steps "
               "to train further)", self.workdir, step, self.cfg.steps)

  def _meta(self, step: int) -> dict:
    return {"model": self.model_desc, "config": dataclasses.asdict(self.cfg), "data_step": step}

  def _announce(self, state: TrainState, flops: throughput.FlopModel) -> None:
    cfg = self.cfg
    teacher = f", teacher {count_text(flops.teacher.total)} params" if flops.teacher else ""
    log.info("training steps %d..%d: student %s params%s, batch %d, loss %s, mixture "
             "lambda1=%g lambda2=%g, on %d x %s", int(state.step) + 1, cfg.steps,
             count_text(flops.student.total), teacher, cfg.batch_size, cfg.loss, cfg.lambda1,
             cfg.lambda2, self.mesh.devices.size, jax.devices()[0].device_kind)

  def _loop(self, state: TrainState, ckpt, teacher_params, flops, on_step,
            stop: StopRequest) -> TrainState:
    """Steps first+1..cfg.steps, each logged, checkpointed and checked: a non-finite step raises
    TrainingDivergedError before anything of it is saved; after a Ctrl-C the step in progress
    ends, is checkpointed, and TrainingInterrupted is raised."""
    cfg, first = self.cfg, int(state.step)
    metrics_log = MetricsLog(self.workdir, self.show)
    if first > 0:
      metrics_log.resume(first)
    window = throughput.Window(self.mesh.devices.size,
                               throughput.peak_flops(jax.devices()[0].device_kind))
    if first == 0 and cfg.eval_at_start and self.eval_fn is not None:
      metrics_log.write(0, {**self._run_eval(0, state), "event": "before training"})
    for step in range(first, cfg.steps):
      state, metrics, source, seconds, shape = self.one_step(step, state, teacher_params)
      done = step + 1
      self._check_finite(done, metrics, source, ckpt, metrics_log)
      sampled_by = None if source == data_lib.FIXED else source
      window.add(int(metrics["tokens"]), flops.step_flops(*shape, sampled_by), seconds)
      self.steps_run += 1
      extra = self._evaluate(done, state)
      if done == first + 1 or done % cfg.log_every == 0 or done == cfg.steps or extra:
        metrics_log.write(done, {**metrics, **extra, "source": source, **window.summary()})
      if self.tick is not None:
        self.tick({"step": done, "total": cfg.steps, "loss": float(metrics["loss"]),
                   "step_s": sum(seconds.values()), "tokens": int(metrics["tokens"])})
      saved = ckpt.save(done, _as_dict(state), self._meta(done))
      if on_step is not None:
        on_step(done, state)
      if stop.requested and done < cfg.steps:
        if not saved:
          ckpt.save(done, _as_dict(state), self._meta(done), force=True)
        raise TrainingInterrupted(done, self.workdir)
    return state

  def _check_finite(self, done: int, metrics: dict, source: str, ckpt, metrics_log) -> None:
    """Raise TrainingDivergedError (the step's record marked in metrics.jsonl) when the step's
    loss, gradients or params are not finite."""
    quantity = non_finite_quantity(metrics)
    metrics.pop(PARAMS_FINITE)
    if quantity is None:
      return
    metrics_log.write(done, {**metrics, "source": source, "event": "diverged",
                             "non_finite": quantity})
    raise TrainingDivergedError(done, quantity, self.workdir, ckpt.latest_step())

  def _evaluate(self, done: int, state: TrainState) -> dict:
    """The eval hook's metrics after `done` steps when it is due (every eval_every steps)."""
    if not (self.eval_fn and self.cfg.eval_every and done % self.cfg.eval_every == 0):
      return {}
    return self._run_eval(done, state)

  def _run_eval(self, done: int, state: TrainState) -> dict:
    started = time.perf_counter()
    extra = self.eval_fn(done, state)
    first = " (the first evaluation compiles it)" if not self._evaluated else ""
    self._evaluated = True
    log.info("evaluated at step %d in %.1fs%s", done, time.perf_counter() - started, first)
    return extra


class Background:
  """fn(*args) in a daemon thread (an interrupted process does not wait for it); `result()`
  waits and returns its value or raises its exception."""

  def __init__(self, fn, *args):
    self._value = self._error = None
    self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
    self._thread.start()

  def _run(self, fn, args) -> None:
    try:
      self._value = fn(*args)
    except BaseException as err:              # re-raised in the caller's thread
      self._error = err

  def result(self):
    self._thread.join()
    if self._error is not None:
      raise self._error
    return self._value


def _abstract_tree(tree):
  """Every array as a ShapeDtypeStruct with its sharding (what lowering needs)."""
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
      tree)


def _as_dict(state: TrainState) -> dict:
  return {"step": state.step, "params": state.params, "opt_state": state.opt_state,
          "rng": state.rng}
