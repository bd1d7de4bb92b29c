"""int4 dense layers (models/quant.py, quant="int4"): the packing, the W4A8 product on specjax's
CPU kernel against an exact reference and against the dequantized fallback, width invariance,
an int4 model against its float twin, speculative decoding with an int4 draft and over an int4
target, and loading (layout out_in, widths that are multiples of 64, the refusals)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import testing
from specjax.models import cpu_kernels, dense_layout, layers, quant

w4a8_only = pytest.mark.skipif(not quant.rounds_activations(),
                               reason="W4A8 is the CPU's int4 product")
needs_kernel = pytest.mark.skipif(
    jax.default_backend() != "cpu" or not cpu_kernels.status().active,
    reason="specjax's CPU kernels are built for the CPU backend with a C++ compiler")

# (M, K, N): one row, several, K with a last group of 64 alone (K % 128 = 64), N not a multiple
# of the kernel's chunk, more rows than one pass takes (8)
SHAPES = [(1, 128, 16), (1, 64, 20), (2, 192, 33), (5, 896, 100), (8, 1536, 40), (9, 320, 17),
          (3, 4864, 24)]


def _reference(x: np.ndarray, packed, scale) -> np.ndarray:
  """The W4A8 product in float64: x's rows rounded to int8 by quant's rule, times the weights
  the packed ones stand for."""
  q, row_scale = quant._quantize_rows(jnp.asarray(x))
  weights = np.asarray(quant.dequantize_int4(packed, scale), np.float64)         # [N, K]
  return (np.asarray(q, np.float64) * np.asarray(row_scale, np.float64)) @ weights.T


def test_packing_rounds_each_group_as_q4_0_and_lays_out_nibbles():
  """Each group of 64 inputs gets the scale (its largest-magnitude entry) / -8, so that entry
  is -8 exactly and every other is within half a step; byte j of a group holds entries j (low
  nibble) and j + 32 (high), each + 8."""
  w = np.zeros((2, 128), np.float32)
  w[0, :64] = np.linspace(-1.0, 2.0, 64)        # largest magnitude 2.0 -> scale -0.25
  w[0, 64:] = 0.0                                # an all-zero group: scale 1, all 8s
  w[1] = np.random.default_rng(0).standard_normal(128)
  packed, scale = quant.pack_int4(jnp.asarray(w))
  assert packed.shape == (2, 64) and packed.dtype == jnp.uint8 and scale.shape == (2, 2)
  assert float(scale[0, 0]) == -0.25 and float(scale[0, 1]) == 1.0
  q = np.clip(np.round(w[0, :64] / -0.25), -8, 7).astype(int) + 8
  want = (q[:32] | (q[32:] << 4)).astype(np.uint8)
  np.testing.assert_array_equal(np.asarray(packed[0, :32]), want)
  assert np.all(np.asarray(packed[0, 32:]) == 0x88)
  back = np.asarray(quant.dequantize_int4(packed, scale))
  steps = np.abs(np.repeat(np.asarray(scale), 64, axis=1))
  assert np.all(np.abs(back - w) <= steps / 2 + 1e-6)
  assert back[0, 63] == 2.0                       # the peak is exact
  with pytest.raises(ValueError, match="multiples of 64"):
    quant.pack_int4(jnp.ones((4, 96)))


def _stored(packed, scale):
  """pack_int4's layer as this machine's kernel reads it (quant.blocked_layout)."""
  return quant.block_int4(packed, scale) if quant.blocked_layout() else (packed, scale)


@needs_kernel
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_the_kernel_is_the_exact_w4a8_product(m, k, n):
  rng = np.random.default_rng(m * 1000 + k + n)
  packed, scale = quant.pack_int4(jnp.asarray(rng.standard_normal((n, k)), jnp.float32))
  x = rng.standard_normal((m, k)).astype(np.float32)
  got = jax.jit(lambda x: quant.int4_matmul(x, *_stored(packed, scale)))(jnp.asarray(x))
  assert got.shape == (m, n) and got.dtype == jnp.float32
  want = _reference(x, packed, scale)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@needs_kernel
@pytest.mark.parametrize("m, k, n", [(7, 896, 300), (23, 192, 303)])
def test_a_row_is_the_same_bits_in_a_product_of_any_width(m, k, n):
  """What keeps greedy SD over an int4 target on its own tokens: row i of an M-row product is
  the bits of that row alone (each group's sum is exact, the groups add in one fixed order),
  also in a prompt's product (M > 8: weight tiles, 5 rows side by side, an odd group last)."""
  rng = np.random.default_rng(m)
  packed, scale = _stored(*quant.pack_int4(jnp.asarray(rng.standard_normal((n, k)),
                                                        jnp.float32)))
  q = jnp.asarray(rng.integers(-127, 128, (m, k), dtype=np.int8))
  dot = jax.jit(cpu_kernels.int4_dot)
  wide = np.asarray(dot(q, packed, scale))
  for i in range(m):
    np.testing.assert_array_equal(np.asarray(dot(q[i:i + 1], packed, scale))[0], wide[i])


@needs_kernel
def test_the_kernel_under_vmap_and_in_a_loop():
  rng = np.random.default_rng(2)
  packed, scale = _stored(*quant.pack_int4(jnp.asarray(rng.standard_normal((40, 192)),
                                                        jnp.float32)))
  q = jnp.asarray(rng.integers(-127, 128, (3, 2, 192), dtype=np.int8))
  mapped = jax.jit(jax.vmap(cpu_kernels.int4_dot, in_axes=(0, None, None)))(q, packed, scale)
  for i in range(3):
    np.testing.assert_array_equal(np.asarray(mapped[i]),
                                  np.asarray(jax.jit(cpu_kernels.int4_dot)(q[i], packed, scale)))
  body = lambda i, acc: acc + cpu_kernels.int4_dot(q[0], packed, scale)
  total = jax.jit(lambda: jax.lax.fori_loop(0, 3, body, jnp.zeros((2, 40))))()
  np.testing.assert_allclose(np.asarray(total), 3 * np.asarray(mapped[0]), rtol=1e-6)


@w4a8_only
def test_without_the_kernel_the_weights_are_dequantized_to_the_same_numbers(monkeypatch):
  """$SPECJAX_INT8_KERNEL=xla (or no compiler): the same W4A8 numbers from the dequantized
  weights in XLA's float32 product."""
  rng = np.random.default_rng(3)
  packed, scale = quant.pack_int4(jnp.asarray(rng.standard_normal((50, 320)), jnp.float32))
  x = rng.standard_normal((4, 320)).astype(np.float32)
  monkeypatch.setattr(cpu_kernels, "status", lambda: cpu_kernels.Status(False, "pinned"))
  jax.clear_caches()
  got = jax.jit(lambda x: quant.int4_matmul(x, packed, scale,
                                            precision=jax.lax.Precision.HIGHEST))(x)
  jax.clear_caches()
  want = _reference(x, packed, scale)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_weight_only_int4_multiplies_by_the_dequantized_weights():
  """Off the CPU (W4A16): the activations are not rounded."""
  rng = np.random.default_rng(4)
  packed, scale = quant.pack_int4(jnp.asarray(rng.standard_normal((24, 128)), jnp.float32))
  x = jnp.asarray(rng.standard_normal((2, 128)), jnp.float32)
  got = quant.int4_matmul(x, packed, scale, precision=jax.lax.Precision.HIGHEST, w4a8=False)
  want = np.asarray(x, np.float64) @ np.asarray(quant.dequantize_int4(packed, scale),
                                                np.float64).T
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def _qwen2(d_model: int = 128, tied: bool = True, vocab: int = 64):
  from specjax.models import llama
  model = llama.Llama(llama.LlamaConfig(
      vocab_size=vocab, d_model=d_model, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64,
      d_ff=192, qkv_bias=True, tie_word_embeddings=tied, model_type="qwen2", bos_token_id=1,
      eos_token_id=2, max_position_embeddings=128, layout="out_in"))
  return model, testing._spread(model.init_params(jax.random.PRNGKey(d_model + vocab)))


def _int4(model, params):
  int4 = dataclasses.replace(model, config=dataclasses.replace(model.config, quant="int4"))
  return int4, quant.quantize_params(jax.tree.map(lambda x: x, params),
                                     model.config.tie_word_embeddings, "out_in", "int4")


@pytest.mark.parametrize("scan, tied", [(True, True), (False, False)])
def test_an_int4_model_tracks_its_float_twin(scan, tied):
  model, params = _qwen2(tied=tied)
  model, params = layers.with_scan(model, scan), layers.to_layout(params, scan)
  int4, qparams = _int4(model, params)
  like = jax.eval_shape(int4.init_params, jax.random.PRNGKey(0))
  assert jax.tree.map(lambda a: (a.shape, a.dtype), like) == jax.tree.map(
      lambda a: (a.shape, a.dtype), qparams)
  assert qparams["lm_head"]["kernel"].shape == (64, 64)          # [V, D / 2]
  tokens, cache = jnp.array([[3, 7, 9, 2, 5]]), model.init_cache(1, 8)
  p = jax.nn.softmax(model.extend_entries(params, tokens, cache)[0])
  q = jax.nn.softmax(int4.extend_entries(qparams, tokens, cache)[0])
  assert float(jnp.max(jnp.sum(jnp.abs(p - q), -1))) < 0.3       # total variation x 2


def test_greedy_sd_with_an_int4_draft_and_over_an_int4_target():
  """An int4 draft costs acceptance, never the target's tokens; an int4 target (width-invariant
  on the CPU like int8) gets its own tokens from greedy SD too."""
  target, tparams = _qwen2()
  draft, dparams = _int4(*_qwen2(vocab=64, d_model=64))
  testing.assert_greedy_sd_is_greedy(target, tparams, draft, dparams)
  int4_target, qparams = _int4(target, tparams)
  assert int4_target.config.arch().width_invariant == quant.rounds_activations()
  testing.assert_greedy_sd_is_greedy(int4_target, qparams, draft, dparams)


def test_int4_needs_out_in_and_widths_of_64():
  from specjax.models import llama
  with pytest.raises(ValueError, match="int4 layers are stored \\[out, in\\]"):
    dense_layout.check("in_out", "int4")
  with pytest.raises(ValueError, match="int4 layers are stored"):
    llama.LlamaConfig(quant="int4", layout="in_out")
  model, params = _qwen2(d_model=96)          # 96 is not a multiple of 64
  with pytest.raises(ValueError, match="multiples of 64"):
    _int4(model, params)


def test_an_int4_load_quantizes_each_kernel_as_it_is_read(tmp_path, monkeypatch, caplog):
  """specjax.load(quant="int4") stores every kernel [out, in] (the layout said in the log), the
  untied head read a few rows at a time, with the bits of the float load quantized afterwards;
  layout in_out is refused before any weight is read."""
  import logging

  import tiny_checkpoints  # tests/ is on sys.path under pytest
  from specjax.api import loading
  from specjax.models import hf_import
  from specjax.models.convert import llama as llama_convert
  monkeypatch.setattr(llama_convert, "_OUTPUT_ROWS", 16)
  vocab = -(-tiny_checkpoints.byte_level_bpe(tmp_path) // 64) * 64
  float_model = dense_layout.with_layout(_qwen2(tied=False, vocab=vocab)[0], "in_out")
  hf_import.save_model(float_model, float_model.init_params(jax.random.PRNGKey(9)),
                       str(tmp_path))
  _, floats = hf_import.load_model(str(tmp_path), "float32", scan_layers=True, layout="out_in")
  want = quant.quantize_params(floats, False, "out_in", "int4")
  int4, got = hf_import.load_model(str(tmp_path), "float32", scan_layers=True, layout="out_in",
                                   quant="int4")
  assert int4.quant == "int4"
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
  with caplog.at_level(logging.INFO, logger="specjax.api.loading"):
    loaded = loading.load(str(tmp_path), quant="int4", role="draft")
  assert loaded.model.config.layout == "out_in" and loaded.model.quant == "int4"
  assert "int4 weights are stored [out, in]" in caplog.text
  with pytest.raises(ValueError, match="int4 layers are stored"):
    loading.load(str(tmp_path), quant="int4", layout="in_out")


def test_a_sub_vocabulary_head_of_an_int4_draft():
  """vocab_top_k on an int4 draft cuts rows of the packed head and of its scales."""
  import types

  import specjax
  from specjax.api.loading import LoadedModel
  int4, params = _int4(*_qwen2())
  draft = LoadedModel(int4, params, types.SimpleNamespace(eos_ids=(1,)), None)
  cut = specjax.sub_vocab(draft, 5, counts=np.arange(64)[::-1].copy())
  head = cut.params["lm_head"]
  assert head["kernel"].shape == (5, 64) and head["scale"].shape == (5, 2)
  tokens, cache = jnp.array([[2, 7, 9]]), int4.init_cache(1, 8)
  want, _, _ = int4.extend_entries(params, tokens, cache)
  got, _, _ = cut.model.extend_entries(cut.params, tokens, cache)
  np.testing.assert_allclose(got[..., :5], want[..., :5], rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(got[..., 5:]) == -np.inf)


def test_sharding_axes_of_int4_leaves():
  from specjax import sharding
  assert sharding.leaf_axes(("mlp", "wi_0", "kernel"), 2, "out_in", "int4") == ("mlp", "embed")
  assert sharding.leaf_axes(("mlp", "wi_0", "scale"), 2, "out_in", "int4") == ("mlp", "embed")
  assert sharding.leaf_axes(("lm_head", "scale"), 2, "out_in", "int4") == ("vocab", "embed")
  assert sharding.leaf_axes(("mlp", "wi_0", "scale"), 1, "out_in", "int8") == ("mlp",)


@needs_kernel
def test_auto_gives_a_draft_int4_where_int8_measures_fastest(tmp_path, monkeypatch, caplog):
  """quant="auto": a draft gets int4 where int8 wins the measurement and specjax's kernel runs
  (a target keeps int8: its rounding would change the distribution); a draft whose widths are
  not multiples of 64 keeps int8."""
  import logging

  import tiny_checkpoints  # tests/ is on sys.path under pytest
  from specjax.api import loading
  from specjax.models import hf_import, layout_choice
  vocab = -(-tiny_checkpoints.byte_level_bpe(tmp_path) // 64) * 64
  model = dense_layout.with_layout(_qwen2(vocab=vocab)[0], "in_out")
  hf_import.save_model(model, model.init_params(jax.random.PRNGKey(3)), str(tmp_path))
  narrow = tiny_checkpoints.qwen2_checkpoint(tmp_path / "narrow")           # d_model 32
  monkeypatch.delenv("SPECJAX_QUANT")
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  monkeypatch.setattr(layout_choice, "time_products", lambda shape, rows, *_: [1e-3] * len(rows))
  monkeypatch.setattr(layout_choice, "time_int8_products",
                      lambda shape, rows, layout: [0.5e-3] * len(rows))
  with caplog.at_level(logging.INFO, logger="specjax.api.loading"):
    draft = loading.load(str(tmp_path), quant="auto", role="draft", rows=(1,))
    target = loading.load(str(tmp_path), quant="auto", role="target", rows=(1, 4))
    small = loading.load(str(narrow), quant="auto", role="draft", rows=(1,))
  assert (draft.model.quant, draft.model.config.layout) == ("int4", "out_in")
  assert "weights of the draft: int4 layers" in caplog.text
  assert "int4 for a draft on specjax's CPU kernel" in caplog.text
  assert target.model.quant == small.model.quant == "int8"
