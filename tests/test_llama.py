"""Llama-family decoder (llama, mistral, qwen2, qwen3): parity with transformers on a ragged batch,
the KV-cache contract, greedy generation, the HF round trip, bf16 and bad input; and the HF
tokenizer's EOS ids and chat template. Tiny random models (hidden 32, 2 layers, 4 query heads
over 2 KV heads, vocab 96), float32 unless stated."""

from __future__ import annotations

import collections
import json
import re
import shutil
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specjax import sampling, testing  # noqa: E402
from specjax.data import tokenizer  # noqa: E402
from specjax.decoding import autoregressive  # noqa: E402
from specjax.models import Prompt, hf_import, hf_tensors, layers, llama  # noqa: E402
from specjax.models.convert import llama as convert_llama  # noqa: E402

VOCAB, EOS = 96, 2
PROMPTS = [[5, 9, 17, 3, 40, 61, 12, 8], [33, 2], [7, 7, 12, 50, 61]]   # ragged on purpose
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}   # wavelengths 6 (kept), 63 (smoothed), 628+


def _hf_config(name: str):
  """The tiny configs under test: every switch of the family at least once."""
  configs = {
      "llama3_rope_bias_untied": lambda: transformers.LlamaConfig(
          **COMMON, rope_parameters=LLAMA3_ROPE, attention_bias=True, mlp_bias=True,
          tie_word_embeddings=False),
      "llama_linear_rope_tied": lambda: transformers.LlamaConfig(
          **COMMON, rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
          tie_word_embeddings=True),
      "mistral_window": lambda: transformers.MistralConfig(**COMMON, sliding_window=5),
      "qwen2_bias_tied": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
      "qwen3_qk_norm": lambda: transformers.Qwen3Config(**COMMON, head_dim=16,
                                                        tie_word_embeddings=False),
  }
  return configs[name]()


CONFIGS = ("llama3_rope_bias_untied", "llama_linear_rope_tied", "mistral_window",
           "qwen2_bias_tied", "qwen3_qk_norm")


def _torch_model(name: str):
  """A random torch model: every tensor N(0, 0.2) (norm scales around 1), so that a swapped or
  mis-transposed tensor cannot go unnoticed."""
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(_hf_config(name),
                                                        attn_implementation="eager").eval()
  with torch.no_grad():
    for param_name, p in model.named_parameters():
      p.normal_(0.0, 0.2)
      if param_name.endswith("norm.weight"):
        p.add_(1.0)
  return model


@pytest.fixture(scope="module")
def hf(request, tmp_path_factory):
  """(name, torch model, checkpoint dir) of a random HF model saved as safetensors; tests pick
  configs with indirect parametrization."""
  model = _torch_model(request.param)
  out = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(out, safe_serialization=True)
  return request.param, model, out


@pytest.fixture(scope="module")
def ours(hf):
  return hf_import.load_model(str(hf[2]))


@pytest.fixture(scope="module")
def unrolled(hf):
  """The same checkpoint in the unstacked layout: layers_0, layers_1 run by a loop."""
  return hf_import.load_model(str(hf[2]), scan_layers=False)


@pytest.fixture(scope="module", params=["scan", "unrolled"])
def each_layout(request, ours, unrolled):
  return ours if request.param == "scan" else unrolled


def _on(*names):
  return pytest.mark.parametrize("hf", names, indirect=True)


def _torch_logits(model, row: list[int]) -> np.ndarray:
  with torch.no_grad():
    out = model(torch.tensor([row]), attention_mask=torch.ones(1, len(row), dtype=torch.long))
  return out.logits[0].numpy()                                                 # [L, V]


def _targets(seed: int, length: int) -> jnp.ndarray:
  return jax.random.randint(jax.random.PRNGKey(seed), (len(PROMPTS), length), 0, VOCAB)


CACHE = 16   # one cache size throughout, so that the tests share compiled functions


@_on(*CONFIGS)
def test_parity_on_ragged_batch(hf, ours):
  _, torch_model, _ = hf
  model, params = ours
  assert isinstance(model, llama.Llama) and not model.is_encoder_decoder
  prompt, targets = Prompt.from_lists(PROMPTS), _targets(1, 4)
  cache = model.init_cache(3, CACHE)
  assert cache.k.shape == (2, 3, 2, CACHE, model.config.head_dim)            # only the KV heads
  first, hidden, cache = model.prefill(params, prompt, cache)
  rest, _, cache = model.extend(params, targets[:, :3], cache)
  logits = jnp.concatenate([first[:, None], rest], axis=1)                    # [B, 4, V]
  assert logits.dtype == jnp.float32 and hidden.shape == (3, 32)
  for b, row in enumerate(PROMPTS):
    full = row + [int(t) for t in targets[b]]
    want = _torch_logits(torch_model, full)[len(row) - 1:len(row) + 3]         # [4, V]
    np.testing.assert_allclose(np.asarray(logits[b]), want, atol=1e-4, rtol=0)
  np.testing.assert_array_equal(cache.lengths, [len(r) + 3 for r in PROMPTS])


def test_mistral_reference_applies_its_window():
  """PROMPTS[0] is longer than mistral's window (5), and transformers' logits past the window
  change without it: the parity test checks the window."""
  torch_model = _torch_model("mistral_window")
  windowed = _torch_logits(torch_model, PROMPTS[0])
  torch_model.config.sliding_window = None
  differs = np.abs(_torch_logits(torch_model, PROMPTS[0]) - windowed).max(axis=-1) > 1e-6
  np.testing.assert_array_equal(differs, [False] * 5 + [True] * 3)


@_on("mistral_window", "qwen3_qk_norm")
def test_extend_block_equals_single_steps(each_layout):
  model, params = each_layout
  prompt, toks = Prompt.from_lists(PROMPTS), _targets(2, 3)
  _, _, cache = model.prefill(params, prompt, model.init_cache(3, CACHE))
  block_logits, block_hidden, block_cache = model.extend(params, toks, cache)  # [B, 3, V]
  step_cache = cache
  for t in range(3):
    logits, hidden, step_cache = model.extend(params, toks[:, t:t + 1], step_cache)
    np.testing.assert_allclose(logits[:, 0], block_logits[:, t], atol=1e-5, rtol=0)
    np.testing.assert_allclose(hidden[:, 0], block_hidden[:, t], atol=1e-5, rtol=0)
  for b, n in enumerate(np.asarray(block_cache.lengths)):
    np.testing.assert_allclose(step_cache.k[:, b, :, :n], block_cache.k[:, b, :, :n], atol=1e-5)
  testing.check_extend_variants(model, params, toks, cache, np.array([2, 0, 1]))

ULP = testing.layout_ulp()


@_on("llama3_rope_bias_untied", "qwen3_qk_norm")
def test_unstacked_layout_equals_stacked(ours, unrolled, tmp_path):
  (model, params), (loop_model, loop_params) = ours, unrolled
  assert not loop_model.config.scan_layers and "layers" not in loop_params
  jax.tree_util.tree_map(np.testing.assert_array_equal, layers.unstack(params), loop_params)
  key = jax.random.PRNGKey(4)                     # init: the same values in either layout
  jax.tree_util.tree_map(np.testing.assert_array_equal, loop_model.init_params(key),
                         layers.unstack(model.init_params(key)))
  prompt, targets = Prompt.from_lists(PROMPTS), _targets(1, 4)
  first, _, cache = model.prefill(params, prompt, model.init_cache(3, CACHE))
  loop_first, _, loop_cache = loop_model.prefill(loop_params, prompt, model.init_cache(3, CACHE))
  np.testing.assert_allclose(loop_first, first, atol=ULP, rtol=0)
  np.testing.assert_allclose(loop_cache.k, cache.k, atol=ULP, rtol=0)
  logits, _, (k, v) = model.extend_entries(params, targets, cache)
  loop_logits, _, (loop_k, loop_v) = loop_model.extend_entries(loop_params, targets, cache)
  # Not bit-equal: XLA fuses a scan body and straight-line layers differently (layer 0's keys are
  # equal, later ones an ulp off), so ULP of the logits' scale.
  scale = float(np.abs(logits).max())
  np.testing.assert_allclose(loop_logits, logits, atol=ULP * max(scale, 1.0), rtol=0)
  assert loop_k.shape == k.shape == (2, 3, 4, 2, model.config.head_dim)      # [L,B,T,Hkv,Dh]
  np.testing.assert_allclose(loop_k, k, atol=ULP, rtol=0)
  np.testing.assert_allclose(loop_v, v, atol=ULP, rtol=0)
  hf_import.save_model(loop_model, loop_params, str(tmp_path))   # exported as the stacked one
  reloaded, reloaded_params = hf_import.load_model(str(tmp_path))
  assert reloaded == model
  jax.tree_util.tree_map(np.testing.assert_array_equal, reloaded_params, params)


@_on("llama3_rope_bias_untied", "qwen2_bias_tied")
def test_greedy_generate_matches_transformers(hf, ours):
  _, torch_model, _ = hf
  model, params = ours
  steps = 8
  gen = autoregressive.generate(model, params, Prompt.from_lists(PROMPTS), jax.random.PRNGKey(0),
                                max_new_tokens=steps, warp=sampling.Warp(temperature=0.0),
                                eos_id=EOS, max_len=CACHE)
  for b, row in enumerate(PROMPTS):
    with torch.no_grad():
      out = torch_model.generate(torch.tensor([row]), attention_mask=torch.ones(
          1, len(row), dtype=torch.long), do_sample=False, max_new_tokens=steps,
          eos_token_id=EOS, pad_token_id=0)
    theirs = out[0, len(row):].numpy()
    np.testing.assert_array_equal(np.asarray(gen.tokens[b, :int(gen.lengths[b])]), theirs)


@_on(*CONFIGS)
def test_export_import_is_exact_and_transformers_loads_it(hf, ours, tmp_path):
  _, torch_model, _ = hf
  model, params = ours
  hf_import.save_model(model, params, str(tmp_path))
  model2, params2 = hf_import.load_model(str(tmp_path))
  assert model2 == model
  jax.tree_util.tree_map(np.testing.assert_array_equal, params, params2)
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["model_type"] == torch_model.config.model_type
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), attn_implementation="eager").eval()
  assert type(reloaded) is type(torch_model)
  for row in PROMPTS:
    np.testing.assert_allclose(_torch_logits(reloaded, row), _torch_logits(torch_model, row),
                               atol=1e-6, rtol=0)


class _CountingTensors(Mapping):
  """A lazy-looking tensor mapping that counts the reads of every name."""

  def __init__(self, tensors):
    self.tensors, self.reads = tensors, collections.Counter()

  def __getitem__(self, name):
    self.reads[name] += 1
    return self.tensors[name]

  def __contains__(self, name):   # as LazyTensors: from the names, reading nothing
    return name in self.tensors

  def __iter__(self):
    return iter(self.tensors)

  def __len__(self):
    return len(self.tensors)


@_on(*CONFIGS)
def test_params_from_hf_reads_each_tensor_once_and_names_bad_ones(hf, ours):
  _, _, path = hf
  model, params = ours
  tensors = dict(hf_import.read_tensors(path))    # an editable copy: read_tensors is lazy
  counting = _CountingTensors(tensors)
  jax.tree_util.tree_map(np.testing.assert_array_equal, convert_llama.params_from_hf(model, counting),
                         params)
  assert counting.reads == collections.Counter(set(tensors))                # every one, once
  name = "model.layers.1.mlp.up_proj.weight"
  with pytest.raises(ValueError, match=rf"'{name}' has shape \(32, 64\).*implies \(64, 32\)"):
    convert_llama.params_from_hf(model, {**tensors, name: tensors[name].T})
  del tensors[name]
  with pytest.raises(ValueError, match=rf"Llama-family checkpoint lacks 1 tensors, e.g. "
                                       rf"\['{name}'\]"):
    convert_llama.params_from_hf(model, tensors)


@_on("qwen3_qk_norm")
def test_bfloat16_loads_and_is_close_to_float32(hf, ours):
  model32, params32 = ours
  model16, params16 = hf_import.load_model(str(hf[2]), dtype="bfloat16")
  assert model16.dtype == jnp.bfloat16 and model16 != model32
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(params16))
  prompt = Prompt.from_lists(PROMPTS)
  logits16, hidden16, cache16 = model16.prefill(params16, prompt, model16.init_cache(3, CACHE))
  logits32, _, _ = model32.prefill(params32, prompt, model32.init_cache(3, CACHE))
  assert logits16.dtype == jnp.float32 and hidden16.dtype == cache16.k.dtype == jnp.bfloat16
  scale = float(jnp.max(jnp.abs(logits32)))
  assert float(jnp.max(jnp.abs(logits16 - logits32))) <= 0.05 * scale + 0.05


def test_unsupported_configs_are_refused_with_the_supported_list(tmp_path):
  config = _hf_config("llama3_rope_bias_untied").to_dict()
  convert_llama.model_from_hf_config(config, "float32")
  yarn = {**config, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}
  with pytest.raises(ValueError, match=r"'yarn'.*\('default', 'linear', 'llama3'\)"):
    convert_llama.model_from_hf_config(yarn, "float32")
  old_style = {**config, "rope_parameters": None, "rope_theta": 500.0,
               "rope_scaling": {"type": "linear", "factor": 2.0}}          # transformers 4 files
  assert convert_llama.model_from_hf_config(old_style, "float32").config.rope == llama.Rope(
      theta=500.0, kind="linear", factor=2.0)
  with pytest.raises(ValueError, match=r"'gemma'.*\('llama', 'mistral', 'qwen2', 'qwen3'\)"):
    convert_llama.model_from_hf_config({**config, "model_type": "gemma"}, "float32")
  _torch_model("qwen2_bias_tied").save_pretrained(tmp_path, safe_serialization=True)
  gemma = json.loads((tmp_path / "config.json").read_text()) | {"model_type": "gemma"}
  (tmp_path / "config.json").write_text(json.dumps(gemma))
  with pytest.raises(ValueError, match=r"'gemma' is not supported.*'llama', 'mistral', 'qwen2'"):
    hf_import.load_model(str(tmp_path))


def test_config_checks():
  base = dict(vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4, head_dim=8, d_ff=64)
  with pytest.raises(ValueError, match="multiple of num_kv_heads"):
    llama.LlamaConfig(**base, num_kv_heads=3)
  with pytest.raises(ValueError, match="precision"):
    llama.LlamaConfig(**base, num_kv_heads=2, precision="tf32")
  qwen2_without_bias = llama.Llama(llama.LlamaConfig(**base, num_kv_heads=2, model_type="qwen2"))
  with pytest.raises(ValueError, match="cannot be written as HF model_type 'qwen2'"):
    convert_llama.hf_config(qwen2_without_bias)


# ---------------------------------------------------------------------------------------------
# HFTokenizer: several EOS ids, special ids from the checkpoint, the chat template.

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def _save_tokenizer(path, **special):
  """A byte-level BPE with Qwen's special tokens (ids 0, 1, 2) saved as an HF checkpoint."""
  tk = pytest.importorskip("tokenizers")
  bpe = tk.Tokenizer(tk.models.BPE())
  bpe.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = tk.decoders.ByteLevel()
  trainer = tk.trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
      initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
  bpe.train_from_iterator(["hello world", "def foo(x):\n    return x + 1\n"] * 10, trainer)
  transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, **special).save_pretrained(path)


def test_hf_tokenizer_eos_ids_and_chat_template(tmp_path):
  _save_tokenizer(tmp_path, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                  chat_template=CHAT_TEMPLATE)
  (tmp_path / "generation_config.json").write_text(json.dumps(
      {"eos_token_id": [2, 0], "bos_token_id": 1}))                  # Qwen instruct's pair
  tok = tokenizer.HFTokenizer.load(tmp_path)
  assert tok.eos_ids == (2, 0) and tok.eos_id == 2
  assert (tok.pad_id, tok.bos_id) == (0, 1)                          # tokenizer's, generation's
  text = tok.apply_chat_template("hello")
  assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
  ids = tok.encode(text)
  assert ids[0] == 1 and ids.count(2) == 1 and tok.decode(ids) == "user\nhello\nassistant\n"


def test_hf_tokenizer_without_chat_template_or_generation_config(tmp_path):
  _save_tokenizer(tmp_path, eos_token="<|endoftext|>")
  tok = tokenizer.HFTokenizer.load(tmp_path)
  assert tok.eos_ids == (0,) and tok.pad_id == tok.bos_id == 0       # GPT-2 style fallbacks
  with pytest.raises(ValueError, match="no chat template"):
    tok.apply_chat_template("hello")
  other = tmp_path.parent / "no_eos"
  shutil.copytree(tmp_path, other)
  config = json.loads((other / "tokenizer_config.json").read_text())
  config.pop("eos_token")
  (other / "tokenizer_config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="defines no EOS token"):
    tokenizer.HFTokenizer.load(other)


@pytest.mark.parametrize("hf", ["qwen2_bias_tied"], indirect=True)
@pytest.mark.parametrize("scan", [False, True])
def test_a_nan_in_any_layer_is_refused_in_either_layout(hf, tmp_path, scan):
  """The unrolled load checks every tensor on the device (one read of the counts at the end);
  the stacked load on the host: both name the tensor and its file."""
  from safetensors.numpy import load_file, save_file
  _, _, path = hf
  shutil.copytree(path, tmp_path / "ckpt")
  weights = tmp_path / "ckpt" / "model.safetensors"
  tensors = load_file(str(weights))
  name = "model.layers.1.mlp.down_proj.weight"
  tensors[name] = tensors[name].copy()
  tensors[name][2, 5] = np.nan
  save_file(tensors, str(weights), metadata={"format": "pt"})
  with pytest.raises(hf_tensors.NonFiniteTensorError,
                     match=re.escape(f"{weights}: tensor {name} holds 1 NaN/inf values")):
    hf_import.load_model(str(tmp_path / "ckpt"), scan_layers=scan)
