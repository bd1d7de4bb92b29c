"""T5: parity with transformers, HF import/export, cache semantics, greedy decoding, bf16."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import testing
from specjax.models import Prompt, hf_import, kv_cache, layers, score, t5
from specjax.models.convert import t5 as convert_t5

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Small bucket settings so that the log-spaced and clipped buckets occur in short sequences.
_COMMON = dict(vocab_size=64, d_model=32, d_ff=48, num_layers=2, relative_attention_num_buckets=8,
               relative_attention_max_distance=16, dropout_rate=0.0, pad_token_id=0,
               eos_token_id=1, decoder_start_token_id=0)
VARIANTS = {
    # original T5: relu, tied embeddings, output scaled by d_model**-0.5, H*Dh == D
    "relu_tied": dict(num_heads=4, d_kv=8, feed_forward_proj="relu", tie_word_embeddings=True),
    # T5 v1.1: gated-gelu, separate lm_head, no scaling, H*Dh (48) != D, deeper decoder
    "gated_untied": dict(num_heads=4, d_kv=12, feed_forward_proj="gated-gelu",
                         tie_word_embeddings=False, num_decoder_layers=3),
}


def _torch_model(name: str, seed: int):
  torch.manual_seed(seed)
  cfg = transformers.T5Config(**_COMMON, **VARIANTS[name])
  model = transformers.T5ForConditionalGeneration(cfg).eval()
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if "layer_norm" in pname:          # non-trivial norm scales and position biases, so that
        p.uniform_(0.5, 1.5)             # a mis-mapped tensor cannot hide
      elif "relative_attention_bias" in pname:
        p.normal_(0.0, 1.0)
    if not VARIANTS[name]["tie_word_embeddings"]:
      # transformers >= 5 ties lm_head to shared even for v1.1 configs; untie it explicitly.
      model.lm_head.weight = torch.nn.Parameter(torch.randn(cfg.vocab_size, cfg.d_model) * 0.5)
  return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """name -> (torch model, HF checkpoint dir) for both variants."""
  out = {}
  for seed, name in enumerate(VARIANTS):
    model = _torch_model(name, seed)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(str(path), safe_serialization=True)
    if not VARIANTS[name]["tie_word_embeddings"]:
      # Write config.json as the hub's v1.1 checkpoints have it (transformers >= 5 would write
      # tie_word_embeddings=true, scale_decoder_outputs=false; test_transformers5_untied_format).
      config = json.loads((path / "config.json").read_text())
      config["tie_word_embeddings"] = False
      config.pop("scale_decoder_outputs", None)
      (path / "config.json").write_text(json.dumps(config))
    out[name] = (model, path)
  return out


def _ragged(rng: np.random.RandomState, lengths, width=None, low=2):
  rows = [list(rng.randint(low, 64, size=n)) for n in lengths]
  return Prompt.from_lists(rows, pad_to=width)


def _torch_logits(model, prompt: Prompt, targets: np.ndarray, start: int = 0) -> np.ndarray:
  tokens = torch.tensor(np.asarray(prompt.tokens), dtype=torch.long)
  mask = torch.tensor(np.arange(tokens.shape[1])[None] < np.asarray(prompt.lengths)[:, None],
                      dtype=torch.long)
  dec = np.concatenate([np.full((targets.shape[0], 1), start), targets[:, :-1]], axis=1)
  with torch.no_grad():
    out = model(input_ids=tokens, attention_mask=mask,
                decoder_input_ids=torch.tensor(dec, dtype=torch.long))
  return out.logits.numpy()


def _parity_inputs():
  """Ragged batch, longer than max_distance (clipped buckets); shared so that jit caches hit."""
  rng = np.random.RandomState(0)
  return _ragged(rng, [18, 11, 1]), rng.randint(2, 64, size=(3, 20))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_parity_with_transformers(checkpoints, name):
  torch_model, path = checkpoints[name]
  model, params = hf_import.load_model(str(path))
  assert model.config.feed_forward_proj == VARIANTS[name]["feed_forward_proj"]
  assert ("lm_head" in params) == (not VARIANTS[name]["tie_word_embeddings"])
  prompt, targets = _parity_inputs()
  ours, hidden = score(model, params, prompt, jnp.asarray(targets))
  assert ours.dtype == jnp.float32 and hidden.shape == (3, 20, 32)
  np.testing.assert_allclose(np.asarray(ours), _torch_logits(torch_model, prompt, targets),
                             atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_export_then_import_is_exact(checkpoints, name, tmp_path):
  torch_model, path = checkpoints[name]
  model, params = hf_import.load_model(str(path))
  hf_import.save_model(model, params, str(tmp_path))
  model2, params2 = hf_import.load_model(str(tmp_path))
  assert model2 == model
  assert jax.tree_util.tree_structure(params2) == jax.tree_util.tree_structure(params)
  for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # transformers loads the export and computes the same function as the original torch model.
  reloaded = transformers.T5ForConditionalGeneration.from_pretrained(str(tmp_path)).eval()
  rng = np.random.RandomState(1)
  prompt = _ragged(rng, [5, 3])
  targets = rng.randint(2, 64, size=(2, 4))
  np.testing.assert_allclose(_torch_logits(reloaded, prompt, targets),
                             _torch_logits(torch_model, prompt, targets), atol=1e-6, rtol=0)


def test_transformers5_untied_format():
  """transformers >= 5 saves v1.1 as tie_word_embeddings=true + scale_decoder_outputs=false + a
  distinct lm_head.weight; the head must stay untied (and a really tied one stay tied)."""
  torch_model = _torch_model("gated_untied", 0)
  tensors = {k: v.detach().numpy() for k, v in torch_model.state_dict().items()}
  hf = dict(torch_model.config.to_dict(), tie_word_embeddings=True, scale_decoder_outputs=False)
  model = convert_t5.model_from_hf_config(hf, "float32")
  assert model.config.tie_word_embeddings and not model.config.scale_decoder_outputs
  params = convert_t5.params_from_hf(model, tensors)
  np.testing.assert_array_equal(np.asarray(params["lm_head"]["kernel"]),
                                tensors["lm_head.weight"].T)
  tensors["lm_head.weight"] = tensors["shared.weight"].copy()
  assert "lm_head" not in convert_t5.params_from_hf(model, tensors)
  del tensors["encoder.block.1.layer.0.SelfAttention.q.weight"]
  with pytest.raises(ValueError, match="lacks 1 tensors"):
    convert_t5.params_from_hf(model, tensors)


def test_init_params_layout_and_export_loads_in_transformers(checkpoints, tmp_path):
  # The same config as the gated_untied checkpoint, so the compiled prefill/extend are reused.
  cfg = t5.T5Config(vocab_size=64, d_model=32, d_kv=12, d_ff=48, num_heads=4, num_layers=2,
                    num_decoder_layers=3, relative_attention_num_buckets=8,
                    relative_attention_max_distance=16, feed_forward_proj="gated-gelu",
                    tie_word_embeddings=False)
  model = t5.T5(cfg)
  assert model == hf_import.load_model(str(checkpoints["gated_untied"][1]))[0]
  params = model.init_params(jax.random.key(0))
  assert type(params) is dict and model.is_encoder_decoder and model.hidden_size == 32
  layer = params["decoder"]["layers"]                          # stacked over the 3 layers
  assert layer["self_attn"]["query"]["kernel"].shape == (3, 32, 48)
  assert layer["cross_attn"]["out"]["kernel"].shape == (3, 48, 32)
  assert layer["mlp"]["wi_0"]["kernel"].shape == (3, 32, 48)
  assert params["encoder"]["layers"]["mlp_norm"]["scale"].shape == (2, 32)
  assert params["decoder"]["relpos_bias"].shape == (8, 4)
  assert params["lm_head"]["kernel"].shape == (32, 64)
  assert params["shared"]["embedding"].shape == (64, 32)
  std = float(jnp.std(layer["mlp"]["wo"]["kernel"]))
  assert 0.8 * 48 ** -0.5 < std < 1.2 * 48 ** -0.5           # T5 init: wo ~ N(0, d_ff**-0.5)
  assert "lm_head" not in t5.T5(dataclasses.replace(cfg, tie_word_embeddings=True)).init_params(
      jax.random.key(0))
  hf_import.save_model(model, params, str(tmp_path))
  torch_model = transformers.T5ForConditionalGeneration.from_pretrained(str(tmp_path)).eval()
  prompt, targets = _parity_inputs()
  ours, _ = score(model, params, prompt, jnp.asarray(targets))
  np.testing.assert_allclose(np.asarray(ours), _torch_logits(torch_model, prompt, targets),
                             atol=1e-4, rtol=0)


# Cache tests: one model, batch 3, encoder width 6, 8 decoder positions (few distinct compiles).
ROWS = [[11, 12, 13, 14, 15, 16], [21, 22], [31, 32, 33, 34]]


@pytest.fixture(scope="module")
def gated(checkpoints):
  return hf_import.load_model(str(checkpoints["gated_untied"][1]))


@pytest.fixture(scope="module")
def gated_unrolled(checkpoints):
  """The same checkpoint in the unstacked layout: {encoder,decoder}/layers_i run by a loop."""
  return hf_import.load_model(str(checkpoints["gated_untied"][1]), scan_layers=False)


@pytest.fixture(scope="module", params=["scan", "unrolled"])
def each_layout(request, gated, gated_unrolled):
  return gated if request.param == "scan" else gated_unrolled


def _steps(model, params, tokens, cache):
  """One extend call per token: [B,T,V] logits."""
  out = []
  for t in range(tokens.shape[1]):
    logits, _, cache = model.extend(params, tokens[:, t:t + 1], cache)
    out.append(np.asarray(logits[:, 0]))
  return np.stack(out, axis=1), cache


def test_extend_block_equals_single_steps(each_layout):
  model, params = each_layout
  tokens = jnp.asarray(np.random.RandomState(3).randint(2, 64, size=(3, 4)))
  _, _, cache = model.prefill(params, Prompt.from_lists(ROWS), model.init_cache(3, 8, 6))
  assert np.asarray(cache.lengths).tolist() == [1, 1, 1]
  block, block_hidden, block_cache = model.extend(params, tokens, cache)
  steps, step_cache = _steps(model, params, tokens, cache)
  np.testing.assert_allclose(np.asarray(block), steps, atol=1e-5, rtol=0)
  assert np.asarray(block_cache.lengths).tolist() == [5, 5, 5]
  np.testing.assert_array_equal(np.asarray(step_cache.lengths), np.asarray(block_cache.lengths))
  assert block_hidden.shape == (3, 4, 32)


def test_extend_select_and_entries(each_layout):
  model, params = each_layout
  tokens = jnp.asarray(np.random.RandomState(4).randint(2, 64, size=(3, 4)))
  _, _, cache = model.prefill(params, Prompt.from_lists(ROWS), model.init_cache(3, 8, 6))
  testing.check_extend_variants(model, params, tokens, cache, np.array([3, 0, 1]))


def test_unstacked_layout_equals_stacked(gated, gated_unrolled, tmp_path):
  (model, params), (loop_model, loop_params) = gated, gated_unrolled
  assert not loop_model.config.scan_layers
  assert sorted(loop_params["encoder"]) == ["final_norm", "layers_0", "layers_1", "relpos_bias"]
  assert "layers_2" in loop_params["decoder"] and "layers" not in loop_params["decoder"]
  np.testing.assert_array_equal(loop_params["decoder"]["layers_2"]["cross_attn"]["key"]["kernel"],
                                params["decoder"]["layers"]["cross_attn"]["key"]["kernel"][2])
  jax.tree_util.tree_map(np.testing.assert_array_equal, layers.stack(loop_params), params)
  # init: the same values in either layout, bit for bit under XLA's defaults
  # (SPECJAX_TEST_LLVM_OPT=1); under the suite's LLVM O0 with the elemental emitter together
  # (tests/conftest.py) the two programs round an ulp apart.
  key = jax.random.key(4)
  rtol = 0 if os.environ.get("SPECJAX_TEST_LLVM_OPT") else 1e-6
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=0),
                         loop_model.init_params(key), layers.unstack(model.init_params(key)))
  tokens = jnp.asarray(np.random.RandomState(5).randint(2, 64, size=(3, 4)))
  first, _, cache = model.prefill(params, Prompt.from_lists(ROWS), model.init_cache(3, 8, 6))
  loop_first, _, loop_cache = loop_model.prefill(loop_params, Prompt.from_lists(ROWS),
                                                 model.init_cache(3, 8, 6))
  # Not bit-equal: XLA fuses a scan body and straight-line layers differently (an ulp here and
  # there), so an ulp of the logits' scale.
  ulp, scale = testing.layout_ulp(), max(float(np.abs(first).max()), 1.0)
  np.testing.assert_allclose(loop_first, first, atol=ulp * scale, rtol=0)
  np.testing.assert_allclose(loop_cache.cross_k, cache.cross_k, atol=ulp, rtol=0)
  logits, _, (k, v) = model.extend_entries(params, tokens, cache)
  loop_logits, _, (loop_k, loop_v) = loop_model.extend_entries(loop_params, tokens, cache)
  np.testing.assert_allclose(loop_logits, logits, atol=ulp * scale, rtol=0)
  assert loop_k.shape == k.shape == (3, 3, 4, 4, 12)                          # [L,B,T,H,Dh]
  np.testing.assert_allclose(loop_k, k, atol=ulp, rtol=0)
  np.testing.assert_allclose(loop_v, v, atol=ulp, rtol=0)
  hf_import.save_model(loop_model, loop_params, str(tmp_path))   # exported as the stacked one
  jax.tree_util.tree_map(np.testing.assert_array_equal, hf_import.load_model(str(tmp_path))[1],
                         params)


def test_rollback_and_ragged_rows_equal_single_row_runs(gated):
  model, params = gated
  rng = np.random.RandomState(4)
  drafts = rng.randint(2, 64, size=(3, 4))
  fresh = rng.randint(2, 64, size=(3, 3))
  first, _, cache = model.prefill(params, Prompt.from_lists(ROWS), model.init_cache(3, 8, 6))
  _, _, cache = model.extend(params, jnp.asarray(drafts), cache)
  keep = np.array([2, 3, 0])                                   # accepted drafts per row
  cache = kv_cache.rollback(cache, jnp.asarray(1 + keep))
  # The re-extend block is 4 wide as the draft block; its last column is padding we ignore.
  logits, _, cache = model.extend(params, jnp.asarray(np.pad(fresh, ((0, 0), (0, 1)))), cache)
  assert np.asarray(cache.lengths).tolist() == (5 + keep).tolist()
  for b, row in enumerate(ROWS):
    alone = model.init_cache(1, 8, 6)
    alone_first, _, alone = model.prefill(params, Prompt.from_lists([row], pad_to=6), alone)
    np.testing.assert_allclose(np.asarray(first[b]), np.asarray(alone_first[0]), atol=1e-5, rtol=0)
    never_rejected = np.concatenate([drafts[b, :keep[b]], fresh[b]])[None]
    alone_logits, _ = _steps(model, params, jnp.asarray(never_rejected), alone)
    np.testing.assert_allclose(np.asarray(logits[b, :3]), alone_logits[0, keep[b]:], atol=1e-5,
                               rtol=0)


def test_greedy_matches_transformers_generate(checkpoints, gated):
  torch_model = checkpoints["gated_untied"][0]
  model, params = gated
  prompt = Prompt.from_lists(ROWS)
  steps = 8
  logits, _, cache = model.prefill(params, prompt, model.init_cache(3, steps, 6))
  out = [np.asarray(jnp.argmax(logits, -1))]
  for _ in range(steps - 1):
    logits, _, cache = model.extend(params, jnp.asarray(out[-1])[:, None], cache)
    out.append(np.asarray(jnp.argmax(logits[:, 0], -1)))
  ours = np.stack(out, axis=1)
  tokens = torch.tensor(np.asarray(prompt.tokens), dtype=torch.long)
  mask = torch.tensor(np.arange(6)[None] < np.asarray(prompt.lengths)[:, None], dtype=torch.long)
  with torch.no_grad():   # no torch cache: transformers 5 sizes it by the ENCODER depth (2 != 3)
    theirs = torch_model.generate(input_ids=tokens, attention_mask=mask, do_sample=False,
                                  num_beams=1, max_new_tokens=steps, min_new_tokens=0,
                                  use_cache=False).numpy()
  assert (theirs[:, 0] == 0).all()                             # the decoder start token
  for b in range(3):
    row = list(ours[b])
    row = row[:row.index(1) + 1] if 1 in row else row          # transformers pads after EOS
    assert list(theirs[b, 1:1 + len(row)]) == row


def test_bfloat16_close_to_float32(checkpoints):
  path = checkpoints["gated_untied"][1]
  model32, params32 = hf_import.load_model(str(path))
  model16, params16 = hf_import.load_model(str(path), dtype="bfloat16")
  assert model16.dtype == jnp.bfloat16
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(params16))
  prompt, targets = _parity_inputs()
  ref, _ = score(model32, params32, prompt, jnp.asarray(targets))
  got, hidden = score(model16, params16, prompt, jnp.asarray(targets))
  assert got.dtype == jnp.float32 and hidden.dtype == jnp.bfloat16
  assert np.isfinite(np.asarray(got)).all()
  assert float(jnp.abs(got - ref).max()) < 0.05 * float(jnp.abs(ref).max())
  assert float(jnp.mean(jnp.argmax(got, -1) == jnp.argmax(ref, -1))) > 0.8


def test_bad_inputs_have_clear_errors(gated):
  model, params = gated
  with pytest.raises(kv_cache.CacheOverflowError, match="prompt"):
    model.prefill(params, Prompt.from_lists([[3, 4, 5, 6]]), model.init_cache(1, 4, 2))
  with pytest.raises(ValueError, match="enc_len"):
    model.init_cache(1, 4)
  with pytest.raises(ValueError, match="feed_forward_proj"):
    t5.T5Config(feed_forward_proj="gated-swish-x")
  with pytest.raises(ValueError, match="dtype"):
    t5.T5Config(dtype="float16")


def test_relative_position_bucket_matches_transformers():
  from transformers.models.t5.modeling_t5 import T5Attention
  rel = np.arange(-300, 300)
  for bidirectional, buckets, distance in ((True, 32, 128), (False, 32, 128), (True, 8, 16),
                                           (False, 8, 16)):
    want = T5Attention._relative_position_bucket(
        torch.tensor(rel), bidirectional=bidirectional, num_buckets=buckets,
        max_distance=distance).numpy()
    got = t5.relative_position_bucket(jnp.asarray(rel, jnp.int32), bidirectional=bidirectional,
                                      num_buckets=buckets, max_distance=distance)
    np.testing.assert_array_equal(np.asarray(got), want)
