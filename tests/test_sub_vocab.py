"""A draft head over a sub-vocabulary (FR-Spec; models/sub_vocab.py, api/drafters.sub_vocab):
the logits it gives, exact SD's law with a target that puts mass outside the subset (and a broken
rule whose residual stays in the subset fails the same test), the config flag and its refusals."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import testing
from specjax.acceptance import exact, registry
from specjax.api.loading import LoadedModel
from specjax.app.config import ConfigError, load_config
from specjax.app.methods import speculative
from specjax.data import token_counts
from specjax.decoding import speculative as loop
from specjax.models import Prompt
from specjax.models.sub_vocab import SubVocab
from specjax.sampling import Warp

STOP = types.SimpleNamespace(eos_ids=(1,))     # what sub_vocab reads of a tokenizer


def _draft(vocab: int = 16, seed: int = 3, **kw) -> LoadedModel:
  model, params = testing.tiny_decoder(seed=seed, vocab_size=vocab, **kw)
  return LoadedModel(model=model, params=params, tokenizer=STOP, path=None)


def test_the_head_scores_the_subset_and_nothing_else():
  full = _draft()
  counts = np.arange(16)[::-1].copy()                 # id 0 most frequent
  cut = specjax.sub_vocab(full, 5, counts=counts)
  assert cut.model.config.head_subset.ids.tolist() == [0, 1, 2, 3, 4]
  assert cut.params["lm_head"]["kernel"].shape == (32, 5)
  tokens = jnp.array([[2, 7, 9]])
  cache = full.model.init_cache(1, 8)
  want, _, _ = full.model.extend_entries(full.params, tokens, cache)
  got, _, _ = cut.model.extend_entries(cut.params, tokens, cache)
  np.testing.assert_allclose(got[..., :5], want[..., :5], rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(got[..., 5:]) == -np.inf)


def test_stop_ids_are_always_kept():
  subset = SubVocab.most_frequent(np.array([9, 0, 8, 7, 6]), 2, always=(1,))
  assert subset.ids.tolist() == [0, 1]


def test_greedy_sd_with_the_cut_draft_is_the_targets_greedy_decoding():
  target = _draft(seed=2)
  draft = specjax.sub_vocab(_draft(seed=3), 6, counts=np.random.RandomState(0).randint(0, 9, 16))
  testing.assert_greedy_sd_is_greedy(target.model, target.params, draft.model, draft.params)


def test_a_bfloat16_cut_draft_decodes_batches_of_two_rows_on_cpu():
  """Its [D, K] head product, 16-bit x 16-bit -> float32 inside the loop, crashed XLA:CPU's dot
  runtime ("Unsupported element type for DotThunk::Execute") for two rows or more."""
  def bf16(seed):
    draft = _draft(seed=seed)
    model = dataclasses.replace(draft.model, config=dataclasses.replace(draft.model.config,
                                                                         dtype="bfloat16"))
    return dataclasses.replace(draft, model=model, params=jax.tree.map(
        lambda x: x.astype(jnp.bfloat16), draft.params))
  target = bf16(2)
  draft = specjax.sub_vocab(bf16(3), 6, counts=np.random.RandomState(0).randint(0, 9, 16))
  testing.assert_greedy_sd_is_greedy(target.model, target.params, draft.model, draft.params)


# The law test: a ToyAR target over 4 ids, a tiny GPT-2 draft whose head keeps ids {0, 1} only.
V, MAX_NEW, PROMPT = 4, 3, [1, 2, 1]
TARGET = testing.ToyAR(V, 6)
N_RUNS = 20_000


@dataclasses.dataclass(frozen=True)
class ResidualInSubset(exact.Exact):
  """Broken: after a rejection it draws the residual only among the ids the draft can propose
  (q > 0), as if the target's vocabulary were the draft's subset."""

  def verify(self, draft_tokens, draft_len, q_logp, p_logp, keys, rule_state):
    support = jnp.isfinite(jnp.concatenate([q_logp, q_logp[:, -1:]], axis=1))   # [B, K+1, V]
    p_in = jnp.where(support, p_logp, -jnp.inf)
    return super().verify(draft_tokens, draft_len, q_logp, p_in, keys, rule_state)


def _pvalue(rule) -> float:
  params = TARGET.init_params(jax.random.PRNGKey(0))
  draft = specjax.sub_vocab(_draft(vocab=V, seed=4), 2, counts=np.array([5, 0, 0, 0]))
  warp = Warp(temperature=1.0)
  gen = loop.generate(TARGET, params, draft.model, draft.params,
                      Prompt.from_lists([PROMPT] * N_RUNS), jax.random.PRNGKey(5), rule=rule,
                      gamma=2, max_new_tokens=MAX_NEW, warp=warp, eos_id=None)
  counts = testing.sequence_counts(gen.tokens, gen.lengths)
  law = testing.enumerate_law(TARGET, params, PROMPT, max_new_tokens=MAX_NEW, warp=warp,
                              eos_id=None)
  outside = sum(mass for seq, mass in law.items() if any(t >= 2 for t in seq))
  assert outside > 0.5                                  # the target's mass is mostly outside
  return testing.chi_square_pvalue(law, counts)


def test_exact_sd_with_a_cut_draft_keeps_the_target_law():
  assert _pvalue(registry.get("exact")) > 1e-3


def test_a_residual_limited_to_the_subset_fails_the_same_law_test():
  assert _pvalue(ResidualInSubset()) < 1e-6


def test_counts_come_from_the_corpus_once(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  tok = types.SimpleNamespace(encode=lambda text: [len(text) % 7, 3], fingerprint="t")
  monkeypatch.setattr(token_counts.stdlib_corpus, "load_corpus",
                      lambda: types.SimpleNamespace(digest="d", lm_split=lambda s: ("ab", "abc")))
  counts = token_counts.stdlib_counts(tok, 8)
  assert counts.tolist() == [0, 0, 1, 3, 0, 0, 0, 0]
  tok.encode = None                                     # a second call reads the cache
  np.testing.assert_array_equal(token_counts.stdlib_counts(tok, 8), counts)


@pytest.mark.parametrize("k", [0, 16, -1, 2.5, True])
def test_a_k_outside_the_vocabulary_is_refused_with_the_range(k):
  with pytest.raises(specjax.UsageError, match="choose a whole number of ids from 1 to 15"):
    specjax.sub_vocab(_draft(), k, counts=np.ones(16))


def test_refusals_name_the_problem():
  cut = specjax.sub_vocab(_draft(), 4, counts=np.ones(16))
  with pytest.raises(specjax.UsageError, match="already scores 4 ids"):
    specjax.sub_vocab(cut, 3, counts=np.ones(16))
  with pytest.raises(specjax.UsageError, match=r"one count per draft id, \(16,\)"):
    specjax.sub_vocab(_draft(), 4, counts=np.ones(3))
  for bad in (-np.ones(16), np.full(16, np.nan), np.array(["1"] * 16)):   # ranked as given before
    with pytest.raises(specjax.UsageError, match="counts: give finite counts >= 0, one per draft"):
      specjax.sub_vocab(_draft(), 4, counts=bad)
  model, params = testing.tiny_t5()
  with pytest.raises(specjax.UsageError, match="encoder-decoder"):
    specjax.sub_vocab(LoadedModel(model, params, STOP, None), 4, counts=np.ones(48))


def test_the_config_flag_names_itself(monkeypatch):
  from specjax.app import methods
  monkeypatch.setattr(methods, "load_placed", lambda *a, **k: _draft())
  monkeypatch.setattr(methods.resolve, "checkpoint_dir", lambda spec: None)   # no fetch or build
  config = load_config("tiny.py", ["--config.draft.vocab_top_k=-1"])
  with pytest.raises(ConfigError, match="--config.draft.vocab_top_k=-1: choose a whole number"):
    speculative(config)
  config = load_config("tiny.py", ["--config.draft.method=ngram", "--config.draft.vocab_top_k=8"])
  with pytest.raises(ConfigError, match="prompt lookup has no draft head"):
    speculative(config)


def test_a_config_k_of_the_whole_vocabulary_keeps_the_full_head(monkeypatch, caplog):
  """A config's K at least the draft's vocabulary (qwen_coder.py's 32768 on a smaller stand-in)
  cuts nothing: the draft keeps its head, and the log says so."""
  from specjax.app import methods
  draft = _draft()
  monkeypatch.setattr(methods, "load_placed", lambda *a, **k: draft)
  monkeypatch.setattr(methods.resolve, "checkpoint_dir", lambda spec: None)
  config = load_config("tiny.py", ["--config.draft.vocab_top_k=16"])
  with caplog.at_level("INFO", logger="specjax.app.methods"):
    assert speculative(config).draft.model.config.head_subset is None
  assert "vocab_top_k=16 covers all 16 ids of the draft: its full head" in caplog.text
