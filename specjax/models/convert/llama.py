"""Llama-family checkpoints (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM) <-> models/llama.py params: the config with its rotary scaling and family
switches, and one table (`_hf_names`) naming the HF tensor of every leaf for import and export.
GGUF files are read through the same names (models/gguf_import.py)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import dense_layout, hf_tensors, layers, quant
from specjax.models.hf_tensors import tree_get
from specjax.models.llama import MODEL_TYPES, Llama, LlamaConfig, Rope

Params = Any

MODEL_CLASS = Llama
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _rope_from_hf(hf_config: dict) -> Rope:
  """transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_theta` next to
  `rope_scaling` (null, or a dict whose type is `rope_type` or, older still, `type`)."""
  rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
  if rope.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0)) != 1.0:
    raise ValueError("partial_rotary_factor != 1 is not supported by specjax.models.llama.")
  kind = rope.get("rope_type", rope.get("type", "default"))
  scaling = {}
  if kind in ("linear", "llama3"):
    scaling["factor"] = float(rope["factor"])
  if kind == "llama3":
    scaling.update(low_freq_factor=float(rope["low_freq_factor"]),
                   high_freq_factor=float(rope["high_freq_factor"]),
                   original_max_positions=int(rope.get("original_max_position_embeddings",
                                                       hf_config["max_position_embeddings"])))
  theta = float(rope.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
  return Rope(theta=theta, kind=kind, **scaling)


def _rope_to_hf(rope: Rope) -> dict | None:
  if rope.kind == "default":
    return None
  out = {"rope_type": rope.kind, "factor": rope.factor}
  if rope.kind == "llama3":
    out.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
               original_max_position_embeddings=rope.original_max_positions)
  return out


def _switches(model_type: str, hf_config: dict) -> dict:
  """The family's architecture switches: biases, qk-norm, sliding window."""
  attention_bias = bool(hf_config.get("attention_bias", False))
  if hf_config.get("use_sliding_window", False):
    raise ValueError(f"{model_type} with use_sliding_window=true (per-layer windows) is not "
                     f"supported by specjax.models.llama.")
  return {
      "llama": dict(qkv_bias=attention_bias, out_bias=attention_bias,
                    mlp_bias=bool(hf_config.get("mlp_bias", False))),
      "mistral": dict(sliding_window=hf_config.get("sliding_window")),
      "qwen2": dict(qkv_bias=True),
      "qwen3": dict(qkv_bias=attention_bias, out_bias=attention_bias, qk_norm=True),
  }[model_type]


def _token_ids(value):
  """HF writes eos_token_id as an int or a list; a tuple keeps the config hashable."""
  return tuple(value) if isinstance(value, list) else value


def model_from_hf_config(hf_config: dict, dtype: str) -> Llama:
  """LlamaConfig / MistralConfig / Qwen2Config / Qwen3Config dict -> Llama; refuses the options
  this implementation does not have (other rope types, other activations)."""
  model_type = hf_config.get("model_type")
  if model_type not in MODEL_TYPES:
    raise ValueError(f"model_type '{model_type}' is not supported by specjax.models.llama; it "
                     f"reads {MODEL_TYPES}.")
  if hf_config.get("hidden_act", "silu") not in ("silu", "swish"):
    raise ValueError(f"hidden_act '{hf_config['hidden_act']}' is not supported; the Llama "
                     f"family's SwiGLU MLP uses 'silu'.")
  d_model, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
  return Llama(LlamaConfig(
      vocab_size=hf_config["vocab_size"], d_model=d_model,
      num_layers=hf_config["num_hidden_layers"], num_heads=heads,
      num_kv_heads=hf_config.get("num_key_value_heads") or heads,
      head_dim=hf_config.get("head_dim") or d_model // heads,
      d_ff=hf_config["intermediate_size"], rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
      rope=_rope_from_hf(hf_config),
      max_position_embeddings=hf_config.get("max_position_embeddings", 4096),
      tie_word_embeddings=hf_config.get("tie_word_embeddings", False),
      bos_token_id=hf_config.get("bos_token_id"),
      eos_token_id=_token_ids(hf_config.get("eos_token_id")),
      pad_token_id=hf_config.get("pad_token_id"), model_type=model_type, dtype=dtype,
      **_switches(model_type, hf_config)))


def _hf_names(model: Llama) -> dict[str, tuple[str, ...]]:
  """HF tensor name -> specjax param path. Per-layer names carry `{i}`; their params sit under
  `layers` with a leading [L] axis."""
  cfg = model.config
  names = {"model.embed_tokens.weight": ("token_embed", "embedding"),
           "model.norm.weight": ("final_norm", "scale")}
  if not cfg.tie_word_embeddings:
    names["lm_head.weight"] = ("lm_head", "kernel")
  layer = "model.layers.{i}"
  linears = [("self_attn.q_proj", ("attention", "query"), cfg.qkv_bias),
             ("self_attn.k_proj", ("attention", "key"), cfg.qkv_bias),
             ("self_attn.v_proj", ("attention", "value"), cfg.qkv_bias),
             ("self_attn.o_proj", ("attention", "out"), cfg.out_bias),
             ("mlp.gate_proj", ("mlp", "wi_0"), cfg.mlp_bias),
             ("mlp.up_proj", ("mlp", "wi_1"), cfg.mlp_bias),
             ("mlp.down_proj", ("mlp", "wo"), cfg.mlp_bias)]
  for hf, ours, has_bias in linears:
    names[f"{layer}.{hf}.weight"] = ("layers", *ours, "kernel")
    if has_bias:
      names[f"{layer}.{hf}.bias"] = ("layers", *ours, "bias")
  names[f"{layer}.input_layernorm.weight"] = ("layers", "attention_norm", "scale")
  names[f"{layer}.post_attention_layernorm.weight"] = ("layers", "mlp_norm", "scale")
  if cfg.qk_norm:
    names[f"{layer}.self_attn.q_norm.weight"] = ("layers", "attention", "q_norm", "scale")
    names[f"{layer}.self_attn.k_norm.weight"] = ("layers", "attention", "k_norm", "scale")
  return names


def _transposed(cfg: LlamaConfig, path: tuple[str, ...]) -> bool:
  """Whether the leaf at `path` is the transpose of its HF tensor: HF Linear weights are
  [out, in]; a float LM head is [D, V] and the layers' Dense kernels [in, out] in the "in_out"
  layout, [out, in] (HF's own, no transpose) in "out_in", an int8 head too
  (models/dense_layout.py)."""
  return path[-1] == "kernel" and not dense_layout.transposes(path, cfg.layout, cfg.quant)


def _read(tensors: Mapping[str, np.ndarray], name: str, path: tuple[str, ...],
          shape: tuple[int, ...], cfg: LlamaConfig, dtype) -> np.ndarray:
  """One tensor, checked against the config's shape, as our layout in the model dtype."""
  if name not in tensors:
    raise ValueError(f"checkpoint lacks tensor '{name}': does its config.json match the "
                     f"weights?")
  tensor = np.asarray(tensors[name])
  transpose = _transposed(cfg, path)
  want = shape[::-1] if transpose else shape
  if tensor.shape != tuple(want):
    raise ValueError(f"checkpoint tensor '{name}' has shape {tensor.shape} but the config "
                     f"implies {tuple(want)}.")
  return (tensor.T if transpose else tensor).astype(dtype)


def float_param_shapes(model: Llama):
  """The model's params as float ShapeDtypeStructs, layers stacked [L, ...] (no params built)."""
  return quant.float_shapes(jax.eval_shape(layers.with_scan(model).init_params,
                                           jax.random.PRNGKey(0)), model.config.quant)


def hf_shapes(model: Llama, shapes=None) -> dict[str, tuple[int, ...]]:
  """Every HF tensor name the model reads (per layer: model.layers.0 .. L-1) -> the shape its
  config implies, in HF's layout (Linear weights [out, in]). shapes: float_param_shapes(model),
  when the caller has them."""
  cfg = model.config
  shapes = float_param_shapes(model) if shapes is None else shapes
  out = {}
  for name, path in _hf_names(model).items():
    shape = tree_get(shapes, path).shape
    per_layer = path[0] == "layers"
    shape = shape[1:] if per_layer else shape
    shape = tuple(shape[::-1] if _transposed(cfg, path) else shape)
    out.update({name.format(i=i): shape for i in (range(cfg.num_layers) if per_layer else [0])})
  return out


def params_from_hf(model: Llama, tensors: Mapping[str, np.ndarray]) -> Params:
  """HF tensors -> params. `tensors` may be lazy (each lookup reads a file): every tensor is
  read once and cast to the model dtype on its own, per-layer ones straight into their [L, ...]
  stack, so no float32 copy of the whole model is built (then split per layer if the model has
  scan_layers=False); an int8 model's kernels are quantized as they are read (quant.put). Extra
  tensors are ignored."""
  cfg = model.config
  shapes = float_param_shapes(model)
  dtype = model.dtype
  names = _hf_names(model)
  # Files' headers give dtypes and shapes without a read; an in-memory mapping's arrays are
  # checked as they are read (_read), so each tensor is still read once.
  check = hf_tensors.check_tensors if hasattr(tensors, "header") else (
      lambda tensors, expected, *why: hf_tensors.check_names(tensors, list(expected), *why))
  check(tensors, hf_shapes(model, shapes), "Llama-family",
        f"does its config.json (num_hidden_layers={cfg.num_layers}, "
        f"tie_word_embeddings={cfg.tie_word_embeddings}) match the weights?")
  if not cfg.scan_layers:
    return _params_unrolled(tensors, names, shapes, cfg, dtype)
  params: dict = {}
  for name, path in names.items():
    shape = tree_get(shapes, path).shape
    if path[0] != "layers":
      quant.put(params, path, jnp.asarray(_read(tensors, name, path, shape, cfg, dtype)),
                cfg.quant, cfg.layout)
      continue
    layer = lambda i: _read(tensors, name.format(i=i), path, shape[1:], cfg, dtype)
    quant.put_layers(params, path, layer, cfg.num_layers, dtype, cfg.quant,   # [L, ...]
                     cfg.layout)
  params = quant.with_head(params, cfg.quant, cfg.tie_word_embeddings, cfg.layout)
  return layers.to_layout(params, cfg.scan_layers, free_stacked=True)


def _params_unrolled(tensors: Mapping[str, np.ndarray], names: dict, shapes, cfg: LlamaConfig,
                     dtype) -> Params:
  """The unrolled layout (layers_0 ... layers_{L-1}) straight from the tensors: each one is put
  on the device as stored, then transposed, cast and checked for NaN / inf there in one compiled
  call (hf_tensors.to_param), so the host makes no converted copy, no stack and no split."""
  params: dict = {}
  checks = hf_tensors.FiniteChecks(tensors)
  for name, path in names.items():
    shape = tree_get(shapes, path).shape
    per_layer = path[0] == "layers"
    transpose = _transposed(cfg, path)
    for i in range(cfg.num_layers) if per_layer else (None,):
      hf_name, where = ((name.format(i=i), (layers.layer_name(i), *path[1:])) if per_layer
                        else (name, path))
      want = shape[1:] if per_layer else shape
      raw = hf_tensors.raw_tensor(tensors, hf_name)
      expect = tuple(want[::-1] if transpose else want)
      if raw.shape != expect:
        raise ValueError(f"checkpoint tensor '{hf_name}' has shape {raw.shape} but the config "
                         f"implies {expect}.")
      if cfg.quant and path[0] == "lm_head":
        _put_quantized_output_layer(params, raw, dtype, lambda bad: checks.add(hf_name, bad),
                                    not transpose, cfg.quant)
        continue
      value, bad = hf_tensors.to_param(raw, transpose, jnp.dtype(dtype))
      checks.add(hf_name, bad)
      quant.put(params, where, value, cfg.quant, cfg.layout)
  checks.raise_if_any()
  return quant.with_head(params, cfg.quant, cfg.tie_word_embeddings, cfg.layout)


_OUTPUT_ROWS = 16384    # vocabulary rows of an untied output layer read per step (quantized loads)


def _put_quantized_output_layer(params: dict, raw: np.ndarray, dtype, check, out_in: bool,
                                quant_name: str) -> None:
  """An untied output layer stored [V, D] -> params["lm_head"] (int8: kernel [D, V], [V, D] when
  `out_in`, scale [V]; int4: kernel [V, D / 2], scale [V, D / 64]), read, transposed if so and
  quantized _OUTPUT_ROWS rows at a time, each step finished before the next starts: the same
  bits as quantizing the whole kernel (its scales are per vocabulary entry), without its
  float32 copy and temporaries (Qwen's 151,936 x 1536
  head: 0.9 GB each). check(count) takes each step's NaN / inf count."""
  kernels, scales = [], []
  for start in range(0, raw.shape[0], _OUTPUT_ROWS):
    value, bad = hf_tensors.to_param(raw[start:start + _OUTPUT_ROWS], not out_in,
                                     jnp.dtype(dtype))
    check(bad)
    kernel, scale = jax.block_until_ready(quant.quantize_kernel(value, out_in, quant_name))
    kernels.append(kernel)                            # [D, rows], [rows, D] or [rows, D / 2]
    scales.append(scale)                              # [rows] or [rows, D / 64]
  params["lm_head"] = {"kernel": jnp.concatenate(kernels, axis=0 if out_in else 1),
                       "scale": jnp.concatenate(scales)}


def params_to_hf(model: Llama, params: Params) -> dict[str, np.ndarray]:
  """params (either layer layout) -> the tensors LlamaForCausalLM (etc.).save_pretrained writes,
  in the param dtype; the exact inverse of params_from_hf."""
  params = layers.stack(params)
  out = {}
  for name, path in _hf_names(model).items():
    value = np.asarray(tree_get(params, path))
    per_layer = ([(name.format(i=i), value[i]) for i in range(model.config.num_layers)]
                 if path[0] == "layers" else [(name, value)])
    transpose = _transposed(model.config, path)
    for hf_name, tensor in per_layer:
      out[hf_name] = np.ascontiguousarray(tensor.T if transpose else tensor)
  return out


def hf_config(model: Llama) -> dict:
  """config.json contents that transformers loads as the config's model_type; refuses a config
  that family cannot express (e.g. qwen2 without q/k/v biases)."""
  cfg = model.config
  out = {
      "model_type": cfg.model_type, "architectures": [_ARCHITECTURES[cfg.model_type]],
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
      "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
      "rope_theta": cfg.rope.theta, "rope_scaling": _rope_to_hf(cfg.rope),
      "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
      "eos_token_id": (list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple)
                       else cfg.eos_token_id),
      "pad_token_id": cfg.pad_token_id, "attention_dropout": 0.0, "initializer_range": 0.02,
  }
  out.update({"llama": {"attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias},
              "mistral": {"sliding_window": cfg.sliding_window},
              "qwen2": {"use_sliding_window": False},
              "qwen3": {"attention_bias": cfg.qkv_bias, "use_sliding_window": False},
              }[cfg.model_type])
  rebuilt = model_from_hf_config(out, cfg.dtype).config    # without the specjax-only settings
  if dataclasses.replace(rebuilt, precision=cfg.precision, scan_layers=cfg.scan_layers,
                         layout=cfg.layout) != cfg:
    raise ValueError(f"this LlamaConfig cannot be written as HF model_type '{cfg.model_type}' "
                     f"(its biases / qk_norm / sliding window differ from that family's): {cfg}")
  return out
