"""Train a student (pretraining or DistillSpec) whose models are already built: the config's
training sections -> TrainConfig, data source, Trainer, progress display, exported params."""

from __future__ import annotations

from pathlib import Path

import jax

from specjax import checkpoint as ckpt_lib
from specjax.app import builders
from specjax.distill import trainer as trainer_lib


def fit(config, workdir: str, student, teacher=None, *, pretrain: bool = False):
  """student / teacher: (model, params) pairs (teacher None when pretraining). Trains from
  WORKDIR's latest checkpoint to `train.steps`, then exports WORKDIR/params. Returns TrainState."""
  cfg = builders.train_config(config, pretrain)
  spec = builders.data_spec(config)
  source = builders.train_source(spec, cfg.batch_size)
  Path(workdir).mkdir(parents=True, exist_ok=True)
  (model, params), (t_model, t_params) = student, teacher or (None, None)
  display = ProgressDisplay(cfg.steps) if cfg.progress and jax.process_index() == 0 else None
  trainer = trainer_lib.Trainer(cfg, model, t_model, source, Path(workdir), eos_id=spec.eos_id,
                                pad_id=spec.pad_id, model_desc=repr(model),
                                show=display.show if display else None)
  if cfg.eval_every and t_model is not None:
    trainer.eval_fn = trainer_lib.on_policy_eval(trainer, source.batch(10**9), t_params,
                                                 jax.random.PRNGKey(cfg.seed + 7))
  try:
    state = trainer.run(params, t_params)
  finally:
    if display:
      display.close()
  ckpt_lib.save_params(workdir, state.params)
  return state


class ProgressDisplay:
  """A progress bar (steps, ETA) with each logged metrics line printed above it."""

  def __init__(self, total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn
    self.progress = Progress("[bold]train", BarColumn(), MofNCompleteColumn(),
                             TimeRemainingColumn(), "{task.description}")
    self.task = self.progress.add_task("", total=total)
    self.progress.start()

  def show(self, record: dict) -> None:
    text = trainer_lib.format_record(record)
    self.progress.update(self.task, completed=record["step"], description=text)
    self.progress.console.print(text)

  def close(self) -> None:
    self.progress.stop()
