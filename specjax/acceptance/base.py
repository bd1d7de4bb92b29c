"""The Rule interface every acceptance rule implements, and the shared rejection-sampling kernel.

The speculative loop (specjax/decoding/speculative.py) calls, once after the target's prefill:

  rule.first_token(p_logits[B, V], warp, keys) -> token[B]   # the first generated token

and per block (a model drafter calls the first two per drafting step, drafting/model.py):

  q_logp = rule.q_log_probs(draft_logits, warp)       # [B, V] over the target's ids
  rule.propose(q_logp, keys) -> token[B]
  p_logp = rule.p_log_probs(target_logits, warp)      # [B, K+1, V]
  rule.verify(draft_tokens[B,K], draft_len[B], q_logp[B,K,V], p_logp[B,K+1,V], keys, rule_state)
      -> (n_accepted[B] in [0, draft_len], next_token[B], rule_state)

`keys` are per-row PRNG keys [B] (already specific to the row and the block). Rules are static
arguments of jit: every field must be hashable.

A rule decides acceptance only; what proposes, how many tokens and how committed tokens are fed
back to a draft with another vocabulary belong to the drafter (drafting/). The contract is
declarative: the loop asks the rule, it never inspects it.
  first_token       how the first token is drawn from the target's prefill logits: by default a
                    sample of the run's warp (as autoregressive decoding); greedy takes argmax.
  needs_same_vocab  False for a rule that maps a draft's own vocabulary into the target's
                    (q_log_probs); such a rule carries its VocabMap as `vocab`, which the model
                    drafter also uses to feed committed tokens back.
  draft_length      the draft-length policy the rule was written with (drafting/length.py):
                    "fixed" (gamma drafts per row) or "entropy" (AdaSD's stop, reading
                    rule_state's thresholds).
  needs_draft_law   why the rule cannot verify a one-hot q (prompt lookup), "" when it can.
  traced            the fields the compiled loop takes as values.
  select_rows       which rule_state survives a block for rows that are done; by default every
                    leaf of rule_state is per-row with a leading [B] axis (checked).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp

from specjax import sampling


@dataclasses.dataclass(frozen=True)
class Rule:
  """Base acceptance rule: sampled drafts from warped q, fixed-length drafting."""
  needs_same_vocab: ClassVar[bool] = True   # draft and target must share token ids
  draft_length: ClassVar[str] = "fixed"     # the draft-length policy (drafting/length.py)
  rule_name: ClassVar[str] = ""             # set by registry.register
  # Fields whose values the compiled loop takes as arguments (leaves of the rule's pytree), so that
  # another value reuses the program; every other field is static (part of the jit cache key).
  traced: ClassVar[tuple[str, ...]] = ()
  # Why the rule cannot verify a drafter's one-hot q (prompt lookup), "" when it can: rules that
  # read q beyond the drafted token's mass (a divergence, an entropy) have nothing to read.
  needs_draft_law: ClassVar[str] = ""

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    jax.tree_util.register_pytree_node(cls, _flatten_rule, functools.partial(_unflatten_rule, cls))

  def init_state(self, batch: int) -> Any:
    del batch
    return ()

  def q_log_probs(self, q_logits: jax.Array, warp: sampling.Warp) -> jax.Array:
    """Draft logits [..., V_draft] -> f32 log-probs q over target ids [..., V], used everywhere."""
    return warp.log_probs(q_logits)

  def p_log_probs(self, p_logits: jax.Array, warp: sampling.Warp) -> jax.Array:
    """Target logits [..., V] -> f32 log-probs p given to verify (and used for residuals/bonus)."""
    return warp.log_probs(p_logits)

  def first_token(self, p_logits: jax.Array, warp: sampling.Warp, keys: jax.Array) -> jax.Array:
    """Target prefill logits [B, V], keys [B] -> the first generated token [B] (int32).

    Drawn before any draft exists, so it follows the rule's output law with the target alone:
    a sample of the warped target (autoregressive decoding's first token, same keys)."""
    return warp.sample(p_logits, keys)

  def propose(self, q_logp: jax.Array, keys: jax.Array) -> jax.Array:
    """q_logp [B, V], keys [B] -> draft token [B]: a sample of warped q."""
    return sampling.categorical(q_logp, keys)

  def select_rows(self, live: jax.Array, new: Any, old: Any) -> Any:
    """rule_state after a block: `new` for live rows [B], `old` for rows that are done.
    Every leaf is per-row ([B, ...]); a rule with shared state overrides this."""
    def pick(a, b):
      if a.ndim == 0 or a.shape[0] != live.shape[0]:
        raise ValueError(f"rule {self.rule_name or type(self).__name__!r}: rule_state leaf of "
                         f"shape {a.shape} is not per-row [B={live.shape[0]}, ...]; override "
                         f"select_rows for state shared across rows")
      return jnp.where(live.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
    return jax.tree_util.tree_map(pick, new, old)

  def verify(self, draft_tokens, draft_len, q_logp, p_logp, keys, rule_state):
    raise NotImplementedError(f"{type(self).__name__} must implement verify()")


def prefix_accepted(accept: jax.Array, draft_len: jax.Array) -> jax.Array:
  """Number of leading accepted drafts: accept [B, K] bool, draft_len [B] -> n [B] int32.

  Drafts at or past draft_len were never offered, so they count as rejections. Example with K=4:
  accept [1, 1, 0, 1], draft_len 4 -> n = 2; accept [1, 1, 1, 1], draft_len 3 -> n = 3.
  """
  offered = jnp.arange(accept.shape[1])[None, :] < draft_len[:, None]
  return jnp.sum(jnp.cumprod(accept & offered, axis=1), axis=1).astype(jnp.int32)


def take_position(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x [B, K, ...], idx [B] -> x[b, idx[b]] of shape [B, ...] (idx clipped to K-1). K = 0 (a
  block verified without drafts): -inf for floats (log q = -inf, q = 0), 0 for integers."""
  if x.shape[1] == 0:
    empty = -jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else 0
    return jnp.full(x.shape[:1] + x.shape[2:], empty, x.dtype)
  idx = jnp.minimum(idx, x.shape[1] - 1)
  return jax.vmap(lambda row, i: row[i])(x, idx)


def take_tokens(logp: jax.Array, tokens: jax.Array) -> jax.Array:
  """logp [B, K, V], tokens [B, K] -> logp[b, k, tokens[b, k]] [B, K]."""
  return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def residual_log_probs(p_logp: jax.Array, q_logp: jax.Array) -> jax.Array:
  """log norm(max(0, p - q)) over the last axis, in f32; p itself where the residual is empty.

  The residual is empty (mass < 1e-12) only when p <= q everywhere, i.e. p == q, and then a
  rejection has probability ~0: falling back to p keeps the law exact and avoids 0/0.
  """
  diff = jnp.maximum(jnp.exp(p_logp) - jnp.exp(q_logp), 0.0)            # [..., V]
  mass = jnp.sum(diff, axis=-1, keepdims=True)
  safe = jnp.where(diff > 0, diff, 1.0)
  res = jnp.where(diff > 0, jnp.log(safe) - jnp.log(jnp.maximum(mass, 1e-30)), -jnp.inf)
  return jnp.where(mass > 1e-12, res, p_logp)


def verify_streams(keys: jax.Array, num: int) -> tuple[jax.Array, jax.Array]:
  """Per-row keys [B] -> (uniforms [B, num] in [0, 1), keys [B] for the final sample).

  Draft j's uniform depends on (row key, j) only, not on num: a verify pass narrowed to the
  drafts actually made (variable-length rules) draws the same numbers as a full one."""
  purpose_keys = sampling.fold_table(keys, 2)                             # [B, 2]
  draft_keys = sampling.fold_table(purpose_keys[:, 0], num)               # [B, num]
  return jax.vmap(jax.vmap(jax.random.uniform))(draft_keys), purpose_keys[:, 1]


def ratio_accept(uniforms: jax.Array, log_fp: jax.Array, log_q: jax.Array) -> jax.Array:
  """The speculative test u < f(p(x)) / q(x), as log u < log f - log q, elementwise -> bool.

  A draft with q(x) = 0 is rejected: the draft could not have proposed it (a rule whose q is empty
  at a position proposes an arbitrary id there, see vocab.Intersection), and log f - log q = +inf
  would accept it whatever p. Example: log q = -inf, log f = log 0.3 -> False (not inf > log u).
  """
  return (log_q > -jnp.inf) & (jnp.log(uniforms) < log_fp - log_q)


def rejection_verify(draft_tokens: jax.Array, draft_len: jax.Array, q_logp: jax.Array,
                     p_logp: jax.Array, keys: jax.Array,
                     log_f: Callable[[jax.Array], jax.Array],
                     residual: bool = True) -> tuple[jax.Array, jax.Array]:
  """Speculative rejection sampling with acceptance min(1, f(p)/q) (DistillSpec Alg. A.1).

  draft i is accepted iff q_i(x_i) > 0 and u_i < f(p_i(x_i)) / q_i(x_i) (ratio_accept).
  After n acceptances: if n < draft_len the next token is drawn from norm(max(0, p_n - q_n))
  (or from p_n when residual=False), else it is the bonus token drawn from p_n.
  Returns (n [B], next_token [B]).
  """
  num = draft_tokens.shape[1]
  uniforms, sample_keys = verify_streams(keys, num)
  log_q = take_tokens(q_logp, draft_tokens)                              # [B, K]
  log_fp = log_f(take_tokens(p_logp[:, :num], draft_tokens))             # [B, K]
  n = prefix_accepted(ratio_accept(uniforms, log_fp, log_q), draft_len)
  p_n = take_position(p_logp, n)                                         # [B, V]
  q_n = take_position(q_logp, n)                                         # [B, V] (unused if bonus)
  rejected = (n < draft_len)[:, None]
  fix = residual_log_probs(p_n, q_n) if residual else p_n
  next_token = sampling.categorical(jnp.where(rejected, fix, p_n), sample_keys)
  return n, next_token


def _fields(cls) -> tuple[list[str], list[str]]:
  """(traced field names, static field names) of a rule class."""
  names = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []
  return [n for n in names if n in cls.traced], [n for n in names if n not in cls.traced]


def _flatten_rule(rule: Rule):
  traced, static = _fields(type(rule))
  return [getattr(rule, n) for n in traced], tuple(getattr(rule, n) for n in static)


def _unflatten_rule(cls, static_values, leaves) -> Rule:
  rule = object.__new__(cls)             # traced leaves: no checks (made on the host)
  traced, static = _fields(cls)
  for name, value in (*zip(static, static_values), *zip(traced, leaves)):
    object.__setattr__(rule, name, value)
  return rule
