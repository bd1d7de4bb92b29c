"""The speculative decoding loop: one SpecState through one jitted lax.while_loop (DESIGN.md §4).

Each block, for every row that is not done:
  1. draft: drafter.propose -> up to gamma proposals per row with their q (a model drafter
     rewinds its cache to the committed stream and drafts one pass per token; its length policy
     may stop a row early -> count);
  2. verify: one target.extend over [pending token, d_0 .. d_{gamma-1}] -> p [B, gamma+1, V];
     rule.verify -> n accepted and the next token (drafters whose counts vary verify at the
     narrowest static width holding the longest proposal: verify_widths);
  3. commit d_0 .. d_{n-1}, next at the row's own offset (cut at EOS and max_new_tokens) and roll
     the target cache back so that it holds the committed stream minus its last (pending) token.

Keys: row b's block starting at generated length g uses fold_in(fold_in(row_key_b, g), 0) for
drafting (then fold_in(., step)) and fold_in(., 1) for verification. The first token is the
rule's first_token of the target's prefill logits with fold_in(row_key_b, 0): a sample of the warp,
exactly as autoregressive decoding, unless the rule says otherwise (greedy: the argmax).

The drafter is anything that keeps the drafter contract (drafting/base.py): a second model
(drafting/model.py, on the target's vocabulary or another one), or prompt lookup
(drafting/ngram.py: no model, no cache, a one-hot q and a variable count).

With `mesh=` the same `loop` runs sharded (decoding/sharded.py): params by the rules table, caches
over rows and KV heads, per-row state over rows, the state pinned to that layout every block.

max_new_tokens is traced (Setup.limit): the program is compiled for its bucket
(state.new_tokens_bucket sizes the token buffer, and the caches when max_len is not given), so
20 and 30 share one program and give the tokens each would give alone.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import drafting, sampling
from specjax.acceptance import base, registry
from specjax.decoding import autoregressive as ar
from specjax.decoding import sharded
from specjax.decoding.state import (DRAFT, TARGET, Generation, OnChunk, Reserve, SpecState,
                                    SpecStats, auto_capacity, chunk_loop, is_stop, loop_jit,
                                    new_tokens_bucket, run_loop, stop_ids,
                                    write_rows)
from specjax.models import Prompt
from specjax.models import kv_cache, prompting


@dataclasses.dataclass(frozen=True)
class Setup:
  """Everything static about one generation (the jit cache key)."""
  target: Any
  drafter: drafting.Drafter   # completed for the rule (drafting.as_drafter)
  rule: base.Rule
  gamma: int
  max_new: int      # the token buffer: new_tokens_bucket(max_new_tokens)
  warp: sampling.Warp
  eos: tuple[int, ...]   # stop ids; (): none
  max_len: int      # cache capacity of both models
  mesh: Any = None  # a ('data', 'model') Mesh: the loop runs sharded over it (decoding/sharded.py)
  limit: Any = None  # [] int32, traced: max_new_tokens itself (<= max_new); None in the jit key


@flax.struct.dataclass(kw_only=True)
class Anchors:
  """Per-row constants fixed by the prefill."""
  target_base: jax.Array    # [B] target cache length after prefill (stream length - 1)
  drafter: Any              # the drafter's own ({name: [B, ...]}, drafter.init)


def generate(target, target_params, draft, draft_params, prompt: Prompt, key: jax.Array, *,
             rule: base.Rule | str, gamma: int, max_new_tokens: int, warp: sampling.Warp,
             eos_id: int | Sequence[int] | None, draft_prompt: Prompt | None = None, max_len: int | None = None,
             debug: bool = False, mesh=None, on_chunk: OnChunk | None = None,
             chunk_blocks: int = 1) -> Generation:
  """Speculative decoding of up to max_new_tokens per row.

  draft: a draft model (draft_params its params), or a drafter (drafting/: NGram for prompt
  lookup, draft_params None; a ModelDrafter with its own length policy). rule: a Rule or a registered name. key: one PRNG key (row b uses
  fold_in(key, b)) or per-row keys [B]. draft_prompt: the prompt in the draft's tokenization
  (default: prompt). max_len: the cache size of both models (default: just enough). debug=True
  runs the same block function from a Python loop, one jitted call per block (wrap the call in
  `jax.disable_jit()` to run eagerly). mesh: a ('data', 'model') Mesh to decode on
  (decoding/sharded.py); the tokens are those of one device. on_chunk: streaming: the loop runs
  chunks of `chunk_blocks` blocks, one compiled call each with the state donated, and calls
  on_chunk(tokens [B, N], lengths [B]) after the prefill and after each chunk (state.drive: it may
  end rows, e.g. at a stop string); one device only.
  Raises NonFiniteLogitsError if either model's logits held NaN / inf.
  """
  setup = _validate(target, draft, prompt, draft_prompt, rule=rule, gamma=gamma,
                    max_new_tokens=max_new_tokens, warp=warp, eos_id=eos_id, max_len=max_len)
  # The rule, the warp and the limit are traced arguments (`knobs`), not part of the static
  # setup: another temperature, top_p, rule hyperparameter (Rule.traced), top_k or
  # max_new_tokens of the same bucket reuses the compiled loop.
  knobs = (setup.rule, setup.warp, np.int32(setup.limit))
  setup = dataclasses.replace(setup, mesh=mesh, rule=None, warp=None, limit=None)
  draft_prompt = prompt if draft_prompt is None else draft_prompt
  keys = sampling.as_row_keys(key, prompt.tokens.shape[0])
  params, prompts = (target_params, draft_params), (prompt, draft_prompt)
  models = (target, setup.drafter.model)
  return run_loop(lambda: run(setup, *params, *prompts, keys, knobs),
                  lambda: _start(setup, *params, *prompts, keys, knobs),
                  lambda: sharded.generate(loop, setup, models, params, prompts, keys, knobs),
                  mesh=mesh, max_new=max_new_tokens, models=models, on_chunk=on_chunk,
                  debug=debug, chunk_blocks=chunk_blocks)


def _validate(target, draft, prompt, draft_prompt, *, rule, gamma, max_new_tokens, warp, eos_id,
              max_len) -> Setup:
  """Host-side checks with actionable messages, before anything is traced. The Setup holds the
  rule, the warp and the limit (max_new_tokens) that `generate` passes traced, as `knobs`."""
  rule = registry.get(rule) if isinstance(rule, str) else rule
  if not isinstance(rule, base.Rule):
    raise TypeError(f"rule must be an acceptance Rule or a registered name "
                    f"({', '.join(registry.names())}), got {type(rule).__name__}")
  if isinstance(gamma, bool) or not isinstance(gamma, numbers.Integral) or gamma < 1:
    raise ValueError(f"gamma (draft tokens per block) must be an integer >= 1, got {gamma!r}")
  gamma = int(gamma)
  ar.check_batch(max_new_tokens, prompt, warp)
  drafter = drafting.as_drafter(draft, rule)
  drafter.check(target, rule)
  dprompt = prompt if draft_prompt is None else draft_prompt
  if dprompt.tokens.shape[0] != prompt.tokens.shape[0]:
    raise ValueError(f"draft_prompt has {dprompt.tokens.shape[0]} rows, prompt has "
                     f"{prompt.tokens.shape[0]}: they must describe the same batch")
  caches = [(reserve(gamma), prompting.prefix_len(target, prompt))]
  models = (target,)
  if drafter.model is not None:
    caches.append((reserve(gamma, drafter), prompting.prefix_len(drafter.model, dprompt)))
    models += (drafter.model,)
  bucket = new_tokens_bucket(max_new_tokens)
  need = max(room.need(prefix, max_new_tokens) for room, prefix in caches)
  if max_len is None:
    max_len = auto_capacity(need, max(room.need(prefix, bucket) for room, prefix in caches),
                            models)
  kv_cache.check_capacity(need, int(max_len), f"prompt + max_new_tokens + gamma ({gamma})")
  return Setup(target=target, drafter=drafter, rule=rule, gamma=gamma, max_new=bucket,
               warp=warp, eos=stop_ids(eos_id), max_len=int(max_len), limit=max_new_tokens)


def reserve(gamma: int, drafter: drafting.Drafter | None = None) -> Reserve:
  """The cache room of the target (drafter None) or of the drafter's model. A block writes
  gamma + 1 target entries after base + g - 1 committed ones, and rows that are done
  (g == max_new_tokens) are still computed: max_new_tokens + gamma covers every write of both
  models (the check uses max_new_tokens itself; a cache sized without max_len holds its bucket,
  state.auto_capacity). A draft with another vocabulary may take up to drafter.per_token draft
  positions per committed token."""
  return Reserve(per_token=1 if drafter is None else drafter.per_token, fixed=gamma,
                 what=f"gamma {gamma}")


@loop_jit(static_argnums=0)
def run(setup: Setup, target_params, draft_params, prompt: Prompt, draft_prompt: Prompt,
        keys: jax.Array, knobs) -> SpecState:
  """The whole generation as one compiled call; returns the final SpecState (caches included).
  knobs: (rule, warp, limit), traced (the setup's own are ignored)."""
  return loop(setup, (target_params, draft_params), (prompt, draft_prompt), keys, knobs)


def with_knobs(setup: Setup, knobs) -> Setup:
  """The setup with the traced (rule, warp, limit) of a compiled call in it."""
  rule, warp, limit = knobs
  return dataclasses.replace(setup, rule=rule, warp=warp, limit=limit)


def loop(setup: Setup, params, prompts, keys: jax.Array, knobs) -> SpecState:
  """`run` before jit (decoding/sharded.py jits it with explicit shardings): params = (target's,
  draft's), prompts = (target's, draft's). With setup.mesh the state is pinned to its shardings
  after the prefill and after every block."""
  (target_params, draft_params), (prompt, draft_prompt) = params, prompts
  setup = with_knobs(setup, knobs)
  state, anchors = init(setup, target_params, draft_params, prompt, draft_prompt, keys)
  step = functools.partial(block, setup, target_params, draft_params, anchors)
  return jax.lax.while_loop(lambda s: ~jnp.all(s.done),
                            lambda s: sharded.pin(step(s), setup.mesh),
                            sharded.pin(state, setup.mesh))


def _start(setup, target_params, draft_params, prompt, draft_prompt, keys, knobs):
  """The chunked form (state.run_loop): the prefill, and `advance` running the same block
  function one jitted call per chunk with the state donated; the state can be inspected between
  chunks. Under `with jax.disable_jit():` everything runs eagerly (breakpoints inside rules and
  models work)."""
  state, anchors = _init_jit(setup, target_params, draft_params, prompt, draft_prompt, keys, knobs)
  # The compiler options follow the arguments' dtypes, which no chunk changes: chosen once, not
  # by walking every param leaf at each chunk's call.
  chunk = _chunk_jit.jitted(setup, target_params, draft_params, anchors, state, 1, knobs)
  return state, lambda s, blocks: chunk(setup, target_params, draft_params, anchors, s, blocks,
                                        knobs)


def init(setup: Setup, target_params, draft_params, prompt, draft_prompt, keys):
  """Prefill the target and the drafter; the first token is the rule's draw from the target's
  prefill logits."""
  target, drafter = setup.target, setup.drafter
  batch = prompt.tokens.shape[0]
  new_cache = lambda model, p: sharded.init_cache(model, batch, setup.max_len,
                                                  prompting.enc_len(model, p), setup.mesh)
  logits, hidden, tcache = target.prefill(target_params, prompt,
                                          new_cache(target, prompt))        # [B, V], [B, D]
  first_keys = sampling.position_keys(keys, jnp.zeros((batch,), jnp.int32))
  first = setup.rule.first_token(logits, setup.warp, first_keys).astype(jnp.int32)   # [B]
  drafter_state, drafter_anchors = drafter.init(draft_params, draft_prompt, new_cache,
                                                setup.gamma)
  if drafter.needs_features:            # the first pair: the prompt's last position, first
    hidden = jnp.reshape(hidden, (batch, 1, -1))
    drafter_state = drafter.after_commit(drafter_state, hidden, first[:, None],
                                         jnp.ones((batch,), jnp.int32))
  anchors = Anchors(target_base=tcache.lengths, drafter=drafter_anchors)
  ones = jnp.ones((batch,), jnp.int32)
  state = SpecState(
      tokens=jnp.zeros((batch, setup.max_new), jnp.int32).at[:, 0].set(first),
      lengths=ones, done=is_stop(first, setup.eos) | (setup.limit <= 1),
      last_two=jnp.stack([prompting.stream_anchor(target, prompt), first], axis=1),
      target_cache=tcache, drafter_state=drafter_state, rule_state=setup.rule.init_state(batch),
      key=keys,
      stats=SpecStats.zeros(batch).add(blocks=ones, emitted=ones, target_passes=ones,
                                       draft_passes=ones * (drafter.model is not None))
      .flag(TARGET, sampling.nonfinite_rows(logits)))
  return state, anchors


def block(setup: Setup, target_params, draft_params, anchors: Anchors, s: SpecState) -> SpecState:
  """One draft-verify-commit block for every row that is not done."""
  live = ~s.done                                                          # [B]
  block_keys = sampling.position_keys(s.key, s.lengths)
  purpose_keys = sampling.fold_table(block_keys, 2)                       # [B, 2]
  draft_keys, verify_keys = purpose_keys[:, 0], purpose_keys[:, 1]
  view = drafting.Block(tokens=s.tokens, lengths=s.lengths, last_two=s.last_two, live=live,
                        keys=draft_keys, rule=setup.rule, rule_state=s.rule_state,
                        warp=setup.warp, gamma=setup.gamma, limit=setup.limit,
                        vocab=setup.target.vocab_size)
  d = setup.drafter.propose(draft_params, anchors.drafter, s.drafter_state, view)
  n, next_token, rule_state, tcache, bad, hidden = _verify(setup, target_params, s, d, live,
                                                           verify_keys)
  n = jnp.minimum(n, d.count)
  stats = s.stats.flag(TARGET, live & bad).flag(DRAFT, live & d.nonfinite)
  s = s.replace(target_cache=tcache, drafter_state=d.state, stats=stats,
                rule_state=setup.rule.select_rows(live, rule_state, s.rule_state))
  return _commit(setup, anchors, s, live, d, n, next_token, hidden)


def verify_widths(setup: Setup) -> tuple[int, ...]:
  """Static widths of the target's verify pass. Drafters that propose gamma tokens: gamma+1.
  Drafters whose proposals vary per row (AdaSD's window up to 20, prompt lookup) get power-of-two
  buckets, so that a block whose longest proposal is 3 runs a 4-token pass, not a 21-token one
  (a pass's cost grows with its width on CPU). A drafter that may propose nothing (prompt lookup
  without a match) also gets width 1: such a block is the target's own decoding step."""
  full = setup.gamma + 1
  if not setup.drafter.variable_count:
    return (full,)
  first = 0 if setup.drafter.may_propose_none else 1
  return tuple(sorted({min(2 ** i, full) for i in range(first, full.bit_length() + 1)}))


def _verify(setup: Setup, params, s: SpecState, d: drafting.Proposal, live, keys):
  """One target pass over [pending token, d_0 .. d_{K-1}] and the rule's verdict.

  Returns (n accepted [B], next token [B], rule_state, target cache, [B] non-finite target
  logits, the target's hidden states [B, K+1, D] for a drafter that reads them, else None). With several verify widths the pass and the rule run at the narrowest width that
  holds every live row's drafts (a lax.switch over static widths): row results do not depend on
  the width (the rule's uniforms are per draft, see base.verify_streams), so batch rows still
  equal single-row runs.
  """
  # An id past the target's (union's sentinel for a draft-only token) is fed as the last id: the
  # rule rejects it, so what the target computes there is never used.
  drafts = jnp.minimum(d.tokens, setup.target.vocab_size - 1)            # [B, K]
  feed = jnp.concatenate([s.last_two[:, 1:], drafts], axis=1)            # [B, K+1]
  full = feed.shape[1]

  def at_width(width):
    def run(feed, cache):
      p_logits, hidden, (k, v) = setup.target.extend_entries(params, feed[:, :width], cache)
      bad = sampling.nonfinite_rows(p_logits)                                     # [B]
      p_logp = setup.rule.p_log_probs(p_logits, setup.warp)              # [B, width, V]
      n, token, rule_state = setup.rule.verify(d.tokens[:, :width - 1], d.count,
                                               d.q_logp[:, :width - 1], p_logp, keys,
                                               s.rule_state)
      pad = ((0, 0), (0, 0), (0, full - width), (0, 0), (0, 0))
      k, v = jnp.pad(k, pad), jnp.pad(v, pad)                            # [L, B, K+1, H, Dh]
      hidden = (jnp.pad(hidden, ((0, 0), (0, full - width), (0, 0)))     # [B, K+1, D]
                if setup.drafter.needs_features else None)
      return n.astype(jnp.int32), token.astype(jnp.int32), rule_state, (k, v), bad, hidden
    return run

  widths = verify_widths(setup)
  if len(widths) == 1:
    n, token, rule_state, (k, v), bad, hidden = at_width(full)(feed, s.target_cache)
  else:
    # The branches only read the cache; written inside them it would be copied whole, twice.
    need = jnp.max(jnp.where(live, d.count, 0)) + 1
    index = jnp.searchsorted(jnp.asarray(widths), need)                  # first width >= need
    n, token, rule_state, (k, v), bad, hidden = jax.lax.switch(
        index, [at_width(w) for w in widths], feed, s.target_cache)
  # Entries past a row's width are zeros past its drafts: _commit's rollback drops them.
  return n, token, rule_state, kv_cache.append(s.target_cache, k, v), bad, hidden


def _commit(setup: Setup, anchors: Anchors, s: SpecState, live, d: drafting.Proposal, n,
            next_token, hidden):
  """Commit d_0 .. d_{n-1}, next_token per row, cut at EOS / max_new, and roll the target back.

  Worked example, gamma K=3, max_new 8, eos 2, target_base 4 (prompt of 4 tokens):
    row 0: lengths 5, drafts [7 8 9], n 2, next 4 -> out [7 8 4 0], count 3: tokens[0, 5:8] =
      7 8 4, lengths 8 (== max_new: done), last_two [8 4]. The target cache held base+5-1 = 8
      entries; extend wrote pending,7,8,9 (12); rollback to base+8-1 = 11 keeps pending,7,8 and
      drops 9. The new pending token 4 is fed by the next block.
    row 1: lengths 3, drafts [5 2 6], n 3, next 1 -> out [5 2 6 1]; EOS at index 1 -> count 2,
      tokens[1, 3:5] = 5 2, lengths 5, done.
    row 2: lengths 6, drafts [5 5 5], n 3, next 1 -> count min(4, 8-6) = 2, lengths 8, done.
  Writes past a row's count go to index setup.max_new (the buffer's width) and are dropped;
  max_new above is the limit, setup.limit (traced), which the buffer may exceed.
  """
  K, max_new, width = setup.gamma, setup.limit, setup.max_new
  j = jnp.arange(K + 1)[None, :]                                          # [1, K+1]
  drafts = jnp.pad(d.tokens, ((0, 0), (0, 1)))                            # [B, K+1]
  out = jnp.where(j < n[:, None], drafts, jnp.where(j == n[:, None], next_token[:, None], 0))
  is_eos = is_stop(out, setup.eos) & (j <= n[:, None])
  first_eos = jnp.argmax(is_eos, axis=1)
  has_eos = jnp.any(is_eos, axis=1)
  count = jnp.where(has_eos, first_eos + 1, n + 1)
  count = jnp.where(live, jnp.minimum(count, max_new - s.lengths), 0).astype(jnp.int32)
  write_at = jnp.where(j < count[:, None], s.lengths[:, None] + j, width)
  lengths = s.lengths + count
  done = s.done | (live & ((has_eos & (first_eos < count)) | (lengths >= max_new)))
  ext = jnp.concatenate([s.last_two, out], axis=1)                        # [B, K+3]
  last_two = jnp.stack([jnp.take_along_axis(ext, count[:, None], 1)[:, 0],
                        jnp.take_along_axis(ext, count[:, None] + 1, 1)[:, 0]], axis=1)
  as_int = lambda x: jnp.where(live, x, 0)
  # Counts stop at what was committed: a block cut by EOS or max_new_tokens after c tokens
  # accepted at most c of its drafts (and verified no more than it committed).
  stats = s.stats.add(blocks=live, drafted=as_int(d.count),
                      accepted=as_int(jnp.minimum(n, count)),
                      verified=as_int(jnp.minimum(jnp.minimum(n + 1, d.count), count)),
                      emitted=count,
                      target_passes=live, draft_passes=as_int(d.passes))
  drafter_state = s.drafter_state
  if setup.drafter.needs_features:      # the verified positions' features with what followed them
    drafter_state = setup.drafter.after_commit(drafter_state, hidden, out, count)
  return s.replace(
      tokens=write_rows(s.tokens, write_at, out), lengths=lengths, done=done,
      drafter_state=drafter_state,
      last_two=last_two, stats=stats,
      target_cache=kv_cache.rollback(s.target_cache, anchors.target_base + lengths - 1))


@functools.partial(jax.jit, static_argnums=0)
def _init_jit(setup: Setup, target_params, draft_params, prompt, draft_prompt, keys, knobs):
  return init(with_knobs(setup, knobs), target_params, draft_params, prompt, draft_prompt, keys)


@loop_jit(static_argnums=(0, 5), donate_argnums=4)
def _chunk_jit(setup: Setup, target_params, draft_params, anchors: Anchors, state: SpecState,
               blocks: int, knobs) -> SpecState:
  setup = with_knobs(setup, knobs)
  step = functools.partial(block, setup, target_params, draft_params, anchors)
  return chunk_loop(step, state, blocks)
