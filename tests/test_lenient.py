"""Lenient (lossy) SD, DistillSpec §2 and §6 item 7."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax import sampling, testing
from specjax.acceptance import lenient, registry
from specjax.decoding import speculative
from specjax.models import Prompt
from specjax.sampling import Warp

KINDS = ("lin", "sq", "exp")
P = jnp.array([0.45, 0.25, 0.15, 0.1, 0.05, 0.0])
Q = jnp.array([0.05, 0.1, 0.15, 0.2, 0.3, 0.2])
N_ROWS = 100_000


def _one_step(rule, key, p=P):
  """K=1 block on fixed p, q for N_ROWS rows -> (n accepted [N], first emitted token [N])."""
  return _one_step_jit(rule, key, p, Q)


@functools.partial(jax.jit, static_argnums=0)
def _one_step_jit(rule, key, p, q):
  # p and q are arguments, not constants: XLA would constant-fold the [N_ROWS, V] sampling math
  # at compile time, which takes minutes.
  keys = sampling.row_keys(key, N_ROWS)
  q_logp = jnp.broadcast_to(jnp.log(q), (N_ROWS, 1, q.size))
  p_logp = jnp.broadcast_to(jnp.log(p), (N_ROWS, 2, p.size))
  draft = rule.propose(q_logp[:, 0], sampling.fold_rows(keys, 7))
  n, nxt, _ = rule.verify(draft[:, None], jnp.ones(N_ROWS, jnp.int32), q_logp, p_logp, keys, ())
  return n, jnp.where(n == 1, draft, nxt)


@pytest.mark.parametrize("kind", KINDS)
def test_eps_one_is_exact_at_the_rule_level(kind):
  n0, tok0 = _one_step(registry.get("exact"), jax.random.PRNGKey(0))
  n1, tok1 = _one_step(registry.get("lenient", kind=kind, eps=1.0), jax.random.PRNGKey(0))
  np.testing.assert_array_equal(n0, n1)
  np.testing.assert_array_equal(tok0, tok1)


@pytest.mark.parametrize("kind", [pytest.param("lin", marks=pytest.mark.slow),
                                  pytest.param("sq", marks=pytest.mark.slow), "exp"])
def test_eps_one_reproduces_exact_generation_with_the_same_key(kind):
  model = testing.ToyAR(5, 6)
  target = model.init_params(jax.random.PRNGKey(0))
  draft = {"table": testing.draft_table(jax.random.PRNGKey(1), target["table"], "poor")}
  prompt = Prompt.from_lists([[1], [2, 3], [4, 4, 1], [3]] * 4)
  run = functools.partial(speculative.generate, model, target, model, draft, prompt,
                          jax.random.PRNGKey(2), gamma=3, max_new_tokens=10, warp=Warp(),
                          eos_id=0)
  want = run(rule=registry.get("exact"))
  got = run(rule=registry.get("lenient", kind=kind, eps=1.0))
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.stats.accepted, want.stats.accepted)


@pytest.mark.parametrize("kind", KINDS)
def test_one_step_law_is_pi_eps(kind):
  eps = 0.3
  _, tokens = _one_step(registry.get("lenient", kind=kind, eps=eps), jax.random.PRNGKey(1))
  law = np.asarray(lenient.lenient_law(P, Q, kind, eps), np.float64)
  assert abs(law.sum() - 1) < 1e-6 and not np.allclose(law, P, atol=0.02)   # really lossy
  observed = np.bincount(np.asarray(tokens), minlength=P.size)
  support = law > 0
  assert observed[~support].sum() == 0
  expected = law[support] / law[support].sum() * N_ROWS
  assert stats.chisquare(observed[support], expected).pvalue > 1e-3


@pytest.mark.parametrize("kind", ["lin", pytest.param("sq", marks=pytest.mark.slow), "exp"])
def test_acceptance_does_not_increase_with_eps(kind):
  previous, rates = None, []
  for eps in (0.05, 0.2, 0.5, 1.0):
    n, _ = _one_step(registry.get("lenient", kind=kind, eps=eps), jax.random.PRNGKey(2))
    if previous is not None:                     # same uniforms: accepted sets are nested
      assert (np.asarray(n) <= previous).all()
    previous = np.asarray(n)
    beta = float(jnp.minimum(Q, jnp.exp(lenient.log_lenience(jnp.log(P), kind, eps))).sum())
    assert abs(previous.mean() - beta) < 4 * np.sqrt(beta * (1 - beta) / N_ROWS + 1e-12)
    rates.append(previous.mean())
  assert rates[0] > rates[-1]


def test_f_sq_is_f_lin_with_eps_squared():
  log_p = jnp.log(P)
  np.testing.assert_allclose(lenient.log_lenience(log_p, "sq", 0.3),
                             lenient.log_lenience(log_p, "lin", 0.09), rtol=1e-6)


def test_tiny_eps_gives_the_draft_law():
  full = jnp.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.05])                 # full support
  _, tokens = _one_step(registry.get("lenient", kind="lin", eps=1e-8), jax.random.PRNGKey(3), full)
  q = np.asarray(Q, np.float64)
  observed = np.bincount(np.asarray(tokens), minlength=Q.size)
  assert stats.chisquare(observed[q > 0], q[q > 0] / q.sum() * N_ROWS).pvalue > 1e-3


def test_f_exp_at_zero_probability_has_no_nan():
  out = lenient.log_lenience(jnp.log(jnp.array([0.0, 0.5])), "exp", 0.5)
  assert np.asarray(out)[0] == -np.inf and np.isfinite(np.asarray(out)[1])
  n, tokens = _one_step(registry.get("lenient", kind="exp", eps=0.5), jax.random.PRNGKey(4))
  assert (np.asarray(tokens) != P.size - 1).all()        # p = 0 there: never accepted or drawn
  assert set(np.unique(np.asarray(n))) == {0, 1}


@pytest.mark.parametrize("kwargs,match", [
    (dict(eps=0.0), r"eps must be in \(0, 1\] .*got 0.0"),
    (dict(eps=-0.2), r"eps must be in \(0, 1\] .*got -0.2"),
    (dict(eps=1.5), r"eps must be in \(0, 1\] .*got 1.5"),
    (dict(eps=float("nan")), r"eps must be in \(0, 1\] .*got nan"),
    (dict(kind="cubic"), r"kind must be one of \('lin', 'sq', 'exp'\), got 'cubic'"),
])
def test_bad_hyperparameters_are_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    registry.get("lenient", **kwargs)
