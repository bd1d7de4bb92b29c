"""SPRINTER's sequential loop against the checkable properties of docs/papers/sprinter.md §6."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling, testing
from specjax.decoding import autoregressive
from specjax.models import Prompt
from specjax.sprinter import loop, verifier as vlib
from specjax.sampling import Warp

V, EOS = 4, 0
BIGRAM = testing.ToyAR(V, 6)
TARGET = BIGRAM.init_params(jax.random.PRNGKey(0))
DRAFT = {"table": testing.draft_table(jax.random.PRNGKey(1), TARGET["table"], "poor")}
# Context-free p and q (ToyAR with constant tables): x is acceptable (q/p <= 1) iff x in {2, 3}.
P_CONST = np.array([0.1, 0.2, 0.3, 0.4])
Q_CONST = np.array([0.3, 0.25, 0.25, 0.2])
FLAT = testing.ToyAR(V, 1)
FLAT_P = {"table": testing.constant_table(np.log(P_CONST), V)}
FLAT_Q = {"table": testing.constant_table(np.log(Q_CONST), V)}
SAMPLES = 20_000


@dataclasses.dataclass(frozen=True)
class TokenVerifier:
  """Reading B on ToyAR, whose hidden state is the token fed: accept x with probability a[x]."""
  features: str = "B"
  hidden_size: int = 1

  def score(self, params, hidden, keys):
    token = hidden[:, 0].astype(jnp.int32)
    u = jax.vmap(jax.random.uniform)(keys)
    return (u < params["a"][token]).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class PrevVerifier(TokenVerifier):
  """Reading A on ToyAR: the hidden state is the last committed token; accept w.p. a[prev]."""
  features: str = "A"


@dataclasses.dataclass(frozen=True)
class RateVerifier:
  """Accept with a constant probability a, whatever the hidden state (any model)."""
  features: str = "A"
  hidden_size: int = 1

  def score(self, params, hidden, keys):
    del hidden
    return (jax.vmap(jax.random.uniform)(keys) < params["a"]).astype(jnp.float32)


def _gen(verifier, a, prompt, key, *, model=BIGRAM, target=TARGET, draft=DRAFT, **kwargs):
  kwargs = {"threshold": 0.5, "gamma_max": 3, "max_new_tokens": 6, "warp": Warp(),
            "eos_id": EOS, **kwargs}
  return loop.generate(model, target, model, draft, verifier, {"a": jnp.asarray(a)},
                             prompt, key, **kwargs)


def _probs(table) -> np.ndarray:
  p = np.exp(np.asarray(table, np.float64))
  return p / p.sum(-1, keepdims=True)


def general_law_table(p_table, q_table, a) -> np.ndarray:
  """log p_out per context (§3 general form) for accept probability a[x]."""
  p, q = _probs(p_table), _probs(q_table)
  a = np.broadcast_to(np.asarray(a, np.float64), p.shape)
  excess = np.maximum(q - p, 0.0)
  short = np.maximum(p - q, 0.0)
  residual = short / np.maximum(short.sum(-1, keepdims=True), 1e-300)
  out = a * q + (1 - a) * np.minimum(p, q) + residual * ((1 - a) * excess).sum(-1, keepdims=True)
  return np.log(np.maximum(out, 1e-300))


def _pvalue(model, table, gen, prompt_row, max_new, eos=EOS) -> float:
  law = testing.enumerate_law(model, {"table": jnp.asarray(table)}, prompt_row,
                              max_new_tokens=max_new, warp=Warp(), eos_id=eos)
  return testing.chi_square_pvalue(law, testing.sequence_counts(gen.tokens, gen.lengths))


def _many(row):
  return Prompt.from_lists([row] * SAMPLES)


# ----------------------------------------------------------------------------- laws

A_TOKEN = np.array([0.9, 0.2, 0.6, 0.35])


def test_one_step_law_for_a_given_accept_probability():
  gen = _gen(TokenVerifier(), A_TOKEN, _many([1, 2]), jax.random.PRNGKey(0), max_new_tokens=3)
  table = general_law_table(TARGET["table"], DRAFT["table"], A_TOKEN)
  assert _pvalue(BIGRAM, table, gen, [1, 2], 3) > 1e-3


def test_broken_residual_fails_the_same_test(monkeypatch):
  """Power: resampling from p instead of the residual must be detected."""
  monkeypatch.setattr(loop.base, "residual_log_probs", lambda p, q: p)
  gen = _gen(TokenVerifier(), A_TOKEN, _many([1, 2]), jax.random.PRNGKey(0), max_new_tokens=3,
             gamma_max=4)        # another static setup (the chunk's width), the same law: retrace
  table = general_law_table(TARGET["table"], DRAFT["table"], A_TOKEN)
  assert _pvalue(BIGRAM, table, gen, [1, 2], 3) < 1e-6


def _flat_gen(a, key, verifier=TokenVerifier(), **kwargs):
  return _gen(verifier, a, _many([1]), key, model=FLAT, target=FLAT_P, draft=FLAT_Q,
              max_new_tokens=3, eos_id=None, **kwargs)


def test_oracle_verifier_gives_exactly_p_and_lambda_above_one_does_not():
  oracle = (Q_CONST <= P_CONST).astype(np.float32)
  table = np.log(np.broadcast_to(P_CONST, (1, V, V)))
  assert _pvalue(FLAT, table, _flat_gen(oracle, jax.random.PRNGKey(1)), [1], 3, None) > 1e-3
  lenient = (Q_CONST <= 1.5 * P_CONST).astype(np.float32)        # also accepts x = 1
  assert _pvalue(FLAT, table, _flat_gen(lenient, jax.random.PRNGKey(1)), [1], 3, None) < 1e-6


@pytest.mark.parametrize("eta_tp", [0.6, 0.2])
def test_class_rate_verifier_mixes_p_and_q_and_alpha_matches(eta_tp):
  eta_fp = 0.3
  a = np.where(Q_CONST <= P_CONST, eta_tp, eta_fp)
  gen = _flat_gen(a, jax.random.PRNGKey(2))
  mix = (1 - eta_fp) * P_CONST + eta_fp * Q_CONST                    # Thm 3.1
  assert _pvalue(FLAT, np.log(np.broadcast_to(mix, (1, V, V))), gen, [1], 3, None) > 1e-3
  d_tv = np.maximum(Q_CONST - P_CONST, 0).sum()
  assert np.abs(mix - P_CONST).sum() / 2 == pytest.approx(eta_fp * d_tv)
  assert gen.stats.alpha() == pytest.approx(1 - (1 - eta_fp) * d_tv, abs=0.01)   # Thm A.4


def test_reading_a_steps_are_exactly_q_or_exactly_p():
  """The decision reads h_(t-1) (here the previous token), never x: accepted steps follow q,
  rejected ones p."""
  accept_prev = np.array([1.0, 0.0, 1.0, 0.0])
  gen = _gen(PrevVerifier(), accept_prev, _many([1, 2]), jax.random.PRNGKey(3), max_new_tokens=3,
             gamma_max=None)
  mixed = np.where(accept_prev[None, :, None] > 0, np.asarray(DRAFT["table"]),
                   np.asarray(TARGET["table"]))
  assert _pvalue(BIGRAM, mixed, gen, [1, 2], 3) > 1e-3


def test_always_reject_gives_p_with_one_target_call_per_token():
  gen = _gen(PrevVerifier(), np.zeros(V), _many([1, 2]), jax.random.PRNGKey(4), max_new_tokens=3)
  assert _pvalue(BIGRAM, TARGET["table"], gen, [1, 2], 3) > 1e-3
  st = gen.stats
  np.testing.assert_array_equal(st.target_calls, gen.lengths)
  np.testing.assert_array_equal(st.rejections, gen.lengths)
  np.testing.assert_array_equal(st.target_tokens, gen.lengths)
  assert int(st.forced.sum()) == 0


# ----------------------------------------------------------------------------- mechanics

ROWS = [[1], [2, 3], [3, 1, 2, 2], [1, 1, 1], [2], [3, 3], [1, 2, 3, 1, 2], [2, 2]]


def test_always_accept_equals_draft_only_sampling():
  keys = sampling.row_keys(jax.random.PRNGKey(5), len(ROWS))
  prompt = Prompt.from_lists(ROWS)
  gen = _gen(PrevVerifier(), np.ones(V), prompt, keys, gamma_max=None, max_new_tokens=8)
  ref = autoregressive.generate(BIGRAM, DRAFT, prompt, keys, max_new_tokens=8, warp=Warp(),
                                eos_id=EOS)
  np.testing.assert_array_equal(gen.tokens, ref.tokens)
  np.testing.assert_array_equal(gen.lengths, ref.lengths)
  assert int(gen.stats.target_calls.sum()) == 0
  np.testing.assert_array_equal(gen.stats.target_passes, 1)        # the prefill only


@pytest.mark.parametrize("cap", [0, 2, 3])
def test_forced_calls_every_cap_plus_one_tokens(cap):
  n = 10
  gen = _gen(PrevVerifier(), np.ones(V), Prompt.from_lists(ROWS), jax.random.PRNGKey(6),
             gamma_max=cap, max_new_tokens=n, eos_id=None)
  st = gen.stats
  np.testing.assert_array_equal(st.forced, n // (cap + 1))
  np.testing.assert_array_equal(st.target_calls, n // (cap + 1))
  np.testing.assert_array_equal(st.target_tokens, (n // (cap + 1)) * (cap + 1))
  np.testing.assert_array_equal(st.blocks, -(-n // (cap + 1)))      # rounds, last one partial


def test_counters_are_consistent():
  gen = _gen(TokenVerifier(), A_TOKEN, Prompt.from_lists(ROWS * 4), jax.random.PRNGKey(7),
             gamma_max=2, max_new_tokens=12)
  st = jax.tree_util.tree_map(np.asarray, gen.stats)
  np.testing.assert_array_equal(st.target_calls, st.rejections + st.forced)
  np.testing.assert_array_equal(st.target_passes, 1 + st.target_calls)
  np.testing.assert_array_equal(st.emitted, gen.lengths)
  np.testing.assert_array_equal(st.drafted, gen.lengths)
  assert np.all((st.blocks >= st.target_calls) & (st.blocks <= st.target_calls + 1))
  # every call ingests its round: N verifier accepts + the previous round's last token
  assert np.all(st.target_tokens <= st.emitted) and np.all(st.target_tokens >= st.target_calls)
  assert np.all(st.target_calls <= st.batched_calls)
  assert st.forced.sum() > 0 and st.rejections.sum() > 0


def test_run_lengths_follow_the_geometric_law():
  """A rate-eta verifier: each step calls the target w.p. 1 - eta, runs are geometric, so the
  tokens ingested by calls are n minus the trailing run (P(run = k) = eta^k (1 - eta), k < n)."""
  eta, n, rows = 0.6, 40, 1000
  gen = _gen(RateVerifier(), eta, Prompt.from_lists([[1]] * rows), jax.random.PRNGKey(8),
             gamma_max=None, max_new_tokens=n, eos_id=None)
  st = gen.stats
  k = np.arange(n)
  trailing = np.sum(k * eta ** k * (1 - eta)) + n * eta ** n
  assert float(st.target_calls.mean()) == pytest.approx(n * (1 - eta), rel=0.02)
  assert float(st.target_tokens.mean()) == pytest.approx(n - trailing, rel=0.02)
  assert float(st.blocks.mean()) == pytest.approx(n * (1 - eta) + 1 - (1 - eta), rel=0.02)


def test_batch_rows_equal_single_row_runs():
  keys = sampling.row_keys(jax.random.PRNGKey(9), len(ROWS))
  kwargs = dict(gamma_max=2, max_new_tokens=6)
  batch = _gen(TokenVerifier(), A_TOKEN, Prompt.from_lists(ROWS), keys, **kwargs)
  assert len(set(np.asarray(batch.stats.target_calls).tolist())) > 1   # ragged target use
  for b, row in enumerate(ROWS):
    single = _gen(TokenVerifier(), A_TOKEN, Prompt.from_lists([row], pad_to=5), keys[b:b + 1],
                  **kwargs)
    np.testing.assert_array_equal(single.tokens[0], batch.tokens[b])
    assert int(single.lengths[0]) == int(batch.lengths[b])
    for f in dataclasses.fields(single.stats):
      if f.name != "batched_calls":                 # counts the other rows' calls too
        assert int(getattr(single.stats, f.name)[0]) == int(getattr(batch.stats, f.name)[b]), f


def test_debug_mode_equals_jitted_loop():
  prompt, key = Prompt.from_lists(ROWS), jax.random.PRNGKey(10)
  fast = _gen(TokenVerifier(), A_TOKEN, prompt, key)
  slow = _gen(TokenVerifier(), A_TOKEN, prompt, key, debug=True)
  np.testing.assert_array_equal(fast.tokens, slow.tokens)
  jax.tree_util.tree_map(np.testing.assert_array_equal, fast.stats, slow.stats)


@pytest.mark.parametrize("features", ["A", "B"])
def test_lazy_target_chunks_and_draft_state_equal_a_full_recompute(features):
  """Real decoders: after every step the target cache (filled chunk by chunk, padded) and the
  draft's q / hidden state (re-fed after replacements under reading B) equal a fresh prefill of
  the committed stream."""
  target, tparams = testing.tiny_decoder(seed=0)
  draft, dparams = testing.tiny_decoder(seed=1)
  verifier = RateVerifier(features=features, hidden_size=draft.hidden_size)
  rows, width = [[3, 5, 7], [4], [9, 8, 7, 6, 5]], 24
  prompt = Prompt.from_lists(rows)
  setup, knobs = loop.split_knobs(loop._validate(
      target, draft, verifier, prompt, threshold=0.5, gamma_max=3, max_new_tokens=10, warp=Warp(),
      eos_id=None, max_len=None))
  params = (tparams, dparams, {"a": jnp.float32(0.6)})
  state, anchors = loop._init_jit(setup, params, prompt,
                                  sampling.row_keys(jax.random.PRNGKey(11), 3), knobs)
  fresh = jax.jit(lambda m, p, pr: m.prefill(p, pr, m.init_cache(3, width)), static_argnums=0)
  for _ in range(10):
    state = loop._step_jit(setup, params, anchors, state, knobs)
    streams = [r + np.asarray(state.tokens[b, :int(state.lengths[b])]).tolist()
               for b, r in enumerate(rows)]
    full = Prompt.from_lists(streams, pad_to=width)
    _, _, tfull = fresh(target, tparams, full)
    q_logits, h, _ = fresh(draft, dparams, full)
    for b in range(3):
      t = int(state.target_cache.lengths[b])
      np.testing.assert_allclose(state.target_cache.k[:, b, :, :t], tfull.k[:, b, :, :t],
                                 atol=1e-4)
      np.testing.assert_allclose(state.target_cache.v[:, b, :, :t], tfull.v[:, b, :, :t],
                                 atol=1e-4)
    np.testing.assert_allclose(state.q_logp, Warp().log_probs(q_logits), atol=1e-4)
    np.testing.assert_allclose(state.hidden, h, atol=1e-4)
  assert int(state.stats.target_calls.sum()) > 0


# ----------------------------------------------------------------------------- input

def test_bad_gamma_max_and_verifier_size_are_refused():
  prompt = Prompt.from_lists(ROWS)
  with pytest.raises(ValueError, match="gamma_max"):
    _gen(PrevVerifier(), np.ones(V), prompt, jax.random.PRNGKey(0), gamma_max=-1)
  with pytest.raises(ValueError, match="hidden states of size 7"):
    _gen(PrevVerifier(hidden_size=7), np.ones(V), prompt, jax.random.PRNGKey(0))


def test_a_workdir_without_a_verifier_is_refused_with_its_path(tmp_path):
  with pytest.raises(vlib.VerifierNotFoundError, match="no verifier in") as info:
    vlib.load(tmp_path / "nothing")
  assert info.value.path == tmp_path / "nothing" / "verifier.json"
  assert isinstance(info.value, FileNotFoundError)


@pytest.mark.parametrize("text, reason", [
    ("{not json", "not JSON"), ("[1]", "no 'verifier' object"),
    ('{"verifier": {"hidden_size": 8, "width": 3}}', "bad 'verifier' entry"),
    ('{"verifier": {"hidden_size": 0}}', "bad 'verifier' entry")])
def test_a_damaged_verifier_file_is_named(tmp_path, text, reason):
  (tmp_path / "verifier.json").write_text(text)
  with pytest.raises(vlib.VerifierFileError, match=reason) as info:
    vlib.load(tmp_path)
  assert str(info.value).startswith(f"the verifier file {tmp_path / 'verifier.json'} is damaged")


def test_warp_threshold_and_limit_are_traced_not_compiled_in():
  """Another temperature, threshold or max_new_tokens of the same bucket (16) reuses the compiled
  loop, and each value is used: a row stops at exactly its limit."""
  prompt, key = Prompt.from_lists(ROWS), jax.random.PRNGKey(11)
  first = _gen(RateVerifier(), 0.5, prompt, key, max_new_tokens=9, eos_id=None)
  before = loop.run._cache_size()
  other = _gen(RateVerifier(), 0.5, prompt, key, max_new_tokens=12, eos_id=None, threshold=0.7,
               warp=Warp(temperature=0.5))
  assert loop.run._cache_size() == before
  assert np.asarray(first.lengths).tolist() == [9] * len(ROWS)
  assert np.asarray(other.lengths).tolist() == [12] * len(ROWS)
  assert not np.array_equal(np.asarray(first.tokens)[:, :9], np.asarray(other.tokens)[:, :9])
