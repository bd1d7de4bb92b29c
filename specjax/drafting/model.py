"""A second model drafts: on the target's vocabulary, or on its own (a VocabMap bridges the two).

Per block: rewind the draft cache to the committed stream minus its last two tokens, feed those
two (in draft ids), then propose up to gamma tokens, one draft pass each, while the length
policy lets the row go on. q is the rule's map of the draft's logits into warped log-probs over
the target's ids (rule.q_log_probs: the identity's warp for a shared vocabulary, Timor et al.'s
TLI or union map for another one); proposals are the rule's draws from q (rule.propose).

Another vocabulary: a committed target token is fed back as its draft encoding (the token's one
draft id, or its draft tokenization from the map's padded image table [V_T, W]), so one target
token may take up to W draft positions (`per_token`).

Early exit (LayerSkip's self-speculation) is this drafter over a model made of the target's
first layers (api/drafters.early_exit).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp

from specjax import sampling
from specjax.acceptance.vocab import VocabMap
from specjax.drafting import length as length_lib
from specjax.drafting.base import Block, Drafter, Proposal
from specjax.models import kv_cache, prompting

UNROLL_MAX_GAMMA = 8   # longer fixed-length draft loops stay rolled (compile time)


def unroll_drafts(variable: bool, gamma: int, backend: str | None = None) -> bool:
  """Whether a block's draft passes are unrolled into the compiled loop (True) or run by a
  while loop (False). Unrolled only on GPU for a fixed count of at most UNROLL_MAX_GAMMA: there
  a while loop reads its condition back to the host each iteration. On the CPU an iteration
  costs nothing measurable next to a draft pass, while every unrolled pass is another copy of
  the draft model for XLA to compile (at every start-up that misses the compilation cache, and in
  each of the test suite's loops). backend: jax.default_backend() when None."""
  backend = backend or jax.default_backend()
  return not variable and gamma <= UNROLL_MAX_GAMMA and backend in ("gpu", "cuda", "rocm")


@dataclasses.dataclass(frozen=True)
class ModelDrafter(Drafter):
  """draft_model: a model of the model contract (models/__init__.Model). vocab: the VocabMap
  when the draft has another tokenizer (None: the target's ids). length: the draft-length policy
  (drafting/length.py; None: the rule's own, length.for_rule)."""
  draft_model: Any = None
  vocab: VocabMap | None = None
  length: Any = None
  name: ClassVar[str] = "model"

  @property
  def model(self):
    return self.draft_model

  @property
  def per_token(self) -> int:
    return 1 if self.vocab is None else int(self.vocab.images.shape[1])

  @property
  def variable_count(self) -> bool:
    return self.length.variable

  def for_rule(self, rule) -> "ModelDrafter":
    """This drafter with what `rule` implies filled in: its length policy when none was given,
    and its VocabMap when the rule maps another vocabulary (a cross-vocabulary rule carries it as
    `vocab`)."""
    policy = length_lib.for_rule(rule) if self.length is None else self.length
    vmap = self.vocab if rule.needs_same_vocab else rule.vocab
    return dataclasses.replace(self, length=policy, vocab=vmap)

  # A same-vocabulary rule with a draft of another logits width (the target's tokenizer, its
  # embedding padded to another row count): q is the draft's logits fitted to the target's width
  # (sampling.fit_width), and a committed id past the draft's rows is fed to it as its last row.
  # Which tokenizer the draft has is checked above this layer (api/methods.check_same_vocabulary).

  def init(self, params, draft_prompt, new_cache, gamma: int):
    del gamma
    model = self.draft_model
    _, _, cache = model.prefill(params, draft_prompt, new_cache(model, draft_prompt))
    anchors = dict(base=cache.lengths,                                   # [B] after the prefill
                   anchor=prompting.stream_anchor(model, draft_prompt))  # [B] in draft ids
    return cache, anchors

  # -- feeding committed target tokens back to the draft

  def to_draft_ids(self, tokens: jax.Array) -> jax.Array:
    """Target ids [...] -> the draft's ids; a token without one draft id -> its first image id."""
    if self.vocab is None:
      return jnp.minimum(tokens, self.draft_model.vocab_size - 1)
    t2d = jnp.asarray(self.vocab.t2d)
    first = jnp.asarray(self.vocab.images[:, 0])
    safe = jnp.clip(tokens, 0, t2d.shape[0] - 1)
    return jnp.where(t2d[safe] >= 0, t2d[safe], first[safe])

  def draft_images(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Target ids [...] -> (draft encodings [..., W] zero-padded, their lengths [...])."""
    if self.vocab is None:
      return self.to_draft_ids(tokens)[..., None], jnp.ones_like(tokens)
    safe = jnp.clip(tokens, 0, self.vocab.images.shape[0] - 1)
    return jnp.asarray(self.vocab.images)[safe], jnp.asarray(self.vocab.image_len)[safe]

  # -- one block

  def propose(self, params, anchors, state, block: Block) -> Proposal:
    """Rewind the draft to len-2, feed the last two committed tokens, then draft up to gamma.

    The draft cache covers at least the committed stream minus its last two tokens, so rewinding
    to len-2 and (re)writing those two tokens covers both the case where the draft already saw
    the last accepted draft token and the case where it did not (all gamma drafts accepted). At
    g == 1 the first of the two is the last token of the draft's own prompt stream.
    """
    model = self.draft_model
    start, feed, count = self._feed(anchors, block)
    cache = kv_cache.rollback(state, start)
    logits, _, cache = model.extend(params, feed, cache, count - 1)       # [B, 1, V_d]
    cache = kv_cache.rollback(cache, start + count)
    # [B, V_d] -> [B, V]: the target's width (a shared vocabulary padded to another row count)
    fit = (lambda x: x) if self.vocab is not None else (
        lambda x: sampling.fit_width(x, block.vocab))

    def step(cache, prev):                                                # prev [B] target ids
      logits, _, cache = model.extend(params, self.to_draft_ids(prev)[:, None], cache)
      return fit(logits[:, 0]), cache

    return draft_steps(self.length, block, fit(logits[:, 0]), cache, step)

  def _feed(self, anchors, block: Block):
    """Where to rewind the draft and what to feed it: the draft encodings of the last two
    committed tokens, packed left. Returns (start [B], feed [B, 2W], count [B] valid entries).

    The committed generated tokens t_0 .. t_{g-1} occupy sum_i len(image(t_i)) draft entries
    after the draft's prompt; start skips all but the last two (at g == 1 the older one is the
    draft's own prompt anchor at base - 1). Example, W = 2, image lengths of t_0..t_3 =
    [1, 2, 1, 2], g = 4: start = base + 3, feed = image(t_2) ++ image(t_3) ++ [0] (count 3).
    With a shared vocab (W = 1) this is start = base + g - 2 and feed = last_two.
    """
    g = block.lengths
    _, lens = self.draft_images(block.tokens)                            # [B, N]
    before = jnp.arange(block.tokens.shape[1])[None, :] < (g - 2)[:, None]
    start = anchors["base"] + jnp.sum(jnp.where(before, lens, 0), axis=1) - (g == 1)
    old_ids, old_len = self.draft_images(block.last_two[:, 0])
    anchor = jnp.zeros_like(old_ids).at[:, 0].set(anchors["anchor"])
    old_ids = jnp.where((g == 1)[:, None], anchor, old_ids)
    old_len = jnp.where(g == 1, 1, old_len)
    new_ids, new_len = self.draft_images(block.last_two[:, 1])
    both = jnp.concatenate([old_ids, new_ids], axis=1)                   # [B, 2W]
    j = jnp.arange(both.shape[1])[None, :]
    width = old_ids.shape[1]
    src = jnp.where(j < old_len[:, None], j, j - old_len[:, None] + width)
    count = (old_len + new_len).astype(jnp.int32)
    feed = jnp.where(j < count[:, None],
                     jnp.take_along_axis(both, jnp.minimum(src, 2 * width - 1), axis=1), 0)
    return start.astype(jnp.int32), feed.astype(jnp.int32), count


def draft_steps(policy, block: Block, logits: jax.Array, carry: Any, step) -> Proposal:
  """Up to gamma proposals per row, one draft pass each, while `policy` lets the row go on.

  logits [B, V_d]: the draft's logits for the first proposal; carry: what step reads and
  updates (a KV cache); step(carry, prev [B] the previous proposal) -> (logits [B, V_d], carry).
  Returns the Proposal with the final carry as its state."""
  rule, K = block.rule, block.gamma
  q = rule.q_log_probs(logits, block.warp)                                # [B, V]
  batch, vocab = q.shape
  d = _Drafting(step=jnp.int32(0), q=q, tokens=jnp.zeros((batch, K), jnp.int32),
                q_logp=jnp.zeros((batch, K, vocab), jnp.float32),
                count=jnp.zeros((batch,), jnp.int32), active=block.live,
                passes=block.live.astype(jnp.int32),
                nonfinite=sampling.nonfinite_rows(logits), carry=carry)
  unrolled = unroll_drafts(policy.variable, K)
  # Variable windows stop where nothing more could be committed: the block also emits a
  # correction or bonus token (AdaSD's K = min(K_max, N_max - len - 1), papers/adasd.md §2).
  budget = block.limit - block.lengths - 1 if policy.variable else None   # [B]
  decide = functools.partial(_decide, policy, rule, _step_keys(block.keys, K),
                             block.rule_state, budget)

  def body(d: _Drafting) -> _Drafting:
    logits, carry = step(d.carry, jnp.take(d.tokens, d.step - 1, axis=1))
    d = d.replace(q=rule.q_log_probs(logits, block.warp), carry=carry,
                  passes=d.passes + d.active,
                  nonfinite=d.nonfinite | (d.active & sampling.nonfinite_rows(logits)))
    return decide(d, logits)

  if unrolled:
    d = jax.lax.fori_loop(0, K - 1, lambda _, d: body(d), decide(d, logits), unroll=True)
  else:
    d = jax.lax.while_loop(lambda d: (d.step < K) & jnp.any(d.active), body, decide(d, logits))
  return Proposal(tokens=d.tokens, q_logp=d.q_logp, count=d.count, passes=d.passes,
                  nonfinite=d.nonfinite, state=d.carry)


@flax.struct.dataclass(kw_only=True)
class _Drafting:
  """The drafting loop's carry within one block."""
  step: jax.Array        # [] next draft index
  q: jax.Array           # [B, V] q for draft `step`
  tokens: jax.Array      # [B, K] proposals (valid below count)
  q_logp: jax.Array      # [B, K, V]
  count: jax.Array       # [B]
  active: jax.Array      # [B] still drafting
  passes: jax.Array      # [B] draft forward passes this block
  nonfinite: jax.Array   # [B] a draft pass of this block gave NaN / +inf logits
  carry: Any             # what the draft's step reads and updates (its KV cache)


def _step_keys(keys: jax.Array, gamma: int):
  """step -> fold_in(keys[b], step) [B], every step's keys derived at once: one PRNG call per
  block (and one threefry in the compiled program, not one before the draft loop and another
  in its body), whether every step runs or drafting stops early."""
  table = sampling.fold_table(keys, gamma)                                 # [B, K]
  return lambda step: jnp.take(table, jnp.minimum(step, gamma - 1), axis=1)


def _decide(policy, rule, step_keys, rule_state, budget, d: _Drafting,
            logits: jax.Array) -> _Drafting:
  """Ask the length policy whether each row keeps drafting (never past `budget` [B] drafts, if
  given); propose draft `step` from q (logits [B, V_d]: the draft's, q's source)."""
  keep = d.active & policy.keep(d.q, d.step, rule, rule_state)
  if budget is not None:
    keep = keep & (d.step < budget)
  token = rule.propose(d.q, step_keys(d.step)).astype(jnp.int32)
  stop = policy.stop_after(d.q, d.step, rule, rule_state, logits)
  return d.replace(step=d.step + 1, tokens=d.tokens.at[:, d.step].set(token),
                   q_logp=d.q_logp.at[:, d.step].set(d.q.astype(jnp.float32)),
                   count=d.count + keep, active=keep & ~stop)
