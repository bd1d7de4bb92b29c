"""DistillSpec / pretraining loop: the pure step (`distill.step`) jitted with shardings over the
mesh, driven step by step with checkpoints, records, evals and Ctrl-C.

The same step serves distillation (a teacher and a divergence loss) and pretraining/fine-tuning
(no teacher, the NLL loss). Data per step follows Alg. A.2 (`distill.data`). Params and optimizer
state are placed by `specjax.sharding`'s rules table; batches are split over 'data' and, on a pod,
each host feeds only its rows. Checkpoints (Orbax) make a killed run resume exactly.

Steps are dispatched without waiting for the device: the host reads it only where it must, at a
record (the first step, every log_every steps, evals, the last step) and before a checkpoint. There
the state's divergence record (`step.TrainState.bad_step`) is read: a step whose loss, gradient
norm or params were not finite raises `TrainingDivergedError` naming that step, and nothing from
it on is saved. A record's metrics are those of its step; its tokens/s and seconds per step are
measured over the steps since the last record (`metrics_log.Interval`), and the step before a record
waits for each phase (data, on-policy generation, update), so its phase split is real time.

Progress goes to the log from the first second: the state's initialisation, each compilation of
the update step (ahead of time, once per batch shape) and each first generation (which compiles the
sampler), with their times. On a cold start the update step compiles in a background thread while
the first on-policy batch is generated (and the sampler compiled). Ctrl-C ends the current step,
checkpoints it and raises `TrainingInterrupted`; a resumed run marks metrics.jsonl and drops the
records of the steps it is about to train again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import checkpoint as ckpt_lib
from specjax import sharding
from specjax.distill import data as data_lib
from specjax.distill import features as features_lib
from specjax.distill import head as head_lib
from specjax.distill import losses as losses_lib
from specjax.distill import step as step_lib
from specjax.distill import throughput
from specjax.distill.metrics_log import Interval, MetricsLog, count_text
from specjax.distill.step import TrainState

log = logging.getLogger(__name__)

Evaluate = Callable[[int, Any], dict]     # (steps done, student params) -> scalars to record


STUDENTS = ("draft", "head")


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
  student: str = "draft"            # draft (a model) | head (an EAGLE-style head on the teacher)
  cache_batches: int = 0            # head: the teacher's outputs over the first N batches cached
                                    # once (distill/features.py), step s trains on batch s mod N;
                                    # 0: the teacher's pass in every step
  cache_top_k: int = 64             # the teacher's top-k log-probs a cache keeps (the rest lumped)
  cache_dir: str = ""               # "" -> WORKDIR/teacher_cache; shared by runs of a sweep
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
    if self.steps < 1:
      raise ValueError(f"steps must be >= 1, got {self.steps} (0 steps would export the "
                       "untrained initial params as the run's result)")
    for name in ("batch_size", "log_every", "eval_prompts"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if not 0 <= self.seed < 2**32:
      raise ValueError(f"seed must be a whole number in [0, {2**32 - 1}], got {self.seed}")
    for name in ("warmup_steps", "decay_start", "eval_every", "learning_rate"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
    if not math.isfinite(self.learning_rate):
      raise ValueError(f"learning_rate must be a finite number, got {self.learning_rate}")
    for name in ("lambda1", "lambda2"):                   # named by the flag that sets them
      if not 0.0 <= getattr(self, name) <= 1.0:
        raise ValueError(f"{name} must be in [0, 1] (a share of the steps), got "
                         f"{getattr(self, name)}")
    if not 0.0 <= self.final_lr_ratio <= 1.0:             # nan fails too
      raise ValueError(f"final_lr_ratio must be in [0, 1] (the last learning rate over the "
                       f"peak), got {self.final_lr_ratio}")
    if self.student not in STUDENTS:
      raise ValueError(f"student must be one of {', '.join(STUDENTS)}, got {self.student!r}")
    if self.student == "head" and self.lambda1 < 1.0 and self.lambda2 > 0.0:
      raise ValueError(f"student 'head' drafts from the teacher's features and cannot sample "
                       f"outputs of its own (lambda1 {self.lambda1}, lambda2 {self.lambda2}): "
                       f"set lambda2=0 (teacher outputs) or lambda1=1 (the dataset), or a "
                       f"recipe that does (seqkd, supkd)")
    for name in ("checkpoint_every", "keep_checkpoints"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.cache_batches < 0 or self.cache_top_k < 1:
      raise ValueError(f"cache_batches must be >= 0 and cache_top_k >= 1, got "
                       f"{self.cache_batches} and {self.cache_top_k}")
    if self.cache_batches and self.student != "head":
      raise ValueError(f"cache_batches={self.cache_batches} caches a teacher's features for a "
                       f"draft head (student 'head'); a draft model (student "
                       f"{self.student!r}) trains on its own samples: set cache_batches=0")


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


class TrainingAbandoned(KeyboardInterrupt):
  """A second Ctrl-C: the loop stopped at once, the step in progress unsaved; `last`: the
  latest whole checkpoint's step (None: none), which a rerun resumes from."""

  def __init__(self, last: int | None, workdir: Path):
    self.last, self.workdir = last, workdir
    then = (f"a rerun resumes from step {last}, the latest whole checkpoint in {workdir}"
            if last is not None else f"no whole checkpoint is in {workdir}: a rerun starts over")
    super().__init__(f"stopped at once, without waiting for a save in progress: {then}")


class StopRequest:
  """Ctrl-C or SIGTERM (what schedulers and preemption send) while `installed`: the first asks
  the loop to stop after the current step (which then saves a checkpoint); a second one
  interrupts at once, as Python would. Installed only in the main thread (the only one that
  receives signals)."""

  def __init__(self):
    self.requested = False

  @contextlib.contextmanager
  def installed(self):
    if threading.current_thread() is not threading.main_thread():
      yield self
      return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
      signal.signal(sig, self._handle)
    try:
      yield self
    finally:
      for sig, handler in previous.items():
        signal.signal(sig, handler)

  def _handle(self, signum, frame) -> None:
    if self.requested:
      raise KeyboardInterrupt
    self.requested = True
    log.warning("interrupted (%s): stopping after this step and saving a checkpoint (again to "
                "stop at once, without saving)", signal.Signals(signum).name)


def check_vocab(student, teacher) -> None:
  if teacher is not None and student.vocab_size != teacher.vocab_size:
    raise ValueError(
        f"teacher vocab {teacher.vocab_size} != student vocab {student.vocab_size}: token-level "
        f"distillation compares distributions over the same ids. Use a draft with the target's "
        f"tokenizer (same vocab_size), or the cross-vocabulary rules for decoding only.")


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


class EvalSchedule:
  """When `evaluate(step, params)` runs (every `every` steps; before the first step too with
  `at_start`), each run logged with its time. `evaluate` None: never."""

  def __init__(self, evaluate: Evaluate | None, every: int, at_start: bool):
    self.evaluate, self.every, self.at_start = evaluate, every, at_start
    self._evaluated = False

  def due(self, done: int) -> bool:
    return self.evaluate is not None and self.every > 0 and done % self.every == 0

  def before_training(self) -> bool:
    return self.evaluate is not None and self.at_start

  def __call__(self, done: int, params) -> dict:
    started = time.perf_counter()
    extra = self.evaluate(done, params)
    first = " (the first evaluation compiles it)" if not self._evaluated else ""
    self._evaluated = True
    log.info("evaluated at step %d in %.1fs%s", done, time.perf_counter() - started, first)
    return extra


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
  mesh: Any = None
  show: Callable[[dict], None] | None = None   # each logged record (default: the log)
  tick: Callable[[dict], None] | None = None   # every step: step, total; at records also loss,
                                               # step_s (the interval's mean), tokens

  def __post_init__(self):
    cfg = self.cfg
    check_vocab(self.student, self.teacher)
    self.workdir = Path(self.workdir)
    self.mesh = self.mesh or sharding.make_mesh(cfg.mesh_data, cfg.mesh_model)
    sharding.check_batch(cfg.batch_size, self.mesh)
    self.loss = losses_lib.get(cfg.loss, cfg.beta if cfg.loss == "jsd" else None)
    if self.loss.needs_teacher and self.teacher is None:
      raise ValueError(f"loss '{cfg.loss}' needs a teacher; pretraining uses loss=nll")
    self.optimizer, self.schedule = step_lib.make_optimizer(cfg)
    self.mixture = data_lib.Mixture(cfg.lambda1, cfg.lambda2, cfg.temperature, cfg.seed)
    self.sampler = (data_lib.Sampler(self.student, self.teacher, self.eos_id, cfg.temperature,
                                     self.pad_id) if self.mixture.needs_generation else None)
    self.steps_run = 0                 # steps trained by the last `run`
    self.records_at: Callable[[int], bool] = lambda done: True   # set by the loop
    self._updates: dict[tuple, Any] = {}
    self._sampled: set[tuple] = set()

  # -- placement -------------------------------------------------------------------------------
  def state_shardings(self, state: TrainState):
    p_sh = sharding.param_shardings(state.params, self.mesh)
    o_sh = sharding.opt_state_shardings(state.opt_state, state.params, self.mesh)
    rep = sharding.replicated(self.mesh)
    return TrainState(step=rep, params=p_sh, opt_state=o_sh, rng=rep, bad_step=rep,
                      bad_quantity=rep)

  def _build_state(self, params) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=self.optimizer.init(params), rng=jax.random.PRNGKey(self.cfg.seed),
                      **step_lib.healthy())

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
    fn = functools.partial(step_lib.train_step, student=self.student, teacher=self.teacher, loss=self.loss,
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
  def sampled_batch(self, step: int, batch, state: TrainState, teacher_params, wait=None):
    """Alg. A.2's batch for `step` (dataset, student or teacher outputs), passed through `wait`;
    the first generation of each model and shape (which compiles the sampler) is waited for and
    logged with its time."""
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
    if first:
      jax.block_until_ready(batch)
      log.info("first %s-sampled batch ready in %.1fs", source, time.perf_counter() - started)
    return (wait or _dispatched)(batch), source

  def one_step(self, step: int, state: TrainState, teacher_params):
    """Data -> generation -> update for `step`, dispatched. The step before a record
    (`records_at`) first waits for the device's backlog ('backlog' seconds), then for each phase,
    so that its split is real time. Returns (state, metrics as device arrays, the batch's source,
    seconds per phase, (rows, prompt, target))."""
    synced = self.records_at(step + 1)
    wait = jax.block_until_ready if synced else _dispatched
    clock = PhaseClock()
    if synced:
      with clock("backlog"):
        jax.block_until_ready(state)
    with clock("data"):
      batch = wait(self.place_batch(self.source.batch(step)))
    if self.mixture.source(step) != data_lib.FIXED:
      self.compile_ahead(state, batch, teacher_params)
    with clock("generate"):
      batch, source = self.sampled_batch(step, batch, state, teacher_params, wait)
    update = self.update_for(state, batch, teacher_params)
    with clock("update"):
      state, metrics = wait(update(state, batch, teacher_params))
    return state, metrics, source, clock.seconds, batch_shape(batch)

  # -- the loop --------------------------------------------------------------------------------
  def abstract_state(self, params) -> TrainState:
    abstract = jax.eval_shape(self._build_state, params)
    return jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract, self.state_shardings(abstract))

  def resume_or_init(self, ckpt: ckpt_lib.Checkpointer, params) -> TrainState:
    """The latest checkpoint of this workdir if any (a run resumes by default), else fresh. Only
    checked states are saved, so a restored one starts with no divergence recorded."""
    restored = ckpt.restore(_as_dict(self.abstract_state(params)))
    if restored is None:
      return self.init_state(params)
    state, meta = restored
    if jax.process_index() == 0:
      log.info("resuming from %s at step %d", ckpt.workdir, meta["step"])
    healthy = jax.device_put(step_lib.healthy(), sharding.replicated(self.mesh))
    return TrainState(**state, **healthy)

  def run(self, student_params, teacher_params=None,
          on_step: Callable[[int, TrainState], None] | None = None,
          evaluate: Evaluate | None = None) -> TrainState:
    """Train from the workdir's latest checkpoint (or from `student_params`) to cfg.steps. A
    checkpoint already at or past cfg.steps leaves everything as it is (`steps_run` == 0).
    evaluate(step, params) -> dict: recorded every cfg.eval_every steps (and before the first
    step with cfg.eval_at_start). on_step(step, state): after each step (the state may not be
    computed yet; reading it waits)."""
    cfg = self.cfg
    self.steps_run = 0
    signature = ckpt_lib.ModelSignature.of(student_params, self.model_desc)
    ckpt = ckpt_lib.Checkpointer(self.workdir, signature, every=cfg.checkpoint_every,
                                 keep=cfg.keep_checkpoints, async_save=cfg.async_checkpoint)
    closed = False
    try:
      state = self.resume_or_init(ckpt, student_params)
      first = int(jax.device_get(state.step))
      if first >= cfg.steps:
        self._nothing_to_do(ckpt, first)
        return state
      placed_teacher = self.place_params(teacher_params)
      if cfg.cache_batches:
        self.use_cache(state, placed_teacher)
      flops = throughput.FlopModel(     # a cached teacher's pass is not part of a step
          throughput.ParamCount.of(student_params),
          None if teacher_params is None or cfg.cache_batches
          else throughput.ParamCount.of(teacher_params))
      self._announce(first, flops)
      evals = EvalSchedule(evaluate, cfg.eval_every, cfg.eval_at_start)
      with StopRequest().installed() as stop:
        state = self._loop(state, first, ckpt, placed_teacher, flops, on_step, stop, evals)
    except KeyboardInterrupt as err:
      if isinstance(err, TrainingInterrupted):        # its checkpoint is whole: close as usual
        raise
      closed = True                                   # a second Ctrl-C: no wait on a save
      raise TrainingAbandoned(ckpt.abandon(), self.workdir) from None
    finally:
      if not closed:
        ckpt.close()
    return state

  def use_cache(self, state: TrainState, teacher_params) -> features_lib.FeatureCache:
    """Train on the teacher cache (distill/features.py) from now on: its missing batches are
    computed first (each as the mixture gives it at its step, then the teacher's pass), with
    progress logged; then the source is the cache and the mixture takes its batches as they
    are. Returns the cache."""
    cfg = self.cfg
    if jax.process_count() > 1:
      raise ValueError("a teacher cache is written by one process: run cache_batches > 0 on one "
                       "host, or set cache_batches=0 on a multi-host run")
    path = Path(cfg.cache_dir) if cfg.cache_dir else self.workdir / "teacher_cache"
    cache = features_lib.FeatureCache(path, self.cache_key(teacher_params), cfg.cache_batches)
    todo = cache.open().missing()
    log.info("teacher cache %s: %d of %d batches there, computing %d (top %d log-probs and the "
             "features of each position)", path, cfg.cache_batches - len(todo), cfg.cache_batches,
             len(todo), cfg.cache_top_k)
    outputs = jax.jit(functools.partial(head_lib.teacher_outputs, self.teacher,
                                        top_k=cfg.cache_top_k))
    started = last = time.perf_counter()
    for n, i in enumerate(todo, 1):
      batch, _ = self.sampled_batch(i, self.place_batch(self.source.batch(i)), state,
                                    teacher_params)
      cache.write(i, batch.replace(teacher=outputs(teacher_params, batch)))
      if n == 1 or n == len(todo) or time.perf_counter() - last > 30:
        last = time.perf_counter()
        log.info("teacher cache: %d / %d batches in %.1fs%s", n, len(todo), last - started,
                 " (the first compiles the teacher's pass)" if n == 1 else "")
    self.source = cache
    self.mixture = data_lib.Mixture(1.0, 0.0, cfg.temperature, cfg.seed)   # the cached batches
    return cache

  def cache_key(self, teacher_params) -> dict:
    """What a teacher cache depends on: the teacher, its params, the data and the mixture."""
    cfg = self.cfg
    first = self.source.batch(0)
    return {"teacher": repr(self.teacher), "teacher_params": features_lib.fingerprint(teacher_params),
            "data": features_lib.fingerprint((first.prompt, first.targets, first.mask)),
            "batch": list(batch_shape(first)), "top_k": cfg.cache_top_k,
            "mixture": [cfg.lambda1, cfg.lambda2, cfg.temperature, cfg.seed]}

  def _nothing_to_do(self, ckpt: ckpt_lib.Checkpointer, step: int) -> None:
    if ckpt.latest_step() is None:
      log.info("nothing to do: steps is %d", self.cfg.steps)
    else:
      log.info("nothing to do: the checkpoint in %s is at step %d and steps is %d (raise steps "
               "to train further)", self.workdir, step, self.cfg.steps)

  def _meta(self, step: int) -> dict:
    return {"model": self.model_desc, "config": dataclasses.asdict(self.cfg), "data_step": step}

  def _announce(self, first: int, flops: throughput.FlopModel) -> None:
    cfg = self.cfg
    teacher = f", teacher {count_text(flops.teacher.total)} params" if flops.teacher else ""
    log.info("training steps %d..%d: student %s params%s, batch %d, loss %s, mixture "
             "lambda1=%g lambda2=%g, on %d x %s", first + 1, cfg.steps,
             count_text(flops.student.total), teacher, cfg.batch_size, cfg.loss, cfg.lambda1,
             cfg.lambda2, self.mesh.devices.size, jax.devices()[0].device_kind)

  def _loop(self, state: TrainState, first: int, ckpt, teacher_params, flops, on_step,
            stop: StopRequest, evals: EvalSchedule) -> TrainState:
    """Steps first+1..cfg.steps, then the last one saved. The host reads the device at records
    and before saves only (`_check`: a divergence raises TrainingDivergedError there, before
    anything of it is saved); after a Ctrl-C the step in progress ends, is checkpointed, and
    TrainingInterrupted is raised."""
    cfg = self.cfg
    metrics_log = MetricsLog(self.workdir, self.show)
    metrics_log.resume(first)
    interval = Interval(throughput.Window(self.mesh.devices.size,
                                          throughput.peak_flops(jax.devices()[0].device_kind)),
                        flops)
    check = functools.partial(self._check, ckpt=ckpt, interval=interval, metrics_log=metrics_log)
    self.records_at = lambda done: (done == first + 1 or done % cfg.log_every == 0
                                    or done == cfg.steps or evals.due(done))
    if first == 0 and evals.before_training():
      metrics_log.write(0, {**evals(0, state.params), "event": "before training"})
    for step in range(first, cfg.steps):
      done = step + 1
      state, metrics, source, seconds, shape = self.one_step(step, state, teacher_params)
      interval.add(done, metrics, source, shape, seconds, split=self.records_at(done))
      self.steps_run += 1
      progress = {}
      if self.records_at(done):
        check(state)
        extra = evals(done, state.params) if evals.due(done) else {}
        values, rates = interval.record()
        metrics_log.write(done, {**values, **extra, "source": source, **rates})
        progress = {"loss": float(values["loss"]), "step_s": rates["step_s"],
                    "tokens": int(values["tokens"])}
      if self.tick is not None:
        self.tick({"step": done, "total": cfg.steps, **progress})
      saved = self._save(ckpt, done, state, check)
      if on_step is not None:
        on_step(done, state)
      if stop.requested and done < cfg.steps:
        if not saved:
          self._save(ckpt, done, state, check, force=True)
        ckpt.wait()             # whole before the run says so (a second Ctrl-C here abandons it)
        raise TrainingInterrupted(done, self.workdir)
    if ckpt.latest_step() != cfg.steps:
      self._save(ckpt, cfg.steps, state, check, force=True)
    return state

  def _save(self, ckpt, done: int, state: TrainState, check, force: bool = False) -> bool:
    """Checkpoint `state` after `done` steps when due (or `force`), checked first."""
    if not (force or ckpt.manager.should_save(done)):
      return False
    check(state)
    return ckpt.save(done, _as_dict(state), self._meta(done), force=force)

  def _check(self, state: TrainState, ckpt, interval: Interval, metrics_log: MetricsLog) -> None:
    """Wait for `state` and raise TrainingDivergedError when a step up to it was not finite (the
    first such step named, its record marked in metrics.jsonl). The wait counts as the
    interval's time: it is the device finishing the steps dispatched before it."""
    started = time.perf_counter()
    bad, code = (int(x) for x in jax.device_get((state.bad_step, state.bad_quantity)))
    interval.wait(time.perf_counter() - started)
    if not bad:
      return
    quantity = step_lib.QUANTITIES[code]
    metrics_log.write(bad, {**interval.metrics_of(bad), "event": "diverged",
                            "non_finite": quantity})
    raise TrainingDivergedError(bad, quantity, self.workdir, ckpt.latest_step())


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


def _dispatched(tree):
  """No wait: the host goes on while the device computes `tree`."""
  return tree


def _as_dict(state: TrainState) -> dict:
  """What a checkpoint holds (the divergence record is not saved: only checked states are)."""
  return {"step": state.step, "params": state.params, "opt_state": state.opt_state,
          "rng": state.rng}
