"""SPRINTER's verifier: the model, the training data (docs/papers/sprinter.md §6.13), training, and the
config-driven run (train, save, load, decode)."""

from __future__ import annotations

import json
import textwrap

import jax
import numpy as np
import pytest

from specjax import testing
from specjax.distill.data import MarkovSource
from specjax.models import Prompt
from specjax.sampling import Warp
from specjax.sprinter import data as dlib, loop, train as tlib, verifier as vlib

VOCAB = 48


@pytest.fixture(scope="module")
def pair():
  target, tparams = testing.tiny_decoder(seed=0, vocab_size=VOCAB)
  draft, dparams = testing.tiny_decoder(seed=1, vocab_size=VOCAB)
  return target, tparams, draft, dparams


def _dataset(pair, features="A", lam=1.2, sequences=16, cont_len=6):
  target, tparams, draft, dparams = pair
  src = MarkovSource(VOCAB, 8, prompt_len=5, target_len=cont_len, seed=0)
  batches = [src.batch(i) for i in range(sequences // 8)]
  data = dlib.DataConfig(lam=lam, cont_len=cont_len, features=features)
  ds = dlib.build_dataset(target, tparams, draft, dparams, batches, jax.random.PRNGKey(0),
                          warp=Warp(), data=data, eos=1)
  return ds, batches


def test_linear_verifier_has_d_plus_one_parameters_and_mlp_is_an_option():
  for width, count in [(0, 769), (16, 768 * 16 + 16 + 17)]:
    params = vlib.Verifier(768, mlp_width=width).init_params(jax.random.PRNGKey(0))
    assert sum(x.size for x in jax.tree_util.tree_leaves(params)) == count
  with pytest.raises(ValueError, match="features must be 'A'"):
    vlib.Verifier(8, features="C")


def test_auroc_and_rates():
  rng = np.random.default_rng(0)
  s, y = rng.random(300), rng.random(300) < 0.4
  s[::7] = 0.5                                                          # ties
  brute = np.mean([(a > b) + 0.5 * (a == b) for a in s[y] for b in s[~y]])
  assert tlib.auroc(s, y) == pytest.approx(brute)
  assert tlib.auroc(y.astype(float), y) == 1.0 and tlib.auroc(-y.astype(float), y) == 0.0
  r = tlib.rates(np.array([0.9, 0.2, 0.7, 0.1]), np.array([1, 1, 0, 0]), 0.5)
  assert (r["tpr"], r["fpr"], r["accept_rate"]) == (0.5, 0.5, 0.5)


@pytest.mark.parametrize("features", ["A", "B"])
def test_stored_labels_and_features_match_a_recomputation(pair, features):
  target, tparams, draft, dparams = pair
  ds, _ = _dataset(pair, features)
  for i in np.random.default_rng(1).choice(len(ds["labels"]), 6, replace=False):
    s, pos = int(ds["seq"][i]), int(ds["pos"][i])
    prefix = ds["sequences"][s, :int(ds["prompt_len"][s]) + pos].tolist()
    p_logits, _, _ = target.prefill(tparams, Prompt.from_lists([prefix]),
                                    target.init_cache(1, len(prefix) + 1))
    q_logits, h, _ = draft.prefill(dparams, Prompt.from_lists([prefix]),
                                   draft.init_cache(1, len(prefix) + 1))
    x = int(ds["x"][i])
    ratio = float(jax.nn.log_softmax(q_logits[0])[x] - jax.nn.log_softmax(p_logits[0])[x])
    assert ds["log_ratio"][i] == pytest.approx(ratio, abs=1e-4)
    assert bool(ds["labels"][i]) == (ratio <= np.log(1.2))
    if features == "B":
      h = draft.prefill(dparams, Prompt.from_lists([prefix + [x]]),
                        draft.init_cache(1, len(prefix) + 1))[1]
    np.testing.assert_allclose(ds["features"][i], h[0], atol=1e-4)


def test_groups_are_balanced_and_text_group_follows_the_text(pair):
  ds, batches = _dataset(pair)
  seq_groups = np.array([ds["group"][ds["seq"] == s][0] for s in np.unique(ds["seq"])])
  assert np.bincount(seq_groups).tolist() == [4, 4, 4, 4]
  text = np.concatenate([np.asarray(b.targets) for b in batches])
  for s in np.flatnonzero(seq_groups == 0):
    start = int(ds["prompt_len"][s])
    np.testing.assert_array_equal(ds["sequences"][s, start:start + 6], text[s])
  rates = [dlib.labels_from(ds["log_ratio"], 0.0, lam).mean() for lam in (1.0, 1.2, 1.5)]
  assert rates[0] <= rates[1] <= rates[2] and rates[2] > rates[0]


def test_valid_positions_stop_at_eos_and_at_the_text_end():
  valid = dlib.valid_positions(np.array([[5, 1, 7], [5, 6, 7]]), np.array([1, 0]),
                               np.array([3, 2]), eos=1)
  assert valid.tolist() == [[True, True, False, False], [True, True, True, False]]


def test_training_learns_a_separable_signal_and_stops_early():
  rng = np.random.default_rng(0)
  n, d = 6000, 8
  x = rng.normal(size=(n, d)).astype(np.float32)
  logit = x @ rng.normal(size=d) + 0.5 * rng.normal(size=n)
  ds = {"features": x, "labels": logit > 0.3, "seq": np.arange(n) // 10,
        "group": np.arange(n) // 10 % 4}
  cfg = tlib.TrainConfig(learning_rate=3e-2, batch_size=128, max_epochs=100, patience=2)
  params, m = tlib.train(vlib.Verifier(d), ds, cfg)
  assert m["test_auroc"] > 0.9 and m["test_tpr"] > m["test_fpr"]
  assert m["epochs"] < 100 and m["train"] + m["val"] + m["test"] == n
  assert 0.2 < m["positive_rate"] < 0.8


def test_too_few_sequences_is_a_typed_error_with_the_counts():
  with pytest.raises(tlib.TooFewSequencesError) as info:
    tlib.split_by_sequence(np.array([0, 0, 1, 1]), tlib.TrainConfig())
  assert (info.value.sequences, info.value.needed) == (2, 3)


def test_run_from_config_trains_saves_and_decodes(tmp_path):
  cfg = tmp_path / "sprinter_test.py"
  cfg.write_text(textwrap.dedent(f"""
      import ml_collections as mlc
      def get_config():
        c = mlc.ConfigDict()
        arch = dict(arch="decoder", vocab_size=32, n_positions=64, num_heads=2, bos_token_id=1,
                    eos_token_id=1, pad_token_id=0)
        c.target = mlc.ConfigDict(dict(arch, d_model=32, num_layers=2, d_ff=64))
        c.draft = mlc.ConfigDict(dict(arch, d_model=16, num_layers=1, d_ff=32))
        c.data = mlc.ConfigDict(dict(source="markov", vocab_size=32, prompt_len=6, eos_id=1))
        c.decode = mlc.ConfigDict(dict(temperature=1.0, top_k=0, top_p=1.0))
        c.verifier = mlc.ConfigDict(dict(features="A", mlp_width=0, lam=1.2, threshold=0.5,
            gamma_max=4, cont_len=8, mix_prob=0.5, num_sequences=64, batch_rows=32,
            learning_rate=1e-2, batch_size=64, max_epochs=3, patience=2, pos_weight=-1.0,
            val_fraction=0.1, test_fraction=0.2, seed=0))
        return c
      """))
  from specjax.app import builders, resolve, sprinter_train
  from specjax.app.config import load_config
  config = load_config(str(cfg))
  workdir = tmp_path / "run"
  metrics = sprinter_train.run_from_config(config, str(workdir))
  saved = json.loads((workdir / "metrics.json").read_text())
  for key in ("positive_rate", "positive_rate_mixed", "test_auroc", "test_tpr", "test_fpr"):
    assert key in saved and key in metrics
  assert saved["parameters"] == 17 and saved["examples"] > 64
  model, params, meta = vlib.load(str(workdir))
  assert model == vlib.Verifier(16) and meta["gamma_max"] == 4
  target, tparams = resolve.build_model(builders.model_spec(config, "target"), 0)
  draft, dparams = resolve.build_model(builders.model_spec(config, "draft"), 1)
  threshold, gamma_max = vlib.decode_settings(meta)               # the saved defaults
  assert (threshold, gamma_max) == (0.5, 4)
  gen = loop.generate(target, tparams, draft, dparams, model, params,
                      Prompt.from_lists([[2, 3, 4], [5]]), jax.random.PRNGKey(0),
                      threshold=threshold, gamma_max=gamma_max, max_new_tokens=6, warp=Warp(),
                      eos_id=None)
  assert gen.lengths.tolist() == [6, 6]
  st = gen.stats
  assert (np.asarray(st.target_calls) == np.asarray(st.rejections + st.forced)).all()
