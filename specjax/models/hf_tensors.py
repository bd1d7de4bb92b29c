"""Reading checkpoint tensors lazily, and the helpers `params_from_hf` builds params with.

`LazyTensors` maps tensor names to arrays over single or sharded safetensors files; a lookup reads
one tensor from its memory-mapped file. A model module's params_from_hf first calls
`check_tensors` (names, shapes and dtypes from the file headers, before any data is read, so a
mismatched checkpoint is refused with nothing loaded), then builds each leaf with `to_device` or
`stack_layers`, which cast every tensor to the model dtype as it is read and put each leaf on the
device as it is built: the host holds one stacked leaf at a time, never a float32 model. Every
tensor read is checked for NaN / inf (chunk by chunk, while it is still in cache), so a damaged
checkpoint is refused by tensor and file instead of decoding padding.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

SOURCE_DTYPES = ("float16", "bfloat16", "float32", "float64")   # stored dtypes we cast from
_SAFETENSORS_DTYPES = {   # header code -> numpy name; others (F8_E4M3, ...) keep their code
    "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "BOOL": "bool",
    "I8": "int8", "U8": "uint8", "I16": "int16", "I32": "int32", "I64": "int64"}


class CorruptCheckpointError(ValueError):
  """A weights file (or shard index) that cannot be read: truncated, or not safetensors."""


class NonFiniteTensorError(CorruptCheckpointError):
  """A checkpoint tensor holding NaN or inf; carries the tensor's `name` and its file `path`."""

  def __init__(self, name: str, path: Path, count: int):
    super().__init__(f"{path}: tensor {name} holds {count} NaN/inf values: the checkpoint is "
                     f"damaged (or was saved after training diverged); re-download or re-export "
                     f"it")
    self.name, self.path = name, path


_FINITE_CHUNK = 1 << 22     # elements checked per step: a 16 MiB bool temporary at most


def check_finite(array: np.ndarray, name: str, path: Path) -> None:
  """Raise NonFiniteTensorError if a floating-point tensor holds NaN or inf. Chunked so that the
  check of a large embedding never allocates a mask of its size."""
  if not (np.issubdtype(array.dtype, np.floating) or array.dtype.name == "bfloat16"):
    return
  flat = array.reshape(-1)
  for start in range(0, flat.size, _FINITE_CHUNK):
    if not np.isfinite(flat[start:start + _FINITE_CHUNK]).all():
      raise NonFiniteTensorError(name, path, int(np.sum(~np.isfinite(flat))))


# Tensor names only one family writes -> how messages name that family.
_FAMILY_MARKERS = (("self_attn.q_proj.weight", "Llama-family (llama, mistral, qwen2, qwen3)"),
                   ("attn.c_attn.weight", "GPT-2"),
                   ("SelfAttention.q.weight", "T5"))


def guess_family(names) -> str | None:
  """The family whose tensor names these are (None when none matches): for messages about a
  config.json of one family next to the weights of another."""
  names = list(names)
  for marker, family in _FAMILY_MARKERS:
    if any(n.endswith(marker) for n in names):
      return family
  return None


def _open(path: Path):
  """safe_open, with the file named in the error a damaged file raises."""
  from safetensors import SafetensorError, safe_open
  try:
    return safe_open(str(path), framework="numpy")
  except (SafetensorError, OSError) as err:
    raise CorruptCheckpointError(f"{path} is not a readable safetensors file (truncated or "
                                 f"corrupt?): {err}") from err


class LazyTensors(Mapping):
  """name -> np.ndarray over single or sharded safetensors files; a lookup reads one tensor.

  Construction reads every file's header (names, shapes, dtypes), so a truncated or corrupt file
  is refused, by name, before any tensor data is read. A lookup maps the tensor's file, copies
  that one tensor out and unmaps the file again, so the pages it touched do not stay in this
  process's resident memory.
  """

  def __init__(self, files: list[Path]):
    self._file: dict[str, Path] = {}
    self._header: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in files:
      with _open(path) as handle:
        for name in handle.keys():
          info = handle.get_slice(name)
          dtype = info.get_dtype()
          self._file[name] = path
          self._header[name] = (tuple(info.get_shape()), _SAFETENSORS_DTYPES.get(dtype, dtype))

  def __getitem__(self, name: str) -> np.ndarray:
    tensor = self.raw(name)
    check_finite(tensor, name, self._file[name])
    return tensor

  def raw(self, name: str) -> np.ndarray:
    """The tensor as stored, not checked for NaN / inf (the caller checks it: FiniteChecks)."""
    with _open(self._file[name]) as handle:
      return handle.get_tensor(name)

  def file(self, name: str) -> Path:
    return self._file[name]

  def __contains__(self, name) -> bool:   # from the headers: Mapping's default would read it
    return name in self._file

  def __iter__(self) -> Iterator[str]:
    return iter(self._file)

  def __len__(self) -> int:
    return len(self._file)

  def header(self, name: str) -> tuple[tuple[int, ...], str]:
    """(shape, dtype name) of a tensor, without reading it."""
    return self._header[name]


def tensor_header(tensors: Mapping, name: str) -> tuple[tuple[int, ...], str]:
  """(shape, dtype name) of tensors[name]: from the file header when lazy, else the array's."""
  if hasattr(tensors, "header"):           # LazyTensors, gguf_import.HFTensors: no read
    return tensors.header(name)
  array = np.asarray(tensors[name])
  return array.shape, array.dtype.name


def check_tensors(tensors: Mapping, expected: Mapping[str, tuple[int, ...]], what: str,
                  hint: str) -> None:
  """Refuse, before any data is read, a checkpoint that lacks an expected tensor, holds one of
  another shape than the config implies, or stores one in a dtype outside SOURCE_DTYPES.
  expected: tensor name -> shape; what: the family ("GPT-2"); hint: the likely cause."""
  check_names(tensors, list(expected), what, hint)
  for name, want in expected.items():
    shape, dtype = tensor_header(tensors, name)
    if tuple(shape) != tuple(want):
      raise ValueError(f"{what} checkpoint tensor {name} has shape {tuple(shape)}; the config "
                       f"implies {tuple(want)}: {hint}")
    if dtype not in SOURCE_DTYPES:
      raise ValueError(f"{what} checkpoint tensor {name} is stored as {dtype}; specjax reads "
                       f"{', '.join(SOURCE_DTYPES)}: use the unquantized checkpoint (specjax "
                       f"quantizes it at load with quant='int8', --config.ROLE.quant=int8)")


def check_names(tensors: Mapping, expected: list[str], what: str, hint: str) -> None:
  """Refuse a checkpoint that lacks expected tensors, naming some (when its tensors are those of
  another family, say which: config.json's model_type does not match the weights), or that holds
  more layers than its config describes (their tensors would be dropped without a word)."""
  missing = [name for name in expected if name not in tensors]
  if not missing:
    _check_layer_count(tensors, expected, what, hint)
    return
  found = guess_family(tensors)
  if found is not None and not found.startswith(what):
    hint = (f"its tensors are those of a {found} checkpoint, but config.json describes a {what} "
            f"model: config.json and the weights come from different models")
  raise ValueError(f"{what} checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}: {hint}")


# A layer's tensors: GPT-2 h.3.*, Llama model.layers.3.*, T5 encoder.block.3.*, GGUF blk.3.*
_LAYER = re.compile(r"^(.*?\b(?:h|layers|block|blk))\.(\d+)\.")


def _layer_counts(names) -> dict[str, int]:
  """Layer-stack prefix -> the number of layers its names reach (highest index + 1)."""
  counts: dict[str, int] = {}
  for name in names:
    match = _LAYER.match(name)
    if match:
      counts[match[1]] = max(counts.get(match[1], 0), int(match[2]) + 1)
  return counts


def _check_layer_count(tensors: Mapping, expected: list[str], what: str, hint: str) -> None:
  have = _layer_counts(tensors)
  for prefix, want in _layer_counts(expected).items():
    if have.get(prefix, 0) > want:
      raise ValueError(f"{what} checkpoint holds {have[prefix]} layers ({prefix}.0 .. "
                       f"{prefix}.{have[prefix] - 1}) where its config describes {want}: {hint}")


def to_device(array: np.ndarray, dtype) -> jax.Array:
  """One leaf: cast on the host (bfloat16 through ml_dtypes), then put on the default device."""
  return jax.device_put(np.asarray(array).astype(dtype, copy=False))


def stack_layers(read_layer: Callable[[int], np.ndarray], num_layers: int, dtype) -> jax.Array:
  """A stacked [L, ...] leaf from read_layer(i), layer i's array in our orientation: each one is
  cast into its slot of one host buffer in the target dtype as it is read, and the buffer is
  put on the device, so loading holds one leaf on the host, never the model in float32."""
  first = np.asarray(read_layer(0))
  stacked = np.empty((num_layers,) + first.shape, dtype)                     # [L, ...]
  stacked[0] = first
  del first
  for i in range(1, num_layers):
    stacked[i] = read_layer(i)
  return jax.device_put(stacked)


def raw_tensor(tensors: Mapping, name: str) -> np.ndarray:
  """tensors[name] as stored: unchecked from a safetensors file (FiniteChecks checks it on the
  device), else the mapping's own lookup (which checks what it dequantizes)."""
  return tensors.raw(name) if isinstance(tensors, LazyTensors) else np.asarray(tensors[name])


@functools.partial(jax.jit, static_argnums=(1, 2))
def _convert(x: jax.Array, transpose: bool, dtype) -> tuple[jax.Array, jax.Array]:
  y = (x.T if transpose else x).astype(dtype)
  return y, jnp.sum(~jnp.isfinite(x)).astype(jnp.int32)


def to_param(array: np.ndarray, transpose: bool, dtype) -> tuple[jax.Array, jax.Array]:
  """One stored tensor -> (the param leaf on the default device, transposed if asked, in dtype;
  its count of NaN / inf values, not yet read). The cast runs on the device (multithreaded there)
  and the host keeps no converted copy."""
  return _convert(jax.device_put(array), transpose, dtype)


class FiniteChecks:
  """NaN / inf counts of the tensors of one load, read all at once at the end (one host sync,
  not one per tensor); raises NonFiniteTensorError naming the first bad tensor and its file."""

  def __init__(self, tensors: Mapping):
    self.tensors, self.counts = tensors, []

  def add(self, name: str, count: jax.Array) -> None:
    self.counts.append((name, count))

  def raise_if_any(self) -> None:
    if not self.counts:
      return
    counts = np.asarray(jnp.stack([c for _, c in self.counts]))
    for (name, _), count in zip(self.counts, counts):
      if count:
        where = (self.tensors.file(name) if isinstance(self.tensors, LazyTensors)
                 else getattr(self.tensors, "path", "?"))
        raise NonFiniteTensorError(name, Path(where), int(count))


def tree_set(tree: dict, path: tuple[str, ...], value) -> None:
  """tree[path[0]][path[1]]... = value, making the dicts on the way."""
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def tree_get(tree: dict, path: tuple[str, ...]):
  """tree[path[0]][path[1]]..."""
  for key in path:
    tree = tree[key]
  return tree
