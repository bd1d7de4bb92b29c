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


def test_top_k_of_one_bucket_compiles_once_and_keeps_its_own_k():
  """top_k is traced within its power-of-two bucket: 3 and 4 share one program (k_max 4) and
  keep 3 and 4 tokens; 5 (k_max 8) compiles another. A k at or past the vocabulary keeps all."""
  logits = _logits(shape=(3, 11))
  log_probs = jax.jit(lambda warp, z: warp.log_probs(z))
  three, four = log_probs(Warp(top_k=3), logits), log_probs(Warp(top_k=4), logits)
  assert log_probs._cache_size() == 1
  assert (np.isfinite(np.asarray(three)).sum(-1) == 3).all()
  assert (np.isfinite(np.asarray(four)).sum(-1) == 4).all()
  np.testing.assert_array_equal(three, Warp(top_k=3).log_probs(logits))
  five = log_probs(Warp(top_k=5), logits)
  assert log_probs._cache_size() == 2 and (np.isfinite(np.asarray(five)).sum(-1) == 5).all()
  for k in (11, 16):
    np.testing.assert_allclose(Warp(top_k=k).log_probs(logits), jax.nn.log_softmax(logits),
                               atol=1e-6)
  assert [sampling.top_k_bucket(k) for k in (0, 1, 2, 3, 4, 5, 9)] == [0, 1, 2, 4, 4, 8, 16]


def test_per_row_values_warp_each_row_as_its_own_warp():
  """A value per row: row b of [B, T, V] logits is warped exactly as by a Warp of row b's values
  alone (a greedy row among sampled ones, top_k and top_p off on some rows); other per-row
  values of the same top_k bucket reuse the compiled function."""
  logits = _logits(shape=(4, 3, 50))
  rows = dict(temperature=(0.0, 0.7, 1.3, 1.0), top_k=(0, 5, 3, 8), top_p=(1.0, 0.9, 0.5, 1.0))
  warped = jax.jit(lambda w, x: w.log_probs(x))
  got = np.asarray(warped(Warp(**rows), logits))
  for b in range(4):
    alone = Warp(**{name: values[b] for name, values in rows.items()}).log_probs(logits[b])
    np.testing.assert_array_equal(got[b], np.asarray(alone), err_msg=f"row {b}")
  assert not np.isnan(got).any() and Warp(**rows).rows == 4 and Warp().rows is None
  before = warped._cache_size()
  other = warped(Warp(temperature=(1.0, 0.0, 0.5, 2.0), top_k=(8, 1, 0, 6),
                      top_p=(0.3, 1.0, 1.0, 0.7)), logits)
  assert warped._cache_size() == before and not np.array_equal(np.asarray(other), got)
  with pytest.raises(ValueError, match="different lengths"):
    Warp(temperature=(1.0, 0.5), top_p=(0.9,))
  with pytest.raises(ValueError, match="per-row warp values for 4 rows"):
    Warp(**rows).log_probs(logits[:2])


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


def _chisq_pvalue(tokens, probs):
  observed = np.bincount(tokens, minlength=len(probs))
  support = probs > 0
  assert observed[~support].sum() == 0, "sampled a zero-probability token"
  return stats.chisquare(observed[support], probs[support] * len(tokens)).pvalue


def _law_with_holes(vocab=150, seed=4):
  """A law over a vocabulary that is not a multiple of the sampler's block, with whole blocks and
  single entries at probability zero (-inf log-prob), and one dominant entry in the last block."""
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=vocab)
  logits[rng.choice(vocab, 40, replace=False)] = -np.inf
  logits[64:128] = -np.inf                          # a whole block with no mass
  logits[vocab - 1] = 2.5
  probs = np.exp(logits - logits[np.isfinite(logits)].max())
  return jnp.asarray(logits, jnp.float32), probs / probs.sum()


def test_categorical_matches_law_with_zero_blocks_and_ragged_vocab():
  logits, probs = _law_with_holes()
  rows = 60000
  keys = sampling.row_keys(jax.random.PRNGKey(5), rows)
  lp = jnp.tile(jax.nn.log_softmax(logits)[None], (rows, 1))
  tokens = np.asarray(sampling.categorical(lp, keys))
  assert _chisq_pvalue(tokens, probs) > 1e-3


def test_categorical_law_test_rejects_a_sampler_that_ignores_block_mass():
  """Power: picking the block uniformly among blocks with mass (a plausible bug in a two-level
  sampler) must fail the same chi-square test."""
  logits, probs = _law_with_holes()
  rows = 60000
  keys = sampling.row_keys(jax.random.PRNGKey(5), rows)
  w = np.asarray(probs)
  blocks = -(-len(w) // sampling._BLOCK)
  padded = np.pad(w, (0, blocks * sampling._BLOCK - len(w))).reshape(blocks, -1)
  flat = (padded.sum(1) > 0)[:, None] * padded / np.maximum(padded.sum(1, keepdims=True), 1e-30)
  broken = (flat / flat.sum()).reshape(-1)[:len(w)]
  lp = jnp.tile(jnp.log(jnp.asarray(broken, jnp.float32))[None], (rows, 1))
  tokens = np.asarray(sampling.categorical(lp, keys))
  assert _chisq_pvalue(tokens, probs) < 1e-6


def test_categorical_one_hot_and_single_row_equals_batch():
  lp = Warp(temperature=0.0).log_probs(_logits(shape=(5, 130)))
  keys = sampling.row_keys(jax.random.PRNGKey(6), 5)
  np.testing.assert_array_equal(sampling.categorical(lp, keys), np.argmax(np.asarray(lp), -1))
  soft = jax.nn.log_softmax(_logits(shape=(5, 130)))
  batch = np.asarray(sampling.categorical(soft, keys))
  singles = [int(sampling.categorical(soft[i:i + 1], keys[i:i + 1])[0]) for i in range(5)]
  np.testing.assert_array_equal(batch, singles)


def test_argmax_is_jnps_argmax():
  """sampling.argmax (two plain reductions, where XLA:CPU's argmax is unvectorised) gives
  jnp.argmax's index in every case: ties (the first), NaN (the first NaN), rows of -inf and of
  +inf, ints; any leading shape."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((3, 4, 1000)).astype(np.float32)
  x[0, 0, [7, 300]] = 50.0                          # a tie: the first
  x[0, 1, [9, 500]] = np.nan                        # NaNs: the first
  x[0, 2] = -np.inf
  x[0, 3, [2, 3]] = np.inf
  x[1, 0] = 0.0                                     # every entry the maximum
  for a in (x, x[0, 0], np.round(x[2] * 3).astype(np.int32)):
    got = jax.jit(sampling.argmax)(jnp.asarray(a))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(jnp.asarray(a), -1)))


def test_a_fold_table_holds_the_keys_of_fold_rows():
  keys = sampling.row_keys(jax.random.PRNGKey(2), 3)
  table = sampling.fold_table(keys, 4)
  assert table.shape[:2] == (3, 4)
  for i in range(4):
    np.testing.assert_array_equal(jax.random.key_data(table[:, i]),
                                  jax.random.key_data(sampling.fold_rows(keys, i)))
