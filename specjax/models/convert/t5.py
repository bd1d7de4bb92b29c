"""T5 checkpoints (T5ForConditionalGeneration) <-> models/t5.py params, through the one table
of param paths and HF tensor names that t5.param_table keeps beside the architecture (init uses
it too)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from specjax.models import hf_tensors, t5
from specjax.models import layers as layers_
from specjax.models.hf_tensors import tree_get, tree_set

Params = Any

MODEL_TYPES = ("t5",)
MODEL_CLASS = t5.T5
# Present in some checkpoints, never used: copies of shared.weight, and an unused cross-attention
# bias table that old transformers versions created.
_HF_IGNORED = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
               "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight")


def model_from_hf_config(hf_config: dict, dtype: str) -> t5.T5:
  get = hf_config.get
  tie = bool(get("tie_word_embeddings", True))
  eos = get("eos_token_id", 1)
  pad = get("pad_token_id", 0)
  pad = 0 if pad is None else pad
  start = get("decoder_start_token_id")
  return t5.T5(t5.T5Config(
      vocab_size=hf_config["vocab_size"], d_model=hf_config["d_model"], d_kv=hf_config["d_kv"],
      d_ff=hf_config["d_ff"], num_heads=hf_config["num_heads"], num_layers=hf_config["num_layers"],
      num_decoder_layers=get("num_decoder_layers") or hf_config["num_layers"],
      relative_attention_num_buckets=get("relative_attention_num_buckets", 32),
      relative_attention_max_distance=get("relative_attention_max_distance", 128),
      feed_forward_proj=get("feed_forward_proj", "relu"), tie_word_embeddings=tie,
      scale_decoder_outputs=bool(get("scale_decoder_outputs", tie)),
      layer_norm_epsilon=get("layer_norm_epsilon", 1e-6), pad_token_id=pad,
      eos_token_id=eos[0] if isinstance(eos, (list, tuple)) else eos,
      decoder_start_token_id=pad if start is None else start, dtype=dtype))








def _hf_shapes(cfg: t5.T5Config, names) -> dict[str, tuple[int, ...]]:
  """HF tensor name -> the shape the config implies, one entry per layer of stacked leaves."""
  shapes = {}
  for path, (hf, transpose) in names.items():
    shape = t5.leaf_spec(cfg, path)[0]
    layers = t5.stacked_layers(cfg, path)
    shape = shape[1:] if layers else shape
    shape = shape[::-1] if transpose else shape
    for i in range(layers or 1):
      shapes[hf.format(i=i)] = shape
  return shapes


def _untied_in_checkpoint(model: t5.T5, tensors: Mapping[str, np.ndarray]) -> bool:
  """A separate head when the config says so, or when lm_head.weight differs from shared.weight
  (transformers >= 5 writes tie_word_embeddings=true for v1.1 and keeps the real lm_head)."""
  if "lm_head.weight" not in tensors:
    return False
  if not model.config.tie_word_embeddings:
    return True
  return not np.array_equal(np.asarray(tensors["lm_head.weight"]),
                            np.asarray(tensors["shared.weight"]))


def _reader(tensors: Mapping[str, np.ndarray], hf: str, transpose: bool):
  """i -> tensor `hf` (layer i's when stacked) in our orientation, read when called."""
  def read(i: int) -> np.ndarray:
    array = np.asarray(tensors[hf.format(i=i)])
    return array.T if transpose else array
  return read


def params_from_hf(model: t5.T5, tensors: Mapping[str, np.ndarray]) -> Params:
  """HF T5 tensors (a lazy mapping: each lookup reads one tensor) -> params on the device in the
  model dtype, in the model's layer layout (built stacked, then split if scan_layers=False).
  Names, shapes and dtypes are checked before any data is read."""
  cfg = model.config
  names = t5.param_table(cfg, untied="lm_head.weight" in tensors)
  shapes = _hf_shapes(cfg, names)
  hf_tensors.check_tensors(tensors, shapes, "T5", "config.json does not match model.safetensors.")
  unexpected = sorted(set(tensors) - set(shapes) - set(_HF_IGNORED))
  if unexpected:
    raise ValueError(f"T5 checkpoint has {len(unexpected)} tensors the config does not explain, "
                     f"e.g. {unexpected[:3]}: check num_layers / feed_forward_proj in config.json.")
  if not _untied_in_checkpoint(model, tensors):
    names.pop(("lm_head", "kernel"), None)
  params: Params = {}
  for path, (hf, transpose) in names.items():
    read = _reader(tensors, hf, transpose)
    layers = t5.stacked_layers(cfg, path)
    value = (hf_tensors.stack_layers(read, layers, model.dtype) if layers
             else hf_tensors.to_device(read(0), model.dtype))
    tree_set(params, path, value)
  return layers_.to_layout(params, cfg.scan_layers, free_stacked=True)


def params_to_hf(model: t5.T5, params: Params) -> dict[str, np.ndarray]:
  """params (either layer layout) -> the tensors T5ForConditionalGeneration writes."""
  params = layers_.stack(params)
  out = {}
  for path, (hf, transpose) in t5.param_table(model.config, "lm_head" in params).items():
    array = np.asarray(tree_get(params, path))
    layers = t5.stacked_layers(model.config, path)
    for i in range(layers or 1):
      tensor = array[i] if layers else array
      out[hf.format(i=i)] = tensor.T if transpose else tensor
  return out


def hf_config(model: t5.T5) -> dict:
  """A config.json that transformers (4.x and 5.x) loads as T5ForConditionalGeneration."""
  cfg = model.config
  return {
      "architectures": ["T5ForConditionalGeneration"], "model_type": "t5",
      "vocab_size": cfg.vocab_size, "d_model": cfg.d_model, "d_kv": cfg.d_kv, "d_ff": cfg.d_ff,
      "num_heads": cfg.num_heads, "num_layers": cfg.num_layers,
      "num_decoder_layers": cfg.num_decoder_layers,
      "relative_attention_num_buckets": cfg.relative_attention_num_buckets,
      "relative_attention_max_distance": cfg.relative_attention_max_distance,
      "feed_forward_proj": cfg.feed_forward_proj, "dense_act_fn": cfg.activation,
      "is_gated_act": cfg.is_gated, "layer_norm_epsilon": cfg.layer_norm_epsilon,
      "tie_word_embeddings": cfg.tie_word_embeddings,
      "scale_decoder_outputs": cfg.scale_decoder_outputs,
      "pad_token_id": cfg.pad_token_id, "eos_token_id": cfg.eos_token_id,
      "decoder_start_token_id": cfg.decoder_start_token_id, "is_encoder_decoder": True,
      "dropout_rate": 0.1, "initializer_factor": 1.0, "use_cache": True, "torch_dtype": "float32",
  }
