"""int8 dense layers (models/quant.py): the product against float32, a quantized model against
its float twin, and speculative decoding exact relative to the quantized target (greedy equals
it alone; exact sampling keeps its law, a broken rule fails the same test)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import testing
from specjax.acceptance import registry
from specjax.decoding import speculative as loop
from specjax.models import Prompt, layers, quant
from specjax.sampling import Warp

# W8A8 (activations rounded to int8) is the CPU's int8 product; accelerators multiply by the
# int8 weights alone (quant.rounds_activations). The W8A8 properties are checked where it runs.
w8a8_only = pytest.mark.skipif(not quant.rounds_activations(),
                               reason="W8A8 is the CPU's int8 product")


@pytest.fixture
def weight_only(monkeypatch):
  """int8 layers multiply as on an accelerator (W8A16), compiled afresh (the choice is made when
  a program is traced, so programs traced the other way are dropped before and after)."""
  jax.clear_caches()
  monkeypatch.setattr(quant, "rounds_activations", lambda backend=None: False)
  yield
  jax.clear_caches()


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("w8a8", [pytest.param(True, marks=w8a8_only), False])
def test_the_int8_product_approximates_float32(rows, w8a8):
  rng = np.random.RandomState(rows)
  x = jnp.asarray(rng.randn(rows, 64), jnp.float32)
  w = jnp.asarray(rng.randn(64, 48) * 0.1, jnp.float32)
  kernel, scale = quant.quantize_kernel(w)
  assert kernel.dtype == jnp.int8 and scale.shape == (48,)
  highest = jax.lax.Precision.HIGHEST
  got = quant.int8_matmul(x, kernel, scale, precision=highest, w8a8=w8a8)
  want = jnp.matmul(x, w, precision=highest)
  assert got.shape == want.shape and got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, atol=0.03 * float(jnp.max(jnp.abs(want))))
  # Weight-only rounds nothing but the weights: the product of the dequantized kernel.
  dequantized = jnp.matmul(x, kernel.astype(jnp.float32) * scale, precision=highest)
  if not w8a8:
    np.testing.assert_allclose(got, dequantized, rtol=1e-5, atol=1e-5)
  else:                                            # W8A8 rounds the activations too
    assert not np.allclose(got, dequantized, rtol=1e-5, atol=1e-5)


def test_weight_only_int8_in_bfloat16_multiplies_in_bfloat16():
  """On an accelerator a bfloat16 model's int8 kernel is converted to bfloat16 (int8 values are
  exact there) inside the product, accumulated in float32."""
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.randn(3, 64), jnp.bfloat16)
  kernel, scale = quant.quantize_kernel(jnp.asarray(rng.randn(64, 48), jnp.float32))
  got = quant.int8_matmul(x, kernel, scale, w8a8=False)
  want = jnp.matmul(x.astype(jnp.float32), kernel.astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST) * scale
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def _quantized(model, params):
  int8 = dataclasses.replace(model, config=dataclasses.replace(model.config, quant="int8"))
  return int8, quant.quantize_params(jax.tree.map(lambda x: x, params),
                                     model.config.tie_word_embeddings)


@pytest.mark.parametrize("scan", [True, False])
def test_a_quantized_decoder_tracks_its_float_twin(scan):
  model, params = testing.tiny_decoder(seed=1, vocab_size=32, num_layers=2)
  model = layers.with_scan(model, scan)
  params = layers.to_layout(params, scan)
  int8, qparams = _quantized(model, params)
  like = jax.eval_shape(int8.init_params, jax.random.PRNGKey(0))
  assert jax.tree.structure(like) == jax.tree.structure(qparams)
  kernels = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(qparams)
             if jax.tree_util.keystr(path).endswith("['kernel']")]
  assert kernels and all(k.dtype == jnp.int8 for k in kernels)
  tokens = jnp.array([[3, 7, 9, 2, 5]])
  cache = model.init_cache(1, 8)
  want, _, _ = model.extend_entries(params, tokens, cache)
  got, _, _ = int8.extend_entries(qparams, tokens, cache)
  p, q = jax.nn.softmax(want), jax.nn.softmax(got)
  assert float(jnp.max(jnp.sum(jnp.abs(p - q), -1))) < 0.1          # total variation x 2


def test_greedy_sd_equals_the_quantized_target_alone():
  target, tparams = _quantized(*testing.tiny_decoder(seed=2, vocab_size=16))
  draft, dparams = _quantized(*testing.tiny_decoder(seed=3, vocab_size=16))
  testing.assert_greedy_sd_is_greedy(target, tparams, draft, dparams)


def test_weight_only_int8_as_on_an_accelerator(weight_only):
  """int8 layers off the CPU (forced here): a layer multiplies by its dequantized weights (the
  output layer's logits are those of its dequantized twin), the model is not held to width
  invariance (nothing rounds its activations), and greedy SD writes the target's own tokens."""
  model, params = testing.tiny_decoder(seed=1, vocab_size=32, num_layers=2)
  int8, qparams = _quantized(model, params)
  assert not int8.config.arch().width_invariant
  hidden = jnp.asarray(np.random.RandomState(0).randn(2, model.config.d_model), jnp.float32)
  head = qparams["lm_head"]
  layer = quant.QuantDense(32, use_bias=False, precision=jax.lax.Precision.HIGHEST)
  got = layer.apply({"params": head}, hidden)
  want = jnp.matmul(hidden, head["kernel"].astype(jnp.float32) * head["scale"],
                    precision=jax.lax.Precision.HIGHEST)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  tokens, cache = jnp.array([[3, 7, 9, 2, 5]]), model.init_cache(1, 8)
  p = jax.nn.softmax(model.extend_entries(params, tokens, cache)[0])
  q = jax.nn.softmax(int8.extend_entries(qparams, tokens, cache)[0])
  assert float(jnp.max(jnp.sum(jnp.abs(p - q), -1))) < 0.1          # total variation x 2
  draft, dparams = _quantized(*testing.tiny_decoder(seed=3, vocab_size=32))
  testing.assert_greedy_sd_is_greedy(int8, qparams, draft, dparams)


# 896 wide (Qwen2.5-0.5B's width): XLA:CPU reduces one row of that width otherwise than several,
# where 64-wide rows happen to agree (the norms' statistics: transformer.by_position).
WIDE = 896


def _int8_model(family: str, scan: bool, window=None):
  from specjax.models import decoder, llama
  if family == "gpt2":
    model = decoder.Decoder(decoder.DecoderConfig(
        vocab_size=500, n_positions=320, d_model=WIDE, num_layers=2, num_heads=14, d_ff=1024))
  else:
    model = llama.Llama(llama.LlamaConfig(
        vocab_size=500, d_model=WIDE, num_layers=2, num_heads=14, num_kv_heads=2, head_dim=64,
        d_ff=1024, qkv_bias=True, tie_word_embeddings=True, model_type="qwen2", bos_token_id=1,
        eos_token_id=2, max_position_embeddings=256, sliding_window=window))
  model = layers.with_scan(model, scan)
  return _quantized(model, model.init_params(jax.random.PRNGKey(0)))


@w8a8_only
@pytest.mark.parametrize("family, scan, window", [
    ("qwen2", True, None), ("qwen2", False, 20), ("gpt2", False, None)])
def test_int8_logits_are_the_same_bits_in_a_pass_of_any_width(family, scan, window):
  """A verify pass over T positions and T one-position steps give each position the same bits,
  in caches of other capacities (speculative decoding sizes its cache for gamma more): what
  makes greedy SD over an int8 target write its own tokens. Float models' batched attention and
  norms differ here by about 1e-7, which int8's rounding can turn into a flipped near-tie."""
  model, params = _int8_model(family, scan, window)
  assert model.config.arch().width_invariant
  rng = np.random.RandomState(0)
  prompt, block = rng.randint(3, 500, (2, 150)), rng.randint(3, 500, (2, 6))
  extend = jax.jit(model.extend)

  def prefilled(capacity):
    return extend(params, jnp.asarray(prompt), model.init_cache(2, capacity))[2]

  wide, _, _ = extend(params, jnp.asarray(block), prefilled(160))       # [B, T, V]
  cache, steps = prefilled(300), []
  for t in range(block.shape[1]):
    logits, _, cache = extend(params, jnp.asarray(block[:, t:t + 1]), cache)
    steps.append(np.asarray(logits[:, 0]))
  np.testing.assert_array_equal(np.asarray(wide), np.stack(steps, 1))


@w8a8_only
def test_string_level_gives_the_int8_targets_prompt_the_bits_of_autoregressive_decoding():
  """SLEM's first target pass: the prompt through prefill at autoregressive decoding's padded
  width, then the candidates, give the logits of autoregressive decoding's prefill and
  one-position steps bit for bit. Fed as one block through extend (prompt_width=0, as SLEM did
  before), the prompt's last logits differ, and greedy SLEM over the int8 real pair left the
  target's own tokens on one of the config's prompts."""
  from specjax.decoding import string_level
  model, params = _int8_model("qwen2", False)
  rng = np.random.RandomState(1)
  prompt, cands = rng.randint(3, 500, 150).tolist(), rng.randint(3, 500, 5).tolist()
  width, n = 256, len(cands) + 1                                  # prompting.bucket(150)
  backend = lambda w: string_level.ModelBackend(model, params, model, params, Warp(),
                                                jax.random.PRNGKey(0), 300, w)
  logits, first = backend(width)._sync("t", prompt, cands)
  last, _, cache = model.prefill(params, Prompt.from_lists([prompt], width), model.init_cache(1, 300))
  steps = [np.asarray(last[0])]
  for token in cands:
    step, _, cache = model.extend(params, jnp.asarray([[token]]), cache)
    steps.append(np.asarray(step[0, 0]))
  np.testing.assert_array_equal(np.asarray(logits[first:first + n]), np.stack(steps))
  block, first = backend(0)._sync("t", prompt, cands)
  assert not np.array_equal(np.asarray(block[first]), steps[0])


# The law of a quantized target over V=4 ids and 3 new tokens, enumerated from its own logits.
V, MAX_NEW, PROMPT, N_RUNS = 4, 3, [1, 2, 1], 20_000


def _pvalue(rule, layout: str = "in_out") -> float:
  from specjax.models import dense_layout
  model = dense_layout.with_layout(testing.tiny_decoder(seed=5, vocab_size=V)[0], layout)
  floats = testing._spread(model.init_params(jax.random.PRNGKey(5)))
  target = dataclasses.replace(model, config=dataclasses.replace(model.config, quant="int8"))
  tparams = quant.quantize_params(floats, model.config.tie_word_embeddings, layout)
  draft, dparams = testing.tiny_decoder(seed=6, vocab_size=V)
  warp = Warp(temperature=1.0)
  gen = loop.generate(target, tparams, draft, dparams, Prompt.from_lists([PROMPT] * N_RUNS),
                      jax.random.PRNGKey(7), rule=rule, gamma=2, max_new_tokens=MAX_NEW,
                      warp=warp, eos_id=None)
  counts = testing.sequence_counts(gen.tokens, gen.lengths)
  law = testing.enumerate_model_law(target, tparams, PROMPT, max_new_tokens=MAX_NEW, warp=warp)
  return testing.chi_square_pvalue(law, counts)


@pytest.mark.slow   # the law test and its broken twin: 30 s (greedy on int8 runs by default)
@pytest.mark.parametrize("layout", ["in_out", "out_in"])   # XLA's product, specjax's kernel
def test_exact_sd_keeps_the_quantized_targets_law(layout):
  assert _pvalue(registry.get("exact"), layout) > 1e-3


@pytest.mark.slow
def test_a_broken_rule_fails_the_same_law_test():
  assert _pvalue(testing.ResampleFromP()) < 1e-6


def test_a_bad_quant_is_refused():
  from specjax.models.decoder import DecoderConfig
  with pytest.raises(ValueError, match="quant 'int3' is not supported"):
    DecoderConfig(quant="int3")


def test_int8_loads_weight_only_off_the_cpu(monkeypatch, tmp_path, caplog):
  """On an accelerator (a gpu backend pretended here) quant="int8" loads and says that its
  product is weight-only; quant="auto" keeps the model dtype there and says why."""
  import logging
  import tiny_checkpoints  # tests/ is on sys.path under pytest
  from specjax.api import loading
  path = tiny_checkpoints.qwen2_checkpoint(tmp_path / "ckpt")
  monkeypatch.setattr(loading.jax, "default_backend", lambda: "gpu")
  monkeypatch.delenv("SPECJAX_QUANT")
  with caplog.at_level(logging.INFO, logger="specjax.api.loading"):
    assert loading.load(str(path), quant="int8", role="target").model.config.quant == "int8"
    assert "with int8 layers (weight-only, W8A16)" in caplog.text
    caplog.clear()
    assert loading.load(str(path), quant="auto", role="target").model.config.quant == ""
    assert "int8 on gpu is weight-only and not measured at load" in caplog.text


@pytest.mark.parametrize("family, scan, tied", [
    ("qwen2", True, True), ("qwen2", False, False), ("gpt2", False, True), ("gpt2", True, False)])
def test_an_int8_load_quantizes_each_kernel_as_it_is_read(tmp_path, monkeypatch, family, scan,
                                                          tied):
  """hf_import.load_model(quant="int8") (what specjax.load does: the float model is never held
  whole) gives the bits of the float load quantized afterwards, in either layer layout, tied or
  untied head (an unrolled Llama-family head read 16 of its 40 rows at a time)."""
  from specjax.models import hf_import, llama
  from specjax.models.convert import llama as llama_convert
  monkeypatch.setattr(llama_convert, "_OUTPUT_ROWS", 16)
  if family == "gpt2":
    model, params = testing.tiny_decoder(seed=4, vocab_size=40, num_layers=2)
    model = dataclasses.replace(model, config=dataclasses.replace(
        model.config, tie_word_embeddings=tied))
    params = model.init_params(jax.random.PRNGKey(4))
  else:
    model = llama.Llama(llama.LlamaConfig(
        vocab_size=40, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        d_ff=64, qkv_bias=True, tie_word_embeddings=tied, model_type="qwen2", bos_token_id=1,
        eos_token_id=2, max_position_embeddings=64))
    params = model.init_params(jax.random.PRNGKey(4))
  hf_import.save_model(model, params, str(tmp_path))
  _, floats = hf_import.load_model(str(tmp_path), "float32", scan_layers=scan)
  want = quant.quantize_params(floats, tied)
  int8, got = hf_import.load_model(str(tmp_path), "float32", scan_layers=scan, quant="int8")
  assert int8.quant == "int8"
  like = jax.eval_shape(int8.init_params, jax.random.PRNGKey(0))
  assert jax.tree.structure(got) == jax.tree.structure(want) == jax.tree.structure(like)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("family, scan", [("qwen2", False), ("gpt2", True)])
def test_int8_kernels_stored_out_in_give_the_in_out_bits(tmp_path, family, scan):
  """int8 layers stored [out, in] (the faster product on some CPUs: models/dense_layout.py),
  the output layer's included, hold the same integers and scales transposed, and their exact
  integer products (specjax's CPU kernel for [out, in], XLA's for [in, out]) give the in_out
  model's logits bit for bit; a load in that layout quantizes each kernel as read."""
  from specjax.models import dense_layout, hf_import
  model, params = _int8_model(family, scan)
  out_in = dense_layout.with_layout(model, "out_in")
  # [out, in], in the CPU kernel's blocked layout where it runs (quant.block_int8)
  stored = quant.block_int8 if quant.blocked_layout() else (lambda x: x)
  flip = lambda p, x: stored(x.T) if dense_layout.transposes(
      tuple(getattr(k, "key", k) for k in p), "out_in", "int8") and x.ndim >= 2 else x
  if scan:
    flip = lambda p, x: (stored(jnp.swapaxes(x, -1, -2)) if dense_layout.transposes(
        tuple(getattr(k, "key", k) for k in p), "out_in", "int8") else x)
  flipped = jax.tree_util.tree_map_with_path(flip, params)
  like = jax.eval_shape(out_in.init_params, jax.random.PRNGKey(0))
  assert jax.tree.map(lambda a: a.shape, like) == jax.tree.map(lambda a: a.shape, flipped)
  tokens, cache = jnp.array([[3, 7, 9, 2, 5]]), model.init_cache(1, 8)
  want, _, _ = model.extend_entries(params, tokens, cache)
  got, _, _ = out_in.extend_entries(flipped, tokens, cache)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # The loader in that layout: the float checkpoint quantized as it is read.
  float_model = dataclasses.replace(model, config=dataclasses.replace(model.config, quant=""))
  floats = float_model.init_params(jax.random.PRNGKey(1))
  hf_import.save_model(float_model, floats, str(tmp_path))
  _, read = hf_import.load_model(str(tmp_path), "float32", scan_layers=scan, layout="out_in")
  want_q = quant.quantize_params(read, float_model.config.tie_word_embeddings, "out_in")
  int8, got_q = hf_import.load_model(str(tmp_path), "float32", scan_layers=scan,
                                     layout="out_in", quant="int8")
  assert int8.config.layout == "out_in" and int8.quant == "int8"
  for a, b in zip(jax.tree.leaves(got_q), jax.tree.leaves(want_q)):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


def test_an_encoder_decoder_is_refused_with_the_families_that_have_it():
  from specjax.api import loading
  model, _ = testing.tiny_t5()
  with pytest.raises(ValueError, match="quantized layers exist for the decoder-only families"):
    loading._quantized(model, "int8", "target")
  with pytest.raises(ValueError, match="quant='int3': use int8, int4"):
    loading.load("builtin:tiny/target", quant="int3")


@pytest.mark.parametrize("layout", ["in_out", "out_in"])
def test_a_sub_vocabulary_head_of_a_quantized_draft(layout):
  """The cut int8 head keeps the model's layout ([D, k], or [k, D] with out_in, the rows
  specjax's CPU kernel reads) and scores the k ids as the full head does."""
  import types

  import specjax
  from specjax.api.loading import LoadedModel
  from specjax.models import dense_layout
  model = dense_layout.with_layout(testing.tiny_decoder(seed=3, vocab_size=16)[0], layout)
  floats = model.init_params(jax.random.PRNGKey(3))
  int8 = dataclasses.replace(model, config=dataclasses.replace(model.config, quant="int8"))
  model, params = int8, quant.quantize_params(floats, model.config.tie_word_embeddings, layout)
  draft = LoadedModel(model, params, types.SimpleNamespace(eos_ids=(1,)), None)
  cut = specjax.sub_vocab(draft, 5, counts=np.arange(16)[::-1].copy())
  assert cut.params["lm_head"]["kernel"].dtype == jnp.int8
  head = cut.params["lm_head"]
  assert head["kernel"].shape == ((32, 5) if layout == "in_out" else (5, 32))
  assert head["scale"].shape == (5,)
  tokens, cache = jnp.array([[2, 7, 9]]), model.init_cache(1, 8)
  want, _, _ = model.extend_entries(params, tokens, cache)
  got, _, _ = cut.model.extend_entries(cut.params, tokens, cache)
  np.testing.assert_allclose(got[..., :5], want[..., :5], rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(got[..., 5:]) == -np.inf)


# ------------------------------------------------------------------------------ quant="auto"

@pytest.mark.parametrize("backend, quantizable, want", [
    ("cpu", True, "auto"),                               # measured (models/layout_choice.py)
    ("gpu", True, ""),                                   # weight-only there: not measured
    ("cpu", False, "")])                                 # T5: no int8 layers
def test_auto_measures_int8_on_the_cpu_only(backend, quantizable, want):
  quant_choice, why = quant.choose(backend, quantizable)
  assert quant_choice == want and why


@w8a8_only     # measured on the CPU only: quant.choose's "gpu" case above
def test_load_resolves_auto_by_measuring_and_says_why(monkeypatch, tmp_path, caplog):
  """quant="auto": int8 where its products (a fake timer here) cost more than MARGIN less than
  the float layout's, logged with the costs; the answer is cached per setting."""
  import logging
  import tiny_checkpoints  # tests/ is on sys.path under pytest
  from specjax.api import loading
  from specjax.models import layout_choice
  path = tiny_checkpoints.qwen2_checkpoint(tmp_path / "ckpt")
  monkeypatch.delenv("SPECJAX_QUANT")
  monkeypatch.setattr(layout_choice, "time_products", lambda shape, rows, *_: [1e-3] * len(rows))
  for int8_ms, rows, want in ((0.97, (1, 4), ""), (2.0, (1,), ""), (0.5, (1, 4), "int8")):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / f"cache{int8_ms}"))
    monkeypatch.setattr(layout_choice, "time_int8_products",
                        lambda shape, rows, layout, ms=int8_ms: [1e-3 * ms] * len(rows))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="specjax.api.loading"):
      loaded = loading.load(str(path), quant="auto", role="target", rows=rows)
    assert loaded.model.config.quant == want
    assert ((f"weights of the target: int8 layers (quant=auto: int8 weights in_out (measured "
             f"at rows {', '.join(map(str, rows))}: in_out" if want else
             "weights of the target: float (quant=auto: in_out (measured at rows")
            in caplog.text), caplog.text
  monkeypatch.setattr(layout_choice, "time_int8_products", lambda *a: pytest.fail("measured"))
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="specjax.api.loading"):
    assert loading.load(str(path), quant="auto", rows=(1, 4)).model.config.quant == "int8"
  assert "(cached in" in caplog.text
  # An explicit out_in layout keeps float weights; T5 has no int8 layers.
  assert loading.auto_quant({"model_type": "qwen2"}, "draft", "out_in") == ""
  assert loading.auto_quant({"model_type": "t5", "is_encoder_decoder": True}, "draft",
                            "auto") == ""
  monkeypatch.setenv("SPECJAX_QUANT", "int8")                   # pinned: no measuring
  assert loading.load(str(path), quant="auto").model.config.quant == "int8"
  monkeypatch.setenv("SPECJAX_QUANT", "yes")
  with pytest.raises(ValueError, match=r"\$SPECJAX_QUANT='yes': use int8 or off"):
    loading.load(str(path), quant="auto")
  with pytest.raises(ValueError, match="quant='int3': use int8, int4, auto"):
    loading.load(str(path), quant="int3")
