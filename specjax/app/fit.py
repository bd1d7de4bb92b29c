"""Train a student (pretraining or DistillSpec) whose models are already built: the config's
training sections -> TrainConfig, data source, Trainer, eval hooks, progress display, exported
params."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import jax

from specjax import checkpoint as ckpt_lib
from specjax.app import builders, outputs
from specjax.app.config import ConfigError
from specjax.decoding.state import position_limit
from specjax.distill import data, evals, sources
from specjax.distill import trainer as trainer_lib
from specjax.distill.metrics_log import format_record

log = logging.getLogger(__name__)


def fit(config, workdir: str, student, teacher=None, *, pretrain: bool = False, display=None,
        source=None):
  """student / teacher: (model, params) pairs (teacher None when pretraining). Trains from
  WORKDIR's latest checkpoint to `train.steps`, then exports WORKDIR/params (unless nothing was
  left to train). `display`: a ProgressDisplay already showing (else one is made here when
  `train.progress`); `source`: the training data already opened (else opened here from the
  `data` section). Returns the TrainState."""
  cfg = builders.train_config(config, pretrain)
  workdir = check_workdir(workdir)
  own = display is None and cfg.progress and jax.process_index() == 0
  display = ProgressDisplay(cfg.steps) if own else display
  try:
    return _fit(config, cfg, workdir, student, teacher, display, source)
  except trainer_lib.TrainingDivergedError as err:
    raise diverged_advice(err, cfg, config, pretrain) from err
  finally:
    if own:
      display.close()


def check_workdir(workdir) -> Path:
  """The absolute path of a training workdir (relative ones are relative to the current
  directory), created if missing; refused now, before any work, if it cannot be written."""
  if "://" in str(workdir):
    raise ConfigError(f"--workdir {workdir}: checkpoints are written to local paths only; mount "
                      f"the bucket (e.g. with gcsfuse) and give the mounted path")
  return outputs.check_workdir(workdir, "--workdir")


def train_flag(config, pretrain: bool, field: str) -> str:
  """The flag that sets a training field for this job: pretraining reads the `pretrain`
  section's value where it has one (pretrain.learning_rate), else the `train` section's."""
  section = "pretrain" if pretrain and field in builders.section(config, "pretrain") else "train"
  return f"--config.{section}.{field}"


def diverged_advice(err: trainer_lib.TrainingDivergedError, cfg, config=None,
                    pretrain: bool = False) -> ConfigError:
  """The divergence with the flags that mend it (a ConfigError: exit status 2 at the CLI)."""
  then = "resumes from it" if err.last_good is not None else "starts again"
  lr, warmup = (train_flag(config or {}, pretrain, f) for f in ("learning_rate", "warmup_steps"))
  return ConfigError(f"{err}. Lower {lr} (now {cfg.learning_rate:g}) or raise {warmup} (now "
                     f"{cfg.warmup_steps}); the same command then {then}")


def _fit(config, cfg, workdir: Path, student, teacher, display, source):
  spec = builders.data_spec(config)
  (model, params), (t_model, t_params) = student, teacher or (None, None)
  check_data_vocab(spec, [m for m in (model, t_model) if m is not None])
  check_data_lengths(spec, [(r, m) for r, m in (("student", model), ("teacher", t_model))
                            if m is not None])
  source = open_source(spec, cfg.batch_size) if source is None else source
  trainer = trainer_lib.Trainer(cfg, model, t_model, source, workdir, eos_id=spec.eos_id,
                                pad_id=spec.pad_id, model_desc=repr(model),
                                show=display.show if display else None,
                                tick=display.tick if display else None)
  evaluate = None
  if (cfg.eval_every or cfg.eval_at_start) and t_model is not None:
    evaluate = eval_hooks(config, cfg, trainer, source, t_params)
  state = trainer.run(params, t_params, evaluate=evaluate)
  # Exported when trained, or when a run that reached `steps` was killed before its export.
  if trainer.steps_run or (int(state.step) == cfg.steps and not (workdir / "params").exists()):
    ckpt_lib.save_params(workdir, state.params)
  return state


def check_data_lengths(spec: builders.DataSpec, models) -> None:
  """data.prompt_len + data.target_len within every model's position table (models: (role,
  model) pairs), named by their flags (a cache error advised decoding's remedies)."""
  need = spec.prompt_len + spec.target_len
  for role, model in models:
    limit = position_limit(model)
    if limit is not None and need > limit:
      raise ConfigError(f"--config.data.prompt_len={spec.prompt_len} + --config.data.target_len="
                        f"{spec.target_len} = {need} positions, and the {role} reads at most "
                        f"{limit} (its n_positions): lower them to {limit} together")


def check_data_vocab(spec: builders.DataSpec, models) -> None:
  """A Markov source draws ids below data.vocab_size: more ids than a model's embedding has
  rows gave non-finite losses, reported as a divergence (the task source checks its tokenizer)."""
  sizes = [getattr(m, "vocab_size", None) for m in models]
  least = min((v for v in sizes if v), default=None)
  if spec.source == "markov" and least is not None and spec.vocab_size > least:
    raise ConfigError(f"--config.data.vocab_size={spec.vocab_size}: the Markov data's ids must "
                      f"fit the models' vocabulary of {least}: set it to at most {least}")


def open_source(spec: builders.DataSpec, batch_size: int):
  """The training data of the `data` section; its errors as advice on the flags that mend them."""
  for field in ("prompt_len", "target_len"):       # (a MarkovSource's repr said it)
    if getattr(spec, field) < 1:
      raise ConfigError(f"--config.data.{field}={getattr(spec, field)}: a training example needs "
                        f"at least 1 {field.split('_')[0]} token")
  options = sources.DataOptions(
      kind=spec.source, task=spec.task, tokenizer=spec.tokenizer, vocab_size=spec.vocab_size,
      prompt_len=spec.prompt_len, target_len=spec.target_len, seed=spec.seed,
      data_dir=spec.data_dir)
  try:
    return sources.open_source(options, batch_size)
  except sources.UnknownSourceError as err:
    raise ConfigError(f"--config.data.source={err.kind!r}: use one of "
                      f"{', '.join(sources.KINDS)}") from err
  except sources.VocabTooSmallError as err:
    raise ConfigError(f"{err}: raise the models' vocab_size (and --config.data.vocab_size) to at "
                      f"least {err.tokenizer_vocab}, or choose a smaller --config.data.tokenizer"
                      ) from err


def eval_hooks(config, cfg, trainer, source, teacher_params):
  """Every eval_every steps: the on-policy TVD on a held-out batch (predicted acceptance) and
  alpha / tau of exact speculative decoding on `train.eval_prompts` held-out prompts, with gamma,
  max_new_tokens and temperature from the `decode` section. The hooks get the models, data placed
  by `trainer` and its mesh, and are called with the params (`trainer.run(..., evaluate=)`)."""
  decode = builders.decode_settings(config)
  settings = evals.SpecEval(gamma=decode.gamma, max_new_tokens=decode.max_new_tokens,
                            temperature=decode.temperature, prompts=cfg.eval_prompts)
  key = jax.random.PRNGKey(cfg.seed + 7)
  try:
    prompts = evals.heldout_prompts(source, cfg.eval_prompts)
  except ValueError as err:
    raise ConfigError(f"--config.train.eval_prompts={cfg.eval_prompts}: {err}") from err
  teacher_params = trainer.place_params(teacher_params)
  sampler = data.Sampler(trainer.student, trainer.teacher, trainer.eos_id, cfg.temperature,
                         trainer.pad_id)
  held_out = trainer.place_batch(source.batch(0, split="validation"))
  on_policy = None if cfg.student == "head" else \
      evals.on_policy_eval(sampler, held_out, teacher_params, key)   # a head samples nothing
  return evals.combine(
      on_policy,
      evals.speculative_eval(trainer.teacher, trainer.student, prompts, teacher_params,
                             jax.random.fold_in(key, 1), settings, eos_id=trainer.eos_id,
                             mesh=trainer.mesh))


class ProgressDisplay:
  """Training progress on `stream` (default stderr), from the first second.

  On a terminal: a bar (steps, loss, tokens/s, elapsed, ETA), with the library's log lines and
  each metrics record printed above it. Anywhere else (a file, a pipe, CI): no bar and no control
  characters, only the log lines and one plain line per metrics record. While it shows, the
  specjax logger's records go through it only (they do not also propagate to the root logger's
  handlers, which some libraries install: every line would appear twice)."""

  def __init__(self, total: int, stream=None):
    self.stream = stream or sys.stderr
    self.total = total
    self.live = bool(getattr(self.stream, "isatty", lambda: False)())
    self.step_s = self.rate = None            # moving averages of the step time and tokens/s
    self.loss = None                          # the last record's
    self.progress = self._start_bar() if self.live else None
    self._logs = _LogRoute(self._print if self.live else None)

  def _start_bar(self):
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("{task.fields[stats]}"),
                        console=Console(file=self.stream), redirect_stdout=False,
                        redirect_stderr=False)
    self.task = progress.add_task("", total=self.total, stats="preparing")
    progress.start()
    return progress

  def _print(self, text: str) -> None:
    if self.live:
      self.progress.console.print(text, markup=False, highlight=False, soft_wrap=True)
    else:
      print(text, file=self.stream, flush=True)

  def show(self, record: dict) -> None:
    """A logged metrics record: one line."""
    self._print(format_record(record))

  def tick(self, info: dict) -> None:
    """Every step: step, total -> the bar's position; at records (the trainer reads the device
    there only) also loss, step_s, tokens -> its stats, kept until the next record."""
    if "loss" in info:
      self.loss = info["loss"]
      self.step_s = _average(self.step_s, info["step_s"])
      self.rate = _average(self.rate, info["tokens"] / max(info["step_s"], 1e-9))
    if not self.live:
      return
    update = {"completed": info["step"]}
    if self.step_s is not None:
      eta = (info["total"] - info["step"]) * self.step_s
      update["stats"] = f"loss {self.loss:.4g} | {_si(self.rate)} tok/s | ETA {_clock(eta)}"
    self.progress.update(self.task, **update)

  def close(self) -> None:
    if self.live:
      self.progress.stop()
    self._logs.restore()


def _average(old: float | None, new: float, weight: float = 0.3) -> float:
  return new if old is None else (1 - weight) * old + weight * new


def _clock(seconds: float) -> str:
  """3725 -> '1:02:05' (hours unbounded: a 300k-step run may be days away)."""
  minutes, secs = divmod(int(seconds), 60)
  return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


def _si(value: float) -> str:
  for unit, scale in (("M", 1e6), ("k", 1e3)):
    if value >= scale:
      return f"{value / scale:.3g}{unit}"
  return f"{value:.3g}"


class _LogRoute:
  """While a display shows: the specjax logger stops propagating to the root logger's handlers
  and, with a bar on screen, its own handlers are replaced by one printing above the bar.
  Loggers without handlers (no CLI set-up) are left as they are."""

  def __init__(self, emit):
    self.logger = logging.getLogger("specjax")
    self.handlers, self.propagate = list(self.logger.handlers), self.logger.propagate
    if not self.handlers:
      return
    self.logger.propagate = False
    if emit is not None:
      replacement = _EmitHandler(emit)
      replacement.setFormatter(self.handlers[0].formatter)
      for handler in self.handlers:
        self.logger.removeHandler(handler)
      self.logger.addHandler(replacement)

  def restore(self) -> None:
    for handler in list(self.logger.handlers):
      self.logger.removeHandler(handler)
    for handler in self.handlers:
      self.logger.addHandler(handler)
    self.logger.propagate = self.propagate


class _EmitHandler(logging.Handler):
  def __init__(self, emit):
    super().__init__()
    self.emit_text = emit

  def emit(self, record: logging.LogRecord) -> None:
    try:
      self.emit_text(self.format(record))
    except Exception:                      # a display error must not stop training
      self.handleError(record)
