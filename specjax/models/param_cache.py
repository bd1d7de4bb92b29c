"""Loaded params kept on disk in the model's own layout and dtype, one NumPy `.npy` file per leaf,
so that the next load maps them instead of converting them again.

A checkpoint's load casts and transposes every tensor (bfloat16 [out, in] -> float32 [in, out]:
about 20 s for a 1.5B model on 2 CPU cores). Kept as `.npy` files (whose data NumPy aligns to 64
bytes), the same params are memory-mapped read-only and handed to the CPU device without a copy:
the load takes a fraction of a second and the pages are read on the first forward pass (from the
page cache when the files were read recently). Layout of DIR: `leaves.json` (the tree: key path
-> file) and the `.npy` files; written under DIR.partial and renamed, so a killed write leaves
nothing that `load` would take.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import numpy as np

MANIFEST = "leaves.json"


def entry(root: Path, source: Path, key: str) -> Path:
  """ROOT/params/NAME-KEY: where the params of checkpoint directory `source` loaded with the
  settings digested in `key` are kept."""
  return Path(root) / "params" / f"{Path(source).name}-{key}"


def remove_entries(root: Path, source: Path) -> list[Path]:
  """Removes every kept params directory of checkpoint directory `source` (whatever its settings:
  the checkpoint is gone); returns those removed."""
  pattern = re.compile(re.escape(Path(source).name) + r"-[0-9a-f]{12}(\.partial)?")
  gone = [p for p in (Path(root) / "params").glob(f"{Path(source).name}-*")
          if p.is_dir() and pattern.fullmatch(p.name)]
  for path in gone:
    shutil.rmtree(path, ignore_errors=True)
  return gone


def complete(path: Path) -> bool:
  """Whether `path` holds a finished cache (the manifest is written last, then renamed)."""
  return (Path(path) / MANIFEST).is_file()


def _file_name(index: int) -> str:
  return f"leaf-{index:05d}.npy"


def save(params, out: Path) -> Path:
  """Writes every leaf of `params` (arrays on one device) to OUT; returns OUT."""
  out = Path(out)
  tmp = out.with_name(out.name + ".partial")
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  names = {}
  for i, (key, leaf) in enumerate(leaves):
    np.save(tmp / _file_name(i), np.asarray(leaf), allow_pickle=False)
    names[jax.tree_util.keystr(key)] = _file_name(i)
  (tmp / MANIFEST).write_text(json.dumps({"leaves": names, "treedef": str(treedef)}, indent=1))
  shutil.rmtree(out, ignore_errors=True)
  tmp.rename(out)
  return out


def load(path: Path, like) -> object:
  """The params saved in PATH, in the tree structure of `like` (the model's abstract params,
  e.g. from jax.eval_shape), each leaf a read-only memory map handed to the default device;
  ValueError when the files do not match `like` (shape, dtype or leaves)."""
  path = Path(path)
  names = json.loads((path / MANIFEST).read_text())
  names = names.get("leaves") if isinstance(names, dict) else None
  leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
  if not isinstance(names, dict) or not all(isinstance(v, str) for v in names.values()):
    raise ValueError(f"{path / MANIFEST} lists no leaves")
  if sorted(names) != sorted(jax.tree_util.keystr(k) for k, _ in leaves):
    raise ValueError(f"{path}: the cached params' leaves do not match the model's")
  out = []
  for key, want in leaves:
    array = np.load(path / names[jax.tree_util.keystr(key)], mmap_mode="r", allow_pickle=False)
    if array.dtype.kind == "V" and array.dtype.itemsize == np.dtype(want.dtype).itemsize:
      array = array.view(want.dtype)       # .npy keeps bfloat16 (an ml_dtypes type) as raw bytes
    if array.shape != tuple(want.shape) or array.dtype != np.dtype(want.dtype):
      raise ValueError(f"{path}: {jax.tree_util.keystr(key)} is {array.dtype}{array.shape}, the "
                       f"model expects {np.dtype(want.dtype)}{tuple(want.shape)}")
    out.append(jax.device_put(array))
  return jax.tree_util.tree_unflatten(treedef, out)
