"""Hugging Face checkpoints <-> specjax params: local directories, safetensors, tokenizers.

Each family's conversion module (models/convert/: gpt2, llama, t5) provides the
architecture-specific pieces (MODEL_TYPES, model_from_hf_config, params_from_hf, params_to_hf,
hf_config). This module finds files, reads and writes them, and dispatches on `model_type`.

Loading streams: `load_model` hands params_from_hf a lazy mapping (`hf_tensors.LazyTensors`) in
which each lookup reads one tensor from its memory-mapped safetensors file; the modules check
and place tensors with the helpers of `hf_tensors`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from specjax.models import convert
from specjax.models.hf_tensors import CorruptCheckpointError, LazyTensors


class CheckpointNotFoundError(FileNotFoundError):
  """A checkpoint directory or hub id that cannot be resolved offline; carries the `name`."""

  def __init__(self, message: str, name: str = ""):
    super().__init__(message)
    self.name = name


def _registry():
  return convert.families()


def resolve_checkpoint(name_or_dir: str) -> Path:
  """A local directory as is; a hub id through the local Hugging Face cache; else a clear error."""
  path = Path(os.path.expanduser(str(name_or_dir)))
  if path.is_dir():
    missing = [f for f in ("config.json",) if not (path / f).exists()]
    if not missing and _weight_files(path):
      return path
    weights = [] if _weight_files(path) else ["model.safetensors (or model.safetensors.index.json)"]
    raise CheckpointNotFoundError(f"checkpoint directory {path} is incomplete: missing "
                                  f"{', '.join(missing + weights)}.", str(name_or_dir))
  if _looks_like_path(str(name_or_dir)):
    what = "is a file, not a checkpoint directory" if path.exists() else "does not exist"
    raise CheckpointNotFoundError(
        f"checkpoint directory {_shown(path)} {what}: check the path (it should hold "
        f"config.json and model.safetensors; a hub id looks like ORG/NAME)", str(name_or_dir))
  try:
    from huggingface_hub import snapshot_download
    snap = Path(snapshot_download(str(name_or_dir), local_files_only=True))
    if (snap / "config.json").exists() and _weight_files(snap):
      return snap
  except Exception:  # offline and not cached: fall through to the explanation below
    pass
  raise CheckpointNotFoundError(
      f"checkpoint '{name_or_dir}' is not a local directory ({_shown(path)}) and is not in the "
      f"local Hugging Face cache (needed: config.json, model.safetensors or model.safetensors.index.json + shards, "
      f"and the tokenizer files). Download it on a machine with network access "
      f"(huggingface-cli download {name_or_dir} --local-dir DIR) and load it from DIR.",
      str(name_or_dir))


def _shown(path: Path) -> str:
  """A path as messages give it: a relative one with the directory it is taken from."""
  if path.is_absolute():
    return str(path)
  return f"{path}, relative to the current directory: {path.absolute()}"


def _looks_like_path(name: str) -> bool:
  """A name that can only be a local path: absolute, ~ or ./ ../, more than one '/', or a
  file's name (a hub id is ORG/NAME or NAME)."""
  return (name.startswith(("/", "~", "./", "../", ".\\")) or name.count("/") > 1
          or os.sep != "/" and os.sep in name or Path(name).exists())


def _weight_files(path: Path) -> list[Path]:
  index = path / "model.safetensors.index.json"
  if index.exists():
    try:
      shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, AttributeError) as err:
      raise CorruptCheckpointError(f"{index} is not a safetensors index (a JSON object with a "
                                   f"'weight_map'): {err!r}") from err
    return [path / s for s in shards]
  single = path / "model.safetensors"
  return [single] if single.exists() else []


def read_tensors(path: Path) -> LazyTensors:
  """The checkpoint's tensors, lazily (see LazyTensors); headers are checked here."""
  files = _weight_files(Path(path))
  for f in files:
    if not f.exists():
      raise CheckpointNotFoundError(f"shard {f} named in the safetensors index is missing")
  return LazyTensors(files)


def load_model(name_or_dir: str, dtype: str = "float32", precision: str | None = None,
               scan_layers: bool | None = None, layout: str | None = None, quant: str = ""):
  """Returns (model, params) for a local HF checkpoint directory or a cached hub id, the params
  read tensor by tensor straight into `dtype` on the default device. precision: the model's
  matmul precision (None: `default_precision(dtype)`; config.json does not carry it).
  scan_layers: the layer layout (models/layers.py; None: the default, stacked under nn.scan;
  False: layers_0 ... run by a loop, split from the stack as it is loaded). layout: a
  decoder-only model's dense-kernel layout (models/dense_layout.py; None: "in_out"), which the
  family's params_from_hf reads the tensors into. quant: "int8" loads a decoder-only model's
  dense kernels as int8 (models/quant.py), each quantized as it is read.
  Raises ValueError for an unsupported model_type, dtype or precision, or tensors that do not
  match config.json (before any data is read), CorruptCheckpointError for a damaged file."""
  path = resolve_checkpoint(name_or_dir)
  mod, model = _model(path, dtype, precision, scan_layers, layout, quant)
  tensors = read_tensors(path)
  try:
    params = mod.params_from_hf(model, tensors)
  except CorruptCheckpointError:      # names its file already
    raise
  except ValueError as err:            # a tensor config.json does not describe: name the path
    if str(path) in str(err):
      raise
    raise ValueError(f"{path}: {err}") from None
  return model, params


def model_from_dir(path: str | os.PathLike, dtype: str = "float32", precision: str | None = None,
                   scan_layers: bool | None = None, layout: str | None = None):
  """The model of a checkpoint directory, as load_model builds it, without reading its weights
  (params come from elsewhere, e.g. models.param_cache)."""
  return _model(Path(path), dtype, precision, scan_layers, layout)[1]


def _model(path: Path, dtype: str, precision: str | None, scan_layers: bool | None,
           layout: str | None = None, quant: str = ""):
  """(the family's module, the model) of config.json, with specjax's own settings applied."""
  hf_config = read_config(path / "config.json")
  model_type = hf_config.get("model_type")
  registry = _registry()
  if model_type not in registry:
    raise ValueError(f"{path}: model_type '{model_type}' is not supported; specjax reads "
                     f"{sorted(registry)}.")
  mod = registry[model_type]
  model = _model_from_config(mod, hf_config, dtype, path / "config.json")
  settings = {k: v for k, v in dict(precision=precision or default_precision(dtype),
                                     scan_layers=scan_layers, layout=layout,
                                     quant=quant or None).items()
              if v is not None}      # specjax settings that config.json does not carry
  model = dataclasses.replace(model, config=dataclasses.replace(model.config, **settings))
  return mod, model


def default_precision(dtype: str) -> str:
  """The matmul precision a model of `dtype` weights gets when none is asked for: "highest" for
  float32 (the default would round it to TF32 on NVIDIA GPUs and to bfloat16 passes on TPUs);
  "default" for 16-bit weights, whose products are exact in float32 at any precision, and which
  XLA:GPU runs as GEMMs at "default" but as slower reductions at "highest"."""
  return "highest" if dtype == "float32" else "default"


def read_config(file: Path) -> dict:
  """config.json as a dict; a file that is not a JSON object is refused by name."""
  return read_json_object(file, "a Hugging Face config.json")


def read_json_object(file: Path, what: str) -> dict:
  """A checkpoint's JSON file as a dict; CorruptCheckpointError naming the file when it is not
  JSON or not an object (`what`: the object it should hold, "a generation_config.json")."""
  try:
    config = json.loads(Path(file).read_text(encoding="utf-8"))
  except (ValueError, UnicodeDecodeError) as err:      # JSONDecodeError is a ValueError
    raise CorruptCheckpointError(f"{file} is not valid JSON ({err}): the checkpoint's files are "
                                 f"damaged; re-download or re-export them") from None
  if not isinstance(config, dict):
    raise CorruptCheckpointError(f"{file} holds a JSON {type(config).__name__}, not the object "
                                 f"of {what}")
  return config


# A config key only one family's config.json has -> the family and its model_type.
_CONFIG_MARKERS = (("n_embd", "gpt2"), ("d_kv", "t5"), ("intermediate_size", "llama-family"))


# Sizes a config.json of any family may hold (None where a family reads it as "off"). Special ids
# are not checked: transformers' GPT2Config keeps id 50256 for a vocabulary of any size.
_SIZE_KEYS = ("vocab_size", "n_positions", "n_ctx", "n_embd", "n_layer", "n_head", "n_inner",
              "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "max_position_embeddings", "sliding_window",
              "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads",
              "relative_attention_num_buckets", "relative_attention_max_distance")


def check_numbers(hf_config: dict, file: Path) -> None:
  """ValueError naming the first size of config.json that is not a whole number >= 1: a damaged
  file, which would otherwise build a model of nonsense shapes or fail inside arithmetic."""
  for key in _SIZE_KEYS:
    value = hf_config.get(key)
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool)
                                  and value >= 1):
      raise ValueError(f"{file}: {key}={value!r} is not a whole number >= 1; the file is "
                       f"damaged: use the config.json that came with the weights")


def _model_from_config(mod, hf_config: dict, dtype: str, file: Path):
  """mod.model_from_hf_config, with a missing key named (and, when the keys are another
  family's, that family) instead of a bare KeyError, and damaged numbers named (check_numbers)."""
  check_numbers(hf_config, file)
  if hf_config.get("quantization_config"):
    method = hf_config["quantization_config"]
    method = method.get("quant_method", "") if isinstance(method, dict) else ""
    raise ValueError(f"{file}: the checkpoint is quantized ({method or 'quantization_config'}); "
                     f"specjax reads float16, bfloat16 or float32 weights: use the unquantized "
                     f"checkpoint, and quantize it at load with --config.ROLE.quant=int8 (or "
                     f"quant='int8' in specjax.load)")
  try:
    return mod.model_from_hf_config(hf_config, dtype)
  except KeyError as err:
    key, model_type = err.args[0], hf_config.get("model_type")
    found = next((family for marker, family in _CONFIG_MARKERS if marker in hf_config), None)
    family = "llama-family" if model_type in ("llama", "mistral", "qwen2", "qwen3") else model_type
    if found is not None and found != family:
      marker = next(m for m, f in _CONFIG_MARKERS if f == found)
      raise ValueError(f"{file}: model_type '{model_type}' expects a {family} config, but the "
                       f"fields found are a {found} config's (it has '{marker}', lacks '{key}'): "
                       f"fix model_type or use the config.json that came with the weights"
                       ) from None
    raise ValueError(f"{file} (model_type '{model_type}') lacks the key '{key}' that a "
                     f"{model_type} config needs: the file is incomplete") from None
  except TypeError as err:          # e.g. a null or a string where a size belongs
    raise ValueError(f"{file} (model_type '{hf_config.get('model_type')}') has a field of the "
                     f"wrong type: {err}") from None
  except ValueError as err:         # sizes that do not fit together (heads that do not group)
    if str(file) in str(err):
      raise
    raise ValueError(f"{file}: {err}") from None


def save_model(model, params, out_dir: str) -> Path:
  """Export to the HF layout (config.json + model.safetensors) loadable by transformers."""
  from safetensors.numpy import save_file
  registry = _registry()
  mod = next(m for m in registry.values() if isinstance(model, m.MODEL_CLASS))
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  (out / "config.json").write_text(json.dumps(mod.hf_config(model), indent=2))
  tensors = {k: np.ascontiguousarray(np.asarray(v, dtype=np.float32))
             for k, v in mod.params_to_hf(model, params).items()}
  save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
  return out
