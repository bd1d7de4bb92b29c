"""GGUF checkpoints -> cached Hugging Face directories.

A GGUF is converted once (dequantized to bfloat16 safetensors shards, with config.json and the
tokenizer files: models/gguf_import.convert, data/gguf_tokenizer.build) into CACHE/gguf/STEM-KEY,
where KEY digests the file's absolute path, size, modification time and the converter version,
so an edited or replaced file is converted again. Later runs load the directory like any HF
checkpoint: reading the GGUF again would parse its metadata (~15 s for a 150k-token vocabulary)
and dequantize every tensor with numpy (about a minute per billion weights on 2 cores).
"""

from __future__ import annotations

import logging
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specjax.data import gguf_tokenizer
from specjax.data.cache import build_lock, cache_dir, settings_key
from specjax.models import gguf_import

log = logging.getLogger(__name__)

CONVERTER_VERSION = 1


def hf_dir(gguf_path: Path) -> Path:
  """The converted directory of a GGUF file, converting it on first use."""
  path = Path(gguf_path).resolve()
  stat = path.stat()
  key = settings_key({"path": str(path), "size": stat.st_size, "mtime": stat.st_mtime_ns,
                      "v": CONVERTER_VERSION})
  out = cache_dir() / "gguf" / f"{path.stem}-{key}"
  if (out / "config.json").exists():
    return out
  with build_lock(f"gguf-{out.name}"):       # another process may be converting it
    if not (out / "config.json").exists():
      _convert(path, stat, out)
  return out


def _convert(path: Path, stat, out: Path) -> None:
  log.info("converting %s (%.2f GB) to a bfloat16 Hugging Face directory %s (first use only)",
           path.name, stat.st_size / 1e9, out)
  with _progress() as bar:
    task = bar.add_task(f"dequantizing {path.name}", total=None)
    ckpt = gguf_import.GGUFCheckpoint(path)
    gguf_import.convert(ckpt, out, gguf_tokenizer.build(ckpt),
                        on_tensor=lambda done, total, name: bar.update(
                            task, completed=done, total=total,
                            description=f"dequantizing {path.name}: {name}"))


def _progress() -> Progress:
  return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True))
