"""Lossless rules: exact speculative sampling and greedy verification; plus HF's assisted-generation
variant (greedy draft), the baseline FSD compared against, which is not lossless."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import sampling
from specjax.acceptance import base
from specjax.acceptance.registry import register


def _identity(log_p: jax.Array) -> jax.Array:
  return log_p


@register("exact")
@dataclasses.dataclass(frozen=True)
class Exact(base.Rule):
  """Leviathan et al. / Chen et al.: accept with min(1, p/q), resample from norm(max(0, p - q)),
  bonus token from p after K acceptances. The output law equals the target's (warped) law."""

  def verify(self, draft_tokens, draft_len, q_logp, p_logp, keys, rule_state):
    n, nxt = base.rejection_verify(draft_tokens, draft_len, q_logp, p_logp, keys, _identity)
    return n, nxt, rule_state


@register("greedy")
@dataclasses.dataclass(frozen=True)
class Greedy(base.Rule):
  """Accept a draft iff it is the target's argmax; the next token is the target's argmax.

  The draft proposes its own argmax. The output equals greedy target decoding token for token,
  whatever the warp and the draft: the first token too is the target's argmax (first_token).
  """

  def first_token(self, p_logits, warp, keys):
    del warp, keys
    return sampling.argmax(p_logits)

  def propose(self, q_logp, keys):
    del keys
    return sampling.argmax(q_logp)

  def verify(self, draft_tokens, draft_len, q_logp, p_logp, keys, rule_state):
    del q_logp, keys
    best = sampling.argmax(p_logp)                                       # [B, K+1]
    n = base.prefix_accepted(draft_tokens == best[:, :-1], draft_len)
    return n, base.take_position(best, n), rule_state


@register("hf_greedy_draft")
@dataclasses.dataclass(frozen=True)
class HFGreedyDraft(base.Rule):
  """Hugging Face assisted generation (transformers 4.44 `_speculative_sampling`): the draft
  proposes its argmax, q is the draft's raw softmax (no temperature / top-k / top-p), p is the
  warped target; accept with min(1, p/q), resample from norm(max(0, p - q)), bonus from p.

  This is FSD's "SD" baseline. It is NOT lossless: the accept test assumes the draft token was
  sampled from q, but it was the argmax. At temperature 0 it reduces to greedy verification.
  """

  def q_log_probs(self, q_logits, warp):
    del warp
    return jax.nn.log_softmax(q_logits.astype(jnp.float32), axis=-1)

  def propose(self, q_logp, keys):
    del keys
    return sampling.argmax(q_logp)

  def verify(self, draft_tokens, draft_len, q_logp, p_logp, keys, rule_state):
    n, nxt = base.rejection_verify(draft_tokens, draft_len, q_logp, p_logp, keys, _identity)
    return n, nxt, rule_state

