"""GGUF files (llama.cpp's format) -> a Llama-family model and its params.

A GGUF holds metadata (the architecture's hyperparameters under `<arch>.*`, the tokenizer under
`tokenizer.*`) and tensors, most of them quantized in blocks of 32 or 256 values. The import goes
through the Hugging Face tensor names that models/convert/llama.py reads, so one name table serves
both formats:

  GGUF `blk.{i}.attn_q.weight` -> HF `model.layers.{i}.self_attn.q_proj.weight` (`_LAYER_NAMES`),
  dequantized to float32 on lookup (`gguf.quants.dequantize`: Q4_K, Q5_0, Q6_K, Q8_0, F16, ...),
  one tensor at a time, so no float32 copy of the whole model is built. llama-architecture GGUFs
  store the q/k rows of every head with the rotary halves interleaved (llama.cpp's converter
  permutes them for its rope kernel): `_unpermute` undoes that. qwen2 / qwen3 GGUFs do not permute.

The tokenizer is rebuilt from `tokenizer.ggml.*` in the data layer (data/gguf_tokenizer.py);
here are the special ids the metadata names (`special_ids`). `convert` writes the whole
checkpoint as a Hugging Face directory (config.json, safetensors shards, the tokenizer it is
given, generation_config.json) that every specjax loader and transformers read.

Files are checked before the `gguf` reader parses them (`check_file`): a truncated or corrupted
file is refused with the byte offset and what was expected there.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
import struct
from pathlib import Path
from typing import Callable, Iterator, Mapping

import numpy as np

from specjax.models import hf_tensors
from specjax.models.convert import llama as convert_llama

log = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "qwen2", "qwen3")   # general.architecture values read here
PERMUTED_ARCHITECTURES = ("llama",)           # q/k rows interleaved by llama.cpp's converter

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    **{f"{g}.{kind}": f"{hf}.{kind}" for g, hf in (
        ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
        ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
        ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"))
       for kind in ("weight", "bias")},
}

# Control tokens that end a generation besides the file's eos/eot/eom ids (llama.cpp's list).
# llama.cpp also ends at the fill-in-the-middle pad, repository and file separators (Qwen2.5-Coder
# writes <|file_sep|> and then another file, which a text without special tokens would join).
_END_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
              "<end_of_turn>", "<|end_of_text|>", "<EOT>", "<|fim_pad|>", "<|repo_name|>",
              "<|file_sep|>")
CONTROL, USER_DEFINED = 3, 4   # gguf.TokenType of control and user-defined tokens


class GGUFError(ValueError):
  """A GGUF file that is corrupt, truncated, or holds something specjax cannot import."""


# ---------------------------------------------------------------------------------------------
# Finding and checking files.


def find_gguf(path: str | Path) -> Path | None:
  """`path` itself if it is a .gguf file; the one .gguf in a directory without config.json; else
  None (not a GGUF checkpoint)."""
  path = Path(path).expanduser()
  if path.is_file() and path.suffix == ".gguf":
    return path
  if not path.is_dir() or (path / "config.json").exists():
    return None
  found = sorted(path.glob("*.gguf"))
  if len(found) > 1:
    raise GGUFError(f"{path} holds several GGUF files ({', '.join(f.name for f in found)}): "
                    f"name one of them as the checkpoint.")
  return found[0] if found else None


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _MAX_DIMS = 8, 9, 4


class _Cursor:
  """Bounded reads over the file's bytes: running past the end names the offset and the field."""

  def __init__(self, data, path: Path):
    self.data, self.pos, self.path = data, 0, path

  def fail(self, at: int, message: str):
    raise GGUFError(f"{self.path}: offset {at}: {message}")

  def take(self, n: int, what: str):
    if self.pos + n > len(self.data):
      self.fail(self.pos, f"expected {what} ({n} bytes) but the file ends at byte "
                          f"{len(self.data)} (truncated?)")
    out = self.data[self.pos:self.pos + n]
    self.pos += n
    return out

  def u32(self, what: str) -> int:
    return struct.unpack("<I", self.take(4, what))[0]

  def u64(self, what: str) -> int:
    return struct.unpack("<Q", self.take(8, what))[0]

  def string(self, what: str) -> str:
    at = self.pos
    raw = self.take(self.u64(f"the length of {what}"), what)
    try:
      return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
      self.fail(at, f"expected {what} as UTF-8 text")

  def value_type(self, what: str) -> int:
    at, kind = self.pos, self.u32(f"the value type of {what}")
    if kind not in _SCALAR_SIZES and kind not in (_STRING, _ARRAY):
      self.fail(at, f"expected a GGUF value type (0-12) for {what}, found {kind}")
    return kind

  def skip_value(self, kind: int, what: str) -> None:
    if kind == _STRING:
      self.string(what)
    elif kind == _ARRAY:
      item, count = self.value_type(f"the items of {what}"), self.u64(f"the length of {what}")
      if item in _SCALAR_SIZES:
        self.take(_SCALAR_SIZES[item] * count, f"{count} items of {what}")
      else:
        for i in range(count):
          self.skip_value(item, f"item {i} of {what}")
    else:
      self.take(_SCALAR_SIZES[kind], what)


def check_file(path: str | Path) -> None:
  """Walks the header, metadata and tensor table, and checks that every tensor's data lies inside
  the file; raises GGUFError naming the offset and what was expected there."""
  import gguf
  path = Path(path)
  with path.open("rb") as f:
    data = f.read() if path.stat().st_size < (1 << 20) else _mmap(f)
    cur = _Cursor(data, path)
    magic = bytes(cur.take(4, "the magic b'GGUF'"))
    if magic != b"GGUF":
      cur.fail(0, f"expected the magic b'GGUF', found {magic!r} (not a GGUF file)")
    version = cur.u32("the GGUF version")
    if version not in (2, 3):
      cur.fail(4, f"expected GGUF version 2 or 3 (little-endian), found {version}")
    tensor_count, kv_count = cur.u64("the tensor count"), cur.u64("the metadata count")
    alignment = _walk_metadata(cur, kv_count)
    tensors = [_tensor_info(cur, gguf) for _ in range(tensor_count)]
    start = -(-cur.pos // alignment) * alignment
    for name, kind, shape, offset in tensors:
      _check_extent(cur, gguf, name, kind, shape, start + offset)


def _mmap(f):
  import mmap
  return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


def _walk_metadata(cur: _Cursor, count: int) -> int:
  """Skips the key-value pairs; returns general.alignment (32 when absent)."""
  alignment = 32
  for i in range(count):
    key = cur.string(f"the key of metadata entry {i}")
    kind = cur.value_type(f"'{key}'")
    if key == "general.alignment" and kind == 4:
      alignment = cur.u32("'general.alignment'")
    else:
      cur.skip_value(kind, f"the value of '{key}'")
  if alignment <= 0 or alignment % 8:
    cur.fail(cur.pos, f"expected general.alignment to be a positive multiple of 8, found {alignment}")
  return alignment


def _tensor_info(cur: _Cursor, gguf):
  name = cur.string("a tensor name")
  at, dims = cur.pos, cur.u32(f"the rank of tensor '{name}'")
  if not 1 <= dims <= _MAX_DIMS:
    cur.fail(at, f"expected tensor '{name}' to have 1-{_MAX_DIMS} dimensions, found {dims}")
  shape = [cur.u64(f"dimension {d} of tensor '{name}'") for d in range(dims)]
  at, kind = cur.pos, cur.u32(f"the type of tensor '{name}'")
  if kind not in gguf.GGML_QUANT_SIZES:
    cur.fail(at, f"expected a GGML tensor type for '{name}', found {kind}")
  return name, kind, shape, cur.u64(f"the data offset of tensor '{name}'")


def _check_extent(cur: _Cursor, gguf, name: str, kind: int, shape: list[int], begin: int):
  block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
  type_name = gguf.GGMLQuantizationType(kind).name
  if shape[0] % block:
    raise GGUFError(f"{cur.path}: tensor '{name}' ({type_name}) has rows of {shape[0]} values, "
                    f"not a multiple of its block size {block}")
  end = begin + int(np.prod(shape)) // block * block_bytes
  if end > len(cur.data):
    raise GGUFError(f"{cur.path}: offset {begin}: expected the data of tensor '{name}' "
                    f"({type_name}, shape {shape}) in bytes {begin}..{end}, but the file ends at "
                    f"byte {len(cur.data)} (truncated: {end - len(cur.data)} bytes missing)")


# ---------------------------------------------------------------------------------------------
# Reading.


@functools.cache
def _reader_class(gguf):
  """gguf.GGUFReader reading through a plain ndarray view of its memory map. The reader slices its
  `data` once per value while it parses the metadata (300,000 for a 151,936-token vocabulary and
  its merges), and each slice of a np.memmap runs memmap's Python __array_finalize__, most of
  the time a file took to open (docs/results.md); the tensors' data, plain views of the same
  mapped bytes, dequantize without that cost too."""

  class PlainReader(gguf.GGUFReader):
    @property
    def data(self):
      return self._plain

    @data.setter
    def data(self, mapped):
      self._plain = mapped.view(np.ndarray)

  return PlainReader


class GGUFCheckpoint:
  """An opened GGUF: its metadata (key -> Python value) and its tensors by GGUF name."""

  def __init__(self, path: str | Path):
    import gguf
    self.path = Path(path)
    check_file(self.path)
    try:
      reader = _reader_class(gguf)(self.path)
    except (ValueError, IndexError, KeyError, OverflowError) as err:   # passed check_file
      raise GGUFError(f"{self.path}: the gguf reader refused the file: {err}") from None
    self.metadata = {k: f.contents() for k, f in reader.fields.items()
                     if not k.startswith("GGUF.")}
    self.tensors = {t.name: t for t in reader.tensors}

  @property
  def architecture(self) -> str:
    return self.metadata.get("general.architecture", "")

  def get(self, key: str, default=None):
    """`<arch>.key` of the metadata."""
    return self.metadata.get(f"{self.architecture}.{key}", default)

  def require(self, key: str):
    value = self.get(key)
    if value is None:
      raise GGUFError(f"{self.path}: metadata lacks '{self.architecture}.{key}'")
    return value

  def shape(self, name: str) -> tuple[int, ...]:
    """The numpy (row-major) shape: GGUF lists dimensions fastest first."""
    return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

  def dequantized(self, name: str) -> np.ndarray:
    """One tensor as float32 in its numpy shape."""
    import gguf
    tensor = self.tensors[name]
    try:
      values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as err:
      raise GGUFError(f"{self.path}: tensor '{name}': {err}") from None
    return np.asarray(values, np.float32).reshape(self.shape(name))

  def is_quantized(self, name: str) -> bool:
    import gguf
    plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
             gguf.GGMLQuantizationType.BF16)
    return self.tensors[name].tensor_type not in plain


def hf_name(gguf_name: str) -> str | None:
  """The HF tensor name of a GGUF tensor name (None: a tensor specjax does not read)."""
  if gguf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[gguf_name]
  prefix, _, rest = gguf_name.partition(".")
  index, _, leaf = rest.partition(".")
  if prefix == "blk" and index.isdigit() and leaf in _LAYER_NAMES:
    return f"model.layers.{index}.{_LAYER_NAMES[leaf]}"
  return None


def _unpermute(tensor: np.ndarray, heads: int) -> np.ndarray:
  """Inverse of llama.cpp's `permute` of q/k rows ([out, ...]): per head, rows (0, Dh/2, 1,
  Dh/2+1, ...) back to HF's rotate-half order (0, 1, ..., Dh-1)."""
  rows = tensor.shape[0]
  return (tensor.reshape(heads, rows // heads // 2, 2, *tensor.shape[1:])
          .swapaxes(1, 2).reshape(tensor.shape))


class HFTensors(Mapping):
  """HF tensor name -> float32 numpy array, dequantized (and un-permuted) on each lookup: the
  lazy Mapping `convert_llama.params_from_hf` reads."""

  def __init__(self, ckpt: GGUFCheckpoint):
    self.ckpt = ckpt
    self._names = {hf: g for g in ckpt.tensors if (hf := hf_name(g)) is not None}
    permuted = ckpt.architecture in PERMUTED_ARCHITECTURES
    heads = int(ckpt.require("attention.head_count"))
    kv_heads = int(ckpt.get("attention.head_count_kv") or heads)
    self._heads = {"q_proj": heads, "k_proj": kv_heads} if permuted else {}

  def gguf_name(self, name: str) -> str:
    return self._names[name]

  def __getitem__(self, name: str) -> np.ndarray:
    tensor = self.ckpt.dequantized(self._names[name])
    hf_tensors.check_finite(tensor, self._names[name], self.ckpt.path)
    projection = name.split(".")[-2]
    if projection in self._heads:
      tensor = _unpermute(tensor, self._heads[projection])
    return tensor

  def header(self, name: str) -> tuple[tuple[int, ...], str]:
    """(shape, dtype name) of a tensor as a lookup returns it, without dequantizing it."""
    return self.ckpt.shape(self._names[name]), "float32"

  def __contains__(self, name) -> bool:   # from the names: Mapping's default would dequantize
    return name in self._names

  def __iter__(self) -> Iterator[str]:
    return iter(self._names)

  def __len__(self) -> int:
    return len(self._names)


# ---------------------------------------------------------------------------------------------
# Model config.


def hf_config(ckpt: GGUFCheckpoint) -> dict:
  """The HF config.json dict the metadata describes (what convert/llama.py's model_from_hf_config
  reads)."""
  arch = ckpt.architecture
  if arch not in ARCHITECTURES:
    raise GGUFError(f"{ckpt.path}: general.architecture '{arch}' is not supported; specjax "
                    f"imports GGUF architectures {ARCHITECTURES}.")
  if "rope_freqs.weight" in ckpt.tensors:
    raise GGUFError(f"{ckpt.path}: rope scaling stored as a rope_freqs tensor (Llama 3.1 style) "
                    f"is not supported by the GGUF import.")
  heads = int(ckpt.require("attention.head_count"))
  kv_heads = ckpt.get("attention.head_count_kv") or heads
  if not isinstance(kv_heads, int):
    raise GGUFError(f"{ckpt.path}: per-layer KV head counts are not supported.")
  d_model = int(ckpt.require("embedding_length"))
  vocab, width = ckpt.shape("token_embd.weight")
  if width != d_model:
    raise GGUFError(f"{ckpt.path}: token_embd.weight has shape {(vocab, width)} but "
                    f"{arch}.embedding_length is {d_model}")
  config = dict(
      model_type=arch, vocab_size=vocab, hidden_size=d_model,
      intermediate_size=int(ckpt.require("feed_forward_length")),
      num_hidden_layers=int(ckpt.require("block_count")), num_attention_heads=heads,
      num_key_value_heads=int(kv_heads),
      head_dim=int(ckpt.get("attention.key_length") or d_model // heads),
      rms_norm_eps=_float32(ckpt.require("attention.layer_norm_rms_epsilon")),
      rope_theta=_float32(ckpt.get("rope.freq_base", 10000.0)),
      rope_scaling=_rope_scaling(ckpt),
      max_position_embeddings=int(ckpt.get("context_length", 4096)),
      tie_word_embeddings="output.weight" not in ckpt.tensors, hidden_act="silu",
      **special_ids(ckpt.metadata))
  if arch == "llama":    # biases are visible only as tensors
    config["attention_bias"] = "blk.0.attn_q.bias" in ckpt.tensors
    config["mlp_bias"] = "blk.0.ffn_up.bias" in ckpt.tensors
  _check_metadata(ckpt, config)
  return config


# config.json field -> the metadata key (after "ARCH.") it comes from.
_METADATA_KEYS = {"hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
                  "num_hidden_layers": "block_count", "num_attention_heads": "attention.head_count",
                  "num_key_value_heads": "attention.head_count_kv",
                  "head_dim": "attention.key_length",
                  "max_position_embeddings": "context_length",
                  "rms_norm_eps": "attention.layer_norm_rms_epsilon",
                  "rope_theta": "rope.freq_base"}


def _check_metadata(ckpt: GGUFCheckpoint, config: dict) -> None:
  """GGUFError naming the file and the metadata key of a value no model has (a size below 1, a
  non-finite or non-positive epsilon or rope base, heads that do not group, a block count other
  than the file's layers), before anything is converted."""
  arch = ckpt.architecture
  bad = lambda field, why: GGUFError(f"{ckpt.path}: {arch}.{_METADATA_KEYS[field]} is "
                                     f"{config[field]}: {why}; the file is damaged")
  for field in _METADATA_KEYS:
    value = config[field]
    if isinstance(value, float) and not (np.isfinite(value) and value > 0):
      raise bad(field, "it must be a finite number > 0")
    if isinstance(value, int) and value < 1:
      raise bad(field, "it must be at least 1")
  if config["num_attention_heads"] % config["num_key_value_heads"]:
    raise bad("num_key_value_heads", f"the {config['num_attention_heads']} attention heads "
              f"must group evenly over it")
  layers = {name.split(".")[1] for name in ckpt.tensors if name.startswith("blk.")}
  if len(layers) != config["num_hidden_layers"]:
    raise bad("num_hidden_layers", f"the file holds tensors of {len(layers)} layers")


def _gguf_name(name: str) -> str:
  """The GGUF name of an HF tensor name (hf_name's inverse)."""
  globals_ = {hf: g for g, hf in _GLOBAL_NAMES.items()}
  if name in globals_:
    return globals_[name]
  index, leaf = name.split(".", 3)[2:]
  return f"blk.{index}.{next(g for g, hf in _LAYER_NAMES.items() if hf == leaf)}"


def _check_tensors(ckpt: GGUFCheckpoint, model) -> None:
  """GGUFError naming the file and a tensor that the metadata implies but the file lacks or holds
  in another shape (the metadata and the tensors disagree), before anything is converted."""
  for name, want in convert_llama.hf_shapes(model).items():
    gguf_name = _gguf_name(name)
    if gguf_name not in ckpt.tensors:
      raise GGUFError(f"{ckpt.path}: the file lacks tensor '{gguf_name}', which its metadata "
                      f"implies; the file is damaged or incomplete")
    if ckpt.shape(gguf_name) != want:
      raise GGUFError(f"{ckpt.path}: tensor '{gguf_name}' has shape {ckpt.shape(gguf_name)} but "
                      f"the metadata ({_sizes(ckpt)}) implies {want}; the file is damaged")


def _sizes(ckpt: GGUFCheckpoint) -> str:
  """The metadata sizes that set the tensors' shapes, as `key=value` text."""
  keys = ("embedding_length", "feed_forward_length", "attention.head_count",
          "attention.head_count_kv", "attention.key_length")
  return ", ".join(f"{ckpt.architecture}.{k}={ckpt.get(k)}" for k in keys
                   if ckpt.get(k) is not None)


def _float32(value) -> float:
  """A float32 metadata value as the decimal it was written from (9.99999997e-07 -> 1e-06)."""
  return float(f"{float(value):.7g}")


def _rope_scaling(ckpt: GGUFCheckpoint) -> dict | None:
  kind = ckpt.get("rope.scaling.type", "none")
  if kind == "none":
    return None
  if kind == "linear":
    return {"rope_type": "linear", "factor": _float32(ckpt.require("rope.scaling.factor"))}
  raise GGUFError(f"{ckpt.path}: rope scaling '{kind}' is not supported (none, linear).")


def special_ids(metadata: dict) -> dict:
  """bos / eos (every end-of-generation id, the file's eos first) / pad of the tokenizer."""
  get = lambda name: metadata.get(f"tokenizer.ggml.{name}_token_id")
  tokens = metadata.get("tokenizer.ggml.tokens") or []
  types = metadata.get("tokenizer.ggml.token_type") or []
  ends = [i for i, (text, kind) in enumerate(zip(tokens, types))
          if kind == CONTROL and text in _END_TEXTS]
  fim = (get("fim_pad"), get("fim_rep"), get("fim_sep"))
  eos = [i for i in (get("eos"), get("eot"), get("eom"), *fim, *ends) if i is not None]
  eos = list(dict.fromkeys(int(i) for i in eos))
  return dict(bos_token_id=get("bos"), pad_token_id=get("padding"),
              eos_token_id=eos[0] if len(eos) == 1 else (eos or None))


def load_model(path: str | Path, dtype: str = "float32"):
  """(model, params) of a GGUF file, dequantized tensor by tensor to `dtype`."""
  ckpt = GGUFCheckpoint(path)
  model = convert_llama.model_from_hf_config(hf_config(ckpt), dtype)
  return model, convert_llama.params_from_hf(model, HFTensors(ckpt))


def generation_config(ckpt: GGUFCheckpoint) -> dict:
  """generation_config.json: every end-of-generation id, bos and pad."""
  return {k: v for k, v in special_ids(ckpt.metadata).items() if v is not None}


# ---------------------------------------------------------------------------------------------
# Conversion to a Hugging Face directory.


def storage_dtype(ckpt: GGUFCheckpoint, gguf_name: str):
  """Quantized tensors are stored as bfloat16 (their dequantized values rounded once, half the
  bytes of float32); F32 / F16 / BF16 tensors keep their own dtype (lossless)."""
  import ml_dtypes
  if ckpt.is_quantized(gguf_name):
    return ml_dtypes.bfloat16
  return {"F32": np.float32, "F16": np.float16,
          "BF16": ml_dtypes.bfloat16}[ckpt.tensors[gguf_name].tensor_type.name]


def convert(ckpt: "GGUFCheckpoint", out_dir: str | Path, tokenizer, shard_bytes: int = 1 << 30,
            on_tensor: Callable[[int, int, str], None] | None = None) -> Path:
  """Writes the opened GGUF as a Hugging Face checkpoint directory (config.json, model
  safetensors shards of at most `shard_bytes` + index, generation_config.json, and the files of
  `tokenizer`: the one the metadata describes, data/gguf_tokenizer.build), tensor by tensor;
  built under OUT.partial and renamed when complete. on_tensor(done, total, name) is called
  after each tensor (progress)."""
  from safetensors.numpy import save_file
  model = convert_llama.model_from_hf_config(hf_config(ckpt), "float32")   # checks the config
  _check_tensors(ckpt, model)
  out = Path(out_dir)
  tmp = out.with_name(out.name + ".partial")
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  tensors = HFTensors(ckpt)
  shards, shard, size = [], {}, 0
  for done, name in enumerate(sorted(tensors), 1):
    shard[name] = tensors[name].astype(storage_dtype(ckpt, tensors.gguf_name(name)))
    size += shard[name].nbytes
    if size >= shard_bytes:
      shards.append(_save_shard(save_file, tmp, shard, len(shards)))
      shard, size = {}, 0
    if on_tensor:
      on_tensor(done, len(tensors), name)
  if shard:
    shards.append(_save_shard(save_file, tmp, shard, len(shards)))
  _write_index(tmp, shards)
  (tmp / "config.json").write_text(json.dumps(convert_llama.hf_config(model), indent=2))
  (tmp / "generation_config.json").write_text(json.dumps(generation_config(ckpt), indent=2))
  tokenizer.save_pretrained(str(tmp))
  shutil.rmtree(out, ignore_errors=True)
  tmp.rename(out)
  return out


def _save_shard(save_file, out: Path, tensors: dict, index: int) -> tuple[str, list[str]]:
  name = f"shard-{index:05d}.safetensors"
  save_file(tensors, str(out / name), metadata={"format": "pt"})
  return name, list(tensors)


def _write_index(out: Path, shards: list[tuple[str, list[str]]]) -> None:
  """Shards renamed to HF's model-0000i-of-0000n.safetensors, and the index naming them."""
  weight_map = {}
  for i, (name, names) in enumerate(shards, 1):
    final = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
    (out / name).rename(out / final)
    weight_map.update({n: final for n in names})
  index = {"metadata": {}, "weight_map": weight_map}
  (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
