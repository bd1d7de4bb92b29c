"""Resolve a config section (`target` / `draft`) into a model, its params and its tokenizer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import ml_collections

from specjax.models import hf_import


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  model: object        # satisfies the model contract (docs/architecture.md)
  params: object       # pytree of arrays
  tokenizer: object    # encode / decode / vocab_size / pad_id / eos_id / bos_id
  path: Path


def checkpoint_dir(section: ml_collections.ConfigDict, flag: str) -> Path:
  """Local directory of a section's checkpoint; `builtin:NAME/ROLE` builds the embedded default."""
  name = str(section.checkpoint)
  if name.startswith("builtin:"):
    from specjax import zoo
    return zoo.ensure(name.removeprefix("builtin:"))
  return hf_import.resolve_checkpoint(name, flag)


def load(section: ml_collections.ConfigDict, role: str) -> LoadedModel:
  flag = f"--config.{role}.checkpoint"
  path = checkpoint_dir(section, flag)
  model, params = hf_import.load_model(str(path), section.get("dtype", "float32"), flag)
  tokenizer = load_tokenizer(section, path)
  return LoadedModel(model=model, params=jax.device_put(params), tokenizer=tokenizer, path=path)


SPM_FILE = "spm.model"   # a SentencePiece model saved beside specjax-trained checkpoints


def load_tokenizer(section: ml_collections.ConfigDict, path: Path):
  """`section.tokenizer` if set, else the checkpoint's own: spm.model or the HF tokenizer files."""
  from specjax.data.tokenizer import get_tokenizer
  spec = section.get("tokenizer") or (str(path / SPM_FILE) if (path / SPM_FILE).exists()
                                       else str(path))
  return get_tokenizer(spec)
