"""Fuzzy speculative decoding (FSD), papers/fsd.md §5: reference divergences through the rule,
T = 0 / T = inf, monotonicity in T, the rejection law (warped p, not the residual), the random
ablation, per-row thresholds and batch invariance."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats
from scipy.spatial.distance import jensenshannon
from scipy.special import rel_entr

from specjax import divergences as dv
from specjax import sampling, testing
from specjax.acceptance import base, fuzzy, registry
from specjax.decoding import autoregressive, speculative
from specjax.models import Prompt
from specjax.sampling import Warp

NAMES = ("kl", "rkl", "js", "js_m", "tv")
N_ROWS = 100_000


def _packed(rule, probs, positions, warp=Warp()):
  """[B, V] probabilities -> the rule's packed log-probs [B, positions, 2V]."""
  with np.errstate(divide="ignore"):
    logits = jnp.log(jnp.asarray(probs, jnp.float32))
  logits = jnp.broadcast_to(logits[:, None], (logits.shape[0], positions, logits.shape[-1]))
  return rule.p_log_probs(logits, warp)


def _verify(rule, p, q, draft_tokens=None, keys=None, warp=Warp()):
  """One block with K = number of positions in q ([B, K, V] probabilities or [B, V] for K=1)."""
  q = np.asarray(q)[:, None] if np.ndim(q) == 2 else np.asarray(q)
  batch, num, _ = q.shape
  with np.errstate(divide="ignore"):
    q_logp = rule.q_log_probs(jnp.log(jnp.asarray(q, jnp.float32)), warp)
  p_logp = _packed(rule, p, num + 1, warp)
  tokens = jnp.zeros((batch, num), jnp.int32) if draft_tokens is None else draft_tokens
  keys = sampling.row_keys(jax.random.PRNGKey(0), batch) if keys is None else keys
  return _jit_verify(rule, tokens, jnp.full((batch,), num, jnp.int32), q_logp, p_logp, keys)


@functools.partial(jax.jit, static_argnums=0)
def _jit_verify(rule, *args):
  return rule.verify(*args, ())


# ----------------------------------------------------------------------------- divergences

@pytest.mark.parametrize("p,q,expected", [
    ((.5, .5), (.9, .1), (.510826, .368064, .101749, .117973, .4)),
    ((.7, .2, .1), (.1, .2, .7), (1.167546, 1.167546, .253102, .330671, .6)),
])
def test_reference_values_through_divergences_and_the_rule(p, q, expected):
  """fsd.md §5.1: the values to 1e-6, and the rule accepts just above them and rejects below."""
  for name, want in zip(NAMES, expected):
    assert float(dv.get(name)(jnp.log(jnp.array(p)), jnp.log(jnp.array(q)))) == pytest.approx(
        want, abs=1e-6)
    rule = registry.get("fuzzy", divergence=name, threshold=(want - 1e-6, want + 1e-6))
    got = rule.divergences(_packed(rule, [p], 1), _packed(rule, [q], 1))
    assert float(got[0, 0]) == pytest.approx(want, abs=1e-6), name
    n, _, _ = _verify(rule, [p, p], [q, q])
    assert list(np.asarray(n)) == [0, 1], name


def test_top_k_reference_values_through_the_rule():
  """fsd.md §5.2: k = 2 lumped values, and k = V equals the full-vocabulary values."""
  p, q = [(.5, .3, .15, .05)], [(.25, .25, .1, .4)]
  lumped = (.218012, .239278, .055582, .058740, .3)
  full = (.358118, .572363, .102363, .130257, .35)
  for name, want_k, want_full in zip(NAMES, lumped, full):
    for k, want in ((2, want_k), (4, want_full)):
      rule = registry.get("fuzzy", divergence=f"{name}_topk", k=k)
      got = float(rule.divergences(_packed(rule, p, 1), _packed(rule, q, 1))[0, 0])
      assert got == pytest.approx(want, abs=1e-6), (name, k)
      assert got <= float(registry.get("fuzzy", divergence=name).divergences(
          _packed(rule, p, 1), _packed(rule, q, 1))[0, 0]) + 1e-6


def test_rule_divergences_agree_with_scipy():
  rng = np.random.default_rng(0)
  p, q = rng.dirichlet(np.ones(9), size=(2, 32))
  m = (p + q) / 2
  want = dict(kl=rel_entr(p, q).sum(-1), rkl=rel_entr(q, p).sum(-1),
              js=jensenshannon(p, q, axis=-1) ** 2,
              js_m=0.5 * rel_entr(m, p).sum(-1) + 0.5 * rel_entr(m, q).sum(-1),
              tv=0.5 * np.abs(p - q).sum(-1), js_distance=jensenshannon(p, q, base=2, axis=-1))
  for name, ref in want.items():
    rule = registry.get("fuzzy", divergence=name)
    got = rule.divergences(_packed(rule, p, 1), _packed(rule, q, 1))[:, 0]
    np.testing.assert_allclose(got, ref, atol=2e-6, rtol=1e-5, err_msg=name)


def test_divergence_uses_the_raw_softmax_whatever_the_warp():
  """The authors' code thresholds the temperature-1 distributions: a greedy warp (one-hot p, q)
  must not change d; divergence_on="warped" does use the warped ones."""
  z = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 1, 7))
  raw = registry.get("fuzzy")
  for warp in (Warp(), Warp(temperature=0.0), Warp(temperature=0.6, top_k=3, top_p=0.9)):
    got = raw.divergences(raw.p_log_probs(z[0], warp), raw.q_log_probs(z[1], warp))
    np.testing.assert_allclose(got, dv.js_m(z[0], z[1]), rtol=1e-6, atol=1e-7)
  warped = registry.get("fuzzy", divergence_on="warped", divergence="js")
  greedy = Warp(temperature=0.0)
  got = warped.divergences(warped.p_log_probs(z[0], greedy), warped.q_log_probs(z[1], greedy))
  same = jnp.argmax(z[0], -1) == jnp.argmax(z[1], -1)
  np.testing.assert_allclose(got, jnp.where(same, 0.0, math.log(2)), atol=1e-6)


# ----------------------------------------------------------------------------- decisions

def test_accepted_count_is_monotone_in_the_threshold():
  """§5.7: for fixed logits, n(T) is non-decreasing (one batch: every row its own T)."""
  grid = (0.0, 0.01, 0.03, 0.1, 0.2, 0.3, 0.5, 0.8, 1.2, 2.0, 5.0, math.inf)
  k, vocab, sets = 5, 6, 8
  z = jax.random.normal(jax.random.PRNGKey(1), (2, sets, k + 1, vocab)) * 1.5
  tiled = lambda a: jnp.repeat(a, len(grid), axis=0)                  # [sets * |grid|, ...]
  for name in ("js_m", "kl", "tv_topk"):
    rule = registry.get("fuzzy", divergence=name, k=3, threshold=grid * sets)
    p_logp = rule.p_log_probs(tiled(z[0]), Warp())
    q_logp = rule.q_log_probs(tiled(z[1, :, :k]), Warp())
    batch = sets * len(grid)
    n, _, _ = _jit_verify(rule, jnp.zeros((batch, k), jnp.int32), jnp.full((batch,), k), q_logp,
                          p_logp, sampling.row_keys(jax.random.PRNGKey(0), batch))
    n = np.asarray(n).reshape(sets, len(grid))
    assert (np.diff(n, axis=1) >= 0).all(), name
    assert (n[:, 0] == 0).all() and (n[:, -1] == k).all(), name      # T = 0 and T = inf
    assert len(np.unique(n)) > 2, name                                 # a real sweep


def test_draft_token_is_never_looked_at():
  rule = registry.get("fuzzy", threshold=0.2)
  p, q = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(2), (2, 64, 5)), axis=-1)
  tokens = jax.random.randint(jax.random.PRNGKey(4), (2, 64, 1), 0, 5)
  n0, _, _ = _verify(rule, p, q, tokens[0])
  n1, _, _ = _verify(rule, p, q, tokens[1])
  np.testing.assert_array_equal(n0, n1)
  assert 0 < int(n0.sum()) < 64


@pytest.mark.parametrize("inclusive", [False, True])
def test_threshold_infinity_accepts_drafts_of_infinite_divergence(inclusive):
  """p and q with disjoint supports: KL is inf both ways. T = inf accepts all K = 3 drafts, a
  huge finite T rejects them, as did the old test d < T at T = inf (d = inf: inf < inf is False)."""
  p, q = [[.5, .5, 0, 0]] * 2, [[0, 0, .5, .5]] * 2
  q3 = np.repeat(np.asarray(q)[:, None], 3, axis=1)                     # [2, K=3, 4]
  for name in ("kl", "rkl"):
    rule = registry.get("fuzzy", divergence=name, threshold=(math.inf, 1e30), inclusive=inclusive)
    d = rule.divergences(_packed(rule, p, 1), _packed(rule, q, 1))
    assert np.isposinf(np.asarray(d)).all(), name
    n, _, _ = _verify(rule, p, q3)
    assert list(np.asarray(n)) == [3, 0], name


@dataclasses.dataclass(frozen=True)
class _ResidualMutant(fuzzy.Fuzzy):
  """Mutant: after a rejection it samples norm(max(0, p - q)) as exact SD does."""

  def rejection_log_probs(self, p_n, q_n):
    return base.residual_log_probs(p_n, q_n)


P6 = np.array([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
Q6 = np.array([0.05, 0.3, 0.1, 0.3, 0.05, 0.2])
WARP6 = Warp(temperature=0.7, top_k=5)


@functools.partial(jax.jit, static_argnums=0)
def _next_tokens(rule, key):
  """N_ROWS one-draft blocks on fixed p, q -> (n [N], next token [N])."""
  q_logp = rule.q_log_probs(jnp.broadcast_to(jnp.log(Q6), (N_ROWS, 1, 6)), WARP6)
  p_logp = rule.p_log_probs(jnp.broadcast_to(jnp.log(P6), (N_ROWS, 2, 6)), WARP6)
  n, nxt, _ = rule.verify(jnp.zeros((N_ROWS, 1), jnp.int32), jnp.ones(N_ROWS, jnp.int32), q_logp,
                          p_logp, sampling.row_keys(key, N_ROWS), ())
  return n, nxt


def _rejection_pvalue(rule):
  n, tokens = _next_tokens(rule, jax.random.PRNGKey(5))
  assert int(n.sum()) == 0                                             # T = 0: always rejected
  law = np.exp(np.asarray(WARP6.log_probs(jnp.log(jnp.asarray(P6))), np.float64))
  observed = np.bincount(np.asarray(tokens), minlength=6)
  if observed[law == 0].any():
    return 0.0
  keep = law > 0
  return stats.chisquare(observed[keep], law[keep] / law[keep].sum() * N_ROWS).pvalue


def test_rejection_samples_the_warped_target_not_the_residual():
  """§5.9: with n forced to 0 the emitted token follows warp(p_1); the residual mutant fails."""
  assert _rejection_pvalue(registry.get("fuzzy", threshold=0.0)) > 1e-3
  assert _rejection_pvalue(_ResidualMutant(threshold=0.0)) < 1e-6


def test_random_mode_mean_accepted_is_the_geometric_sum():
  """§5.10: accept each draft iff u <= T -> E[n] = sum_{j<=L} T^j."""
  t, k, rows = 0.6, 4, 20_000
  rule = registry.get("fuzzy_random", threshold=t)
  assert rule.mode == "random"
  p = np.full((rows, 5), 0.2)
  q = np.tile(np.eye(5)[None, :1] * 0.9 + 0.02, (rows, k, 1))           # far from p: irrelevant
  n, _, _ = _verify(rule, p, q)
  want = sum(t ** j for j in range(1, k + 1))
  sd = float(np.std(np.asarray(n)))
  assert abs(float(n.mean()) - want) < 4 * sd / math.sqrt(rows)


@pytest.mark.parametrize("name,kwargs,match", [
    ("fuzzy", dict(threshold=-0.1), r"threshold must be >= 0 .*got -0.1"),
    ("fuzzy", dict(threshold=math.nan), r"threshold must be >= 0 .*got nan"),
    ("fuzzy", dict(threshold=(0.1, math.nan)), r"threshold must be >= 0 .*got \(0.1, nan\)"),
    ("fuzzy", dict(threshold=()), "empty"),
    ("fuzzy", dict(divergence="hellinger"), "unknown divergence"),
    ("fuzzy", dict(divergence="tv_topk", k=-2), r"fuzzy k \(top-k size .* >= 1, got -2"),
    ("fuzzy", dict(mode="oracle"), "mode must be one of"),
    ("fuzzy", dict(mode="random", threshold=2.0), r"threshold .* in \[0, 1\], got 2.0"),
    ("fuzzy", dict(divergence_on="logits"), "divergence_on must be one of"),
    ("fuzzy_random", dict(threshold=1.5), r"fuzzy_random threshold .* in \[0, 1\], got 1.5"),
    ("fuzzy_random", dict(threshold=math.inf), r"in \[0, 1\], got inf"),
    ("fuzzy_random", dict(threshold=(0.5, 1.2)), r"in \[0, 1\], got \(0.5, 1.2\)"),
    ("fuzzy_random", dict(threshold=-0.5), r"threshold must be >= 0 .*got -0.5"),
])
def test_bad_hyperparameters_are_refused(name, kwargs, match):
  with pytest.raises(ValueError, match=match):
    registry.get(name, **kwargs)


def test_edge_hyperparameters_are_accepted():
  assert registry.get("fuzzy_random", threshold=(0.0, 1.0)).threshold == (0.0, 1.0)
  assert registry.get("fuzzy", threshold=math.inf).threshold == math.inf
  assert registry.get("fuzzy", divergence="tv_topk", k=1).k == 1


def test_threshold_list_becomes_a_hashable_tuple_and_must_match_the_batch():
  rule = registry.get("fuzzy", threshold=[0.1, 0.2])
  assert rule.threshold == (0.1, 0.2) and hash(rule) == hash(fuzzy.Fuzzy(threshold=(0.1, 0.2)))
  with pytest.raises(ValueError, match="2 values for a batch of 3 rows"):
    rule.thresholds(3)


# ----------------------------------------------------------------------------- end to end

@functools.lru_cache(maxsize=None)
def _tiny_pair():
  target, target_params = testing.tiny_decoder(seed=0)
  draft, draft_params = testing.tiny_decoder(seed=1, d_model=16, num_layers=1)
  return target, target_params, draft, draft_params


def test_threshold_zero_is_greedy_target_decoding_and_infinity_accepts_everything():
  """§5.4 and §5.5 in one batch with per-row thresholds (0, 0, inf, inf), greedy target."""
  target, tparams, draft, dparams = _tiny_pair()
  rows = [[5, 6, 7], [9, 3]]
  prompt = Prompt.from_lists(rows * 2, pad_to=4)
  gamma, max_new = 3, 14
  greedy = dict(max_new_tokens=max_new, warp=Warp(temperature=0.0), eos_id=None)
  want = autoregressive.generate(target, tparams, Prompt.from_lists(rows, pad_to=4),
                                 jax.random.PRNGKey(0), **greedy)
  rule = registry.get("fuzzy", threshold=(0.0, 0.0, math.inf, math.inf))
  got = speculative.generate(target, tparams, draft, dparams, prompt, jax.random.PRNGKey(1),
                             rule=rule, gamma=gamma, **greedy)
  st = got.stats
  np.testing.assert_array_equal(got.tokens[:2], want.tokens)
  np.testing.assert_array_equal(st.accepted[:2], 0)
  # Every draft is accepted, but counts stop at what was committed: the last block, cut by
  # max_new_tokens after `rest` tokens, accepted only those (13 = 3 blocks of 4 + 1 -> 3*3 + 1).
  full, rest = divmod(max_new - 1, gamma + 1)
  np.testing.assert_array_equal(st.accepted[2:], full * gamma + min(rest, gamma))
  np.testing.assert_array_equal(st.verified[2:], st.accepted[2:])
  np.testing.assert_array_equal(st.drafted[2:], (full + (rest > 0)) * gamma)
  blocks = 1 + math.ceil((max_new - 1) / (gamma + 1))                  # prefill + full blocks
  np.testing.assert_array_equal(st.target_passes[2:], blocks)


def test_batch_rows_with_their_own_thresholds_equal_single_row_runs():
  """§5.12: row b (threshold T_b, key k_b) of a batch equals a one-row run (sampled decoding)."""
  model = testing.ToyAR(5, 6)
  target = model.init_params(jax.random.PRNGKey(0))
  draft = {"table": testing.draft_table(jax.random.PRNGKey(1), target["table"], "poor")}
  rows, thresholds = [[1], [2, 3]], (0.05, 0.6)
  keys = sampling.row_keys(jax.random.PRNGKey(3), len(rows))
  run = functools.partial(speculative.generate, model, target, model, draft, gamma=3,
                          max_new_tokens=10, warp=Warp(), eos_id=0)
  batch = run(Prompt.from_lists(rows), keys, rule=registry.get("fuzzy", threshold=thresholds))
  assert len({int(a) for a in batch.stats.accepted}) > 1              # thresholds really differ
  for b, (row, t) in enumerate(zip(rows, thresholds)):
    single = run(Prompt.from_lists([row], pad_to=2), keys[b:b + 1],
                 rule=registry.get("fuzzy", threshold=t))
    np.testing.assert_array_equal(single.tokens[0], batch.tokens[b])
    assert int(single.stats.accepted[0]) == int(batch.stats.accepted[b])


# ----------------------------------------------------------------------------- eval/tradeoff.py

def test_tradeoff_parsing_and_settings():
  from eval import tradeoff
  assert tradeoff.parse_values("0, 0.1,inf") == [0.0, 0.1, math.inf]
  with pytest.raises(ValueError, match="comma-separated numbers"):
    tradeoff.parse_values("0.1;0.2")
  assert tradeoff.parse_sets(["divergence=js", "k=20", "sample_draft=True"]) == {
      "divergence": "js", "k": 20, "sample_draft": True}
  with pytest.raises(ValueError, match="NAME=VALUE"):
    tradeoff.parse_sets(["js"])
  points = tradeoff.settings("fuzzy", [0.0, 0.5], 4, {"divergence": "tv"}, [0.3])
  assert [(p.curve, p.value) for p in points] == [
      ("target", ""), ("draft", ""), ("fuzzy", 0.0), ("fuzzy", 0.5), ("fuzzy_random", 0.3)]
  assert points[3].rule == fuzzy.Fuzzy(threshold=0.5, divergence="tv") and points[3].gamma == 4
  assert points[4].rule.mode == "random" and points[4].rule.threshold == 0.3
  lenient = tradeoff.settings("lenient", [0.1], 3, {"kind": "exp"}, [])
  assert lenient[-1].rule == registry.get("lenient", eps=0.1, kind="exp")
  ada = tradeoff.settings("adaptive", [], 4, {}, [])
  assert [(p.curve, p.gamma) for p in ada[2:]] == [("exact", 4), ("adasd", 20), ("gen_only", 20),
                                                   ("verify_only", 5)]
  with pytest.raises(ValueError, match="--values is not used"):
    tradeoff.settings("adaptive", [0.1], 4, {}, [])
  with pytest.raises(ValueError, match="needs --values"):
    tradeoff.settings("fuzzy", [], 4, {}, [])
  with pytest.raises(ValueError, match="--rule must be one of"):
    tradeoff.settings("exact", [1.0], 4, {}, [])
  with pytest.raises(ValueError, match=r"--set threshold=\.\.\. sets what --rule fuzzy sweeps"):
    tradeoff.settings("fuzzy", [0.1], 4, {"threshold": 0.5}, [])       # was overridden silently
  assert tradeoff.check_quality_key(None, "rouge") == "rouge2"
  assert tradeoff.check_quality_key("rougeL", "rouge") == "rougeL"
  with pytest.raises(ValueError, match="--quality_key bogus: the task's metric rouge reports "
                                       "rouge1, rouge2, rougeL"):
    tradeoff.check_quality_key("bogus", "rouge")     # was a KeyError after loading and decoding
  assert tradeoff.draft_share({"accepted": 30, "emitted": 40}) == 0.75


class _CharTokenizer:
  """ids 1..5 <-> 'abcde', 0 is EOS and padding."""
  eos_id, pad_id, bos_id = 0, 0, None

  def encode(self, text):
    return ["abcde".index(c) + 1 for c in text]

  def decode(self, ids):
    return " ".join("abcde"[i - 1] for i in ids if i > 0)


def test_tradeoff_sweep_end_to_end_on_a_toy_pair(tmp_path):
  import csv
  import json
  from pathlib import Path

  from eval import tradeoff
  from specjax.app import builders, methods, resolve
  model = testing.ToyAR(6, 8)
  target = model.init_params(jax.random.PRNGKey(0))
  draft = {"table": testing.draft_table(jax.random.PRNGKey(1), target["table"], "good")}
  loaded = lambda params: resolve.LoadedModel(model, params, _CharTokenizer(), Path("."))
  settings = builders.DecodeSettings(gamma=3, max_new_tokens=8)
  base = methods.Speculative(target=loaded(target), settings=settings, draft=loaded(draft))
  alone = methods.Autoregressive(target=loaded(draft), settings=settings)
  points = tradeoff.settings("fuzzy", [0.3], 3, {}, [0.5])
  prompts, refs = ["ab", "cde", "e"], ["a b c", "d e", "b b a"]
  records = tradeoff.sweep([(p, tradeoff.method_for(p, base, alone)) for p in points], prompts,
                           refs, "rouge", "rouge1", jax.random.PRNGKey(0), timing_prompts=1,
                           repeats=1, batch_size=1)
  assert [r["curve"] for r in records] == ["target", "draft", "fuzzy", "fuzzy_random"]
  for r in records:
    assert r["tokens_per_s"] > 0 and 0 <= r["quality"] <= 100
    assert r["ms_per_token"] == pytest.approx(1e3 / r["tokens_per_s"])
  assert records[0]["draft_share"] == 0 and np.isnan(records[0]["alpha"])
  assert 0 < records[2]["draft_share"] < 1 and 0 < records[2]["alpha"] <= 1
  tradeoff.write(records, str(tmp_path / "out"), "rouge1")
  with open(tmp_path / "out.csv") as f:
    rows = list(csv.DictReader(f))
  assert [r["curve"] for r in rows] == [r["curve"] for r in records]
  assert json.loads((tmp_path / "out.json").read_text())["records"][2]["value"] == 0.3
  try:
    import matplotlib  # noqa: F401
    assert (tmp_path / "out.png").exists()
  except ImportError:
    assert not (tmp_path / "out.png").exists()
