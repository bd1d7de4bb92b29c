"""The EAGLE-style draft head as a drafter (the head itself: models/draft_head.py).

The head drafts from the target's own features, so it follows the verify pass: after each block
the loop hands it the target's hidden states of the verified positions with the tokens that
were committed after them (`after_commit`), and at the next block the head's cache catches up on
those pairs (h_t, x_{t+1}) in one pass, whose last position proposes the first draft. Draft step
j >= 2 reads the head's own feature f in place of the target's. The head's cache holds one entry
per committed pair; drafted entries are rolled back at the next block.

It starts from the pair (the target's hidden state at the prompt's last token, the first
generated token): the head's cache does not hold the prompt (no prefill of its own), so early
blocks attend to little context.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp

from specjax.drafting import length as length_lib
from specjax.drafting.base import Block, Drafter, Proposal
from specjax.drafting.model import draft_steps
from specjax.models import kv_cache
from specjax.models.draft_head import DraftHead


@flax.struct.dataclass(kw_only=True)
class HeadState:
  """What the head keeps between blocks."""
  cache: kv_cache.KVCache   # [1, B, Hkv, S, Dh] one entry per committed pair (+ drafted ones)
  committed: jax.Array      # [B] int32 cache entries that are committed pairs
  features: jax.Array       # [B, K+1, D] the target's hidden states of the last verified positions
  tokens: jax.Array         # [B, K+1] int32 the token committed after each of those positions
  pending: jax.Array        # [B] int32 pairs of features / tokens not yet in the cache (>= 1)


@dataclasses.dataclass(frozen=True)
class HeadDrafter(Drafter):
  """head: the DraftHead for the target (DraftHead.for_target). length: the draft-length
  policy (None: the rule's own). Its params are draft_head.with_target(head params, target
  params)."""
  head: DraftHead = None
  length: Any = None
  name: ClassVar[str] = "head"
  what: ClassVar[str] = "the draft head"
  needs_features: ClassVar[bool] = True

  @property
  def model(self) -> DraftHead:
    return self.head

  @property
  def variable_count(self) -> bool:
    return self.length.variable

  def for_rule(self, rule) -> "HeadDrafter":
    policy = length_lib.for_rule(rule) if self.length is None else self.length
    return dataclasses.replace(self, length=policy)

  def refusal(self, rule) -> str:
    name = rule.rule_name or getattr(rule, "__name__", type(rule).__name__)
    if not rule.needs_same_vocab:
      return (f"rule {name!r} maps a draft model's vocabulary, and the draft head proposes the "
              f"target's own ids: use a same-vocabulary rule (exact, greedy, lenient, fuzzy, "
              f"adaptive, ...)")
    return ""

  def check(self, target, rule) -> None:
    super().check(target, rule)
    if (self.head.vocab_size, self.head.hidden_size) != (target.vocab_size, target.hidden_size):
      raise ValueError(f"this draft head was built for a target of vocabulary "
                       f"{self.head.vocab_size} and hidden size {self.head.hidden_size}; the "
                       f"target has {target.vocab_size} and {target.hidden_size}: build it with "
                       f"DraftHead.for_target(target) and train it for this target")

  def init(self, params, draft_prompt, new_cache, gamma: int):
    del params
    batch = draft_prompt.tokens.shape[0]
    zeros = jnp.zeros((batch,), jnp.int32)
    state = HeadState(cache=new_cache(self.head, draft_prompt), committed=zeros,
                      features=jnp.zeros((batch, gamma + 1, self.head.hidden_size),
                                         self.head.dtype),
                      tokens=jnp.zeros((batch, gamma + 1), jnp.int32), pending=zeros)
    return state, {}

  def after_commit(self, state: HeadState, features, tokens, count) -> HeadState:
    """features [B, W, D] of W verified positions, tokens [B, W] committed after each, count [B]
    pairs committed (0: the row is done; its pairs are kept)."""
    width = state.features.shape[1] - features.shape[1]
    features = jnp.pad(features.astype(state.features.dtype), ((0, 0), (0, width), (0, 0)))
    tokens = jnp.pad(tokens.astype(jnp.int32), ((0, 0), (0, width)))
    keep = count > 0
    return state.replace(features=jnp.where(keep[:, None, None], features, state.features),
                         tokens=jnp.where(keep[:, None], tokens, state.tokens),
                         pending=jnp.where(keep, count, state.pending).astype(jnp.int32))

  def propose(self, params, anchors, state: HeadState, block: Block) -> Proposal:
    """Catch up on the pending pairs (one pass; its last position gives the first draft), then
    draft from the head's own features."""
    del anchors
    head = self.head
    cache = kv_cache.rollback(state.cache, state.committed)
    logits, f, cache = head.extend(params, state.features, state.tokens, cache,
                                   jnp.maximum(state.pending - 1, 0))     # [B, 1, V], [B, 1, D]
    committed = state.committed + jnp.where(block.live, state.pending, 0)
    cache = kv_cache.rollback(cache, committed)

    def step(carry, prev):                                                # prev [B] target ids
      cache, f = carry
      logits, f, cache = head.extend(params, f[:, None], prev[:, None], cache)
      return logits[:, 0], (cache, f[:, 0])

    proposal = draft_steps(self.length, block, logits[:, 0], (cache, f[:, 0]), step)
    cache, _ = proposal.state
    return proposal.replace(state=state.replace(cache=cache, committed=committed))
