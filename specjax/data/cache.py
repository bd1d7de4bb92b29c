"""Where specjax keeps files it can rebuild: extracted corpora and trained tokenizers.

The default is ~/.cache/specjax; the environment variable SPECJAX_CACHE overrides it (tests point
it at a temporary directory). Every cached file name carries the settings that produced it, so a
change of settings never reads a stale file.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib


def cache_dir() -> pathlib.Path:
  default = os.path.join(os.path.expanduser("~"), ".cache", "specjax")
  root = os.environ.get("SPECJAX_CACHE") or default
  path = pathlib.Path(root)
  path.mkdir(parents=True, exist_ok=True)
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
