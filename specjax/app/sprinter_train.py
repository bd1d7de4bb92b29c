"""Config -> SPRINTER verifier training: what `python -m train.verifier` runs.

The `verifier` section holds the data settings (sprinter.data.DataConfig), the optimisation
(sprinter.train.TrainConfig) and a few run settings (VerifierRun); each key belongs to exactly one
of them and is typed by its field. The models come from `target` and `draft`, the text prefixes
from `data`, the sampling warp from `decode`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import jax

from specjax.app import builders, resolve
from specjax.app.fit import check_workdir
from specjax.app.training import RUN_FILE, VERIFIER_FILE
from specjax.app.config import ConfigError
from specjax.data.source import SourceConfig, make_source
from specjax.distill import data as distill_data
from specjax.sprinter import train as train_lib
from specjax.sprinter.data import DataConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class VerifierRun:
  """The `verifier` keys that are neither data nor optimisation settings."""
  workdir: str = ""          # where the sprinter_* configs expect the trained verifier
  mlp_width: int = 0         # 0: a linear verifier (the paper's), else one hidden layer
  gamma_max: int = 8         # the decoding default saved with the verifier
  num_sequences: int = 1024  # text prefixes (split by sequence into train/val/test)
  batch_rows: int = 64       # prefixes per rollout batch
  overwrite: bool = False    # replace a verifier already in the workdir

  def __post_init__(self):
    for name in ("gamma_max", "num_sequences", "batch_rows"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.mlp_width < 0:
      raise ValueError(f"mlp_width must be >= 0 (0: linear), got {self.mlp_width}")


def split_section(section: dict) -> tuple[DataConfig, train_lib.TrainConfig, VerifierRun]:
  """The `verifier` section, each key typed by the dataclass that owns it; unknown keys refused."""
  parts = (DataConfig, train_lib.TrainConfig, VerifierRun)
  owners = {f.name: cls for cls in parts for f in dataclasses.fields(cls)}
  unknown = sorted(set(section) - set(owners))
  if unknown:
    raise ConfigError(f"--config.verifier: unknown field(s) {', '.join(unknown)}; known fields: "
                      f"{', '.join(sorted(owners))}")
  return tuple(builders.typed(cls, {k: v for k, v in section.items() if owners[k] is cls},
                              "verifier") for cls in parts)


def text_batches(spec: builders.DataSpec, rows: int, count: int, cont_len: int):
  """`count` batches of `rows` text prefixes: the config's task, or the seeded Markov language
  when data.source == 'markov' (the DataSpec default)."""
  if spec.source == "markov":
    src = distill_data.MarkovSource(spec.vocab_size, rows, spec.prompt_len, cont_len, spec.seed)
    return [src.batch(i) for i in range(count)]
  src = make_source(spec.task, resolve.tokenizer_location(spec.tokenizer), SourceConfig(
      batch_size=rows, max_target_len=cont_len, lm_prompt_len=spec.lm_prompt_len,
      max_prompt_len=spec.max_prompt_len))
  return [src.batch(i, "train") for i in range(count)]


def check_text_source(spec: builders.DataSpec) -> None:
  """Refuse, before any model is built, a data section that names a task but leaves `source` at
  its default ('markov') without a Markov vocabulary: the verifier would not train on the task."""
  if spec.source == "markov" and spec.vocab_size < 3 and spec.task:
    raise ConfigError(f"the verifier's text comes from data.source, 'markov' unless the config "
                      f"sets it; this config's data section names task '{spec.task}' but no "
                      f"source (nor a Markov vocab_size): add source='task' to its data section "
                      f"to train on the task's text")


def check_verifier_workdir(workdir: str, overwrite: bool) -> Path:
  """The workdir's absolute path, refused now (before any work) if it cannot be written or
  already holds a verifier that `overwrite` does not allow to replace."""
  path = check_workdir(workdir)
  other = [name for name in (RUN_FILE, "checkpoints") if (path / name).exists()]
  if other:
    raise ConfigError(f"--workdir {path} holds a training run ({', '.join(other)}): a verifier "
                      f"saved there would replace its params/; choose another workdir")
  if (path / VERIFIER_FILE).exists() and not overwrite:
    raise ConfigError(f"--workdir {path} already holds a verifier ({VERIFIER_FILE}): choose "
                      f"another workdir, or replace it with --config.verifier.overwrite=true")
  return path


def _models(config) -> dict:
  """What names the target and the draft (builders.model_name), and the draft's checkpoint
  directory when it has one (`draft_dir`: what the Python API's loaded draft is checked by)."""
  models = {role: builders.model_name(config, role) for role in ("target", "draft")}
  spec = builders.model_spec(config, "draft")
  if spec.checkpoint:
    models["draft_dir"] = str(resolve.checkpoint_dir(spec).resolve())
  return models


def run_from_config(config, workdir: str) -> dict:
  """Models + text prefixes -> examples -> trained verifier, saved in workdir with
  verifier.json and metrics.json. Returns the metrics."""
  data, training, run = split_section(builders.section(config, "verifier"))
  workdir = check_verifier_workdir(workdir, run.overwrite)
  spec = builders.data_spec(config)
  check_text_source(spec)
  log.info("workdir %s", workdir)
  seed = training.seed
  target, tparams = resolve.build_model(builders.model_spec(config, "target"), seed)
  draft, dparams = resolve.build_model(builders.model_spec(config, "draft"), seed + 1)
  count = math.ceil(run.num_sequences / run.batch_rows)
  if count * run.batch_rows != run.num_sequences:
    log.warning("verifier: num_sequences %d raised to %d (%d whole batches of batch_rows %d)",
                run.num_sequences, count * run.batch_rows, count, run.batch_rows)
  batches = text_batches(spec, run.batch_rows, count, data.cont_len)
  try:
    return train_lib.train_verifier(
        target, tparams, draft, dparams, batches, jax.random.PRNGKey(seed),
        warp=builders.decode_settings(config).warp, data=data, training=training,
        eos=spec.eos_id, mlp_width=run.mlp_width, workdir=workdir, gamma_max=run.gamma_max,
        models=_models(config))
  except train_lib.TooFewSequencesError as e:
    raise ConfigError(f"{e}; raise --config.verifier.num_sequences (now {run.num_sequences}) "
                      f"or lower --config.verifier.val_fraction / test_fraction") from e
