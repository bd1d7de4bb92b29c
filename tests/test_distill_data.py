"""Alg. A.2 data mixing: source frequencies (§6.12), homogeneous batches, recipes, sampling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import testing
from specjax.decoding import autoregressive
from specjax.distill import data
from specjax.sampling import Warp


@pytest.mark.parametrize("lambda1,lambda2", [(0.0, 1.0), (0.3, 0.5), (0.5, 0.2), (1.0, 0.0)])
def test_source_frequencies(lambda1, lambda2):
  """Over 10^4 steps: fixed ~ l1, student ~ (1-l1) l2, teacher ~ (1-l1)(1-l2) (within 4 sigma)."""
  mix = data.Mixture(lambda1, lambda2, seed=3)
  n = 10_000
  sources = [mix.source(s) for s in range(n)]
  expected = {data.FIXED: lambda1, data.STUDENT: (1 - lambda1) * lambda2,
              data.TEACHER: (1 - lambda1) * (1 - lambda2)}
  for name, prob in expected.items():
    freq = sources.count(name) / n
    assert abs(freq - prob) <= 4 * np.sqrt(prob * (1 - prob) / n) + 1e-12, (name, freq, prob)
  assert sources == [mix.source(s) for s in range(n)]          # deterministic in (seed, step)


def test_recipes():
  assert data.recipe("SeqKD") == data.Recipe("seqkd", 0.0, 0.0)
  assert data.recipe("SupKD").lambda1 == 1.0
  assert data.recipe("f-Distill") == data.Recipe("tvd", 0.0, 0.5)
  assert data.recipe("GKD") == data.Recipe("fkl", 0.0, 1.0)
  assert data.recipe("ImitKD").lambda2 == 1.0
  with pytest.raises(ValueError, match="unknown DistillSpec recipe"):
    data.recipe("dpo")
  with pytest.raises(ValueError, match="lambda1"):
    data.Mixture(1.5, 0.0)


def test_markov_source_deterministic():
  src = data.MarkovSource(vocab_size=32, batch_size=4, prompt_len=3, target_len=5)
  a, b, c = src.batch(7), src.batch(7), src.batch(8)
  np.testing.assert_array_equal(a.targets, b.targets)
  assert not np.array_equal(a.targets, c.targets)
  assert a.targets.shape == (4, 5) and a.prompt.tokens.shape == (4, 3)
  assert int(a.targets.min()) >= 2


def test_sampled_batches_are_homogeneous_and_on_policy():
  """Student batches equal `generate` with the current student params; teacher batches the
  teacher's; every row of a batch comes from the same model; fixed batches pass through."""
  teacher, t_params = testing.tiny_decoder(seed=1, vocab_size=32, d_model=16, num_layers=1)
  student, s_params = testing.tiny_decoder(seed=2, vocab_size=32, d_model=16, num_layers=1)
  src = data.MarkovSource(vocab_size=32, batch_size=4, prompt_len=3, target_len=6)
  sampler = data.Sampler(student, teacher, eos_id=1, temperature=1.0)
  batch, key = src.batch(0), jax.random.PRNGKey(5)
  for source, model, params in ((data.STUDENT, student, s_params), (data.TEACHER, teacher, t_params)):
    out = sampler(source, batch, s_params, t_params, key)
    gen = autoregressive.generate(model, params, batch.prompt, key, max_new_tokens=6,
                                  warp=Warp(1.0), eos_id=1)
    targets, mask = data.fit_width(gen.tokens, gen.lengths, 6)
    np.testing.assert_array_equal(out.targets, targets)
    np.testing.assert_array_equal(out.mask, mask)
    np.testing.assert_array_equal(out.prompt.tokens, batch.prompt.tokens)
  assert sampler(data.FIXED, batch, s_params, t_params, key) is batch
  mix = data.Mixture(0.0, 1.0)
  out, source = data.mixed_batch(mix, sampler, 3, batch, s_params, t_params, key)
  assert source == data.STUDENT


def test_fit_width():
  tokens = jnp.array([[5, 6, 1, 9], [7, 8, 9, 3]])
  targets, mask = data.fit_width(tokens, jnp.array([3, 4]), 6)
  np.testing.assert_array_equal(targets, [[5, 6, 1, 0, 0, 0], [7, 8, 9, 3, 0, 0]])
  np.testing.assert_array_equal(mask.sum(1), [3, 4])
  targets, mask = data.fit_width(tokens, jnp.array([3, 4]), 2)
  np.testing.assert_array_equal(targets, [[5, 6], [7, 8]])
