"""GPT-2 checkpoints (GPT2LMHeadModel) <-> models/decoder.py params: the config, and the tensor
names of every param (query, key and value are the thirds of c_attn's last axis)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import dense_layout, hf_tensors, layers, quant
from specjax.models.hf_tensors import tree_get, tree_set
from specjax.models.decoder import Decoder, DecoderConfig

Params = Any

MODEL_TYPES = ("gpt2",)
MODEL_CLASS = Decoder
_HF_BUFFERS = (".attn.bias", ".attn.masked_bias")   # causal-mask buffers in old GPT-2 files


def model_from_hf_config(hf_config: dict, dtype: str) -> Decoder:
  """GPT2Config dict -> Decoder; refuses the GPT-2 options this implementation does not have."""
  if hf_config.get("model_type") not in MODEL_TYPES:
    raise ValueError(f"model_type '{hf_config.get('model_type')}' is not a GPT-2 checkpoint.")
  if not hf_config.get("scale_attn_weights", True) or hf_config.get(
      "scale_attn_by_inverse_layer_idx", False) or hf_config.get("add_cross_attention", False):
    raise ValueError("GPT-2 options scale_attn_weights=False, scale_attn_by_inverse_layer_idx and "
                     "add_cross_attention are not supported by specjax.models.decoder.")
  d_model = hf_config["n_embd"]
  eos = hf_config.get("eos_token_id", 50256)
  pad = hf_config.get("pad_token_id")
  return Decoder(DecoderConfig(
      vocab_size=hf_config["vocab_size"],
      n_positions=hf_config.get("n_positions", hf_config.get("n_ctx", 1024)),
      d_model=d_model, num_layers=hf_config["n_layer"], num_heads=hf_config["n_head"],
      d_ff=hf_config.get("n_inner") or 4 * d_model,
      layer_norm_epsilon=hf_config.get("layer_norm_epsilon", 1e-5),
      activation=hf_config.get("activation_function", "gelu_new"),
      tie_word_embeddings=hf_config.get("tie_word_embeddings", True),
      bos_token_id=hf_config.get("bos_token_id", 50256), eos_token_id=eos,
      pad_token_id=eos if pad is None else pad, dtype=dtype))


# Our param path -> HF GPT-2 tensor (without `transformer.`): stacked leaves under `layers` come
# from `h.{i}.` + the name; query, key and value are the thirds of c_attn's last axis.
_HF_TOP = {("token_embed", "embedding"): "wte.weight",
           ("pos_embed", "position_embedding"): "wpe.weight",
           ("ln_f", "scale"): "ln_f.weight", ("ln_f", "bias"): "ln_f.bias"}
_HF_LAYER = {("ln_1", "scale"): "ln_1.weight", ("ln_1", "bias"): "ln_1.bias",
             ("ln_2", "scale"): "ln_2.weight", ("ln_2", "bias"): "ln_2.bias",
             ("attention", "out", "kernel"): "attn.c_proj.weight",
             ("attention", "out", "bias"): "attn.c_proj.bias",
             ("mlp", "wi", "kernel"): "mlp.c_fc.weight", ("mlp", "wi", "bias"): "mlp.c_fc.bias",
             ("mlp", "wo", "kernel"): "mlp.c_proj.weight", ("mlp", "wo", "bias"): "mlp.c_proj.bias"}
_QKV = ("query", "key", "value")
_C_ATTN = {"kernel": "attn.c_attn.weight", "bias": "attn.c_attn.bias"}


def _hf_shapes(model: Decoder) -> dict[str, tuple[int, ...]]:
  """HF GPT-2 tensor name (without `transformer.`) -> the shape the config implies."""
  cfg = model.config
  floats = dataclasses.replace(model, config=dataclasses.replace(cfg, quant=""))  # int4's shapes
  in_out = dense_layout.with_layout(layers.with_scan(floats), dense_layout.IN_OUT)  # HF's layout
  ours = jax.eval_shape(in_out.init_params, jax.random.PRNGKey(0))
  stacked = ours[layers.STACKED]
  shapes = {name: tree_get(ours, path).shape for path, name in _HF_TOP.items()}
  for i in range(cfg.num_layers):
    shapes.update({f"h.{i}.{name}": tree_get(stacked, path).shape[1:]
                   for path, name in _HF_LAYER.items()})
    for leaf, name in _C_ATTN.items():
      third = stacked["attention"]["query"][leaf].shape[1:]
      shapes[f"h.{i}.{name}"] = third[:-1] + (3 * third[-1],)
  if not cfg.tie_word_embeddings:
    shapes["lm_head.weight"] = ours["lm_head"]["kernel"].shape[::-1]
  return shapes


def params_from_hf(model: Decoder, tensors: Mapping[str, np.ndarray]) -> Params:
  """HF GPT-2 tensors (a lazy mapping: each lookup reads one tensor) -> params on the device in
  the model dtype, in the model's layer layout (built stacked, then split if scan_layers=False).
  Names, shapes and dtypes are checked before any data is read. Conv1D weights are already
  [in, out] (transposed for layout="out_in"); c_attn [D,3D] splits into query/key/value. Names
  with or without the `transformer.` prefix are accepted."""
  cfg = model.config
  keys = {k.removeprefix("transformer."): k for k in tensors if not k.endswith(_HF_BUFFERS)}
  expected = {keys.get(name, name): shape for name, shape in _hf_shapes(model).items()}
  hf_tensors.check_tensors(tensors, expected, "GPT-2",
                          f"does its config.json (n_layer={cfg.num_layers}, n_embd={cfg.d_model}, "
                          f"tie_word_embeddings={cfg.tie_word_embeddings}) match the weights?")
  read = lambda name: tensors[keys[name]]
  dt, num_layers = model.dtype, cfg.num_layers
  orient = lambda path, x: x.T if dense_layout.transposes(path, cfg.layout) else x
  params: dict = {}
  for path, name in _HF_TOP.items():
    tree_set(params, path, hf_tensors.to_device(read(name), dt))
  for path, name in _HF_LAYER.items():
    layer = lambda i: orient(path, read(f"h.{i}.{name}"))
    quant.put_layers(params, ("layers",) + path, layer, num_layers, dt, cfg.quant, cfg.layout)
  for third, proj in enumerate(_QKV):
    for leaf, name in _C_ATTN.items():
      part = lambda i: orient((leaf,), np.split(read(f"h.{i}.{name}"), 3, axis=-1)[third])
      quant.put_layers(params, ("layers", "attention", proj, leaf), part,   # [D, 3D] -> [D, D]
                       num_layers, dt, cfg.quant, cfg.layout)
  if not cfg.tie_word_embeddings:
    head = read("lm_head.weight")                                           # [V, D]
    if not dense_layout.transposes(("lm_head", "kernel"), cfg.layout, cfg.quant):
      head = head.T                                                         # -> [D, V]
    quant.put(params, ("lm_head", "kernel"), hf_tensors.to_device(head, dt), cfg.quant,
              cfg.layout)
  params = quant.with_head(params, cfg.quant, cfg.tie_word_embeddings, cfg.layout)
  return layers.to_layout(params, cfg.scan_layers, free_stacked=True)


def params_to_hf(model: Decoder, params: Params) -> dict[str, np.ndarray]:
  """params (either layer layout) -> the tensors GPT2LMHeadModel.save_pretrained writes (with
  `transformer.` prefix)."""
  cfg = model.config
  params = layers.stack(params)
  as_np = lambda x: np.asarray(jnp.asarray(x, jnp.float32))
  out = {f"transformer.{name}": as_np(tree_get(params, path)) for path, name in _HF_TOP.items()}
  stacked = jax.tree_util.tree_map(as_np, params[layers.STACKED])            # [L, ...] leaves
  attn = stacked["attention"]
  hf = lambda path, x: (np.ascontiguousarray(x.T) if dense_layout.transposes(path, cfg.layout)
                        else x)                                              # Conv1D: [in, out]
  for i in range(cfg.num_layers):
    for path, name in _HF_LAYER.items():
      out[f"transformer.h.{i}.{name}"] = hf(path, tree_get(stacked, path)[i])
    for leaf, name in _C_ATTN.items():
      out[f"transformer.h.{i}.{name}"] = np.concatenate(
          [hf((leaf,), attn[p][leaf][i]) for p in _QKV], -1)
  if not cfg.tie_word_embeddings:
    out["lm_head.weight"] = np.ascontiguousarray(as_np(params["lm_head"]["kernel"]).T)
  return out


def hf_config(model: Decoder) -> dict:
  """config.json contents that transformers loads as GPT2LMHeadModel."""
  cfg = model.config
  return {
      "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
      "vocab_size": cfg.vocab_size, "n_positions": cfg.n_positions, "n_ctx": cfg.n_positions,
      "n_embd": cfg.d_model, "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
      "n_inner": cfg.d_ff, "activation_function": cfg.activation,
      "layer_norm_epsilon": cfg.layer_norm_epsilon, "tie_word_embeddings": cfg.tie_word_embeddings,
      "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
      "pad_token_id": cfg.pad_token_id, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
      "attn_pdrop": 0.0, "scale_attn_weights": True, "initializer_range": 0.02,
  }
