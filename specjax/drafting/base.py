"""The drafter contract: what the speculative loop (decoding/speculative.py) asks of anything that
proposes tokens, beside the acceptance rule's contract (acceptance/base.py).

Once, after the target's prefill:

  drafter.init(params, draft_prompt, new_cache, gamma) -> (state, anchors)

and per block, for the rows that are not done:

  drafter.propose(params, anchors, state, block: Block) -> Proposal
  drafter.after_commit(state, features, tokens, count) -> state    # needs_features drafters

A drafter proposes up to gamma tokens per row, in the target's ids, each with its draft
distribution q as log-probabilities over the target's ids, already warped (one-hot for a
deterministic drafter); `count` says how many it offers per row (a length policy or a lookup miss
may offer fewer). It keeps whatever it needs across blocks in `state` (a model's KV cache) and
rewinds it to the committed stream at the start of the next block: the committed tokens are in
`block`. The rule decides what is kept; the drafter never sees the verdict except through the
committed stream (and the rule's state, which a length policy may read). A drafter that reads
the target's features (`needs_features`: the draft head) is also handed, after the prefill and
after each block, the target's hidden states of the verified positions with the tokens committed
after them.

Implementations: model.ModelDrafter (a second model, on the target's vocabulary or another one,
with early exit as a model made of the target's first layers), ngram.NGram (prompt lookup, no
model), head.HeadDrafter (an EAGLE-style head on the target's features). Drafters are static arguments of jit: every field must be hashable.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import flax.struct
import jax

from specjax import sampling

# A pairing that has no meaning is refused at start-up; these rules verify a one-hot q.
ONE_HOT_RULES = "exact, greedy, lenient or hf_greedy_draft"


@dataclasses.dataclass(frozen=True)
class Block:
  """What a drafter reads at the start of a block (arrays per row [B]). Built inside the traced
  loop; never carried."""
  tokens: jax.Array       # [B, N] committed generated tokens (0 past lengths)
  lengths: jax.Array      # [B] tokens generated so far
  last_two: jax.Array     # [B, 2] the last two committed stream tokens (prompt included)
  live: jax.Array         # [B] rows that are not done
  keys: jax.Array         # [B] this block's drafting keys
  rule: Any               # the acceptance rule, its traced values in it
  rule_state: Any         # the rule's state (a length policy may read its thresholds)
  warp: sampling.Warp
  gamma: int              # most proposals per row (static)
  limit: jax.Array        # [] max_new_tokens (traced)
  vocab: int              # the target's logits width


@flax.struct.dataclass(kw_only=True)
class Proposal:
  """One block's proposals."""
  tokens: jax.Array       # [B, K] int32 target ids (valid below count); an id >= vocab (union's
  #                         sentinel for a draft-only token) is fed as vocab - 1 and rejected
  q_logp: jax.Array       # [B, K, V] f32 warped draft log-probs over the target's ids
  count: jax.Array        # [B] int32 proposals offered, 0 .. K (0 for rows that are done)
  passes: jax.Array       # [B] int32 draft forward passes spent
  nonfinite: jax.Array    # [B] bool: a draft pass gave NaN / +inf logits
  state: Any              # the drafter's state after the block


@dataclasses.dataclass(frozen=True)
class Drafter:
  """Base drafter. Subclasses set `name` and implement init and propose."""
  name: ClassVar[str] = ""
  what: ClassVar[str] = ""          # what it is, in messages ("prompt lookup")
  one_hot: ClassVar[bool] = False   # q is one-hot: a proposal that depends only on the history
  needs_features: ClassVar[bool] = False   # reads the target's hidden states (after_commit)

  @property
  def model(self) -> Any:
    """The draft model whose params the loop passes (None: a drafter without one)."""
    return None

  @property
  def per_token(self) -> int:
    """Draft cache positions one committed target token may take (another tokenizer: more)."""
    return 1

  @property
  def variable_count(self) -> bool:
    """True when rows may offer fewer than gamma proposals: the loop verifies at the narrowest
    static width that holds the block's longest proposal."""
    return False

  @property
  def may_propose_none(self) -> bool:
    """True when every row of a block may offer no proposal (prompt lookup without a match):
    the loop then also verifies at width 1, the target's own step."""
    return False

  def check(self, target, rule) -> None:
    """ValueError naming the problem and the fix when `rule` cannot verify this drafter's
    proposals for `target`."""
    refusal = self.refusal(rule)
    if refusal:
      raise ValueError(refusal)

  def refusal(self, rule) -> str:
    """Why `rule` (a Rule or its class) cannot verify this drafter, "" when it can."""
    return one_hot_refusal(rule, self.what or self.name) if self.one_hot else ""

  def init(self, params, draft_prompt, new_cache: Callable, gamma: int) -> tuple[Any, Any]:
    """Prefill what the drafter keeps. new_cache(model, draft_prompt) -> an empty KV cache on
    the loop's layout; gamma: the most proposals per block. Returns (state, anchors): anchors
    are per-row constants."""
    raise NotImplementedError(f"{type(self).__name__} must implement init()")

  def after_commit(self, state, features: jax.Array, tokens: jax.Array, count: jax.Array):
    """(needs_features drafters) features [B, W, D]: the target's hidden states at W verified
    positions (after its final norm); tokens [B, W]: the token committed after each; count [B]:
    how many pairs were committed (0 for rows that are done). Returns the new state."""
    del features, tokens, count
    return state

  def propose(self, params, anchors, state, block: Block) -> Proposal:
    raise NotImplementedError(f"{type(self).__name__} must implement propose()")


def one_hot_refusal(rule, drafter: str) -> str:
  """Why `rule` cannot verify a drafter whose q is one-hot on the target's own ids, "" when it
  can: a cross-vocabulary rule maps a draft model's ids; a rule that reads q beyond the drafted
  token's mass (a divergence, an entropy) has nothing to read."""
  name = rule.rule_name or getattr(rule, "__name__", type(rule).__name__)
  if not rule.needs_same_vocab:
    return (f"rule {name!r} maps a draft model's vocabulary to the target's, and {drafter} "
            f"proposes the target's own ids: use {ONE_HOT_RULES}")
  if rule.needs_draft_law:
    return f"rule {name!r} cannot verify {drafter}: {rule.needs_draft_law}; use {ONE_HOT_RULES}"
  return ""
