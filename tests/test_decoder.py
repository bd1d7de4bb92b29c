"""GPT-2 compatible decoder: parity with transformers, HF round trip, the KV-cache contract, greedy
generation and bf16. Tiny random models (d_model 32, 2 layers, 4 heads, vocab 64), fp32 unless
stated."""

from __future__ import annotations

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specjax.models import Prompt, score  # noqa: E402
from specjax import testing  # noqa: E402
from specjax.models import decoder, hf_import, layers  # noqa: E402
from specjax.models.convert import gpt2  # noqa: E402

VOCAB, N_POS = 64, 32
PROMPTS = [[5, 9, 17, 3, 40], [33, 2], [7, 7, 12, 50, 61, 8, 1]]   # ragged on purpose


def _tiny_hf_config(tie: bool = True):
  return transformers.GPT2Config(
      vocab_size=VOCAB, n_positions=N_POS, n_embd=32, n_layer=2, n_head=4, n_inner=64,
      tie_word_embeddings=tie, bos_token_id=1, eos_token_id=1, pad_token_id=0,
      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _randomize_torch(model):
  """Every tensor random (LayerNorm scale around 1) so that a swapped name cannot go unnoticed."""
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.normal_(0.0, 0.1)
      if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name.endswith("ln_f.weight"):
        p.add_(1.0)
  return model


def _torch_logits(model, row: list[int]) -> np.ndarray:
  with torch.no_grad():
    out = model(torch.tensor([row]), attention_mask=torch.ones(1, len(row), dtype=torch.long))
  return out.logits[0].numpy()                                                 # [L, V]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
  """(torch model, checkpoint dir) of a random GPT2LMHeadModel saved as safetensors."""
  torch.manual_seed(0)
  model = transformers.GPT2LMHeadModel(_tiny_hf_config()).eval()
  _randomize_torch(model)
  out = tmp_path_factory.mktemp("gpt2")
  model.save_pretrained(out)
  assert (out / "model.safetensors").exists()
  return model, out


@pytest.fixture(scope="module")
def ours(hf):
  return hf_import.load_model(str(hf[1]))


@pytest.fixture(scope="module")
def unrolled(hf):
  """The same checkpoint in the unstacked layout: layers_0, layers_1 run by a loop."""
  return hf_import.load_model(str(hf[1]), scan_layers=False)


@pytest.fixture(scope="module", params=["scan", "unrolled"])
def each_layout(request, ours, unrolled):
  return ours if request.param == "scan" else unrolled


def _targets(seed: int, length: int) -> jnp.ndarray:
  return jax.random.randint(jax.random.PRNGKey(seed), (len(PROMPTS), length), 0, VOCAB)


def test_parity_with_transformers(hf, ours):
  torch_model, _ = hf
  model, params = ours
  assert isinstance(model, decoder.Decoder) and not model.is_encoder_decoder
  prompt, targets = Prompt.from_lists(PROMPTS), _targets(1, 4)
  logits, hidden = score(model, params, prompt, targets)                      # [B, 4, V]
  assert logits.dtype == jnp.float32 and hidden.shape == (3, 4, 32)
  # The same through prefill and two extends (1 then 2 tokens).
  cache = model.init_cache(3, 16)
  first, _, cache = model.prefill(params, prompt, cache)
  mid, _, cache = model.extend(params, targets[:, :1], cache)
  last, _, cache = model.extend(params, targets[:, 1:3], cache)
  direct = jnp.concatenate([first[:, None], mid, last], axis=1)               # [B, 4, V]
  for b, row in enumerate(PROMPTS):
    full = row + [int(t) for t in targets[b]]
    want = _torch_logits(torch_model, full)[len(row) - 1:len(row) + 3]        # [4, V]
    np.testing.assert_allclose(np.asarray(logits[b]), want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(direct[b]), want, atol=1e-4, rtol=0)
  np.testing.assert_array_equal(cache.lengths, [len(r) + 3 for r in PROMPTS])


def test_export_import_is_exact_and_transformers_loads_it(hf, ours, tmp_path):
  torch_model, _ = hf
  model, params = ours
  hf_import.save_model(model, params, str(tmp_path))
  model2, params2 = hf_import.load_model(str(tmp_path))
  assert model2 == model
  jax.tree_util.tree_map(np.testing.assert_array_equal, params, params2)
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["model_type"] == "gpt2" and config["architectures"] == ["GPT2LMHeadModel"]
  reloaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
  for row in PROMPTS:
    np.testing.assert_allclose(_torch_logits(reloaded, row), _torch_logits(torch_model, row),
                               atol=1e-6, rtol=0)


def test_untied_lm_head_export_matches_transformers(tmp_path):
  cfg = decoder.DecoderConfig(vocab_size=VOCAB, n_positions=N_POS, d_model=32, num_layers=2,
                              num_heads=4, d_ff=64, tie_word_embeddings=False, bos_token_id=1,
                              eos_token_id=1, pad_token_id=0)
  model = decoder.Decoder(cfg)
  params = model.init_params(jax.random.PRNGKey(3))
  assert params["lm_head"]["kernel"].shape == (32, VOCAB)
  rng = np.random.default_rng(3)     # every leaf random, norm scales included
  params = jax.tree_util.tree_map(lambda x: x + 0.1 * rng.standard_normal(x.shape, np.float32),
                                  params)
  hf_import.save_model(model, params, str(tmp_path))
  model2, params2 = hf_import.load_model(str(tmp_path))
  assert model2 == model
  jax.tree_util.tree_map(np.testing.assert_array_equal, params, params2)
  torch_model = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
  logits, _, _ = model.prefill(params, Prompt.from_lists(PROMPTS), model.init_cache(3, 16))
  for b, row in enumerate(PROMPTS):
    np.testing.assert_allclose(logits[b], _torch_logits(torch_model, row)[-1], atol=1e-4, rtol=0)


def test_params_from_hf_accepts_unprefixed_names_and_reports_missing(hf, ours):
  model, params = ours
  tensors = hf_import.read_tensors(hf[1])
  bare = {k.removeprefix("transformer."): v for k, v in tensors.items()}
  jax.tree_util.tree_map(np.testing.assert_array_equal, gpt2.params_from_hf(model, bare), params)
  del bare["h.1.mlp.c_fc.weight"]
  with pytest.raises(ValueError, match="lacks 1 tensors"):
    gpt2.params_from_hf(model, bare)


def test_extend_block_equals_single_steps(each_layout):
  model, params = each_layout
  prompt, toks = Prompt.from_lists(PROMPTS), _targets(2, 3)
  _, _, cache = model.prefill(params, prompt, model.init_cache(3, 16))
  block_logits, block_hidden, block_cache = model.extend(params, toks, cache)  # [B, 3, V]
  step_cache = cache
  for t in range(3):
    logits, hidden, step_cache = model.extend(params, toks[:, t:t + 1], step_cache)
    np.testing.assert_allclose(logits[:, 0], block_logits[:, t], atol=1e-5, rtol=0)
    np.testing.assert_allclose(hidden[:, 0], block_hidden[:, t], atol=1e-5, rtol=0)
  np.testing.assert_array_equal(step_cache.lengths, block_cache.lengths)
  for b, n in enumerate(np.asarray(block_cache.lengths)):
    np.testing.assert_allclose(step_cache.k[:, b, :, :n], block_cache.k[:, b, :, :n], atol=1e-5)


def test_extend_select_and_entries(each_layout):
  model, params = each_layout
  _, _, cache = model.prefill(params, Prompt.from_lists(PROMPTS), model.init_cache(3, 16))
  testing.check_extend_variants(model, params, _targets(2, 3), cache, np.array([2, 0, 1]))


def test_unstacked_layout_equals_stacked(ours, unrolled, tmp_path):
  (model, params), (loop_model, loop_params) = ours, unrolled
  assert not loop_model.config.scan_layers and "layers" not in loop_params
  np.testing.assert_array_equal(loop_params["layers_1"]["mlp"]["wi"]["kernel"],
                                params["layers"]["mlp"]["wi"]["kernel"][1])
  jax.tree_util.tree_map(np.testing.assert_array_equal, layers.stack(loop_params), params)
  jax.tree_util.tree_map(np.testing.assert_array_equal, layers.unstack(params), loop_params)
  key = jax.random.PRNGKey(4)                     # init: the same values in either layout
  jax.tree_util.tree_map(np.testing.assert_array_equal, loop_model.init_params(key),
                         layers.unstack(model.init_params(key)))
  prompt, targets = Prompt.from_lists(PROMPTS), _targets(1, 4)
  logits, _ = score(model, params, prompt, targets)
  loop_logits, _ = score(loop_model, loop_params, prompt, targets)
  np.testing.assert_allclose(loop_logits, logits, atol=1e-6, rtol=0)
  _, _, cache = model.prefill(params, prompt, model.init_cache(3, 16))       # the same cache
  entries = model.extend_entries(params, targets, cache)[2]
  loop_entries = loop_model.extend_entries(loop_params, targets, cache)[2]
  assert loop_entries[0].shape == (2, 3, 4, 4, 8)                            # [L, B, T, H, Dh]
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), loop_entries,
                         entries)
  hf_import.save_model(loop_model, loop_params, str(tmp_path))   # exported as the stacked one
  jax.tree_util.tree_map(np.testing.assert_array_equal, hf_import.load_model(str(tmp_path))[1],
                         params)


def test_layout_choice_of_the_app(hf, monkeypatch):
  """`layers` of a model section: auto is scanned on TPU and where the CPU kernels read the
  quantized layers in place, unrolled elsewhere."""
  from specjax.api import loading
  from specjax.app import builders, config, resolve
  assert layers.scan_layers("auto", backend="tpu")
  assert not layers.scan_layers("auto", backend="cpu") and not layers.scan_layers("auto", "gpu")
  assert layers.scan_layers("auto", "cpu", in_place=True)       # the kernels read the stack
  assert not layers.scan_layers("auto", "gpu", in_place=True)
  assert layers.scan_layers("scan") and not layers.scan_layers("unrolled")
  with pytest.raises(config.ConfigError, match="--config.target: layers='fast'"):
    builders.model_spec({"target": {"checkpoint": str(hf[1]), "layers": "fast"}}, "target")
  no_tokenizer = types.SimpleNamespace(vocab_size=1)                          # none saved here
  monkeypatch.setattr(loading, "load_tokenizer", lambda path, override: no_tokenizer)
  on_tpu = jax.default_backend() == "tpu"
  for layout, scan in (("auto", on_tpu), ("scan", True), ("unrolled", False)):
    spec = builders.model_spec({"target": {"checkpoint": str(hf[1]), "layers": layout}}, "target")
    loaded = resolve.load(spec)
    assert loaded.model.config.scan_layers is scan and ("layers" in loaded.params) is scan


def _single_row(model, params, b: int, pieces: list[jnp.ndarray]):
  """Row b alone (padded wider, with another pad id), then extend each piece's row b; returns the
  logits of the last extend."""
  alone = Prompt.from_lists([PROMPTS[b]], pad_to=8, pad_id=21)
  _, _, cache = model.prefill(params, alone, model.init_cache(1, 16))
  logits = None
  for piece in pieces:
    if piece.shape[1]:
      logits, _, cache = model.extend(params, piece[b:b + 1], cache)
  return logits[0]


def test_ragged_rollback_then_extend_equals_never_extending(ours):
  model, params = ours
  prompt, drafts, fresh = Prompt.from_lists(PROMPTS), _targets(3, 3), _targets(4, 2)
  _, _, cache = model.prefill(params, prompt, model.init_cache(3, 16))
  _, _, cache = model.extend(params, drafts, cache)
  keep = np.array([1, 2, 0])                                   # drafts kept per row
  cache = cache.replace(lengths=prompt.lengths + keep)
  logits, _, cache = model.extend(params, fresh, cache)        # [B, 2, V]
  np.testing.assert_array_equal(cache.lengths, prompt.lengths + keep + 2)
  for b in range(3):
    want = _single_row(model, params, b, [drafts[:, :keep[b]], fresh])
    np.testing.assert_allclose(logits[b], want, atol=1e-5, rtol=0)


def test_ragged_batch_equals_single_rows(ours):
  model, params = ours
  prompt, toks = Prompt.from_lists(PROMPTS, pad_id=13), _targets(5, 2)
  first, hidden, cache = model.prefill(params, prompt, model.init_cache(3, 16))
  assert hidden.shape == (3, model.hidden_size)
  np.testing.assert_array_equal(cache.lengths, prompt.lengths)
  logits, _, _ = model.extend(params, toks, cache)
  for b in range(3):
    alone = Prompt.from_lists([PROMPTS[b]], pad_to=8, pad_id=21)
    single, _, _ = model.prefill(params, alone, model.init_cache(1, 16))
    np.testing.assert_allclose(first[b], single[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits[b], _single_row(model, params, b, [toks]), atol=1e-5, rtol=0)


def test_cache_beyond_n_positions_is_refused(ours):
  model, _ = ours
  model.init_cache(2, N_POS)
  with pytest.raises(ValueError, match="n_positions=32.*max_len"):
    model.init_cache(2, N_POS + 1)


def test_greedy_matches_transformers_generate(hf, ours):
  torch_model, _ = hf
  model, params = ours
  steps = 8
  prompt = Prompt.from_lists(PROMPTS)
  logits, _, cache = model.prefill(params, prompt, model.init_cache(3, 16))
  out = []
  for _ in range(steps):
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)                      # [B]
    out.append(np.asarray(token))
    step_logits, _, cache = model.extend(params, token[:, None], cache)
    logits = step_logits[:, 0]
  ours_tokens = np.stack(out, axis=1)                                          # [B, steps]
  for b, row in enumerate(PROMPTS):
    with torch.no_grad():
      gen = torch_model.generate(torch.tensor([row]), attention_mask=torch.ones(1, len(row),
                                 dtype=torch.long), do_sample=False, max_new_tokens=steps,
                                 pad_token_id=0)
    theirs = gen[0, len(row):].numpy()
    assert len(theirs) >= 1
    np.testing.assert_array_equal(ours_tokens[b, :len(theirs)], theirs)


def test_bfloat16_runs_and_is_close_to_float32(hf, ours):
  model32, params32 = ours
  model16, params16 = hf_import.load_model(str(hf[1]), dtype="bfloat16")
  assert model16.dtype == jnp.bfloat16 and model16 != model32
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(params16))
  prompt, targets = Prompt.from_lists(PROMPTS), _targets(1, 4)
  logits16, hidden16 = score(model16, params16, prompt, targets)
  logits32, _ = score(model32, params32, prompt, targets)
  assert logits16.dtype == jnp.float32 and hidden16.dtype == jnp.bfloat16
  assert bool(jnp.all(jnp.isfinite(logits16)))
  scale = float(jnp.max(jnp.abs(logits32)))
  assert float(jnp.max(jnp.abs(logits16 - logits32))) <= 0.03 * scale + 0.02


def test_lm1b_pair_shapes_and_config_errors():
  counts = {}
  for size in ("target", "draft"):
    model = decoder.Decoder(decoder.lm1b_config(size))
    shapes = jax.eval_shape(model.init_params, jax.random.PRNGKey(0))
    counts[size] = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))
    assert shapes["token_embed"]["embedding"].shape == (32128, model.hidden_size)
  assert 180e6 < counts["target"] < 190e6 and 24e6 < counts["draft"] < 26e6, counts
  with pytest.raises(ValueError, match="unknown LM1B size"):
    decoder.lm1b_config("huge")
  with pytest.raises(ValueError, match="not divisible"):
    decoder.DecoderConfig(d_model=30, num_heads=4)
  with pytest.raises(ValueError, match="activation"):
    decoder.DecoderConfig(activation="tanh")
