"""The teacher's outputs over a run's first N training batches, computed once and kept on disk.

A draft head's training step is mostly the target's pass over the batch (its features and
next-token distributions), which does not change while the head trains. With a cache of N
batches the pass runs once per batch: batch i is stored as the run's data mixture gives it at
step i (dataset tokens or the teacher's sampled continuations) with the target's features and
its top-k log-probs (the rest of the vocabulary lumped into one bin, `divergences.top_k_lumped`),
and step s trains on batch s mod N. Several epochs over N batches, or a sweep of head settings
over one cache directory, pay for the target once.

On disk: DIR/manifest.json (what the cache was built for: its key, a JSON object) and one
safetensors file per batch, written under a temporary name and renamed, so a killed build
resumes at the batches still missing and loses at most the one in progress. A cache built for
something else (another target, data, top_k or batch shape) is refused, naming what differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import load_file, save_file

from specjax.data.batch import Batch
from specjax.distill.head import TeacherOutputs
from specjax.models import Prompt

FORMAT = 1
MANIFEST = "manifest.json"


class CacheMismatchError(ValueError):
  """The directory holds a cache built for something else."""

  def __init__(self, path: Path, differences: list[str]):
    self.path, self.differences = path, differences
    super().__init__(f"the teacher cache in {path} was built for another run ({'; '.join(differences)}): "
                     f"give another --config.distill.cache_dir, or delete {path} to rebuild it")


@dataclasses.dataclass(frozen=True)
class FeatureCache:
  """N cached batches in `path` for the run described by `key` (JSON-able values)."""
  path: Path
  key: dict
  batches: int

  def __post_init__(self):
    if self.batches < 1:
      raise ValueError(f"a teacher cache holds at least 1 batch, got {self.batches}")

  def open(self) -> "FeatureCache":
    """Create the directory and its manifest, or check an existing manifest against the key
    (CacheMismatchError). Returns self."""
    self.path.mkdir(parents=True, exist_ok=True)
    manifest = self.path / MANIFEST
    key = {"format": FORMAT, **self.key}
    if manifest.exists():
      saved = json.loads(manifest.read_text())
      differences = [f"{name}: {_short(saved.get(name))} there, {_short(key.get(name))} here"
                     for name in sorted(set(saved) | set(key)) if saved.get(name) != key.get(name)]
      if differences:
        raise CacheMismatchError(self.path, differences)
    else:
      _write_atomic(manifest, lambda tmp: tmp.write_text(json.dumps(key, indent=1, sort_keys=True)))
    return self

  def file(self, index: int) -> Path:
    return self.path / f"batch_{index:06d}.safetensors"

  def missing(self) -> list[int]:
    """The indices in [0, batches) without a file yet."""
    return [i for i in range(self.batches) if not self.file(i).exists()]

  def write(self, index: int, batch: Batch) -> None:
    """Store batch `index` (its `teacher` outputs set; arrays on the host or devices)."""
    t = batch.teacher
    if t is None or t.ids is None:
      raise ValueError("a cached batch needs the teacher's top-k outputs (TeacherOutputs.ids)")
    arrays = {"prompt_tokens": batch.prompt.tokens, "prompt_lengths": batch.prompt.lengths,
              "targets": batch.targets, "mask": batch.mask, "hidden": t.hidden, "logp": t.logp,
              "ids": t.ids}
    arrays = {name: np.ascontiguousarray(jax.device_get(x)) for name, x in arrays.items()}
    _write_atomic(self.file(index), lambda tmp: save_file(arrays, str(tmp)))

  def read(self, index: int) -> Batch:
    """Batch `index` as numpy arrays, its `teacher` set."""
    a = load_file(str(self.file(index)))
    return Batch(prompt=Prompt(tokens=a["prompt_tokens"], lengths=a["prompt_lengths"]),
                 targets=a["targets"], mask=a["mask"],
                 teacher=TeacherOutputs(hidden=a["hidden"], logp=a["logp"], ids=a["ids"]))

  def batch(self, step: int, split: str = "train") -> Batch:
    """The trainer's source interface: step s reads batch s mod N (training data only)."""
    if split != "train":
      raise ValueError(f"a teacher cache holds training batches only, not {split!r}")
    return self.read(step % self.batches)


def fingerprint(*trees) -> str:
  """A short digest of arrays' shapes, dtypes and first and last values (cheap on any size: it
  tells two checkpoints or data sets apart, not a proof that they are equal)."""
  digest = hashlib.sha256()
  for tree in trees:
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
      flat = np.ravel(np.asarray(jax.device_get(x[(slice(0, 2),) * min(np.ndim(x), 1)])))
      tail = np.ravel(np.asarray(jax.device_get(x[(slice(-2, None),) * min(np.ndim(x), 1)])))
      digest.update(f"{jax.tree_util.keystr(path)} {np.shape(x)} {x.dtype}".encode())
      digest.update(np.ascontiguousarray(flat[:64]).tobytes())
      digest.update(np.ascontiguousarray(tail[-64:]).tobytes())
  return digest.hexdigest()[:16]


def _write_atomic(path: Path, write) -> None:
  """write(tmp) then rename tmp -> path: a reader sees the whole file or none."""
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  try:
    write(tmp)
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)


def _short(value) -> str:
  text = json.dumps(value) if value is not None else "absent"
  return text if len(text) <= 60 else text[:57] + "..."
