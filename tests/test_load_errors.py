"""Loading refuses bad checkpoints with one message that names the file and the problem, never a
bare KeyError or a traceback (#18 items 4 and 8, #15 bad input and item 5): a config.json that is
not JSON, one that lacks a key, a model_type whose fields or tensors are another family's, a
section's `arch` against its checkpoint, truncated weights, a tokenizer larger than its model's
embedding (every family and tokenizer kind, target or draft); and the shipped Qwen2.5 pair config
resolved through the local Hugging Face cache only (absent: the one-line message of
t5_xl_small.py and exit status 2). Tiny models written by specjax itself; no torch."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from specjax import testing
from specjax.app import builders, resolve
from specjax.app.config import load_config
from specjax.data import tokenizer as tk
from specjax.models import hf_import, hf_tensors

import tiny_checkpoints  # noqa: E402  (tests/ is on sys.path under pytest)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  """family -> checkpoint directory: gpt2 and t5 (weights only), qwen2 (with its byte-level
  tokenizer, embedding 320 > tokenizer 300)."""
  out = {}
  for name, (model, params) in {"gpt2": testing.tiny_decoder(), "t5": testing.tiny_t5()}.items():
    out[name] = hf_import.save_model(model, params, tmp_path_factory.mktemp(name))
  out["qwen2"] = tiny_checkpoints.qwen2_checkpoint(tmp_path_factory.mktemp("qwen2"))
  return out


def _copy(src: Path, dst: Path, **config_changes) -> Path:
  shutil.copytree(src, dst)
  if config_changes:
    config = json.loads((dst / "config.json").read_text())
    config.update(config_changes)
    config = {k: v for k, v in config.items() if v is not None}
    (dst / "config.json").write_text(json.dumps(config))
  return dst


def _spec(path, role="target", **kw) -> builders.ModelSpec:
  return builders.ModelSpec(role=role, checkpoint=str(path), **kw)


# -------------------------------------------------------------------------------- config.json

@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\x00garbage", b"[1, 2]"])
def test_config_json_that_is_not_a_json_object_is_refused_by_name(dirs, tmp_path, content):
  path = _copy(dirs["gpt2"], tmp_path / "ckpt")
  (path / "config.json").write_bytes(content)
  config = re.escape(str(path / "config.json"))
  with pytest.raises(hf_tensors.CorruptCheckpointError, match=config):
    hf_import.load_model(str(path))
  with pytest.raises(hf_tensors.CorruptCheckpointError, match=config):
    resolve.load(_spec(path))


@pytest.mark.parametrize("family, key", [("gpt2", "n_head"), ("t5", "d_ff"),
                                         ("qwen2", "num_hidden_layers")])
def test_a_missing_config_key_is_named(dirs, tmp_path, family, key):
  path = _copy(dirs[family], tmp_path / "ckpt", **{key: None})
  with pytest.raises(ValueError, match=re.escape(
      f"{path / 'config.json'} (model_type '{family}') lacks the key '{key}' that a {family} "
      f"config needs")):
    hf_import.load_model(str(path))


@pytest.mark.parametrize("family, change, message", [
    ("gpt2", {"n_positions": -1}, "n_positions=-1 is not a whole number >= 1"),
    ("gpt2", {"n_embd": "256"}, "n_embd='256' is not a whole number >= 1"),
    ("t5", {"num_heads": 0}, "num_heads=0 is not a whole number >= 1"),
    ("qwen2", {"num_key_value_heads": 1.5}, "num_key_value_heads=1.5 is not a whole number"),
])
def test_damaged_numbers_of_config_json_are_named(dirs, tmp_path, family, change, message):
  """They built a model of nonsense shapes (a cache limit of -1 positions), failed in string
  formatting ("not all arguments converted")."""
  path = _copy(dirs[family], tmp_path / "ckpt", **change)
  with pytest.raises(ValueError, match=re.escape(str(path / "config.json")) + ": " + message
                     + ".*use the config.json that came with the weights"):
    hf_import.load_model(str(path))


@pytest.mark.parametrize("family, claimed, expected, found, marker", [
    ("gpt2", "t5", "t5", "gpt2", "n_embd"),
    ("gpt2", "llama", "llama-family", "gpt2", "n_embd"),
    ("qwen2", "gpt2", "gpt2", "llama-family", "intermediate_size"),
    ("t5", "qwen2", "llama-family", "t5", "d_kv"),
])
def test_model_type_of_another_family_names_expected_and_found(dirs, tmp_path, family, claimed,
                                                               expected, found, marker):
  """A config.json whose model_type was edited (or mixed up): today's `error: 'd_model'`."""
  path = _copy(dirs[family], tmp_path / "ckpt", model_type=claimed)
  with pytest.raises(ValueError, match=re.escape(
      f"model_type '{claimed}' expects a {expected} config, but the fields found are a {found} "
      f"config's (it has '{marker}'")):
    hf_import.load_model(str(path))


@pytest.mark.parametrize("config_of, tensors_of, what, found", [
    ("gpt2", "qwen2", "GPT-2", "Llama-family"),
    ("qwen2", "gpt2", "Llama-family", "GPT-2"),
    ("t5", "gpt2", "T5", "GPT-2"),
])
def test_tensors_of_another_family_are_named(dirs, tmp_path, config_of, tensors_of, what, found):
  path = _copy(dirs[config_of], tmp_path / "ckpt")
  shutil.copy(dirs[tensors_of] / "model.safetensors", path / "model.safetensors")
  with pytest.raises(ValueError, match=re.escape(f"{what} checkpoint lacks ") + r".*" +
                     re.escape(f"its tensors are those of a {found}")):
    hf_import.load_model(str(path))


@pytest.mark.parametrize("family, key, stack", [("gpt2", "n_layer", "transformer.h"),
                                                 ("qwen2", "num_hidden_layers", "model.layers"),
                                                 ("t5", "num_layers", "encoder.block")])
def test_weights_of_more_layers_than_the_config_describes_are_refused(dirs, family, key,
                                                                       stack, tmp_path):
  """A config.json with one layer fewer than the weights hold loaded the first layers and
  dropped the last one without a word (the output another model's)."""
  layers = json.loads((dirs[family] / "config.json").read_text())[key]
  path = _copy(dirs[family], tmp_path / "ckpt", **{key: layers - 1})
  if family == "t5":
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_decoder_layers": layers}))
  with pytest.raises(ValueError, match=re.escape(
      f"checkpoint holds {layers} layers ({stack}.0 .. {stack}.{layers - 1}) where its config "
      f"describes {layers - 1}: ")):
    hf_import.load_model(str(path))


def test_a_section_arch_must_match_its_checkpoint(dirs):
  with pytest.raises(ValueError, match=re.escape(
      f"--config.draft.arch=t5 expects a t5 checkpoint, but {dirs['gpt2']} holds model_type "
      f"'gpt2'")):
    resolve.load(_spec(dirs["gpt2"], role="draft", arch="t5"))


def test_truncated_weights_are_refused_by_name_through_resolve(dirs, tmp_path):
  path = _copy(dirs["qwen2"], tmp_path / "ckpt")
  weights = path / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[:-64])
  with pytest.raises(hf_tensors.CorruptCheckpointError, match=re.escape(
      f"{weights} is not a readable safetensors file (truncated or corrupt?)")):
    resolve.load(_spec(path))


# ------------------------------------------------------------- tokenizer larger than embedding

@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
  """kind -> (tokenizer spec, size): Qwen-style byte-level BPE, Llama-style Metaspace BPE with
  byte fallback (HF directories), and a SentencePiece .model."""
  root = tmp_path_factory.mktemp("tokenizers")
  (root / "bl").mkdir()
  (root / "ms").mkdir()
  spm = tk.train_sentencepiece(tiny_checkpoints.TEXT.splitlines(keepends=True) * 5,
                               root / "sp.model", model_type="bpe", vocab_size=300)
  return {"byte_level": (str(root / "bl"), tiny_checkpoints.byte_level_bpe(root / "bl")),
          "metaspace": (str(root / "ms"), tiny_checkpoints.metaspace_bpe(root / "ms")),
          "sentencepiece": (str(spm), tk.Tokenizer.load(spm).vocab_size)}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
  """family -> checkpoint whose embedding has 256 rows (fewer than every test tokenizer)."""
  out = {}
  models = {"gpt2": testing.tiny_decoder(vocab_size=256), "t5": testing.tiny_t5(vocab_size=256),
            "llama": tiny_checkpoints.tiny_llama("llama", 256, 0, eos=2),
            "qwen2": tiny_checkpoints.tiny_llama("qwen2", 256, 0, eos=0)}
  for name, (model, params) in models.items():
    out[name] = hf_import.save_model(model, params, tmp_path_factory.mktemp(name))
  return out


@pytest.mark.parametrize("family", ["gpt2", "t5", "llama", "qwen2"])
@pytest.mark.parametrize("kind", ["byte_level", "metaspace", "sentencepiece"])
@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_tokenizer_larger_than_the_embedding_is_refused_before_the_weights(
    small, tokenizers, monkeypatch, family, kind, role):
  spec_string, size = tokenizers[kind]
  monkeypatch.setattr(hf_import, "load_model", lambda *a, **k: pytest.fail("weights were read"))
  with pytest.raises(resolve.VocabMismatchError, match=re.escape(
      f"the {role}'s tokenizer ({spec_string}) has {size} tokens but the {role}'s "
      f"embedding table has 256 rows: --config.{role}.tokenizer={spec_string} belongs to another "
      f"model")):
    resolve.load(_spec(small[family], role=role, tokenizer=spec_string))


def test_the_checkpoint_own_tokenizer_is_checked_and_a_larger_embedding_is_fine(dirs, small,
                                                                                tmp_path):
  loaded = resolve.load(_spec(dirs["qwen2"], role="draft"))        # embedding 320, tokenizer 300
  assert (loaded.model.vocab_size, loaded.tokenizer.vocab_size) == (320, 300)
  mixed = _copy(small["qwen2"], tmp_path / "mixed")
  for f in dirs["qwen2"].iterdir():
    if f.name.startswith(("tokenizer", "special_tokens")):
      shutil.copy(f, mixed / f.name)
  with pytest.raises(resolve.VocabMismatchError, match="has 300 tokens but the draft's "
                     "embedding table has 256 rows: the checkpoint's tokenizer files and weights "
                     "come from different models"):
    resolve.load(_spec(mixed, role="draft"))


# ----------------------------------------------------------- the Qwen2.5 pair by hub ids

def _hub_snapshot(cache: Path, repo_id: str, source: Path, revision: str = "0" * 40) -> Path:
  """`source` placed as the Hugging Face hub cache holds a downloaded repo."""
  repo = cache / f"models--{repo_id.replace('/', '--')}"
  snapshot = repo / "snapshots" / revision
  shutil.copytree(source, snapshot)
  (repo / "refs").mkdir(parents=True)
  (repo / "refs" / "main").write_text(revision)
  return snapshot


def test_qwen_pair_resolves_from_the_local_hub_cache(dirs, tmp_path, monkeypatch):
  import huggingface_hub.constants
  cache = tmp_path / "hub"
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
  config = load_config("qwen2_5_7b.py")
  assert (config.target.checkpoint, config.draft.checkpoint) == (
      "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct")
  assert config.decode.chat and config.rule.name == "exact"
  draft = builders.model_spec(config, "draft")
  with pytest.raises(hf_import.CheckpointNotFoundError, match="'Qwen/Qwen2.5-0.5B-Instruct' is "
                     r"not a local directory \(.*\) and is not in the local Hugging Face cache"):
    resolve.checkpoint_dir(draft)
  snapshot = _hub_snapshot(cache, "Qwen/Qwen2.5-0.5B-Instruct", dirs["qwen2"])
  assert resolve.checkpoint_dir(draft) == snapshot
  loaded = resolve.load(draft)
  assert loaded.model.config.model_type == "qwen2" and loaded.path == snapshot
  assert str(loaded.model.dtype) == "bfloat16"          # the config's dtype


def test_qwen_pair_absent_gives_one_line_and_exit_2(tmp_path):
  env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
             HF_HUB_CACHE=str(tmp_path / "hf" / "hub"), JAX_PLATFORMS="cpu")
  env.pop("SPECJAX_DEBUG", None)
  proc = subprocess.run([sys.executable, "-m", "specjax.decode", "--config", "qwen2_5_7b.py",
                         "--prompt", "hello"], cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr
  assert "Traceback" not in proc.stderr
  errors = [line for line in proc.stderr.splitlines() if "error:" in line]
  assert len(errors) == 1, proc.stderr
  assert "checkpoint 'Qwen/Qwen2.5-7B-Instruct' is not a local directory (Qwen/Qwen2.5-7B-Instruct" \
         f", relative to the current directory: {tmp_path}/Qwen/Qwen2.5-7B-Instruct) and is not " \
         "in the local Hugging Face cache" in errors[0]
  assert errors[0].endswith("Then pass --config.target.checkpoint=DIR.")


@pytest.mark.parametrize("name", ["/no/such/model", "./no/such", "~/no-such-model", "a/b/c"])
def test_a_missing_local_path_is_named_as_a_path_not_a_hub_id(name):
  with pytest.raises(hf_import.CheckpointNotFoundError,
                     match="does not exist: check the path") as err:
    hf_import.resolve_checkpoint(name)
  assert "huggingface-cli" not in str(err.value)
  if name.startswith("./"):       # a user's config's relative path: where it was looked for
    assert f"relative to the current directory: {os.getcwd()}/no/such" in str(err.value)


def test_a_damaged_sentencepiece_model_and_a_cache_that_is_a_file_are_named(tmp_path, monkeypatch):
  from specjax.data import cache, tokenizer
  bad = tmp_path / "spm.model"
  bad.write_bytes(b"\x00not a model" * 10)
  with pytest.raises(ValueError, match="is not a SentencePiece model .*copy the checkpoint's"):
    tokenizer.Tokenizer.load(bad)
  afile = tmp_path / "file"
  afile.write_text("x")
  monkeypatch.setenv("SPECJAX_CACHE", str(afile))
  with pytest.raises(ValueError, match=r"\$SPECJAX_CACHE .* point SPECJAX_CACHE at a writable"):
    cache.cache_dir()


def test_a_tokenizer_path_that_does_not_exist_is_named(tmp_path):
  from specjax.data import tokenizer
  with pytest.raises(FileNotFoundError, match="tokenizer .*absent.model does not exist"):
    tokenizer.get_tokenizer(str(tmp_path / "absent.model"))


@pytest.mark.parametrize("family", ["gpt2", "t5", "qwen2"])
def test_a_tensor_of_the_wrong_shape_names_tensor_shapes_and_checkpoint(dirs, tmp_path, family):
  """B26: the tensor, the shape found, the shape the config implies, and the checkpoint's path."""
  import numpy as np
  path = _copy(dirs[family], tmp_path / "ckpt")
  weights = load_file(path / "model.safetensors")
  name = sorted(k for k in weights if weights[k].ndim == 2)[0]
  rows, cols = weights[name].shape
  weights[name] = np.zeros((rows + 1, cols), weights[name].dtype)
  save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ValueError) as err:
    hf_import.load_model(str(path))
  text = str(err.value)
  assert text.startswith(f"{path}: ") and name in text, text
  assert f"{(rows + 1, cols)}" in text and f"{(rows, cols)}" in text, text


def test_init_from_of_another_size_names_the_flag_tensor_and_shapes(tmp_path):
  """B26: exported params restored into a model of another size."""
  from specjax import checkpoint
  small, small_params = testing.tiny_decoder(d_model=16)
  checkpoint.save_params(tmp_path, small_params)
  spec = builders.ModelSpec(role="target", init_from=str(tmp_path))
  _, params = testing.tiny_decoder(d_model=32)
  with pytest.raises(ValueError, match=re.escape(
      f"--config.target.init_from={tmp_path}: {tmp_path / 'params'} holds params of another "
      f"model: tensor ") + r"\S+ has shape \(\d+, 16\) there, and this model expects \(\d+, 32\)"):
    builders.with_init_from(spec, params)


@pytest.mark.parametrize("kind", ["int8", "float8", "config"])
def test_a_quantized_checkpoint_is_refused_before_its_weights_are_read(dirs, tmp_path, kind):
  """Probe round 6: int8 weights with weight_scale tensors loaded as floats and decoded garbage
  (exit 0); float8 weights raised AttributeError from numpy. The Llama family now checks every
  tensor's dtype from the headers, as GPT-2 and T5 did, and a config.json that declares a
  quantization is refused by name."""
  import ml_dtypes
  import numpy as np
  quant = {"quant_method": "fp8"} if kind == "config" else None
  path = _copy(dirs["qwen2"], tmp_path / "ckpt", quantization_config=quant)
  weights = load_file(path / "model.safetensors")
  stored = {"int8": np.int8, "float8": ml_dtypes.float8_e4m3fn}.get(kind)
  if stored is not None:
    for name in [k for k in weights if k.endswith("proj.weight")]:
      scale = np.abs(weights[name]).max(axis=1, keepdims=True) / 127
      weights[name] = np.round(weights[name] / scale).astype(stored)
      weights[name.replace(".weight", ".weight_scale")] = scale.astype(np.float32)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ValueError) as err:
    hf_import.load_model(str(path))
  text = str(err.value)
  if kind == "config":
    assert text.startswith(f"{path / 'config.json'}: the checkpoint is quantized (fp8)"), text
  else:
    assert text.startswith(f"{path}: Llama-family checkpoint tensor model.layers.0."), text
    assert f"is stored as {'int8' if kind == 'int8' else 'F8_E4M3'}; specjax reads " in text, text
  assert "quant='int8'" in text, text


@pytest.mark.parametrize("file, content, message", [
    ("tokenizer.json", "{not json", "tokenizer.json is not valid JSON (Expecting property"),
    ("generation_config.json", "{bad", "generation_config.json is not valid JSON (Expecting"),
    ("config.json", None, "config.json: transformers refuses it while reading the tokenizer "
                          "(TypeError: Field 'rms_norm_eps' expected float, got int (value: 1))"),
])
def test_damaged_tokenizer_files_are_named(dirs, tmp_path, file, content, message):
  """Probe round 6: a damaged tokenizer.json or generation_config.json gave a bare JSON error
  naming no file, and an integer where transformers' strict config wants a float (rms_norm_eps
  1) a traceback from inside AutoTokenizer."""
  path = _copy(dirs["qwen2"], tmp_path / "ckpt", **({"rms_norm_eps": 1} if content is None
                                                     else {}))
  if content is not None:
    (path / file).write_text(content)
  with pytest.raises(ValueError) as err:
    tk.get_tokenizer(str(path))
  assert str(err.value).startswith(str(path / file)) and message in str(err.value), err.value


def test_heads_that_do_not_group_name_the_config_file(dirs, tmp_path):
  """Probe round 6: the model's own ValueError named neither the checkpoint nor its file."""
  path = _copy(dirs["qwen2"], tmp_path / "ckpt", num_key_value_heads=3)
  with pytest.raises(ValueError, match=re.escape(f"{path / 'config.json'}: num_heads 4 is not a "
                                                 f"multiple of num_kv_heads 3")):
    hf_import.load_model(str(path))
