"""Divergences: docs/papers/fsd.md §5.1-5.3 reference values, scipy agreement, docs/papers/distillspec.md §6.8 identities."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import enable_x64
from scipy.spatial.distance import jensenshannon
from scipy.special import rel_entr

from specjax import divergences as dv

NAMES = ("kl", "rkl", "js", "js_m", "tv")


def logits_of(p):
  with np.errstate(divide="ignore"):
    return jnp.log(jnp.asarray(p, jnp.float32))


def values(p, q, k=None):
  return [float(dv.get(n, k)(logits_of(p), logits_of(q))) for n in NAMES]


@pytest.mark.parametrize("p,q,expected", [
    ((.5, .5), (.9, .1), (.510826, .368064, .101749, .117973, .4)),
    ((.7, .2, .1), (.1, .2, .7), (1.167546, 1.167546, .253102, .330671, .6)),
])
def test_fsd_reference_values(p, q, expected):
  np.testing.assert_allclose(values(p, q), expected, atol=1e-6)
  np.testing.assert_allclose(values(p, p), 0.0, atol=1e-7)


def test_fsd_near_disjoint():
  p, q = (1 - 1e-6, 1e-6), (1e-6, 1 - 1e-6)
  with enable_x64():
    lp, lq = jnp.log(jnp.asarray(p)), jnp.log(jnp.asarray(q))
    assert float(dv.js(lp, lq)) == pytest.approx(.693132, abs=1e-6)
    assert float(dv.js_m(lp, lq)) == pytest.approx(6.2146, abs=1e-4)
  assert float(dv.js(logits_of(p), logits_of(q))) == pytest.approx(.693132, abs=1e-5)


def test_fsd_top_k_reference():
  p, q = (.5, .3, .15, .05), (.25, .25, .1, .4)
  np.testing.assert_allclose(values(p, q, k=2), (.218012, .239278, .055582, .058740, .3), atol=1e-6)
  np.testing.assert_allclose(values(p, q), (.358118, .572363, .102363, .130257, .35), atol=1e-6)
  np.testing.assert_allclose(values(p, q, k=4), values(p, q), atol=1e-6)   # k = V: full


def reference(p, q):
  """float64 numpy references."""
  m = (p + q) / 2
  kl = rel_entr(p, q).sum(-1)
  return dict(kl=kl, rkl=rel_entr(q, p).sum(-1),
              js=0.5 * rel_entr(p, m).sum(-1) + 0.5 * rel_entr(q, m).sum(-1),
              js_m=0.5 * rel_entr(m, p).sum(-1) + 0.5 * rel_entr(m, q).sum(-1),
              tv=0.5 * np.abs(p - q).sum(-1))


def test_random_logits_match_float64_and_scipy():
  rng = np.random.default_rng(0)
  z1, z2 = rng.normal(size=(2, 64, 50)) * 2
  p = np.exp(z1 - np.logaddexp.reduce(z1, -1, keepdims=True))
  q = np.exp(z2 - np.logaddexp.reduce(z2, -1, keepdims=True))
  ref = reference(p, q)
  for name in NAMES:
    got = np.asarray(dv.DIVERGENCES[name](jnp.asarray(z1, jnp.float32), jnp.asarray(z2, jnp.float32)))
    np.testing.assert_allclose(got, ref[name], atol=2e-6, rtol=1e-5, err_msg=name)
  d = np.asarray(dv.js_distance(jnp.asarray(z1, jnp.float32), jnp.asarray(z2, jnp.float32)))
  np.testing.assert_allclose(d, jensenshannon(p, q, base=2, axis=-1), atol=1e-6)
  assert np.all(ref["js"] <= math.log(2) * ref["tv"] + 1e-9)
  assert np.all(ref["tv"] <= np.sqrt(ref["kl"] / 2) + 1e-9)


def test_zero_probabilities_no_nan_and_grads_finite():
  p = jnp.array([[0.0, -jnp.inf, 1.0, 2.0]])         # logits with a masked id
  q = jnp.array([[1.0, -jnp.inf, 0.5, -jnp.inf]])
  for name in NAMES + ("js_distance",):
    v = dv.DIVERGENCES[name](p, q)
    assert not np.isnan(np.asarray(v)).any(), name
  for name in ("js", "tv", "js_distance"):
    assert np.isfinite(float(dv.DIVERGENCES[name](p, q)[0]))
  grad = jax.grad(lambda z: dv.kl(p, z).sum())(jnp.array([[1.0, -jnp.inf, 0.5, 0.3]]))
  assert np.isfinite(np.asarray(grad)[:, [0, 2, 3]]).all()
  disjoint = dv.js_distance(jnp.log(jnp.array([1.0, 0.0])), jnp.log(jnp.array([0.0, 1.0])))
  assert float(disjoint) == pytest.approx(1.0, abs=1e-6)


def test_entropy():
  assert float(dv.entropy(jnp.log(jnp.array([0.0, 1.0, 0.0])))) == 0.0
  assert float(dv.entropy(jnp.zeros(7))) == pytest.approx(math.log(7), abs=1e-6)


def dirichlet_logits(rng, n, v):
  return np.log(rng.dirichlet(np.ones(v), size=n))


def test_distillspec_identities_float64():
  """§6.8: non-negativity, bounds, the JSD[beta] symmetry and limits, TVD forms, Pinsker."""
  rng = np.random.default_rng(1)
  with enable_x64():
    lp, lq = (jnp.asarray(dirichlet_logits(rng, 200, 6)) for _ in range(2))
    for name in NAMES:
      assert np.all(np.asarray(dv.DIVERGENCES[name](lp, lq)) >= -1e-12)
      assert np.allclose(dv.DIVERGENCES[name](lp, lp), 0.0, atol=1e-12)
    assert np.all(np.asarray(dv.js(lp, lq)) <= math.log(2) + 1e-12)
    for beta in (0.1, 0.3, 0.9):
      bound = -beta * math.log(beta) - (1 - beta) * math.log(1 - beta)
      assert np.all(np.asarray(dv.jsd_beta(lp, lq, beta)) <= bound + 1e-12)
      np.testing.assert_allclose(dv.jsd_beta(lp, lq, beta), dv.jsd_beta(lq, lp, 1 - beta),
                                 rtol=1e-10)
    beta = 1e-7
    np.testing.assert_allclose(dv.jsd_beta(lp, lq, beta) / beta, dv.kl(lp, lq), rtol=1e-3)
    np.testing.assert_allclose(dv.jsd_beta(lp, lq, 1 - beta) / beta, dv.rkl(lp, lq), rtol=1e-3)
    p, q = np.exp(np.asarray(lp)), np.exp(np.asarray(lq))
    tv = np.asarray(dv.tv(lp, lq))
    np.testing.assert_allclose(tv, 1 - np.minimum(p, q).sum(-1), atol=1e-12)
    np.testing.assert_allclose(tv, np.where(p > q, p - q, 0).sum(-1), atol=1e-12)  # max_A P(A)-Q(A)
    assert np.all(tv <= 1)
    assert np.all(tv <= np.sqrt(np.asarray(dv.kl(lp, lq)) / 2) + 1e-12)
    assert np.all(tv <= np.sqrt(np.asarray(dv.rkl(lp, lq)) / 2) + 1e-12)
    one_hot = jnp.log(jax.nn.one_hot(jnp.arange(200) % 6, 6, dtype=jnp.float64))
    np.testing.assert_allclose(dv.kl(one_hot, lq), -lq[jnp.arange(200), jnp.arange(200) % 6],
                               rtol=1e-10)


def test_get_errors():
  with pytest.raises(ValueError, match="unknown divergence"):
    dv.get("hellinger")
  with pytest.raises(ValueError, match="needs k"):
    dv.get("js_topk")
