from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax import sampling
from specjax.sampling import Warp


def _logits(seed=0, shape=(3, 7)):
  return 2.0 * jax.random.normal(jax.random.PRNGKey(seed), shape)


def test_temperature_zero_is_one_hot_argmax_without_nan():
  logits = _logits().at[0, 2].set(-jnp.inf)
  lp = Warp(temperature=0.0).log_probs(logits)
  assert not np.isnan(np.asarray(lp)).any()
  best = np.argmax(np.asarray(logits), -1)
  np.testing.assert_array_equal(np.exp(np.asarray(lp)), np.eye(7)[best])


def test_temperature_scales_logits():
  logits = _logits()
  got = Warp(temperature=0.5).log_probs(logits)
  np.testing.assert_allclose(got, jax.nn.log_softmax(logits / 0.5), atol=1e-6)
  assert got.dtype == jnp.float32


def test_top_k_keeps_k_largest():
  logits = _logits()
  lp = np.asarray(Warp(top_k=3).log_probs(logits))
  kept = np.isfinite(lp)
  assert (kept.sum(-1) == 3).all()
  top3 = np.argsort(-np.asarray(logits), -1)[:, :3]
  assert all(set(np.flatnonzero(k)) == set(t) for k, t in zip(kept, top3))
  np.testing.assert_allclose(np.exp(lp).sum(-1), 1.0, atol=1e-6)


def test_top_p_keeps_smallest_set_reaching_mass():
  probs = jnp.array([[0.5, 0.3, 0.15, 0.05]])
  lp = Warp(top_p=0.8).log_probs(jnp.log(probs))
  np.testing.assert_allclose(np.exp(lp), [[0.625, 0.375, 0, 0]], atol=1e-6)
  lp = Warp(top_p=0.81).log_probs(jnp.log(probs))
  np.testing.assert_allclose(np.exp(lp), [[0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]], atol=1e-6)


def test_sample_follows_warped_law_per_row_keys():
  logits = jnp.tile(jnp.array([[1.0, 0.0, -1.0, 2.0]]), (20000, 1))
  warp = Warp(temperature=0.7)
  keys = sampling.row_keys(jax.random.PRNGKey(1), logits.shape[0])
  tokens = np.asarray(warp.sample(logits, keys))
  probs = np.exp(np.asarray(warp.log_probs(logits[0]), np.float64))
  observed = np.bincount(tokens, minlength=4)
  assert stats.chisquare(observed, probs / probs.sum() * len(tokens)).pvalue > 1e-3


def test_row_keys_are_fold_in_and_per_row_keys_pass_through():
  key = jax.random.PRNGKey(3)
  keys = sampling.row_keys(key, 4)
  np.testing.assert_array_equal(keys[2], jax.random.fold_in(key, 2))
  np.testing.assert_array_equal(sampling.as_row_keys(keys, 4), keys)
  np.testing.assert_array_equal(sampling.as_row_keys(key, 4), keys)
  typed = jax.random.key(3)
  assert sampling.as_row_keys(typed, 5).shape == (5,)
  with pytest.raises(ValueError, match="per-row keys"):
    sampling.as_row_keys(keys, 3)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0),
                                    dict(top_p=1.5)])
def test_bad_warp_is_refused(kwargs):
  with pytest.raises(ValueError):
    Warp(**kwargs)
