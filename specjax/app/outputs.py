"""Files the tools write. Output paths are checked before any work starts, so a long run never
ends in a write error; results are written atomically (a temporary file beside the target, then a
rename), so a killed run leaves the old file or the new one, never half of one; JSON is strict
(a non-finite float is written as null, which every JSON reader accepts)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
from typing import Any, Iterator

import numpy as np


class OutputPathError(ValueError):
  """An output path that cannot be written; the message names the path and the fix."""


def check_output_file(path: str | os.PathLike, flag: str) -> pathlib.Path:
  """The absolute path of a file the run will write, refused now if it cannot be written."""
  out = pathlib.Path(path).expanduser().absolute()
  if out.is_dir():
    raise OutputPathError(f"{flag} {out} is a directory: give a file name")
  if not out.parent.is_dir():
    raise OutputPathError(f"{flag} {out}: the directory {out.parent} does not exist; "
                          f"create it or choose another path")
  if not os.access(out.parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
    raise OutputPathError(f"{flag} {out} is not writable: choose another path")
  return out


def check_workdir(path: str | os.PathLike, flag: str) -> pathlib.Path:
  """The absolute path of a directory the run will write into (created if missing), refused now
  if it cannot be created or written."""
  out = pathlib.Path(path).expanduser().absolute()
  if out.exists() and not out.is_dir():
    raise OutputPathError(f"{flag} {out} is a file, not a directory: choose another path")
  try:
    out.mkdir(parents=True, exist_ok=True)
  except OSError as err:
    raise OutputPathError(f"{flag} {out} cannot be created ({err.strerror}): "
                          f"choose another path") from None
  if not os.access(out, os.W_OK | os.X_OK):
    raise OutputPathError(f"{flag} {out} is not writable: choose another path")
  return out


def strict(obj: Any) -> Any:
  """obj with every non-finite float replaced by None and numpy values made plain Python."""
  if isinstance(obj, dict):
    return {k: strict(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [strict(v) for v in obj]
  if isinstance(obj, np.ndarray):
    return strict(obj.tolist())
  if isinstance(obj, np.generic):
    obj = obj.item()
  if isinstance(obj, float) and not math.isfinite(obj):
    return None
  return obj


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[pathlib.Path]:
  """A temporary path to write to; renamed onto `path` when the block ends without error."""
  out = pathlib.Path(path)
  tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp{out.suffix}")
  try:
    yield tmp
    os.replace(tmp, out)
  finally:
    tmp.unlink(missing_ok=True)


def write_text(path: str | os.PathLike, text: str) -> None:
  with atomic_path(path) as tmp:
    tmp.write_text(text)


def write_json(path: str | os.PathLike, obj: Any) -> None:
  """Strict JSON (non-finite floats as null), written atomically."""
  write_text(path, json.dumps(strict(obj), indent=2, allow_nan=False, default=str) + "\n")
