"""The EAGLE-style draft head (models/draft_head.py, drafting/head.py, distill/head.py): greedy SD
with it is the target's greedy decoding, exact SD keeps the target's law (and a broken rule
fails the same test), training raises its agreement with the target, and a head built for
another target is refused."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import testing
from specjax.acceptance import registry
from specjax.api.loading import LoadedModel
from specjax.decoding import autoregressive, speculative
from specjax.distill import head as head_training
from specjax.drafting import HeadDrafter
from specjax.models import Prompt
from specjax.models.draft_head import DraftHead, with_target
from specjax.models.llama import Llama, LlamaConfig
from specjax.models.transformer import Rope
from specjax.sampling import Warp


def _llama(vocab_size=32, seed=0):
  cfg = LlamaConfig(vocab_size=vocab_size, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, d_ff=64, rope=Rope(theta=10000.0), scan_layers=False)
  model = Llama(cfg)
  params = jax.tree_util.tree_map(lambda x: 4.0 * x, model.init_params(jax.random.PRNGKey(seed)))
  return model, params


def _head(target, target_params, seed=1):
  head = DraftHead.for_target(target)
  params = with_target(head.init_params(jax.random.PRNGKey(seed)), target_params)
  return HeadDrafter(head=head), params


@pytest.mark.parametrize("family", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_greedy_sd_with_a_head_is_greedy_decoding(family):
  target, tparams = _llama() if family == "llama" else testing.tiny_decoder(seed=2)
  drafter, dparams = _head(target, tparams)
  testing.assert_greedy_sd_is_greedy(target, tparams, drafter, dparams, gamma=3,
                                     max_new_tokens=14)


V, MAX_NEW, PROMPT, N_RUNS = 4, 3, [1, 2, 1], 20_000


def _pvalue(rule) -> float:
  target, tparams = _llama(vocab_size=V, seed=5)
  drafter, dparams = _head(target, tparams, seed=6)
  warp = Warp(temperature=1.0)
  gen = speculative.generate(target, tparams, drafter, dparams,
                             Prompt.from_lists([PROMPT] * N_RUNS), jax.random.PRNGKey(7),
                             rule=rule, gamma=2, max_new_tokens=MAX_NEW, warp=warp, eos_id=None)
  assert gen.stats.totals()["accepted"] > 0
  law = testing.enumerate_model_law(target, tparams, PROMPT, max_new_tokens=MAX_NEW, warp=warp)
  return testing.chi_square_pvalue(law, testing.sequence_counts(gen.tokens, gen.lengths))


@pytest.mark.slow   # the law test and its broken twin: 15 s (greedy with a head runs by default)
def test_exact_sd_with_a_head_keeps_the_target_law():
  assert _pvalue(registry.get("exact")) > 1e-3


@pytest.mark.slow
def test_a_broken_rule_fails_the_same_law_test():
  assert _pvalue(testing.ResampleFromP()) < 1e-6


def _greedy_text(target, tparams, rows, n, seed):
  prompt = Prompt.from_lists(rows)
  gen = autoregressive.generate(target, tparams, prompt, jax.random.PRNGKey(seed),
                                max_new_tokens=n, warp=Warp(0.0), eos_id=None)
  return np.concatenate([np.asarray(prompt.tokens), np.asarray(gen.tokens)[:, :n]], axis=1)


def _alpha(target, tparams, drafter, dparams, rows) -> float:
  gen = speculative.generate(target, tparams, drafter, dparams, Prompt.from_lists(rows),
                             jax.random.PRNGKey(0),
                             rule="greedy", gamma=3, max_new_tokens=24, warp=Warp(0.0),
                             eos_id=None)
  totals = gen.stats.totals()
  return totals["accepted"] / max(totals["verified"], 1)


def test_training_raises_the_heads_acceptance():
  """The target's own greedy continuations (SeqKD-style data): a trained head agrees with the
  target far more often than the untrained one, as a draft in the loop (alpha) and in training
  (top-1)."""
  target, tparams = _llama(seed=3)
  head = DraftHead.for_target(target)
  rng = np.random.default_rng(0)
  rows = [list(map(int, rng.integers(2, 32, size=3))) for _ in range(64)]
  data = _greedy_text(target, tparams, rows, 29, seed=0)                # [64, 32]
  batches = ((data[i % 4 * 16:(i % 4 + 1) * 16], np.ones((16, 32), np.int32))
             for i in range(10**6))
  fresh = head.init_params(jax.random.PRNGKey(1))
  trained, history = head_training.train(head, target, tparams, batches, steps=150,
                                         learning_rate=1e-2, head_params=fresh,
                                         feature_weight=0.1)
  assert history[-1]["top1"] > history[0]["top1"] + 0.3
  before = _alpha(target, tparams, HeadDrafter(head=head), with_target(fresh, tparams), rows[:8])
  after = _alpha(target, tparams, HeadDrafter(head=head), with_target(trained, tparams),
                 rows[:8])
  assert after > before + 0.25, (before, after)


def test_a_head_for_another_target_is_refused():
  target, tparams = _llama()
  other, _ = testing.tiny_decoder(seed=2, vocab_size=48, d_model=16)
  drafter = HeadDrafter(head=DraftHead.for_target(other))
  with pytest.raises(ValueError, match="vocabulary 48 and hidden size 16.*has 32 and 32"):
    speculative.generate(target, tparams, drafter, {}, Prompt.from_lists([[1, 2]]),
                         jax.random.PRNGKey(0), rule="exact", gamma=2, max_new_tokens=4,
                         warp=Warp(), eos_id=None)


def test_a_cross_vocabulary_rule_is_refused_with_a_head():
  target, tparams = _llama()
  drafter, dparams = _head(target, tparams)
  rule = registry.rule_class("intersection")
  with pytest.raises(ValueError, match="proposes the target's own ids"):
    drafter.check(target, rule)


def test_the_head_reads_the_targets_embedding_and_head_not_a_copy():
  target, tparams = _llama()
  head = DraftHead.for_target(target)
  own = head.init_params(jax.random.PRNGKey(0))
  assert "token_embed" not in own and "lm_head" not in own and "fc" in own
  params = with_target(own, tparams)
  assert params["token_embed"]["embedding"] is tparams["token_embed"]["embedding"]
  fc = own["fc"]["kernel"]
  assert sorted(fc.shape) == [32, 64]
  logits, f, cache = head.extend(params, jnp.zeros((2, 3, 32)), jnp.ones((2, 3), jnp.int32),
                                 head.init_cache(2, 8))
  assert logits.shape == (2, 3, 32) and f.shape == (2, 3, 32)
  assert cache.lengths.tolist() == [3, 3]


def test_the_head_method_needs_a_checkpoint():
  from specjax.app import methods
  from specjax.app.config import ConfigError, load_config
  config = load_config("tiny.py", ["--config.draft.method=head", "--config.draft.checkpoint="])
  with pytest.raises(ConfigError, match="method=head needs --config.draft.checkpoint=WORKDIR"):
    methods.build(config)


def test_a_head_student_cannot_sample_its_own_outputs():
  from specjax.distill.trainer import TrainConfig
  with pytest.raises(ValueError, match="cannot sample outputs.*set lambda2=0"):
    TrainConfig(student="head", lambda1=0.0, lambda2=0.5)
  with pytest.raises(ValueError, match="student must be one of draft, head"):
    TrainConfig(student="eagle")
  assert TrainConfig(student="head", lambda1=0.0, lambda2=0.0).student == "head"


# A draft head over a sub-vocabulary (FR-Spec; api/drafters.sub_vocab with target=): the head
# scores K ids through its own [D, K] cut of the target's LM head.

STOP = types.SimpleNamespace(eos_ids=(1,))     # what sub_vocab reads of a tokenizer


def _loaded(family, vocab_size=32, seed=0):
  target, tparams = _llama(vocab_size, seed) if family == "llama" else testing.tiny_decoder(
      seed=seed, vocab_size=vocab_size)
  head = DraftHead.for_target(target)
  loaded = specjax.LoadedHead(drafter=HeadDrafter(head=head),
                              params=head.init_params(jax.random.PRNGKey(seed + 1)))
  return LoadedModel(model=target, params=tparams, tokenizer=STOP, path=None), loaded


@pytest.mark.parametrize("family", ["llama", "gpt2"])       # an untied head and a tied one
def test_a_cut_head_scores_its_subset_through_its_own_kernel(family):
  target, full = _loaded(family)
  cut = specjax.sub_vocab(full, 6, counts=np.arange(32)[::-1].copy(), target=target)
  assert cut.drafter.head.arch.head_subset.ids.tolist() == [0, 1, 2, 3, 4, 5]
  params = cut.loop_params(target)
  assert params["lm_head"]["kernel"].shape == (32, 6)
  assert "lm_head" not in target.params or target.params["lm_head"]["kernel"].shape[-1] == 32
  args = (jnp.ones((2, 3, 32)), jnp.array([[2, 7, 9], [1, 1, 3]]))
  want, f_want, _ = full.drafter.head.extend(full.loop_params(target), *args,
                                             full.drafter.head.init_cache(2, 8))
  got, f_got, _ = cut.drafter.head.extend(params, *args, cut.drafter.head.init_cache(2, 8))
  np.testing.assert_allclose(f_got, f_want, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got[..., :6], want[..., :6], rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(got[..., 6:]) == -np.inf)


def test_greedy_sd_with_a_cut_head_is_greedy_decoding():
  target, full = _loaded("llama")
  cut = specjax.sub_vocab(full, 8, counts=np.random.RandomState(0).randint(0, 9, 32),
                          target=target)
  testing.assert_greedy_sd_is_greedy(target.model, target.params, cut.drafter,
                                     cut.loop_params(target), gamma=3, max_new_tokens=14)


def _cut_pvalue(rule) -> float:
  """Exact SD with a head cut to ids {0, 1} of 4, on a target whose mass is mostly outside."""
  target, full = _loaded("llama", vocab_size=V, seed=5)
  cut = specjax.sub_vocab(full, 2, counts=np.array([5, 0, 0, 0]), target=target)
  warp = Warp(temperature=1.0)
  gen = speculative.generate(target.model, target.params, cut.drafter, cut.loop_params(target),
                             Prompt.from_lists([PROMPT] * N_RUNS), jax.random.PRNGKey(7),
                             rule=rule, gamma=2, max_new_tokens=MAX_NEW, warp=warp, eos_id=None)
  assert gen.stats.totals()["accepted"] > 0
  law = testing.enumerate_model_law(target.model, target.params, PROMPT,
                                    max_new_tokens=MAX_NEW, warp=warp)
  assert sum(m for seq, m in law.items() if any(t >= 2 for t in seq)) > 0.5
  return testing.chi_square_pvalue(law, testing.sequence_counts(gen.tokens, gen.lengths))


@pytest.mark.slow   # the law test and its broken twin (the cut draft model's run by default)
def test_exact_sd_with_a_cut_head_keeps_the_target_law():
  assert _cut_pvalue(registry.get("exact")) > 1e-3


@pytest.mark.slow
def test_a_residual_limited_to_the_heads_subset_fails_the_same_law_test():
  from test_sub_vocab import ResidualInSubset
  assert _cut_pvalue(ResidualInSubset()) < 1e-6


def test_cutting_a_head_is_refused_with_the_fix():
  target, full = _loaded("llama")
  with pytest.raises(specjax.UsageError, match="pass the target, sub_vocab"):
    specjax.sub_vocab(full, 4, counts=np.ones(32))
  with pytest.raises(specjax.UsageError, match="from 1 to 31 \\(the target has 32\\)"):
    specjax.sub_vocab(full, 32, counts=np.ones(32), target=target)
  cut = specjax.sub_vocab(full, 4, counts=np.ones(32), target=target)
  with pytest.raises(specjax.UsageError, match="already scores 4 ids"):
    specjax.sub_vocab(cut, 3, counts=np.ones(32), target=target)
  other, _ = _loaded("gpt2", vocab_size=48)
  with pytest.raises(specjax.UsageError, match="vocabulary 32 and hidden size 32.*has 48"):
    specjax.sub_vocab(full, 4, counts=np.ones(48), target=other)


def test_the_config_flag_cuts_the_head(monkeypatch):
  from specjax.app import methods
  from specjax.app.config import ConfigError, load_config
  target, full = _loaded("llama")
  monkeypatch.setattr(methods, "load_placed", lambda *a, **k: target)
  monkeypatch.setattr(methods, "draft_head", lambda *a, **k: full)
  monkeypatch.setattr(methods, "check_head_dir", lambda *a: None)       # "somewhere" is fake
  args = ["--config.draft.method=head", "--config.draft.checkpoint=somewhere"]
  config = load_config("tiny.py", [*args, "--config.draft.vocab_top_k=-1"])
  with pytest.raises(ConfigError, match="--config.draft.vocab_top_k=-1: choose a whole number"):
    methods.build(config)
  whole = methods.build(load_config("tiny.py", [*args, "--config.draft.vocab_top_k=99"]))
  assert whole.draft is full                     # K covers the vocabulary: the head as it is
  monkeypatch.setattr(methods, "sub_vocab", lambda head, k, flag, target: specjax.sub_vocab(
      head, k, counts=np.ones(32), flag=flag, target=target))       # no corpus to count
  method = methods.build(load_config("tiny.py", [*args, "--config.draft.vocab_top_k=5"]))
  assert method.draft.drafter.head.arch.head_subset.size == 5


@pytest.mark.parametrize("layout", ["in_out", "out_in"])
def test_a_head_trained_float_drafts_for_an_int8_target(tmp_path, layout):
  """A head's workdir holds float params; beside an int8 target (qwen_coder.py's quant "auto")
  it was refused as "params of another model". Loaded, it is quantized as the target's layers
  are, and greedy SD with it is the int8 target's greedy decoding."""
  import dataclasses
  from specjax import checkpoint
  from specjax.models import dense_layout, quant
  target, tparams = _llama()
  head = DraftHead.for_target(target)
  checkpoint.save_params(tmp_path, head.init_params(jax.random.PRNGKey(1)))
  if layout == "out_in":
    tparams = jax.tree_util.tree_map_with_path(
        lambda p, x: x.T if dense_layout.transposes(tuple(k.key for k in p), layout) else x,
        tparams)
  int8 = dataclasses.replace(target, config=dataclasses.replace(target.config, quant="int8",
                                                                layout=layout))
  qparams = quant.quantize_params(jax.tree.map(lambda x: x, tparams), tied=False, layout=layout)
  loaded = specjax.draft_head(LoadedModel(model=int8, params=qparams, tokenizer=STOP, path=None),
                              str(tmp_path))
  assert loaded.drafter.head.quant == "int8"
  testing.assert_greedy_sd_is_greedy(int8, qparams, loaded.drafter,
                                     loaded.loop_params(LoadedModel(model=int8, params=qparams,
                                                                    tokenizer=STOP, path=None)))
