"""DistillSpec losses: gradients (§6.9), padding invariance (§6.10), on-policy gradient (§6.11)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import enable_x64

from specjax.distill import losses


def rand(seed, shape, scale=2.0, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, dtype)


def token_loss(name, z, t, **kw):
  """The loss of one token: [V] student logits, [V] teacher logits -> scalar."""
  return losses.get(name, **kw).per_sequence(z[None, None], t[None, None], None,
                                             jnp.ones((1, 1), bool))[0]


def test_gradients_closed_form():
  """§6.9: d/dz of FKL = q - p, of RKL = q (log q - log p - RKL), of TVD = 1/2 q (s - <q, s>)."""
  z, t = rand(0, (11,)), rand(1, (11,))
  q, p = jax.nn.softmax(z), jax.nn.softmax(t)
  lq, lp = jnp.log(q), jnp.log(p)
  np.testing.assert_allclose(jax.grad(lambda z: token_loss("fkl", z, t))(z), q - p, atol=1e-6)
  rkl = jnp.sum(q * (lq - lp))
  np.testing.assert_allclose(jax.grad(lambda z: token_loss("rkl", z, t))(z),
                             q * (lq - lp - rkl), atol=1e-6)
  s = jnp.sign(q - p)
  np.testing.assert_allclose(jax.grad(lambda z: token_loss("tvd", z, t))(z),
                             0.5 * q * (s - jnp.dot(q, s)), atol=1e-6)


def test_jsd_gradient_matches_finite_differences_float64():
  with enable_x64():
    z, t = rand(2, (7,), dtype=jnp.float64), rand(3, (7,), dtype=jnp.float64)
    for beta in (0.1, 0.5, 0.9):
      f = lambda z: token_loss("jsd", z, t, beta=beta)
      grad = np.asarray(jax.grad(f)(z))
      eps = 1e-6
      fd = [(f(z.at[i].add(eps)) - f(z.at[i].add(-eps))) / (2 * eps) for i in range(7)]
      np.testing.assert_allclose(grad, np.asarray(fd), atol=1e-8)


@pytest.mark.parametrize("name", ["fkl", "rkl", "jsd", "tvd", "seqkd"])
def test_no_gradient_into_teacher_and_padding_invariance(name):
  """§6.10: per-sequence mean then batch mean: extra padding changes nothing."""
  s, t = rand(4, (3, 5, 9)), rand(5, (3, 5, 9))
  targets = jnp.asarray(np.random.default_rng(6).integers(0, 9, (3, 5)), jnp.int32)
  mask = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], bool)
  loss = losses.get(name)
  base = loss(s, t, targets, mask)
  pad = lambda x, v: jnp.concatenate([x, jnp.full(x.shape[:1] + (4,) + x.shape[2:], v, x.dtype)], 1)
  padded = loss(pad(s, 3.0), pad(t, -1.0), pad(targets, 0), pad(mask, False))
  np.testing.assert_allclose(padded, base, rtol=1e-6)
  # Garbage in masked positions changes nothing either.
  noisy = loss(jnp.where(mask[..., None], s, 50.0), t, targets, mask)
  np.testing.assert_allclose(noisy, base, rtol=1e-6)
  per_seq = loss.per_sequence(s, t, targets, mask)
  assert per_seq.shape == (3,)
  np.testing.assert_allclose(base, per_seq.mean(), rtol=1e-6)
  if loss.needs_teacher:
    grad_t = jax.grad(lambda t: loss(s, t, targets, mask))(t)
    assert float(jnp.abs(grad_t).max()) == 0.0


def test_seqkd_is_fkl_against_one_hot_teacher():
  s = rand(7, (2, 4, 6))
  targets = jnp.asarray([[0, 3, 5, 1], [2, 2, 4, 0]], jnp.int32)
  mask = jnp.ones((2, 4), bool)
  one_hot = jnp.log(jax.nn.one_hot(targets, 6))
  np.testing.assert_allclose(losses.get("seqkd")(s, None, targets, mask),
                             losses.get("fkl")(s, one_hot, targets, mask), rtol=1e-6)


def test_on_policy_gradient_treats_samples_as_constants():
  """§6.11: sampling y from the student inside the loss adds no gradient term (no REINFORCE)."""
  w = rand(8, (4, 6))                         # a bigram student: logits = w[prev]
  teacher = rand(9, (4, 6))
  key = jax.random.PRNGKey(0)

  def sample(w):
    return jax.random.categorical(key, w[jnp.array([0, 1, 2, 3])], axis=-1)   # [4]

  def loss_of(w, y):
    prev = jnp.concatenate([jnp.array([0]), y[:-1] % 4])
    s_logits, t_logits = w[prev][None], teacher[prev][None]
    return losses.get("fkl")(s_logits, t_logits, y[None], jnp.ones((1, 4), bool))

  y = sample(w)
  on_policy = jax.grad(lambda w: loss_of(w, sample(w)))(w)
  constant = jax.grad(lambda w: loss_of(w, jax.lax.stop_gradient(y)))(w)
  np.testing.assert_allclose(on_policy, constant, rtol=1e-6)


def test_registry_errors():
  with pytest.raises(ValueError, match="unknown distillation loss"):
    losses.get("mse")
  with pytest.raises(ValueError, match="beta"):
    losses.get("jsd", beta=1.5)
  with pytest.raises(ValueError, match="needs teacher"):
    losses.get("fkl")(rand(0, (1, 2, 3)), None, None, jnp.ones((1, 2), bool))
