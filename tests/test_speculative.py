from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import drafting, sampling, testing
from specjax.acceptance import base, exact, registry
from specjax.decoding import autoregressive, speculative
from specjax.models import Prompt
from specjax.models.kv_cache import CacheOverflowError
from specjax.sampling import Warp

V, EOS = 4, 0
MODEL = testing.ToyAR(V, 6)
TARGET = MODEL.init_params(jax.random.PRNGKey(0))
DRAFT = {"table": testing.draft_table(jax.random.PRNGKey(1), TARGET["table"], "poor")}
ROWS = [[1], [2, 3], [3, 1, 2, 2], [1, 1, 1], [2], [3, 3], [1, 2, 3, 1, 2], [2, 2]]
WIDTH = 5


def _spec(prompt, key, draft=MODEL, draft_params=DRAFT, **kwargs):
  kwargs = {"rule": "exact", "gamma": 3, "max_new_tokens": 6, "warp": Warp(), "eos_id": EOS,
            **kwargs}
  return speculative.generate(MODEL, TARGET, draft, draft_params, prompt, key, **kwargs)


# ----------------------------------------------------------------------------- bad input

def test_unknown_rule_lists_known_rules():
  with pytest.raises(ValueError, match="unknown acceptance rule 'nope'.*exact.*greedy"):
    _spec(Prompt.from_lists(ROWS), jax.random.PRNGKey(0), rule="nope")


def test_unknown_hyperparameter_is_named():
  with pytest.raises(ValueError, match="no hyperparameter bogus"):
    registry.get("lenient", bogus=1)


@pytest.mark.parametrize("gamma", [0, -2])
def test_gamma_below_one_is_refused(gamma):
  with pytest.raises(ValueError, match="gamma"):
    _spec(Prompt.from_lists(ROWS), jax.random.PRNGKey(0), gamma=gamma)


def test_prompt_longer_than_cache_is_refused():
  with pytest.raises(CacheOverflowError, match="needs 14 cache positions but the cache holds 10"):
    _spec(Prompt.from_lists(ROWS), jax.random.PRNGKey(0), max_len=10)   # 5 + 6 + 3


# ----------------------------------------------------------------------------- loop mechanics

def test_debug_mode_equals_jitted_loop():
  prompt, key = Prompt.from_lists(ROWS), jax.random.PRNGKey(7)
  fast = _spec(prompt, key)
  slow = _spec(prompt, key, debug=True)
  np.testing.assert_array_equal(fast.tokens, slow.tokens)
  np.testing.assert_array_equal(fast.lengths, slow.lengths)
  jax.tree_util.tree_map(np.testing.assert_array_equal, fast.stats, slow.stats)


def test_batch_rows_equal_single_row_runs():
  keys = sampling.row_keys(jax.random.PRNGKey(3), len(ROWS))
  batch = _spec(Prompt.from_lists(ROWS), keys)
  for b, row in enumerate(ROWS):
    single = _spec(Prompt.from_lists([row], pad_to=WIDTH), keys[b:b + 1])
    np.testing.assert_array_equal(single.tokens[0], batch.tokens[b])
    assert int(single.lengths[0]) == int(batch.lengths[b])
    for f in dataclasses.fields(single.stats):
      assert int(getattr(single.stats, f.name)[0]) == int(getattr(batch.stats, f.name)[b]), f.name


def test_first_token_is_the_autoregressive_first_token():
  keys = sampling.row_keys(jax.random.PRNGKey(4), len(ROWS))
  prompt = Prompt.from_lists(ROWS)
  spec = _spec(prompt, keys)
  auto = autoregressive.generate(MODEL, TARGET, prompt, keys, max_new_tokens=1, warp=Warp(),
                                 eos_id=EOS)
  np.testing.assert_array_equal(spec.tokens[:, :1], auto.tokens)


def test_caches_follow_the_loop_invariant_and_stats_add_up():
  prompt = Prompt.from_lists(ROWS)
  setup = speculative._validate(MODEL, MODEL, prompt, None, rule="exact", gamma=3,
                                max_new_tokens=6, warp=Warp(), eos_id=EOS, max_len=None)
  keys = sampling.row_keys(jax.random.PRNGKey(5), len(ROWS))
  state = speculative.run(setup, TARGET, DRAFT, prompt, prompt, keys, (setup.rule, setup.warp,
                                                                      setup.limit))
  for b, row in enumerate(ROWS):
    stream = row + [int(t) for t in state.tokens[b, :int(state.lengths[b])]]
    assert MODEL.stored_tokens(state.target_cache, b) == stream[:-1]          # minus pending
    assert list(np.asarray(state.last_two[b])) == stream[-2:]
    assert MODEL.stored_tokens(state.drafter_state, b)[:len(stream) - 2] == stream[:-2]
  st = state.stats
  np.testing.assert_array_equal(st.emitted, state.lengths)
  np.testing.assert_array_equal(st.blocks, st.target_passes)
  assert (st.accepted <= st.verified).all() and (st.verified <= st.drafted).all()
  assert (st.drafted <= 3 * (st.blocks - 1)).all() and (st.emitted <= 4 * st.blocks).all()


@dataclasses.dataclass(frozen=True)
class _StopWhenUnsure(drafting.length.Fixed):
  """A length policy (drafting/length.py) that stops drafting when q's top probability is
  below 0.6 (AdaSD-like), with the exact rule."""
  variable = True

  def keep(self, q_logp, step, rule, rule_state):
    return (jnp.max(q_logp, axis=-1) > jnp.log(0.6)) | (step == 0)


@pytest.mark.parametrize("policy", [_StopWhenUnsure(), drafting.length.ConfidenceStop(0.5)],
                         ids=["stop_when_unsure", "confidence_stop"])
def test_a_drafters_own_length_policy_keeps_the_target_law(policy):
  n = 50000
  drafter = drafting.ModelDrafter(draft_model=MODEL, length=policy)
  gen = _spec(Prompt.from_lists([[1]] * n), jax.random.PRNGKey(9), draft=drafter, rule="exact",
              gamma=4, max_new_tokens=4)
  law = testing.enumerate_law(MODEL, TARGET, [1], max_new_tokens=4, warp=Warp(), eos_id=EOS)
  assert testing.chi_square_pvalue(law, testing.sequence_counts(gen.tokens, gen.lengths)) > 1e-3
  st = gen.stats
  assert int(st.drafted.sum()) < 4 * int((st.blocks - 1).sum())           # some rows stopped early


def test_confidence_stop_ends_a_block_after_the_first_unsure_draft():
  """drafting/length.ConfidenceStop: a draft whose top probability under the draft model (its
  raw softmax, whatever the warp) is below the threshold is offered, then drafting stops; greedy
  SD under it still writes the target's own tokens."""
  policy = drafting.length.ConfidenceStop(0.5)
  logits = jnp.log(jnp.array([[0.9, 0.05, 0.05], [0.4, 0.35, 0.25]]))
  one_hot = Warp(temperature=0.0).log_probs(logits)                      # greedy's q: no use
  stop = policy.stop_after(one_hot, jnp.int32(0), None, None, logits)
  np.testing.assert_array_equal(stop, [False, True])
  assert policy.keep(one_hot, jnp.int32(0), None, None).all() and policy.variable
  adaptive = registry.get("adaptive")             # around AdaSD's window: either stop ends it
  entropy = drafting.length.ConfidenceStop(0.5, inner=drafting.length.for_rule(adaptive))
  state = adaptive.init_state(2)
  q = jax.nn.log_softmax(logits)
  inner = drafting.length.for_rule(adaptive).stop_after(q, jnp.int32(3), adaptive, state)
  np.testing.assert_array_equal(
      entropy.stop_after(q, jnp.int32(3), adaptive, state, logits), inner | stop)
  prompt, greedy = Prompt.from_lists(ROWS), dict(warp=Warp(temperature=0.0), eos_id=None)
  alone = autoregressive.generate(MODEL, TARGET, prompt, jax.random.PRNGKey(0), max_new_tokens=12,
                                  **greedy)
  for threshold in (0.6, 0.8, 1.0):          # the toy draft's top probabilities: 0.38 .. 1
    drafter = drafting.ModelDrafter(draft_model=MODEL,
                                    length=drafting.length.ConfidenceStop(threshold))
    gen = _spec(prompt, jax.random.PRNGKey(1), draft=drafter, rule="greedy", gamma=6,
                max_new_tokens=12, **greedy)
    np.testing.assert_array_equal(gen.tokens, alone.tokens)
    st = gen.stats
    sd_blocks = int((st.blocks - 1).sum())
    if threshold == 1.0:    # every draft is unsure: one per block (none where only one fits)
      assert len(ROWS) <= int(st.drafted.sum()) <= sd_blocks
    else:
      assert sd_blocks < int(st.drafted.sum()) < 6 * sd_blocks


def test_hf_greedy_draft_is_greedy_at_temperature_zero_and_lossy_otherwise():
  prompt = Prompt.from_lists(ROWS)
  greedy = dict(warp=Warp(temperature=0.0), eos_id=None)
  auto = autoregressive.generate(MODEL, TARGET, prompt, jax.random.PRNGKey(0), max_new_tokens=6,
                                 **greedy)
  hf = _spec(prompt, jax.random.PRNGKey(1), rule="hf_greedy_draft", **greedy)
  np.testing.assert_array_equal(hf.tokens, auto.tokens)
  n = 50000
  gen = _spec(Prompt.from_lists([[1]] * n), jax.random.PRNGKey(2), rule="hf_greedy_draft",
              max_new_tokens=4)
  law = testing.enumerate_law(MODEL, TARGET, [1], max_new_tokens=4, warp=Warp(), eos_id=EOS)
  assert testing.chi_square_pvalue(law, testing.sequence_counts(gen.tokens, gen.lengths)) < 1e-6


# ----------------------------------------------------------------------------- block efficiency

def _constant_run(p_logits, q_logits, gamma=3, n_rows=64, max_new=601):
  """Context-independent p and q, no EOS (one compile shared by the tests below)."""
  model = testing.ToyAR(len(p_logits), 1)
  target = {"table": testing.constant_table(p_logits, len(p_logits))}
  draft = {"table": testing.constant_table(q_logits, len(q_logits))}
  gen = speculative.generate(model, target, model, draft, Prompt.from_lists([[0]] * n_rows),
                             jax.random.PRNGKey(9), rule="exact", gamma=gamma,
                             max_new_tokens=max_new, warp=Warp(), eos_id=None)
  st = {k: np.asarray(v, np.float64) for k, v in vars(gen.stats).items()}
  tau = (st["emitted"] - 1).sum() / (st["blocks"] - 1).sum()                # SD blocks only
  return tau, st["accepted"].sum() / st["verified"].sum()


def test_block_efficiency_matches_theory():
  p = jnp.log(jnp.array([0.4, 0.3, 0.2, 0.1]))
  q = jnp.log(jnp.array([0.25, 0.25, 0.25, 0.25]))
  alpha = float(jnp.minimum(jnp.exp(p), jnp.exp(q)).sum())                  # 0.85
  gamma = 3
  tau, alpha_hat = _constant_run(p, q)
  assert abs(alpha_hat - alpha) < 0.01
  assert abs(tau - (1 - alpha ** (gamma + 1)) / (1 - alpha)) < 0.03


def test_block_efficiency_extremes():
  p = jnp.log(jnp.array([0.4, 0.3, 0.2, 0.1]))
  tau, alpha_hat = _constant_run(p, p)                 # 601 = 1 + 150 * 4: no truncated block
  assert tau == 4.0 and alpha_hat == 1.0
  disjoint = jnp.array([0.0, 0.0, -jnp.inf, -jnp.inf])
  tau, alpha_hat = _constant_run(disjoint, disjoint[::-1])
  assert tau == 1.0 and alpha_hat == 0.0


# ----------------------------------------------------------------------------- greedy == target

@functools.lru_cache(maxsize=None)
def _models(kind):
  """(target, params, {"noisy": (target, perturbed params), "small": (smaller model, params)})."""
  if kind == "t5":
    pytest.importorskip("specjax.models.t5")
  make = testing.tiny_t5 if kind == "t5" else testing.tiny_decoder
  model, params = make(seed=0)
  noisy = jax.tree_util.tree_map(
      lambda x: x + 0.3 * jnp.std(x) * jax.random.normal(jax.random.PRNGKey(2), x.shape), params)
  return model, params, {"noisy": (model, noisy), "small": make(seed=1, d_model=16, num_layers=1)}


GREEDY_CASES = [("decoder", "greedy", 1, "noisy"), ("decoder", "exact", 4, "small"),
                ("t5", "greedy", 3, "noisy"),
                pytest.param("decoder", "greedy", 5, "noisy", marks=pytest.mark.slow),
                pytest.param("t5", "greedy", 1, "small", marks=pytest.mark.slow),
                pytest.param("t5", "exact", 5, "noisy", marks=pytest.mark.slow),
                pytest.param("decoder", "hf_greedy_draft", 3, "small", marks=pytest.mark.slow)]


@pytest.mark.parametrize("kind,rule,gamma,draft", GREEDY_CASES)
def test_greedy_sd_equals_greedy_target_decoding(kind, rule, gamma, draft):
  """At temperature 0 every lossless rule must reproduce greedy target decoding token for token
  (exact at temperature 0 works on one-hot p and q)."""
  model, params, drafts = _models(kind)
  draft_model, draft_params = drafts[draft]
  prompt = Prompt.from_lists([[5, 6, 7], [9], [3, 4, 5, 6, 7, 8], [11, 12]], pad_to=8)
  greedy = dict(max_new_tokens=12, warp=Warp(temperature=0.0), eos_id=None, max_len=32)
  want = autoregressive.generate(model, params, prompt, jax.random.PRNGKey(0), **greedy)
  got = speculative.generate(model, params, draft_model, draft_params, prompt,
                             jax.random.PRNGKey(1), rule=rule, gamma=gamma, **greedy)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  if draft == "noisy":
    assert int(got.stats.accepted.sum()) > 0             # the drafts were sometimes right


@dataclasses.dataclass(frozen=True)
class _SampledFirstToken(exact.Greedy):
  """The old loop: greedy's first token sampled with the run's warp, later tokens argmax."""

  def first_token(self, p_logits, warp, keys):
    return base.Rule.first_token(self, p_logits, warp, keys)


@pytest.mark.parametrize("warp", [Warp(temperature=1.0), Warp(temperature=1.0, top_k=2)])
def test_greedy_rule_is_greedy_target_decoding_under_a_sampling_warp(warp):
  """The greedy rule's output is greedy target decoding whatever the warp, first token included
  (the loop asks rule.first_token); the old sampled first token fails the same comparison."""
  good = {"table": testing.draft_table(jax.random.PRNGKey(1), TARGET["table"], "good")}
  prompt, key = Prompt.from_lists(ROWS * 4), jax.random.PRNGKey(6)          # 32 rows
  want = autoregressive.generate(MODEL, TARGET, prompt, key, max_new_tokens=6,
                                 warp=Warp(temperature=0.0), eos_id=EOS)
  got = _spec(prompt, key, draft_params=good, rule="greedy", warp=warp)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.lengths, want.lengths)
  assert int(got.stats.accepted.sum()) > 0                 # the drafts were sometimes right
  old = _spec(prompt, key, draft_params=good, rule=_SampledFirstToken(), warp=warp)
  assert (np.asarray(old.tokens[:, 0]) != np.asarray(want.tokens[:, 0])).any()


# ----------------------------------------------------------------------------- verify widths

def test_verify_pass_widths_follow_the_drafters_count():
  model, params, drafts = _models("decoder")
  setup = lambda rule, gamma: speculative.Setup(
      target=model, drafter=drafting.as_drafter(model, registry.get(rule)),
      rule=registry.get(rule), gamma=gamma, max_new=8, warp=Warp(), eos=-1, max_len=32)
  assert speculative.verify_widths(setup("exact", 20)) == (21,)
  assert speculative.verify_widths(setup("adaptive", 20)) == (2, 4, 8, 16, 21)
  assert speculative.verify_widths(setup("adaptive", 3)) == (2, 4)
  lookup = speculative.Setup(target=model, drafter=drafting.NGram(), rule=registry.get("exact"),
                             gamma=3, max_new=8, warp=Warp(), eos=-1, max_len=32)
  assert speculative.verify_widths(lookup) == (1, 2, 4)      # no match: the target's own step


def test_narrow_verify_passes_give_the_tokens_of_full_width_passes(monkeypatch):
  """AdaSD's windows end early; its verify pass then runs over the narrowest bucket that holds
  the longest draft. The tokens, statistics and rule state equal those of full-width passes."""
  model, params, drafts = _models("decoder")
  draft_model, draft_params = drafts["small"]
  prompt = Prompt.from_lists([[5, 6, 7], [9], [3, 4, 5, 6, 7, 8]], pad_to=8)
  rule = registry.get("adaptive", tau_g_init=0.5)

  def run():
    jax.clear_caches()                                    # verify_widths is read when tracing
    return speculative.generate(model, params, draft_model, draft_params, prompt,
                                jax.random.PRNGKey(3), rule=rule, gamma=3, max_new_tokens=16,
                                warp=Warp(), eos_id=None, max_len=40)

  narrow = run()
  st = narrow.stats
  assert int(st.drafted.sum()) < 3 * int((st.blocks - 1).sum())          # short windows
  traced = []
  monkeypatch.setattr(speculative, "verify_widths",
                      lambda setup: traced.append(setup) or (setup.gamma + 1,))
  full = run()
  assert traced                                          # the loop was traced again, full width
  np.testing.assert_array_equal(narrow.tokens, full.tokens)
  jax.tree_util.tree_map(np.testing.assert_array_equal, narrow.stats, full.stats)


def test_unrolled_draft_passes_give_the_tokens_of_the_rolled_loop(monkeypatch):
  """A block's draft passes run in a while loop on the CPU and unrolled on GPU
  (drafting/model.unroll_drafts): both programs give the same tokens and statistics."""
  from specjax.drafting import model as model_drafter
  assert not model_drafter.unroll_drafts(False, 4, "cpu")
  assert model_drafter.unroll_drafts(False, 4, "gpu")
  assert not model_drafter.unroll_drafts(True, 4, "gpu")                  # variable windows
  assert not model_drafter.unroll_drafts(False, model_drafter.UNROLL_MAX_GAMMA + 1, "gpu")
  model, params, drafts = _models("decoder")
  draft_model, draft_params = drafts["small"]
  prompt = Prompt.from_lists([[5, 6, 7], [9], [3, 4, 5, 6, 7, 8]], pad_to=8)

  def run(unrolled: bool):
    jax.clear_caches()                                   # unroll_drafts is read when tracing
    traced = []
    monkeypatch.setattr(model_drafter, "unroll_drafts",
                        lambda variable, gamma, backend=None: traced.append(1) or unrolled)
    out = speculative.generate(model, params, draft_model, draft_params, prompt,
                               jax.random.PRNGKey(5), rule="exact", gamma=3, max_new_tokens=12,
                               warp=Warp(), eos_id=None)
    assert traced
    return out

  rolled, unrolled = run(False), run(True)
  np.testing.assert_array_equal(rolled.tokens, unrolled.tokens)
  jax.tree_util.tree_map(np.testing.assert_array_equal, rolled.stats, unrolled.stats)
  assert int(rolled.stats.accepted.sum()) > 0
