"""Streaming checkpoint loads (hf_import.load_model over hf_tensors.LazyTensors): each tensor is
cast to the target dtype as it is read, sharded files read like one file, and bad checkpoints
(shapes, dtypes, damaged files) are refused before any tensor data is read. Tiny random GPT-2 (3
layers, untied head) and T5 checkpoints written by specjax itself; no torch needed."""

from __future__ import annotations

import json
import re
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from specjax import testing
from specjax.models import decoder, hf_import, hf_tensors
from specjax.models.convert import gpt2 as convert_gpt2, t5 as convert_t5

FAMILIES = {"gpt2": convert_gpt2, "t5": convert_t5}


def _perturbed(params, seed: int):
  """Every leaf random (norm scales and biases too), so that a cast or a mix-up shows."""
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map(
      lambda x: x + 0.1 * rng.standard_normal(x.shape).astype(np.float32), params)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """family -> directory of a float32 checkpoint (config.json + model.safetensors)."""
  cfg = decoder.DecoderConfig(vocab_size=48, n_positions=32, d_model=32, num_layers=3,
                              num_heads=4, d_ff=64, tie_word_embeddings=False)
  gpt2 = decoder.Decoder(cfg)
  t5_model, t5_params = testing.tiny_t5(feed_forward_proj="gated-gelu", tie_word_embeddings=False)
  out = {}
  for name, (model, params) in {"gpt2": (gpt2, gpt2.init_params(jax.random.PRNGKey(0))),
                                "t5": (t5_model, t5_params)}.items():
    out[name] = hf_import.save_model(model, _perturbed(params, 1), tmp_path_factory.mktemp(name))
  return out


def _copy_with(src, dst, tensors: dict[str, np.ndarray]):
  """A checkpoint directory with src's config.json and these tensors in model.safetensors."""
  shutil.copy(src / "config.json", dst / "config.json")
  save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
  return dst


def _write_sharded(src, dst, shards: int) -> list:
  """src's tensors split over `shards` files with a model.safetensors.index.json."""
  tensors = load_file(str(src / "model.safetensors"))
  shutil.copy(src / "config.json", dst / "config.json")
  names = sorted(tensors)
  weight_map, files = {}, []
  for s in range(shards):
    file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    part = {n: tensors[n] for n in names[s::shards]}
    save_file(part, str(dst / file), metadata={"format": "pt"})
    weight_map.update({n: file for n in part})
    files.append(dst / file)
  (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  return files


def _assert_same_tree(got, want):
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    assert isinstance(a, jax.Array) and a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_float32_checkpoint_loads_as_bfloat16_equal_to_casting_the_float32_load(checkpoints,
                                                                                family):
  path = checkpoints[family]
  model16, params16 = hf_import.load_model(str(path), dtype="bfloat16")
  mod = FAMILIES[family]
  model32 = mod.model_from_hf_config(json.loads((path / "config.json").read_text()), "float32")
  eager = load_file(str(path / "model.safetensors"))             # every tensor in memory, f32
  params32 = mod.params_from_hf(model32, eager)
  assert model16.dtype == jnp.bfloat16
  _assert_same_tree(params16, jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params32))


def test_sharded_checkpoint_reads_like_one_file(checkpoints, tmp_path):
  path = checkpoints["gpt2"]
  files = _write_sharded(path, tmp_path, shards=3)
  lazy = hf_import.read_tensors(tmp_path)
  eager = load_file(str(path / "model.safetensors"))
  assert len(lazy) == len(eager) and set(lazy) == set(eager)
  name = "transformer.h.2.attn.c_attn.weight"
  assert name in lazy and "h.2.attn.c_attn.weight" not in lazy
  assert lazy.header(name) == ((32, 96), "float32")
  np.testing.assert_array_equal(lazy[name], eager[name])
  _assert_same_tree(hf_import.load_model(str(tmp_path))[1], hf_import.load_model(str(path))[1])
  assert len({f.name for f in files}) == 3


def test_bfloat16_checkpoint_loads_exactly_in_either_dtype(checkpoints, tmp_path):
  path = checkpoints["t5"]
  tensors = {k: v.astype(ml_dtypes.bfloat16)
             for k, v in load_file(str(path / "model.safetensors")).items()}
  _copy_with(path, tmp_path, tensors)
  assert hf_import.read_tensors(tmp_path).header("shared.weight")[1] == "bfloat16"
  _, params16 = hf_import.load_model(str(tmp_path), dtype="bfloat16")
  _, params32 = hf_import.load_model(str(tmp_path), dtype="float32")
  _assert_same_tree(params32, jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), params16))


@pytest.mark.parametrize("family, name, bad, want", [
    ("gpt2", "transformer.h.1.mlp.c_fc.weight", (32, 60), (32, 64)),
    ("t5", "decoder.block.1.layer.2.DenseReluDense.wo.weight", (32, 60), (32, 64)),
])
def test_mismatched_shape_is_refused_before_any_data_is_read(checkpoints, tmp_path, monkeypatch,
                                                            family, name, bad, want):
  path = checkpoints[family]
  tensors = load_file(str(path / "model.safetensors"))
  tensors[name] = np.zeros(bad, np.float32)
  _copy_with(path, tmp_path, tensors)
  reads = []
  read = hf_tensors.LazyTensors.__getitem__
  monkeypatch.setattr(hf_tensors.LazyTensors, "__getitem__",
                      lambda self, key: reads.append(key) or read(self, key))
  message = f"{name} has shape {bad}; the config implies {want}"
  with pytest.raises(ValueError, match=re.escape(message)):
    hf_import.load_model(str(tmp_path))
  assert reads == []                                           # refused from the headers alone


def test_unsupported_dtypes_are_refused(checkpoints, tmp_path):
  path = checkpoints["gpt2"]
  tensors = load_file(str(path / "model.safetensors"))
  tensors["transformer.h.0.ln_1.weight"] = tensors["transformer.h.0.ln_1.weight"].astype(np.int32)
  _copy_with(path, tmp_path, tensors)
  with pytest.raises(ValueError, match=re.escape(
      "h.0.ln_1.weight is stored as int32; specjax reads float16, bfloat16, float32")):
    hf_import.load_model(str(tmp_path))
  with pytest.raises(ValueError, match=re.escape(
      "dtype 'float16' is not supported; use one of ('float32', 'bfloat16')")):
    hf_import.load_model(str(path), dtype="float16")


def test_damaged_files_are_refused_by_name(checkpoints, tmp_path):
  path = checkpoints["gpt2"]
  single = tmp_path / "single"
  shutil.copytree(path, single)
  weights = single / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[:-100])                        # truncated
  with pytest.raises(hf_import.CorruptCheckpointError, match=re.escape(str(weights))):
    hf_import.load_model(str(single))
  weights.write_bytes(b"not a safetensors file")
  with pytest.raises(hf_import.CorruptCheckpointError, match=re.escape(str(weights))):
    hf_import.load_model(str(single))
  sharded = tmp_path / "sharded"
  sharded.mkdir()
  shard = _write_sharded(path, sharded, shards=2)[1]
  shard.write_bytes(shard.read_bytes()[:-8])
  with pytest.raises(hf_import.CorruptCheckpointError, match=re.escape(str(shard))):
    hf_import.load_model(str(sharded))
  index = sharded / "model.safetensors.index.json"
  index.write_text("{not json")
  with pytest.raises(hf_import.CorruptCheckpointError, match=re.escape(str(index))):
    hf_import.load_model(str(sharded))
