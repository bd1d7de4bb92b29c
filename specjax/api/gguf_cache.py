"""GGUF checkpoints -> cached Hugging Face directories.

A GGUF is converted once (dequantized to bfloat16 safetensors shards, with config.json and the
tokenizer files: models/gguf_import.convert, data/gguf_tokenizer.build) into CACHE/gguf/STEM-KEY,
where KEY digests the file's absolute path, size, modification time and the converter version,
so an edited or replaced file is converted again. Later runs load the directory like any HF
checkpoint: reading the GGUF again would parse its metadata (~15 s for a 150k-token vocabulary)
and dequantize every tensor with numpy (about a minute per billion weights on 2 cores).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specjax.data import gguf_tokenizer
from specjax.data.cache import atomic_write_bytes, build_lock, cache_dir, settings_key
from specjax.models import gguf_import, param_cache

log = logging.getLogger(__name__)

CONVERTER_VERSION = 3      # 2: the tokenizer adds BOS where the GGUF says add_bos_token
                           # 3: fill-in-the-middle separators end a generation (llama.cpp's)
MANIFEST = "converted-files.json"    # the files a conversion wrote -> their sizes


def hf_dir(gguf_path: Path) -> Path:
  """The converted directory of a GGUF file, converting it on first use."""
  path = Path(gguf_path).resolve()
  stat = path.stat()
  out = _converted(path, stat, CONVERTER_VERSION)
  if _intact(out):
    return out
  with build_lock(f"gguf-{out.name}"):       # another process may be converting it
    if not _intact(out, path):
      _convert(path, stat, out)
      _write_manifest(out)
      _remove_older(path, stat)
  return out


def _converted(path: Path, stat, version: int) -> Path:
  """The directory of `path`'s conversion by converter `version`."""
  key = settings_key({"path": str(path), "size": stat.st_size, "mtime": stat.st_mtime_ns,
                      "v": version})
  return cache_dir() / "gguf" / f"{path.stem}-{key}"


def _remove_older(path: Path, stat) -> None:
  """Remove this file's conversions by older converters (the real pair's are 4.6 GB) and the
  params kept from them (models/param_cache: a few GB per weight format)."""
  for version in range(1, CONVERTER_VERSION):
    stale = _converted(path, stat, version)
    if stale.exists():
      log.info("removing %s: this GGUF's conversion by an older specjax", stale)
      shutil.rmtree(stale, ignore_errors=True)
    for kept in param_cache.remove_entries(cache_dir(), stale):
      log.info("removed %s: params kept from that conversion", kept)


def _intact(out: Path, source: Path | None = None) -> bool:
  """Whether a converted directory is complete: its config.json, and every file its conversion
  listed in MANIFEST at the size it was written (an entry from before the list was kept is taken
  as it is). With `source`, a damaged entry is logged as being converted again."""
  if not (out / "config.json").exists():
    return False
  try:
    listed = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    damaged = [name for name, size in listed.items()
               if not (out / name).is_file() or (out / name).stat().st_size != size]
  except FileNotFoundError:
    return True
  except (ValueError, OSError, AttributeError):
    damaged = [MANIFEST]
  if damaged and source is not None:
    log.warning("the converted directory %s is damaged (%s missing or of another size): "
                "converting %s again", out, ", ".join(damaged[:3]), source.name)
  return not damaged


def _write_manifest(out: Path) -> None:
  files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
  atomic_write_bytes(out / MANIFEST, json.dumps(files, indent=1).encode())


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
