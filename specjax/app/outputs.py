"""Files the tools write. Output paths are checked before any work starts, so a long run never
ends in a write error, and an output that would overwrite one of the run's inputs is refused;
results are written atomically (a temporary file beside the target, then a rename), so a killed
run leaves the old file or the new one, never half of one; JSON is strict (a non-finite float is
written as null, which every JSON reader accepts). A path that exists and is not a regular file
(/dev/null, a FIFO, /dev/stdout) is written in place, never replaced."""

from __future__ import annotations

import contextlib
import fnmatch
import json
import math
import os
import pathlib
import stat
import tempfile
from typing import Any, Iterator, Mapping

import numpy as np

# The files of a checkpoint directory that an output must not overwrite.
CHECKPOINT_FILES = ("config.json", "generation_config.json", "*.safetensors",
                    "*.safetensors.index.json", "*.gguf", "*.bin", "*.model", "tokenizer*",
                    "vocab.*", "merges.txt", "special_tokens_map.json", "verifier.json")


class OutputPathError(ValueError):
  """An output path that cannot be written; the message names the path and the fix."""


def check_output_file(path: str | os.PathLike, flag: str) -> pathlib.Path:
  """The absolute path of a file the run will write, refused now if it cannot be written. A
  device, FIFO or /dev/stdout needs only to be writable itself (it is written in place)."""
  if not str(path).strip():
    raise OutputPathError(f"{flag} is empty: give a file name")
  out = pathlib.Path(path).expanduser().absolute()
  if out.is_dir():
    raise OutputPathError(f"{flag} {out} is a directory: give a file name")
  if writes_in_place(out):
    if not os.access(out, os.W_OK):
      raise OutputPathError(f"{flag} {out} is not writable: choose another path")
    return out
  if not out.parent.is_dir():
    blocker = next((p for p in out.parents if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
      raise OutputPathError(f"{flag} {out}: {blocker} is a file, not a directory: choose "
                            f"another path")
    raise OutputPathError(f"{flag} {out}: the directory {out.parent} does not exist; "
                          f"create it or choose another path")
  if (not os.access(out.parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK))
      or not _can_create_in(out.parent)):
    raise OutputPathError(f"{flag} {out} is not writable: choose another path")
  return out


def _can_create_in(directory: pathlib.Path) -> bool:
  """Whether a file can be made in `directory`, as the atomic write does (os.access says yes
  to root for /proc and for read-only mounts)."""
  try:
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".specjax-check-"):
      return True
  except OSError:
    return False


def check_workdir(path: str | os.PathLike, flag: str) -> pathlib.Path:
  """The absolute path of a directory the run will write into (created if missing), refused now
  if it is empty (it would mean the current directory), or cannot be created or written."""
  if not str(path).strip():
    raise OutputPathError(f"{flag} is empty: give the directory to write into (e.g. runs/NAME; "
                          f"'.' for the current directory)")
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


def check_not_input(output: str | os.PathLike | None, inputs: Mapping[str, Any],
                    flag: str) -> None:
  """Refuse an output (a file or a workdir) that is one of the run's inputs: `inputs` maps the
  flag that names each input to its path (None, '' and paths that do not exist are skipped; a
  directory stands for itself and the checkpoint files in it, CHECKPOINT_FILES). Paths are
  compared as files (os.path.samefile), so a symlink, a hard link or another spelling of the
  same path is caught. A new file or a device (written in place) destroys nothing."""
  if not output or not os.path.exists(output) or writes_in_place(output):
    return
  cache = _cache_root()
  if os.path.isfile(output) and _inside(pathlib.Path(output), cache):
    raise OutputPathError(f"{flag} {output} is in specjax's cache ({cache}, which holds the "
                          f"models it builds, fetches and converts): choose another path")
  for name, path in inputs.items():
    if path and os.path.exists(path) and _overwrites(pathlib.Path(output), pathlib.Path(path)):
      raise OutputPathError(f"{flag} {output} would overwrite {name} {path}, an input of this "
                            f"run: choose another path")


def _overwrites(output: pathlib.Path, source: pathlib.Path) -> bool:
  """Whether writing `output` replaces `source` or a checkpoint file of directory `source`:
  the file itself, or a link to it in `source` (a Hugging Face cache snapshot links each file
  to a blob elsewhere; the rename would replace the link)."""
  if os.path.samefile(output, source):
    return True
  if not source.is_dir():
    return False
  real = pathlib.Path(os.path.realpath(output))       # a symlink: the file it leads to
  as_named = pathlib.Path(os.path.abspath(output))
  return any(path.is_file() and os.path.samefile(path.parent, source)
             and any(fnmatch.fnmatch(path.name, p) for p in CHECKPOINT_FILES)
             for path in (real, as_named))


def _cache_root() -> pathlib.Path:
  """specjax's cache directory ($SPECJAX_CACHE, else ~/.cache/specjax), not created here."""
  return pathlib.Path(os.environ.get("SPECJAX_CACHE")
                      or os.path.join(os.path.expanduser("~"), ".cache", "specjax"))


def _inside(path: pathlib.Path, directory: pathlib.Path) -> bool:
  """Whether `path` (links resolved) lies under `directory`."""
  try:
    return pathlib.Path(os.path.realpath(path)).is_relative_to(os.path.realpath(directory))
  except OSError:
    return False


def writes_in_place(path: str | os.PathLike) -> bool:
  """True for an existing file that a rename must not replace: anything but a regular file or a
  directory (a character device such as /dev/null, a FIFO, a socket), or a path that leads
  through /proc (/dev/stdout, /dev/fd/N: the file behind a process's descriptor)."""
  try:
    mode = os.stat(path).st_mode
  except OSError:
    return False
  if stat.S_ISDIR(mode):
    return False
  return not stat.S_ISREG(mode) or _through_proc(path)


def _through_proc(path: str | os.PathLike) -> bool:
  """Whether resolving `path` link by link passes through /proc (realpath would resolve the
  descriptor's magic link to the file behind it and hide that)."""
  p = os.path.abspath(path)
  for _ in range(40):                                   # the kernel's own symlink limit
    p = os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))
    if p.startswith("/proc/"):
      return True
    if not os.path.islink(p):
      return False
    p = os.path.join(os.path.dirname(p), os.readlink(p))
  return False


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
  """A temporary path to write to. When the block ends without error it is renamed onto `path`
  (onto the file a symlink names, so the link stays), or, where `path` must not be replaced
  (`writes_in_place`), its bytes are written into `path` (OutputPathError naming it if that
  fails)."""
  out = pathlib.Path(path)
  in_place = writes_in_place(out)
  if in_place:
    fd, name = tempfile.mkstemp(prefix="specjax-", suffix=out.suffix)
    os.close(fd)
    tmp = pathlib.Path(name)
  else:
    out = pathlib.Path(os.path.realpath(out))
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp{out.suffix}")
  try:
    yield tmp
    if in_place:
      _write_into(out, tmp.read_bytes())
    else:
      os.replace(tmp, out)
  finally:
    tmp.unlink(missing_ok=True)


def _write_into(path: pathlib.Path, data: bytes) -> None:
  """`data` written into `path` as it stands (appended: a terminal or a file behind /dev/stdout
  keeps what was printed before); a failure (ENOSPC on /dev/full) names the path."""
  try:
    with open(path, "ab") as f:
      f.write(data)
  except OSError as err:
    raise OutputPathError(f"{path} could not be written ({err.strerror or err})") from None


def write_text(path: str | os.PathLike, text: str) -> None:
  """`text` written to `path` atomically (in place for a device, FIFO or /dev/stdout)."""
  with atomic_path(path) as tmp:
    tmp.write_text(text)


def write_json(path: str | os.PathLike, obj: Any) -> None:
  """Strict JSON (non-finite floats as null), written atomically."""
  write_text(path, json.dumps(strict(obj), indent=2, allow_nan=False, default=str) + "\n")
