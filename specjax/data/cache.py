"""Where specjax keeps files it can rebuild: extracted corpora and trained tokenizers.

The default is ~/.cache/specjax; the environment variable SPECJAX_CACHE overrides it (tests point
it at a temporary directory). Every cached file name carries the settings that produced it, so a
change of settings never reads a stale file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pathlib
import threading
from typing import Iterator

import filelock

log = logging.getLogger(__name__)


def cache_dir() -> pathlib.Path:
  default = os.path.join(os.path.expanduser("~"), ".cache", "specjax")
  root = os.environ.get("SPECJAX_CACHE") or default
  path = pathlib.Path(root)
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as err:
    where = "$SPECJAX_CACHE" if os.environ.get("SPECJAX_CACHE") else "the default cache"
    raise ValueError(f"{where} {path} cannot be used as specjax's cache directory "
                     f"({err.strerror or err}): point SPECJAX_CACHE at a writable directory") from None
  return path


def settings_key(settings: dict) -> str:
  """A short stable digest of a JSON-serialisable settings dict (sorted keys)."""
  blob = json.dumps(settings, sort_keys=True, default=str).encode()
  return hashlib.sha256(blob).hexdigest()[:12]


def atomic_write_bytes(path: pathlib.Path, data: bytes) -> None:
  """Write via a temporary file and rename, so a killed process never leaves half a file."""
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  tmp.write_bytes(data)
  os.replace(tmp, path)


_LOCKS: dict[str, filelock.FileLock] = {}
_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def build_lock(name: str) -> Iterator[None]:
  """Hold CACHE/locks/NAME.lock (an OS file lock: released when the process dies) while a cache
  entry is built or checked: a pair fetched, a GGUF converted, the embedded pair trained. Another
  process waits for it, saying for which process. Re-entrant in one thread (one lock object per
  name), so a build may resolve other entries under it."""
  path = cache_dir() / "locks" / f"{name.replace('/', '_')}.lock"
  path.parent.mkdir(parents=True, exist_ok=True)
  with _LOCKS_GUARD:
    lock = _LOCKS.setdefault(str(path), filelock.FileLock(str(path)))
  pid_file = path.with_name(path.name + ".pid")
  try:
    lock.acquire(timeout=0)
  except filelock.Timeout:
    holder = pid_file.read_text().strip() if pid_file.exists() else "?"
    log.info("waiting for process %s, which is building %s in %s ...", holder, name,
             cache_dir())
    lock.acquire()
  try:
    if lock.lock_counter == 1:
      pid_file.write_text(f"{os.getpid()}\n")
    yield
  finally:
    lock.release()
