"""AdaSD, papers/adasd.md §6: the worked trace, thresholds and recording, the entropy window and
its cap, losslessness with tau_v = 0, equality with exact SD, batch invariance."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import divergences as dv
from specjax import drafting, sampling, testing
from specjax.acceptance import adaptive, registry
from specjax.decoding import speculative
from specjax.models import Prompt
from specjax.sampling import Warp

ACC, REJ = True, False


def _decide(rule, state, sd, dist, ent, draft_len=None):
  arr = lambda x, dtype: jnp.asarray([x], dtype)
  draft_len = len(sd) if draft_len is None else draft_len
  return rule.decide(arr(sd, bool), arr(dist, jnp.float32), arr(ent, jnp.float32),
                     jnp.asarray([draft_len], jnp.int32), state)


def _thresholds(rule, state):
  tau_g, tau_v = rule.thresholds(state)
  return float(tau_g[0]), float(tau_v[0])


# ----------------------------------------------------------------------------- thresholds

def test_worked_trace():
  """adasd.md §6.3, the speculative test's outcome forced."""
  rule = registry.get("adaptive")
  s = rule.init_state(1)
  assert _thresholds(rule, s) == (math.inf, 0.0)
  n, s = _decide(rule, s, [ACC, ACC, REJ], [.05, .10, .60], [0.3, 0.4, 2.0])
  assert int(n[0]) == 2
  tau_g, tau_v = _thresholds(rule, s)
  assert tau_g == pytest.approx(2.0, abs=1e-6) and tau_v == pytest.approx(.3375, abs=1e-6)
  n, s = _decide(rule, s, [ACC, REJ, REJ], [.2, .3, .5], [0.1, 0.2, 1.0])
  assert int(n[0]) == 2                                   # position 2 JS-accepted (.3 < .3375)
  tau_g, tau_v = _thresholds(rule, s)
  assert tau_v == pytest.approx((.1625 + .55) / 2, abs=1e-6) and tau_v == pytest.approx(.35625)
  assert tau_g == pytest.approx(1.5, abs=1e-6)
  assert (int(s.n_acc[0]), int(s.n_rej[0])) == (4, 2)


def test_midpoint_is_not_count_weighted_and_the_appendix_variants():
  s = adaptive.AdaState(sum_d_acc=jnp.array([10.0]), n_acc=jnp.array([100]),
                        sum_d_rej=jnp.array([0.5]), sum_h_rej=jnp.array([3.0]),
                        n_rej=jnp.array([1]))
  want = {"midpoint": 0.30, "accepted_mean": 0.1, "pooled": 10.5 / 101}
  for variant, value in want.items():
    _, tau_v = _thresholds(registry.get("adaptive", tau_v_rule=variant), s)
    assert tau_v == pytest.approx(value, abs=1e-6), variant


def test_initial_thresholds_are_configurable():
  rule = registry.get("adaptive", tau_g_init=0.0, tau_v_init=0.25)
  assert _thresholds(rule, rule.init_state(2)) == (0.0, 0.25)
  n, s = _decide(rule, rule.init_state(1), [REJ, REJ], [.1, .3], [1.0, 1.0])
  assert int(n[0]) == 1                                   # .1 < tau_v_init, .3 is not
  assert _thresholds(rule, s) == pytest.approx((1.0, (.1 + .3) / 2))
  n, s = _decide(rule, s, [ACC, REJ], [.1, .9], [0.5, 3.0])
  assert _thresholds(rule, s) == pytest.approx((2.0, (.1 + .6) / 2))


def test_only_verified_drafts_are_recorded():
  """Drafts after the first rejection, and past draft_len, leave no trace (§6.5)."""
  rule = registry.get("adaptive")
  n, s = _decide(rule, rule.init_state(1), [ACC, REJ, ACC, ACC, ACC], [.1, .7, .2, .2, .2],
                 [1.0, 2.0, 9.0, 9.0, 9.0])
  assert int(n[0]) == 1
  assert (float(s.sum_d_acc[0]), int(s.n_acc[0])) == pytest.approx((.1, 1))
  assert (float(s.sum_d_rej[0]), float(s.sum_h_rej[0]), int(s.n_rej[0])) == pytest.approx(
      (.7, 2.0, 1))
  n, s = _decide(rule, rule.init_state(1), [ACC, ACC, REJ, REJ], [.1, .1, .8, .8],
                 [1.0, 1.0, 5.0, 5.0], draft_len=2)
  assert int(n[0]) == 2 and int(s.n_rej[0]) == 0 and int(s.n_acc[0]) == 2   # all offered accepted


def test_sd_only_recording_label():
  """record="sd": a JS-accepted draft that failed the speculative test joins the rejected lists."""
  rule = registry.get("adaptive", record="sd", tau_v_init=0.5)
  n, s = _decide(rule, rule.init_state(1), [ACC, REJ, REJ], [.1, .3, .9], [1.0, 2.0, 4.0])
  assert int(n[0]) == 2
  assert (int(s.n_acc[0]), int(s.n_rej[0])) == (1, 2)
  assert float(s.sum_h_rej[0]) == pytest.approx(6.0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_window=0), "min_window <= max_window"),
    (dict(min_window=3, max_window=2), "min_window <= max_window"),
    (dict(tau_v_rule="median"), "tau_v_rule"),
    (dict(record="sometimes"), "record must be one of"),
    (dict(min_window=0), r"1 <= min_window <= max_window, got min_window 0, max_window 20"),
    (dict(tau_g_init=math.nan), "tau_g_init must be a number .*got nan"),
    (dict(tau_v_init=math.nan), "tau_v_init must be a number .*got nan"),
])
def test_bad_hyperparameters_are_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    registry.get("adaptive", **kwargs)


# ----------------------------------------------------------------------------- the window

def _window(rule, q_steps, state):
  """Simulate the loop's drafting under the rule's length policy (drafting/length.py): the
  number of drafts each row offers (q_steps [S, B, V])."""
  policy = drafting.length.for_rule(rule)
  active = jnp.ones(q_steps.shape[1], bool)
  length = jnp.zeros(q_steps.shape[1], jnp.int32)
  for step in range(q_steps.shape[0]):
    keep = active & policy.keep(q_steps[step], jnp.int32(step), rule, state)
    length = length + keep
    active = keep & ~policy.stop_after(q_steps[step], jnp.int32(step), rule, state)
  return np.asarray(length)


def test_entropy_window_and_its_cap():
  """§6.4: with fixed tau_g the window ends with the first draft whose H > tau_g (that stopping
  draft is offered, §7), and never exceeds max_window = 20."""
  steps, rows, vocab = 26, 64, 6
  q = jax.nn.log_softmax(3.0 * jax.random.normal(jax.random.PRNGKey(0), (steps, rows, vocab)))
  q = q.at[:, :4].set(jnp.log(jnp.eye(vocab)[0] * 0.99 + 0.002))    # rows 0-3: confident always
  h = np.asarray(dv.entropy(q))                                      # [S, B]
  tau_g = 1.2
  state = adaptive.AdaState(sum_d_acc=jnp.zeros(rows), n_acc=jnp.zeros(rows, jnp.int32),
                            sum_d_rej=jnp.zeros(rows), sum_h_rej=jnp.full(rows, 2 * tau_g),
                            n_rej=jnp.full(rows, 2, jnp.int32))
  got = _window(registry.get("adaptive"), q, state)
  over = h > tau_g
  first = np.where(over.any(0), over.argmax(0) + 1, steps)           # the stopping draft counts
  np.testing.assert_array_equal(got, np.minimum(first, 20))
  assert ((h[0] > tau_g) & (got == 1)).any()
  assert (got[:4] == 20).all() and len(np.unique(got)) > 3
  fixed = _window(registry.get("adaptive", entropy_stop=False, max_window=5), q, state)
  assert (fixed == 5).all()
  fresh = _window(registry.get("adaptive"), q, adaptive.AdaState.zeros(rows))   # tau_g = inf
  assert (fresh == 20).all()


MODEL = testing.ToyAR(4, 6)
TARGET = MODEL.init_params(jax.random.PRNGKey(0))
DRAFT = {"table": testing.draft_table(jax.random.PRNGKey(1), TARGET["table"], "poor")}


def _spec(prompt, key, rule, gamma, max_new, draft=DRAFT, eos_id=0):
  return speculative.generate(MODEL, TARGET, MODEL, draft, prompt, key, rule=rule, gamma=gamma,
                              max_new_tokens=max_new, warp=Warp(), eos_id=eos_id)


def test_window_never_exceeds_twenty_drafts_with_a_larger_gamma():
  """Draft == target: everything is accepted and tau_g stays inf, so every block drafts
  min(20, budget - 1) (§2: K = min(K_max, N_max - len - 1)) although the loop allows gamma = 24:
  lengths 1 -> 22 -> 43 -> 50 with 20, 20 and 6 drafts."""
  gen = _spec(Prompt.from_lists([[1], [2, 3]]), jax.random.PRNGKey(0), registry.get("adaptive"),
              gamma=24, max_new=50, draft=TARGET, eos_id=None)
  st = gen.stats
  np.testing.assert_array_equal(st.blocks, [4, 4])                     # the first token + 3
  np.testing.assert_array_equal(st.drafted, [46, 46])
  np.testing.assert_array_equal(st.accepted, st.drafted)
  np.testing.assert_array_equal(gen.lengths, [50, 50])


def _pvalue(rule, n_rows=50_000):     # the JS rule's p-value is 0.0 at 50k rows
  gen = _spec(Prompt.from_lists([[1]] * n_rows), jax.random.PRNGKey(3), rule, gamma=3, max_new=4)
  law = testing.enumerate_law(MODEL, TARGET, [1], max_new_tokens=4, warp=Warp(), eos_id=0)
  st = gen.stats
  assert int(st.drafted.sum()) < 3 * int((st.blocks - 1).sum())        # windows really vary
  return testing.chi_square_pvalue(law, testing.sequence_counts(gen.tokens, gen.lengths))


def test_tau_v_zero_is_lossless_and_the_js_test_is_not():
  """§6.6: Gen-Only (tau_v = 0) with an active entropy window keeps the enumerated target law;
  the JS acceptance (tau_v = 0.4 from the start) fails the same test."""
  assert _pvalue(registry.get("adaptive", js_accept=False, tau_g_init=0.7)) > 1e-3
  assert _pvalue(registry.get("adaptive", tau_g_init=0.7, tau_v_init=0.4)) < 1e-6


def test_verify_only_with_tau_v_zero_is_exact_sd_token_for_token():
  """§6.6: no entropy stop, window K, tau_v = 0 -> exact SD with K drafts under the same keys."""
  prompt, key = Prompt.from_lists([[1], [2, 3], [3, 1, 2]]), jax.random.PRNGKey(4)
  want = _spec(prompt, key, registry.get("exact"), gamma=3, max_new=12)
  rule = registry.get("adaptive", entropy_stop=False, js_accept=False, max_window=3)
  got = _spec(prompt, key, rule, gamma=3, max_new=12)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  jax.tree_util.tree_map(np.testing.assert_array_equal, got.stats, want.stats)


def test_batch_rows_equal_single_row_runs():
  """§6.8: each row keeps its own history; a row of a batch equals a one-row run."""
  rows = [[1], [2, 3], [3, 1, 2]]
  keys = sampling.row_keys(jax.random.PRNGKey(5), len(rows))
  run = functools.partial(_spec, rule=registry.get("adaptive"), gamma=6, max_new=24, eos_id=None)
  batch = run(Prompt.from_lists(rows), keys)
  assert int(batch.stats.drafted.sum()) < 6 * int((batch.stats.blocks - 1).sum())
  for b, row in enumerate(rows):
    single = run(Prompt.from_lists([row], pad_to=3), keys[b:b + 1])
    np.testing.assert_array_equal(single.tokens[0], batch.tokens[b])
    for name in ("drafted", "accepted", "blocks"):
      assert int(getattr(single.stats, name)[0]) == int(getattr(batch.stats, name)[b]), name
