"""Orbax checkpoints of a training run: params, optimizer state, step, data position and rng.

A run resumes from its workdir by default. Each checkpoint carries the model's signature (its
description, parameter count, and every param's path, shape and dtype) and a fingerprint of it;
opening a workdir whose checkpoint has other param shapes raises `CheckpointMismatchError`, naming
both models and their differing shapes, before anything is written, so a run never overwrites
another model's checkpoints. `lock_workdir` keeps a second run out of a workdir in use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import logging
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Iterator

import filelock
import jax
import numpy as np

log = logging.getLogger(__name__)


def _orbax():
  """orbax.checkpoint, imported on first use: its import takes a few tenths of a second, and
  every command (decoding too) imports this module, most without saving or restoring."""
  import orbax.checkpoint as ocp
  absl = logging.getLogger("absl")                 # orbax logs through absl's logger
  if _no_interrupt_tracebacks not in absl.filters:
    absl.addFilter(_no_interrupt_tracebacks)
  return ocp


def _no_interrupt_tracebacks(record: logging.LogRecord) -> bool:
  """Drops orbax's report of a wait that Ctrl-C cut short (a traceback ending in
  KeyboardInterrupt): the command says in one line what was and was not saved."""
  return not (record.exc_info and record.exc_info[0] is not None
              and issubclass(record.exc_info[0], KeyboardInterrupt))


class CheckpointMismatchError(ValueError):
  """A workdir's checkpoint belongs to another model; carries both models' signatures."""

  def __init__(self, workdir: Path, step: int, saved: "ModelSignature", current: "ModelSignature"):
    self.workdir, self.step, self.saved, self.current = workdir, step, saved, current
    super().__init__(
        f"workdir {workdir} holds a checkpoint (step {step}) of another model. The checkpoint's: "
        f"{saved.summary()}. This run's: {current.summary()}. {_shape_differences(saved, current)}"
        f"Nothing was written. Use another workdir, or delete {workdir / 'checkpoints'} to start "
        f"over.")


class WorkdirBusyError(ValueError):
  """Another process holds the workdir's lock; carries the `workdir` and the holder's `pid`
  (None when it could not be read)."""

  def __init__(self, workdir: Path, pid: int | None):
    self.workdir, self.pid = workdir, pid
    holder = f"process {pid}" if pid is not None else "another process"
    super().__init__(f"workdir {workdir} is in use by another training run ({holder} holds "
                     f"{workdir / LOCK_FILE})")


LOCK_FILE = ".specjax.lock"          # the lock; the holder's pid is in LOCK_FILE + ".pid"


@contextlib.contextmanager
def lock_workdir(workdir) -> Iterator[None]:
  """Hold WORKDIR/.specjax.lock (an OS file lock, released when the process dies) for the block,
  with this process's pid in WORKDIR/.specjax.lock.pid; WorkdirBusyError at once if another
  process holds it."""
  workdir = Path(workdir).absolute()
  lock = filelock.FileLock(str(workdir / LOCK_FILE))
  pid_file = workdir / (LOCK_FILE + ".pid")
  try:
    lock.acquire(timeout=0)
  except filelock.Timeout:
    raise WorkdirBusyError(workdir, _read_pid(pid_file)) from None
  try:
    pid_file.write_text(f"{os.getpid()}\n")
    yield
  finally:
    pid_file.unlink(missing_ok=True)
    lock.release()


def _read_pid(path: Path) -> int | None:
  try:
    return int(path.read_text().strip())
  except (OSError, ValueError):
    return None


def describe_params(params) -> list[str]:
  """One 'path shape dtype' line per leaf (sorted): what the fingerprint hashes."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return sorted(f"{jax.tree_util.keystr(p)} {tuple(x.shape)} {np.dtype(x.dtype).name}"
                for p, x in flat)


def fingerprint(params, model_desc: str = "") -> str:
  return ModelSignature.of(params, model_desc).fingerprint


@dataclasses.dataclass(frozen=True)
class ModelSignature:
  """What a checkpoint records about its model: the description (the model's repr: its config),
  the parameter count and one 'path shape dtype' line per leaf."""
  description: str
  num_params: int
  shapes: tuple[str, ...]

  @classmethod
  def of(cls, params, description: str = "") -> "ModelSignature":
    count = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))
    return cls(description, count, tuple(describe_params(params)))

  @property
  def fingerprint(self) -> str:
    text = self.description + "\n" + "\n".join(self.shapes)
    return hashlib.sha256(text.encode()).hexdigest()[:16]

  def summary(self) -> str:
    if not self.shapes:
      return self.description or "(shapes not recorded)"
    return f"{self.description or 'model'} with {self.num_params:,} params"

  def to_meta(self) -> dict:
    return {"model": self.description, "num_params": self.num_params, "shapes": list(self.shapes),
            "fingerprint": self.fingerprint}

  @classmethod
  def from_meta(cls, meta: dict) -> "ModelSignature":
    return cls(meta.get("model", ""), int(meta.get("num_params", 0)),
               tuple(meta.get("shapes", ())))


def _shape_differences(saved: ModelSignature, current: ModelSignature, limit: int = 3) -> str:
  """The first leaves whose shape or dtype differ, 'path: checkpoint vs this run'."""
  if not saved.shapes:
    return ""
  old = dict(line.partition(" ")[0::2] for line in saved.shapes)      # path -> 'shape dtype'
  new = dict(line.partition(" ")[0::2] for line in current.shapes)
  diffs = [f"{path}: {old.get(path, 'absent')} vs {new.get(path, 'absent')}"
           for path in sorted(set(old) | set(new)) if old.get(path) != new.get(path)]
  if not diffs:
    return ""
  more = f" (and {len(diffs) - limit} more)" if len(diffs) > limit else ""
  return f"Differences (checkpoint vs this run): {'; '.join(diffs[:limit])}{more}. "


@dataclasses.dataclass
class Checkpointer:
  """CheckpointManager over WORKDIR/checkpoints bound to one model (its signature)."""
  workdir: Path
  signature: ModelSignature
  every: int = 1000
  keep: int = 3
  async_save: bool = True

  def __post_init__(self):
    self.workdir = Path(self.workdir).absolute()
    self._remove_unfinished()
    options = _orbax().CheckpointManagerOptions(
        max_to_keep=self.keep, save_interval_steps=max(1, self.every),
        enable_async_checkpointing=self.async_save, create=True)
    self.manager = _orbax().CheckpointManager(self.workdir / "checkpoints", options=options)
    self._check_existing()

  def _check_existing(self) -> None:
    """Refuse a checkpoint of other param shapes. A description that differs over the same shapes
    (a config field added by a newer specjax, say) is only logged: refusing it would strand
    every run across an upgrade."""
    found = self._latest_meta()
    if found is None:
      return
    step, meta = found
    saved = ModelSignature.from_meta(meta)
    if saved.shapes:
      same = saved.shapes == self.signature.shapes
    else:                                  # written before shapes were recorded
      same = meta.get("fingerprint") == self.signature.fingerprint
    if not same:
      raise CheckpointMismatchError(self.workdir, step, saved, self.signature)
    if saved.description != self.signature.description and saved.shapes:
      log.warning("the checkpoint in %s was written for %s; this run's model is %s (the same "
                  "param shapes): resuming", self.workdir, saved.description,
                  self.signature.description)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, meta: dict | None = None, force: bool = False) -> bool:
    """Save `state` (a pytree) at `step` when the interval says so (or force)."""
    meta = dict(meta or {}, **self.signature.to_meta(), step=int(step))
    args = _orbax().args
    return self.manager.save(int(step), args=args.Composite(state=args.StandardSave(state),
                                                            meta=args.JsonSave(meta)),
                             force=force)

  def _latest_meta(self) -> tuple[int, dict] | None:
    """(step, meta) of the latest checkpoint whose metadata reads (a damaged one is skipped
    here: `restore` names it); None when there is none."""
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        args = _orbax().args
        return step, self.manager.restore(step, args=args.Composite(
            meta=args.JsonRestore()))["meta"]
      except Exception:                 # whatever orbax / tensorstore raise for a damaged file
        continue
    return None

  def restore(self, abstract_state, step: int | None = None):
    """(state, meta) of `step` (default: the latest good one) placed like `abstract_state`, or
    None if empty.

    abstract_state: pytree of jax.ShapeDtypeStruct with shardings (or concrete arrays).
    A latest checkpoint that cannot be read (a killed disk, a truncated file) is moved aside to
    WORKDIR/checkpoints.damaged/STEP, never deleted, and the previous good one restored, with a
    warning naming both; DamagedCheckpointError when none can be restored (nothing moved).
    """
    target = jax.tree_util.tree_map(_abstract, abstract_state)
    if step is not None:
      return self._restore_step(step, target)
    failed = []
    for candidate in sorted(self.manager.all_steps(), reverse=True):
      try:
        with _quiet_unraisable():
          restored = self._restore_step(candidate, target)
      except Exception as err:          # whatever orbax / tensorstore raise for a damaged file
        failed.append((candidate, _first_line(err)))
        continue
      self._set_aside(failed, candidate)
      return restored
    if failed:
      raise DamagedCheckpointError(self.workdir / "checkpoints", failed)
    return None

  def _restore_step(self, step: int, target):
    args = _orbax().args
    out = self.manager.restore(step, args=args.Composite(state=args.StandardRestore(target),
                                                         meta=args.JsonRestore()))
    return out["state"], out["meta"]

  def _set_aside(self, failed: list[tuple[int, str]], good: int) -> None:
    """Move the damaged checkpoints newer than `good` out of the manager's way (a resumed run
    saves those steps again), each with a warning."""
    if not failed:
      return
    for step, reason in failed:
      kept = self.workdir / "checkpoints" / str(step)
      if jax.process_index() == 0:
        kept = _move_aside(kept, self.workdir / DAMAGED_DIR)
      log.warning("the checkpoint of step %d (%s) is damaged (%s): resuming from step %d, the "
                  "latest good one; the damaged one is kept in %s (delete it when you no longer "
                  "need it)", step, self.workdir / "checkpoints" / str(step), reason, good, kept)
    self.manager.reload()

  def _remove_unfinished(self) -> None:
    """Remove the temporary directories of saves that never finished (a run stopped at once
    while saving): orbax leaves them for good. The workdir is this run's (lock_workdir)."""
    if jax.process_index() != 0:
      return
    for tmp in (self.workdir / "checkpoints").glob(f"*{UNFINISHED}*"):
      log.info("removing %s: a save that a stopped run left unfinished", tmp)
      shutil.rmtree(tmp, ignore_errors=True)

  def finished_steps(self) -> list[int]:
    """The steps whose checkpoints are whole on disk (a save in progress is not one)."""
    steps = self.workdir / "checkpoints"
    return sorted(int(p.name) for p in steps.iterdir() if p.name.isdigit()) \
        if steps.is_dir() else []

  def abandon(self) -> int | None:
    """Stop at once, without waiting for a save in progress (a second Ctrl-C): orbax's threads,
    cut short, are kept from logging tracebacks, and the save's temporary directory is removed
    by the next run. Returns the latest whole checkpoint's step (None: none)."""
    for name in ("absl", "orbax", "orbax.checkpoint"):
      logging.getLogger(name).setLevel(logging.CRITICAL + 1)
    done = self.finished_steps()
    return done[-1] if done else None

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


DAMAGED_DIR = "checkpoints.damaged"
UNFINISHED = ".orbax-checkpoint-tmp"       # orbax's name for a save in progress


@contextlib.contextmanager
def _quiet_unraisable() -> Iterator[None]:
  """Within: the reads that orbax leaves behind when one read of a damaged checkpoint fails
  (coroutines that raise again when collected) are collected here and logged at debug level,
  instead of Python printing a traceback for each ("Exception ignored in"); the warning that
  names the damaged checkpoint says what happened."""
  hook = sys.unraisablehook
  sys.unraisablehook = lambda u: log.debug("reading a damaged checkpoint: %s", u.exc_value)
  try:
    yield
  finally:
    gc.collect()
    sys.unraisablehook = hook


class DamagedCheckpointError(ValueError):
  """No checkpoint of a workdir can be restored; `failed`: (step, reason) newest first."""

  def __init__(self, checkpoints: Path, failed: list[tuple[int, str]]):
    self.checkpoints, self.failed = checkpoints, failed
    steps = "; ".join(f"step {step} ({checkpoints / str(step)}): {reason}"
                      for step, reason in failed)
    settings = ("if this run's settings differ from theirs (--config.train.optimizer, say), "
                "rerun with the settings that wrote them")
    damaged = (f"move them away (mv {checkpoints} {checkpoints.parent / DAMAGED_DIR}) and rerun "
               f"to start over")
    if all("tree structure" in reason for _, reason in failed):
      # Every file read; only the state's layout differs: another optimizer, not damage.
      super().__init__(f"no checkpoint in {checkpoints} holds this run's training state: "
                       f"{steps}. They read, but their state is laid out otherwise: {settings}; "
                       f"to start over instead, {damaged}")
    else:
      super().__init__(f"no checkpoint in {checkpoints} can be restored: {steps}. If they are "
                       f"damaged, {damaged}; {settings}")


def _first_line(err: Exception, limit: int = 200) -> str:
  text = (str(err).strip().splitlines() or [type(err).__name__])[0]
  text = text.partition(" See full TensorStore details")[0]
  return text if len(text) <= limit else text[:limit] + " ..."


def _move_aside(path: Path, into: Path) -> Path:
  """path renamed into the directory `into` (a free name: STEP, STEP.1, ...); the new path."""
  into.mkdir(exist_ok=True)
  dest, n = into / path.name, 0
  while dest.exists():
    n += 1
    dest = into / f"{path.name}.{n}"
  path.rename(dest)
  return dest


def _abstract(x):
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  sharding = getattr(x, "sharding", None)
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def write_json(path: Path, obj) -> None:
  """A run's metadata file (verifier.json, metrics.json): strict JSON (a non-finite float is
  null), written atomically (a temporary file, then a rename)."""
  path = Path(path)
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  tmp.write_text(json.dumps(_strict(obj), indent=2, sort_keys=True, default=str,
                            allow_nan=False))
  os.replace(tmp, path)


def _strict(obj):
  if isinstance(obj, dict):
    return {k: _strict(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_strict(v) for v in obj]
  if isinstance(obj, (float, np.floating)):
    return float(obj) if math.isfinite(obj) else None
  return obj


def save_params(workdir, params) -> None:
  """Export the final params to WORKDIR/params (what `init_from=WORKDIR` loads), atomically:
  written beside it first, then swapped in, so a killed export leaves the previous params."""
  path = Path(workdir).absolute() / "params"
  staged, old = path.with_name(".params.new"), path.with_name(".params.old")
  for leftover in (staged, old):
    shutil.rmtree(leftover, ignore_errors=True)
  checkpointer = _orbax().StandardCheckpointer()
  checkpointer.save(staged, params)
  checkpointer.wait_until_finished()
  if path.exists():
    path.rename(old)
  staged.rename(path)
  shutil.rmtree(old, ignore_errors=True)


def load_params(workdir, like):
  """Params exported by `save_params`, shaped and placed like `like` (clear error if absent)."""
  path = Path(workdir).absolute() / "params"
  if not path.exists():
    raise FileNotFoundError(f"{path} not found: init_from must name the workdir of a finished "
                            f"train.pretrain / train.distill run")
  target = jax.tree_util.tree_map(_abstract, like)
  checkpointer = _orbax().StandardCheckpointer()
  _check_saved_shapes(path, checkpointer, target)
  try:
    return checkpointer.restore(path, target)
  except (ValueError, KeyError) as e:
    raise ValueError(f"{path} holds params of another model: {e}") from e


def _check_saved_shapes(path: Path, checkpointer, target) -> None:
  """Refuse exported params whose tensors differ from the model's, naming the first tensor, its
  shape in the model and in the checkpoint, before anything is read."""
  try:
    saved = checkpointer.metadata(path).item_metadata.tree
  except Exception:                    # no readable metadata: the restore itself says why
    return
  have = {jax.tree_util.keystr(p): tuple(x.shape)
          for p, x in jax.tree_util.tree_flatten_with_path(saved)[0] if hasattr(x, "shape")}
  want = {jax.tree_util.keystr(p): tuple(x.shape)
          for p, x in jax.tree_util.tree_flatten_with_path(target)[0]}
  differ = [k for k in sorted(set(want) | set(have)) if want.get(k) != have.get(k)]
  if not differ:
    return
  name = differ[0]
  more = f" (and {len(differ) - 1} more tensors differ)" if len(differ) > 1 else ""
  raise ValueError(f"{path} holds params of another model: tensor {name} has shape "
                   f"{have.get(name, '(absent)')} there, and this model expects "
                   f"{want.get(name, '(absent)')}{more}: give the workdir of a run that trained a "
                   f"model of this size")
