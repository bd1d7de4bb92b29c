"""The dense-kernel layout (models/dense_layout.py) and its load-time choice
(models/layout_choice.py): an out_in model computes what its in_out twin computes, for both
decoder-only families, scanned and unrolled; HF import and export are exact in both layouts; the
"auto" choice is measured once, kept and re-read (the timer is replaced: the decision logic is
tested, not this machine); bad values are refused naming the allowed ones."""

from __future__ import annotations

import dataclasses
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from specjax import testing
from specjax.api import loading
from specjax.app import builders
from specjax.app.config import ConfigError
from specjax.models import decoder, dense_layout, hf_import, layers, layout_choice, llama

CACHE = 16


def _llama(**overrides):
  return llama.Llama(llama.LlamaConfig(**{
      **dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
             d_ff=48, qkv_bias=True, tie_word_embeddings=False, model_type="qwen2",
             bos_token_id=1, eos_token_id=2, max_position_embeddings=64), **overrides}))


def _gpt2(**overrides):
  return decoder.Decoder(decoder.DecoderConfig(
      vocab_size=64, n_positions=32, d_model=32, num_layers=2, num_heads=4, d_ff=48,
      tie_word_embeddings=False, **overrides))


FAMILIES = {"llama": _llama, "gpt2": _gpt2}


def _to_out_in(params: dict) -> dict:
  """An in_out model's params as its out_in twin stores them: every layer kernel transposed."""
  def one(path, x):
    names = tuple(str(getattr(k, "key", k)) for k in path)
    return jnp.swapaxes(x, -1, -2) if dense_layout.transposes(names, "out_in") else x
  return jax.tree_util.tree_map_with_path(one, params)


def _pair(family: str, scan: bool):
  """(in_out model, its params, out_in model, the same params transposed)."""
  model = layers.with_scan(FAMILIES[family](), scan)
  params = testing._spread(model.init_params(jax.random.PRNGKey(0)))
  return model, params, dense_layout.with_layout(model, "out_in"), _to_out_in(params)


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_out_in_model_gives_the_in_out_logits(family, scan):
  model, params, twin, twin_params = _pair(family, scan)
  key = jax.random.PRNGKey(3)        # init: one seed, the same model in either layout
  jax.tree_util.tree_map(np.testing.assert_array_equal, twin.init_params(key),
                         _to_out_in(model.init_params(key)))
  block = jnp.array([[5, 9, 17, 3, 40, 61], [33, 2, 7, 7, 12, 50], [1, 3, 4, 6, 2, 8]])
  logits, _, cache = model.extend(params, block, model.init_cache(3, CACHE))       # [B, 6, V]
  twin_logits, _, twin_cache = twin.extend(twin_params, block, twin.init_cache(3, CACHE))
  # Float32 rounding only: the two layouts may sum a dot product in another order.
  scale = max(1.0, float(jnp.max(jnp.abs(logits))))
  np.testing.assert_allclose(twin_logits, logits, atol=1e-5 * scale, rtol=0)
  np.testing.assert_allclose(twin_cache.k, cache.k, atol=1e-5 * scale, rtol=0)
  np.testing.assert_allclose(twin_cache.v, cache.v, atol=1e-5 * scale, rtol=0)


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_round_trip_is_exact_in_both_layouts(family, scan, tmp_path):
  model, params, twin, twin_params = _pair(family, scan)
  hf_import.save_model(model, params, str(tmp_path / "in_out"))
  hf_import.save_model(twin, twin_params, str(tmp_path / "out_in"))
  written = [load_file(str(tmp_path / d / "model.safetensors")) for d in ("in_out", "out_in")]
  assert written[0].keys() == written[1].keys()
  for name, tensor in written[0].items():          # the HF layout exactly, either way
    np.testing.assert_array_equal(written[1][name], tensor, err_msg=name)
  assert (tmp_path / "in_out" / "config.json").read_text() == (
      tmp_path / "out_in" / "config.json").read_text()         # layout is not an HF field
  for layout, want_model, want in (("in_out", model, params), ("out_in", twin, twin_params)):
    got_model, got = hf_import.load_model(str(tmp_path / "in_out"), scan_layers=scan,
                                          layout=layout)
    assert got_model == want_model
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)


def test_bad_layouts_are_refused():
  assert _llama(quant="int8", layout="out_in").config.layout == "out_in"   # int8 takes both
  for make in FAMILIES.values():
    with pytest.raises(ValueError, match=r"layout 'kn' is not supported; use one of "
                                         r"\('in_out', 'out_in'\)"):
      make(layout="kn")
  with pytest.raises(ValueError, match="layout='kn': use one of auto, in_out, out_in"):
    loading.load("/nonexistent", layout="kn")
  with pytest.raises(ConfigError, match=r"--config.target: layout='kn': use one of auto, in_out, "
                                        r"out_in"):
    builders.model_spec({"target": {"checkpoint": "x", "layout": "kn"}}, "target")
  with pytest.raises(ConfigError, match="trainers export"):
    builders.model_spec({"target": {"checkpoint": "x", "layout": "out_in", "init_from": "w"}},
                        "target")


# ------------------------------------------------------------------------- the "auto" choice

def _fake_timer(monkeypatch, out_in_factor: float, calls: list):
  """time_products replaced: in_out costs 1 ms x M per product, out_in `out_in_factor` that."""
  def fake(shape, rows, layout, dtype, precision):
    calls.extend((shape, m, layout) for m in rows)
    return [1e-3 * m * (out_in_factor if layout == "out_in" else 1.0) for m in rows]
  monkeypatch.setattr(layout_choice, "time_products", fake)


def test_dense_shapes_are_the_largest_per_layer_with_their_counts():
  # gate and up [32, 48] x2, down [48, 32], then q and out [32, 32] (k, v [32, 16] left out).
  assert layout_choice.dense_shapes(_llama()) == ((32, 48, 2), (48, 32, 1), (32, 32, 2))
  assert layout_choice.dense_shapes(dense_layout.with_layout(_gpt2(), "out_in")) == (
      (32, 48, 1), (48, 32, 1), (32, 32, 4))


@pytest.mark.parametrize("factor, want", [(0.9, "out_in"), (0.97, "in_out"), (1.2, "in_out")])
def test_auto_measures_once_then_reads_the_cache(monkeypatch, tmp_path, factor, want):
  calls = []
  _fake_timer(monkeypatch, factor, calls)
  cache = tmp_path / "dense_layout.json"
  model = _llama()
  first = layout_choice.choose(model, (1, 5), cache_file=cache, backend="cpu")
  assert first.layout == want and first.reason.startswith("measured at rows 1, 5")
  assert len(calls) == 3 * 2 * 2                  # shapes x widths x layouts
  assert first.costs["in_out"] == pytest.approx(1e-3 * (2 + 1 + 2) * (1 + 5))
  again = layout_choice.choose(model, [5, 1], cache_file=cache, backend="cpu")
  assert again.layout == want and again.reason == f"cached in {cache}"
  assert len(calls) == 12                         # not measured again
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=false")   # another setting
  assert layout_choice.choose(model, (1, 5), cache_file=cache, backend="cpu").reason.startswith(
      "measured")
  assert len(calls) == 24


def test_a_cached_choice_does_not_trace_the_model_again(monkeypatch, tmp_path):
  """The shapes and head of a config are kept beside the choices: a second run with the same
  config reads them (no abstract params traced); another config, or another layout of the same
  one (the twin is stacked [in, out] either way), is handled as before."""
  _fake_timer(monkeypatch, 0.9, [])
  monkeypatch.setattr(layout_choice, "time_int8_products",
                      lambda shape, rows, layout: [1e-3 * m for m in rows])
  cache, model = tmp_path / "dense_layout.json", _llama()
  first = layout_choice.choose(model, (1, 5), cache_file=cache, backend="cpu", int8=True)
  traced = []
  real = layout_choice._abstract_params
  monkeypatch.setattr(layout_choice, "_abstract_params",
                      lambda m: traced.append(m) or real(m))
  for again in (model, dense_layout.with_layout(model, "out_in"), layers.with_scan(model, False)):
    assert layout_choice.choose(again, (1, 5), cache_file=cache, backend="cpu",
                                int8=True) == dataclasses.replace(first,
                                                                  reason=f"cached in {cache}")
  assert not traced
  wider = _llama(d_ff=64)
  layout_choice.choose(wider, (1, 5), cache_file=cache, backend="cpu", int8=True)
  assert len(traced) == 1
  assert layout_choice.dense_shapes(wider)[0] == (32, 64, 2)
  kept = [v for k, v in json.loads(cache.read_text()).items() if k.startswith("config-")]
  assert sorted(tuple(map(tuple, v["shapes"]))[0] for v in kept) == [(32, 48, 2), (32, 64, 2)]


def test_a_repeated_width_counts_as_often_as_it_runs(monkeypatch):
  calls = []
  _fake_timer(monkeypatch, 0.9, calls)
  choice = layout_choice.choose(_llama(), (2, 1, 1, 1), cache_file=None, backend="cpu")
  assert sorted({m for _, m, _ in calls}) == [1, 2] and len(calls) == 3 * 2 * 2   # timed once
  assert choice.costs["in_out"] == pytest.approx(1e-3 * (2 + 1 + 2) * (3 * 1 + 2))
  assert choice.reason == "measured at rows 1, 1, 1, 2"


def test_auto_off_the_cpu_and_the_margin(monkeypatch, tmp_path):
  calls = []
  _fake_timer(monkeypatch, 0.5, calls)
  choice = layout_choice.choose(_llama(), cache_file=tmp_path / "c.json", backend="gpu")
  assert choice.layout == "in_out" and "gpu backend's default" in choice.reason and not calls
  assert layout_choice.decide({"in_out": 1.0, "out_in": 0.96}) == "in_out"
  assert layout_choice.decide({"in_out": 1.0, "out_in": 0.94}) == "out_in"
  (tmp_path / "bad.json").write_text("not json")           # a damaged cache: measured again
  assert layout_choice.choose(_llama(), cache_file=tmp_path / "bad.json",
                              backend="cpu").layout == "out_in"


@pytest.mark.parametrize("tied", [False, True])
def test_int8_is_a_candidate_costed_per_step_with_the_head(monkeypatch, tmp_path, tied):
  """With int8=True: a step's products per candidate (the layers' times the layer count, plus
  the output layer as stored: a tied [V, D] table is timed as out_in, an int8 head as its
  candidate stores it, [D, V] or [V, D]), int8 in either layout, chosen only past the margin, and the answer cached apart
  from the layout-only one."""
  calls = []
  _fake_timer(monkeypatch, 0.9, calls)
  int8_ms = {"in_out": 0.5, "out_in": 0.4}
  monkeypatch.setattr(layout_choice, "time_int8_products",
                      lambda shape, rows, layout: calls.extend(
                          (shape, m, f"int8 {layout}") for m in rows) or
                      [1e-3 * m * int8_ms[layout] for m in rows])
  model, cache = _llama(tie_word_embeddings=tied), tmp_path / "c.json"
  choice = layout_choice.choose(model, (1, 5), cache_file=cache, backend="cpu", int8=True)
  assert (choice.quant, choice.layout) == ("int8", "out_in")
  layer = 1e-3 * (2 + 1 + 2) * (1 + 5)                  # the fake in_out cost of a layer
  head_shape = (32, 64)                                 # (D, V): V < HEAD_ROWS, timed whole
  assert [c for c in calls if c[0] == head_shape] == [
      (head_shape, 1, "out_in" if tied else "in_out"), (head_shape, 5, "out_in" if tied else
      "in_out"), (head_shape, 1, "int8 in_out"), (head_shape, 5, "int8 in_out"),
      (head_shape, 1, "int8 out_in"), (head_shape, 5, "int8 out_in")]
  assert choice.costs["in_out"] == pytest.approx(2 * layer + 1e-3 * 6 * (0.9 if tied else 1))
  assert choice.costs["out_in"] == pytest.approx(0.9 * 2 * layer + 1e-3 * 6 * (0.9 if tied else 1))
  assert choice.costs["int8"] == pytest.approx(0.5 * (2 * layer + 1e-3 * 6))
  assert choice.costs["int8_out_in"] == pytest.approx(0.4 * (2 * layer + 1e-3 * 6))
  assert "int8 weights out_in (measured at rows 1, 5" in choice.describe()
  again = layout_choice.choose(model, (1, 5), cache_file=cache, backend="cpu", int8=True)
  assert (again.quant, again.layout) == ("int8", "out_in") and again.reason.startswith("cached")
  alone = layout_choice.choose(model, (1, 5), cache_file=cache, backend="cpu")
  assert alone.quant == "" and alone.reason.startswith("measured")   # another question
  int8_ms.update(in_out=0.87, out_in=0.95)              # out_in costs 0.9: int8 not past margin
  fixed = layout_choice.choose(model, (1, 5), cache_file=None, backend="cpu", int8=True)
  assert (fixed.quant, fixed.layout) == ("", "out_in")
  only = layout_choice.choose(model, (1, 5), cache_file=None, backend="cpu", int8=True,
                              layout="in_out")          # a fixed layout: 0.87 < 0.95, in_out
  assert (only.quant, only.layout) == ("int8", "in_out")
  assert "out_in" not in only.costs and "int8_out_in" not in only.costs


def test_time_int8_products_runs():
  for layout in dense_layout.LAYOUTS:
    times = layout_choice.time_int8_products((16, 24), (1, 3), layout)
    assert len(times) == 2 and min(times) > 0


def test_time_products_runs_both_layouts():
  for layout in dense_layout.LAYOUTS:
    times = layout_choice.time_products((16, 24), (1, 3), layout, "float32", "highest")
    assert len(times) == 2 and min(times) > 0


def test_load_resolves_auto_and_logs_why(monkeypatch, tmp_path, caplog):
  """specjax.load(layout="auto") on a checkpoint: the timer's answer, logged with its reason;
  the cached answer next time; an explicit layout as asked."""
  import tiny_checkpoints  # tests/ is on sys.path under pytest
  path = tiny_checkpoints.qwen2_checkpoint(tmp_path / "ckpt")
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  monkeypatch.setenv("SPECJAX_DENSE_LAYOUT", "out_in")            # what conftest pins, here out_in
  assert loading.load(str(path)).model.config.layout == "out_in"
  monkeypatch.setenv("SPECJAX_DENSE_LAYOUT", "kn")
  with pytest.raises(ValueError, match=r"\$SPECJAX_DENSE_LAYOUT='kn': use one of in_out, out_in"):
    loading.load(str(path))
  monkeypatch.delenv("SPECJAX_DENSE_LAYOUT")                      # measured (a fake timer)
  calls = []
  _fake_timer(monkeypatch, 0.5, calls)
  with caplog.at_level(logging.INFO, logger="specjax.api.loading"):
    loaded = loading.load(str(path), layout="auto", rows=(1, 4), role="target")
  if jax.default_backend() != "cpu":                               # in_out without measuring
    assert loaded.model.config.layout == "in_out" and not calls
    return
  assert loaded.model.config.layout == "out_in" and calls
  assert "dense layout of the target: out_in (measured at rows 1, 4" in caplog.text
  reference = loading.load(str(path), layout="in_out")
  assert reference.model.config.layout == "in_out"
  jax.tree_util.tree_map(np.testing.assert_array_equal, loaded.params,
                         _to_out_in(reference.params))
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="specjax.api.loading"):
    again = loading.load(str(path))
  assert again.model.config.layout == "out_in"
  assert "gamma not known at load, rows (1, 5) assumed" in caplog.text
  assert dataclasses.replace(again.model.config, layout="in_out") == reference.model.config


def test_param_cache_key_includes_the_layout(monkeypatch, tmp_path):
  """The converted params kept in the cache are per layout; in_out keeps the key it had."""
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  ckpt = tmp_path / "gguf" / "target-x"
  ckpt.mkdir(parents=True)
  (ckpt / "config.json").write_text("{}")
  keys = {layout: loading._param_cache_dir(ckpt, "float32", False, "", layout)
          for layout in (None, "in_out", "out_in")}
  assert keys[None] == keys["in_out"] != keys["out_in"]
  assert keys["out_in"].parent == tmp_path / "params"
