"""Orbax checkpoints of a training run: params, optimizer state, step, data position and rng.

A run resumes from its workdir by default. Each checkpoint carries a fingerprint of the model
(param paths, shapes, dtypes and the model description); opening a workdir whose checkpoint has
another fingerprint raises `CheckpointMismatchError` before anything is written, so a run never
overwrites another model's checkpoints.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp


class CheckpointMismatchError(ValueError):
  pass


def describe_params(params) -> list[str]:
  """One 'path shape dtype' line per leaf (sorted): what the fingerprint hashes."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return sorted(f"{jax.tree_util.keystr(p)} {tuple(x.shape)} {np.dtype(x.dtype).name}"
                for p, x in flat)


def fingerprint(params, model_desc: str = "") -> str:
  text = model_desc + "\n" + "\n".join(describe_params(params))
  return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclasses.dataclass
class Checkpointer:
  """CheckpointManager over WORKDIR/checkpoints bound to one model fingerprint."""
  workdir: Path
  fingerprint: str
  every: int = 1000
  keep: int = 3
  async_save: bool = True

  def __post_init__(self):
    self.workdir = Path(self.workdir).absolute()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=self.keep, save_interval_steps=max(1, self.every),
        enable_async_checkpointing=self.async_save, create=True)
    self.manager = ocp.CheckpointManager(self.workdir / "checkpoints", options=options)
    self._check_existing()

  def _check_existing(self) -> None:
    step = self.manager.latest_step()
    if step is None:
      return
    meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if meta.get("fingerprint") != self.fingerprint:
      raise CheckpointMismatchError(
          f"workdir {self.workdir} holds a checkpoint (step {step}) of another model "
          f"(fingerprint {meta.get('fingerprint')}, {meta.get('model', '?')}; this run is "
          f"{self.fingerprint}). Nothing was written. Use a new --workdir, or delete "
          f"{self.workdir / 'checkpoints'} to start over.")

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, meta: dict | None = None, force: bool = False) -> bool:
    """Save `state` (a pytree) at `step` when the interval says so (or force)."""
    meta = dict(meta or {}, fingerprint=self.fingerprint, step=int(step))
    return self.manager.save(
        int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                           meta=ocp.args.JsonSave(meta)), force=force)

  def restore(self, abstract_state, step: int | None = None):
    """(state, meta) of `step` (default latest) placed like `abstract_state`, or None if empty.

    abstract_state: pytree of jax.ShapeDtypeStruct with shardings (or concrete arrays).
    """
    step = self.manager.latest_step() if step is None else step
    if step is None:
      return None
    target = jax.tree_util.tree_map(_abstract, abstract_state)
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    return out["state"], out["meta"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def _abstract(x):
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  sharding = getattr(x, "sharding", None)
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def write_json(path: Path, obj) -> None:
  """Small helper for run metadata files (config snapshot)."""
  Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))


def save_params(workdir, params) -> None:
  """Export the final params to WORKDIR/params (what `init_from=WORKDIR` loads)."""
  path = Path(workdir).absolute() / "params"
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, params, force=True)
  checkpointer.wait_until_finished()


def load_params(workdir, like):
  """Params exported by `save_params`, shaped and placed like `like` (clear error if absent)."""
  path = Path(workdir).absolute() / "params"
  if not path.exists():
    raise FileNotFoundError(f"{path} not found: init_from must name the workdir of a finished "
                            f"train.pretrain / train.distill run")
  target = jax.tree_util.tree_map(_abstract, like)
  try:
    return ocp.StandardCheckpointer().restore(path, target)
  except (ValueError, KeyError) as e:
    raise CheckpointMismatchError(f"{path} holds params of another model: {e}") from e
