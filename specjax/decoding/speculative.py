"""The speculative decoding loop: one SpecState through one jitted lax.while_loop (DESIGN.md §4).

Each block, for every row that is not done:
  1. draft: rewind the draft cache to len-2 and feed the last two committed tokens, then propose up
     to gamma tokens (a lax.while_loop; the rule's keep_drafting may stop a row early -> draft_len);
  2. verify: one target.extend over [pending token, d_0 .. d_{gamma-1}] -> p [B, gamma+1, V];
     rule.verify -> n accepted and the next token (rules whose drafts stop early verify at the
     narrowest static width holding the longest draft: verify_widths);
  3. commit d_0 .. d_{n-1}, next at the row's own offset (cut at EOS and max_new_tokens) and roll
     the target cache back so that it holds the committed stream minus its last (pending) token.

Keys: row b's block starting at generated length g uses fold_in(fold_in(row_key_b, g), 0) for
drafting (then fold_in(., step)) and fold_in(., 1) for verification. The first token is the
rule's first_token of the target's prefill logits with fold_in(row_key_b, 0): a sample of the warp,
exactly as autoregressive decoding, unless the rule says otherwise (greedy: the argmax).

The drafter is a second model, or prompt lookup (decoding/ngram.py: no model, no cache; its
proposals follow the last match of the stream's suffix, with a one-hot q and a variable count).

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

from specjax import sampling
from specjax.acceptance import base, registry
from specjax.decoding import autoregressive as ar
from specjax.decoding import ngram, sharded
from specjax.decoding.state import (DRAFT, TARGET, Generation, OnChunk, Reserve, SpecState,
                                    SpecStats, auto_capacity, chunk_loop, is_stop, loop_jit,
                                    new_tokens_bucket, nonfinite_rows, run_loop, stop_ids,
                                    write_rows)
from specjax.models import Prompt
from specjax.models import kv_cache, prompting


@dataclasses.dataclass(frozen=True)
class Setup:
  """Everything static about one generation (the jit cache key)."""
  target: Any
  draft: Any        # a draft model, or a drafter without one (ngram.NGram)
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
  draft_base: jax.Array     # [B] draft cache length after its prefill
  draft_anchor: jax.Array   # [B] last token of the draft's prompt stream, in draft ids
  history: jax.Array | None = None       # [B, P] the prompt (prompt lookup reads it)
  history_len: jax.Array | None = None   # [B]


def is_lookup(draft) -> bool:
  """A drafter that is no model (prompt lookup): no params, no cache, a one-hot q."""
  return isinstance(draft, ngram.NGram)


def generate(target, target_params, draft, draft_params, prompt: Prompt, key: jax.Array, *,
             rule: base.Rule | str, gamma: int, max_new_tokens: int, warp: sampling.Warp,
             eos_id: int | Sequence[int] | None, draft_prompt: Prompt | None = None, max_len: int | None = None,
             debug: bool = False, mesh=None, on_chunk: OnChunk | None = None,
             chunk_blocks: int = 1) -> Generation:
  """Speculative decoding of up to max_new_tokens per row.

  draft: a draft model (draft_params its params), or ngram.NGram(...) for prompt lookup
  (draft_params None). rule: a Rule or a registered name. key: one PRNG key (row b uses
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
  return run_loop(lambda: run(setup, *params, *prompts, keys, knobs),
                  lambda: _start(setup, *params, *prompts, keys, knobs),
                  lambda: sharded.generate(loop, setup, (target, draft), params, prompts, keys,
                                           knobs),
                  mesh=mesh, max_new=max_new_tokens, models=(target, draft), on_chunk=on_chunk,
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
  if is_lookup(draft):                     # no draft model: no vocabulary, prompt or cache
    refusal = lookup_refusal(rule)
    if refusal:
      raise ValueError(refusal)
  elif rule.needs_same_vocab and draft.vocab_size != target.vocab_size:
    raise ValueError(
        f"draft vocab size {draft.vocab_size} differs from target vocab size {target.vocab_size} "
        f"and rule {rule.rule_name or type(rule).__name__!r} needs a shared vocabulary: use a "
        f"draft with the target's tokenizer or a cross-vocabulary rule")
  dprompt = prompt if draft_prompt is None else draft_prompt
  if dprompt.tokens.shape[0] != prompt.tokens.shape[0]:
    raise ValueError(f"draft_prompt has {dprompt.tokens.shape[0]} rows, prompt has "
                     f"{prompt.tokens.shape[0]}: they must describe the same batch")
  caches = [(reserve(rule, gamma), prompting.prefix_len(target, prompt))]
  if not is_lookup(draft):
    caches.append((reserve(rule, gamma, draft=True), prompting.prefix_len(draft, dprompt)))
  bucket = new_tokens_bucket(max_new_tokens)
  need = max(room.need(prefix, max_new_tokens) for room, prefix in caches)
  if max_len is None:
    models = (target,) if is_lookup(draft) else (target, draft)
    max_len = auto_capacity(need, max(room.need(prefix, bucket) for room, prefix in caches),
                            models)
  kv_cache.check_capacity(need, int(max_len), f"prompt + max_new_tokens + gamma ({gamma})")
  return Setup(target=target, draft=draft, rule=rule, gamma=gamma, max_new=bucket,
               warp=warp, eos=stop_ids(eos_id), max_len=int(max_len), limit=max_new_tokens)


LOOKUP_RULES = "exact, greedy, lenient or hf_greedy_draft"


def lookup_refusal(rule) -> str:
  """Why `rule` (a Rule or its class) cannot verify prompt lookup's drafts, "" when it can."""
  name = rule.rule_name or getattr(rule, "__name__", type(rule).__name__)
  if not rule.needs_same_vocab:
    return (f"rule {name!r} maps a draft model's vocabulary to the target's, and prompt lookup "
            f"proposes the target's own ids: use {LOOKUP_RULES}")
  if rule.needs_draft_law:
    return f"rule {name!r} cannot verify prompt lookup: {rule.needs_draft_law}; use {LOOKUP_RULES}"
  return ""


def reserve(rule: base.Rule, gamma: int, draft: bool = False) -> Reserve:
  """A block writes gamma + 1 target entries after base + g - 1 committed ones, and rows that
  are done (g == max_new_tokens) are still computed: max_new_tokens + gamma covers every write of
  both models (the check uses max_new_tokens itself; a cache sized without max_len holds its
  bucket, state.auto_capacity).
  A draft with another vocabulary may need up to rule.draft_image_width draft tokens per
  committed token."""
  return Reserve(per_token=rule.draft_image_width if draft else 1, fixed=gamma,
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
  return state, lambda s, blocks: _chunk_jit(setup, target_params, draft_params, anchors, s,
                                             blocks, knobs)


def init(setup: Setup, target_params, draft_params, prompt, draft_prompt, keys):
  """Prefill both models; the first token is the rule's draw from the target's prefill logits."""
  target, draft = setup.target, setup.draft
  batch = prompt.tokens.shape[0]
  tcache = sharded.init_cache(target, batch, setup.max_len, prompting.enc_len(target, prompt),
                              setup.mesh)
  logits, _, tcache = target.prefill(target_params, prompt, tcache)      # [B, V]
  first_keys = sampling.position_keys(keys, jnp.zeros((batch,), jnp.int32))
  first = setup.rule.first_token(logits, setup.warp, first_keys).astype(jnp.int32)   # [B]
  if is_lookup(draft):
    dcache, zeros = None, jnp.zeros((batch,), jnp.int32)
    anchors = Anchors(target_base=tcache.lengths, draft_base=zeros, draft_anchor=zeros,
                      history=prompt.tokens, history_len=prompt.lengths.astype(jnp.int32))
  else:
    dcache = sharded.init_cache(draft, batch, setup.max_len,
                                prompting.enc_len(draft, draft_prompt), setup.mesh)
    _, _, dcache = draft.prefill(draft_params, draft_prompt, dcache)
    anchors = Anchors(target_base=tcache.lengths, draft_base=dcache.lengths,
                      draft_anchor=ar.stream_anchor(draft, draft_prompt))
  ones = jnp.ones((batch,), jnp.int32)
  state = SpecState(
      tokens=jnp.zeros((batch, setup.max_new), jnp.int32).at[:, 0].set(first),
      lengths=ones, done=is_stop(first, setup.eos) | (setup.limit <= 1),
      last_two=jnp.stack([ar.stream_anchor(target, prompt), first], axis=1),
      target_cache=tcache, draft_cache=dcache, rule_state=setup.rule.init_state(batch), key=keys,
      stats=SpecStats.zeros(batch).add(blocks=ones, emitted=ones, target_passes=ones,
                                       draft_passes=ones * (dcache is not None))
      .flag(TARGET, nonfinite_rows(logits)))
  return state, anchors


def block(setup: Setup, target_params, draft_params, anchors: Anchors, s: SpecState) -> SpecState:
  """One draft-verify-commit block for every row that is not done."""
  live = ~s.done                                                          # [B]
  block_keys = sampling.position_keys(s.key, s.lengths)
  d = _draft(setup, draft_params, anchors, s, live, sampling.fold_rows(block_keys, 0))
  n, next_token, rule_state, tcache, bad = _verify(setup, target_params, s, d, live,
                                                   sampling.fold_rows(block_keys, 1))
  n = jnp.minimum(n, d.draft_len)
  stats = s.stats.flag(TARGET, live & bad).flag(DRAFT, live & d.nonfinite)
  s = s.replace(target_cache=tcache, draft_cache=d.cache, stats=stats,
                rule_state=setup.rule.select_rows(live, rule_state, s.rule_state))
  return _commit(setup, anchors, s, live, d, n, next_token)


def verify_widths(setup: Setup) -> tuple[int, ...]:
  """Static widths of the target's verify pass. Fixed-length rules: gamma+1. Rules whose drafts
  stop early (AdaSD, window up to 20) get power-of-two buckets, so that a block whose longest
  draft is 3 runs a 4-token pass, not a 21-token one (a pass's cost grows with its width on CPU)."""
  full = setup.gamma + 1
  if not (setup.rule.variable_length or is_lookup(setup.draft)):
    return (full,)
  return tuple(sorted({min(2 ** i, full) for i in range(1, full.bit_length() + 1)}))


def _verify(setup: Setup, params, s: SpecState, d: _Drafts, live, keys):
  """One target pass over [pending token, d_0 .. d_{K-1}] and the rule's verdict.

  Returns (n accepted [B], next token [B], rule_state, target cache, [B] non-finite target
  logits). With several verify widths the pass and the rule run at the narrowest width that
  holds every live row's drafts (a lax.switch over static widths): row results do not depend on
  the width (the rule's uniforms are per draft, see base.verify_streams), so batch rows still
  equal single-row runs.
  """
  drafts = setup.rule.to_target_ids(d.tokens)                           # [B, K]
  feed = jnp.concatenate([s.last_two[:, 1:], drafts], axis=1)            # [B, K+1]
  full = feed.shape[1]

  def at_width(width):
    def run(feed, cache):
      p_logits, _, (k, v) = setup.target.extend_entries(params, feed[:, :width], cache)
      bad = nonfinite_rows(p_logits)                                     # [B]
      p_logp = setup.rule.p_log_probs(p_logits, setup.warp)              # [B, width, V]
      n, token, rule_state = setup.rule.verify(d.tokens[:, :width - 1], d.draft_len,
                                               d.q_logp[:, :width - 1], p_logp, keys,
                                               s.rule_state)
      pad = ((0, 0), (0, 0), (0, full - width), (0, 0), (0, 0))
      k, v = jnp.pad(k, pad), jnp.pad(v, pad)                            # [L, B, K+1, H, Dh]
      return n.astype(jnp.int32), token.astype(jnp.int32), rule_state, (k, v), bad
    return run

  widths = verify_widths(setup)
  if len(widths) == 1:
    n, token, rule_state, (k, v), bad = at_width(full)(feed, s.target_cache)
  else:
    # The branches only read the cache; written inside them it would be copied whole, twice.
    need = jnp.max(jnp.where(live, d.draft_len, 0)) + 1
    index = jnp.searchsorted(jnp.asarray(widths), need)                  # first width >= need
    n, token, rule_state, (k, v), bad = jax.lax.switch(index, [at_width(w) for w in widths],
                                                       feed, s.target_cache)
  # Entries past a row's width are zeros past its drafts: _commit's rollback drops them.
  return n, token, rule_state, kv_cache.append(s.target_cache, k, v), bad


@flax.struct.dataclass(kw_only=True)
class _Drafts:
  step: jax.Array        # [] next draft index
  q: jax.Array           # [B, V] q for draft `step`
  tokens: jax.Array      # [B, K] proposals (valid below draft_len)
  q_logp: jax.Array      # [B, K, V]
  draft_len: jax.Array   # [B]
  active: jax.Array      # [B] still drafting
  passes: jax.Array      # [B] draft forward passes this block
  nonfinite: jax.Array   # [B] a draft pass of this block gave NaN / +inf logits
  cache: kv_cache.KVCache | None     # None: a drafter without a model


def _draft(setup: Setup, params, anchors: Anchors, s: SpecState, live, keys) -> _Drafts:
  """The block's drafts: prompt lookup's, or the draft model's (_draft_model)."""
  if is_lookup(setup.draft):
    return _lookup(setup, anchors, s, live)
  return _draft_model(setup, params, anchors, s, live, keys)


def _lookup(setup: Setup, anchors: Anchors, s: SpecState, live) -> _Drafts:
  """Prompt lookup's proposals with their one-hot q [B, K, V]; no draft pass."""
  tokens, count = setup.draft.propose(anchors.history, anchors.history_len, s.tokens, s.lengths,
                                      setup.gamma)
  count = jnp.where(live, count, 0)
  vocab = setup.target.vocab_size
  q_logp = jnp.where(jax.nn.one_hot(tokens, vocab, dtype=bool), 0.0, -jnp.inf)   # [B, K, V]
  none = jnp.zeros(live.shape, bool)
  return _Drafts(step=jnp.int32(setup.gamma), q=q_logp[:, -1], tokens=tokens, q_logp=q_logp,
                 draft_len=count, active=none, passes=count * 0, nonfinite=none, cache=None)


def _draft_model(setup: Setup, params, anchors: Anchors, s: SpecState, live, keys) -> _Drafts:
  """Rewind the draft to len-2, feed the last two committed tokens, then draft up to gamma tokens.

  The draft cache covers at least the committed stream minus its last two tokens, so rewinding to
  len-2 and (re)writing those two tokens covers both the case where the draft already saw the
  last accepted draft token and the case where it did not (all gamma drafts accepted). At g == 1
  the first of the two is the last token of the draft's own prompt stream.
  """
  rule, model, K = setup.rule, setup.draft, setup.gamma
  start, feed, count = _draft_feed(rule, anchors, s)
  cache = kv_cache.rollback(s.draft_cache, start)
  logits, _, cache = model.extend(params, feed, cache, count - 1)         # [B, 1, V_d]
  cache = kv_cache.rollback(cache, start + count)
  q = rule.q_log_probs(logits[:, 0], setup.warp)                         # [B, V]
  batch, vocab = q.shape
  d = _Drafts(step=jnp.int32(0), q=q, tokens=jnp.zeros((batch, K), jnp.int32),
              q_logp=jnp.zeros((batch, K, vocab), jnp.float32),
              draft_len=jnp.zeros((batch,), jnp.int32), active=live,
              passes=live.astype(jnp.int32), nonfinite=nonfinite_rows(logits), cache=cache)
  fixed = not rule.variable_length
  unrolled = fixed and K <= UNROLL_MAX_GAMMA
  # Variable windows stop where nothing more could be committed: the block also emits a
  # correction or bonus token (AdaSD's K = min(K_max, N_max - len - 1), papers/adasd.md §2).
  budget = None if fixed else setup.limit - s.lengths - 1                 # [B]
  decide = functools.partial(_decide, rule, _step_keys(keys, K, unrolled), s.rule_state, budget)

  def body(d: _Drafts) -> _Drafts:
    prev = rule.to_draft_ids(jnp.take(d.tokens, d.step - 1, axis=1))[:, None]   # [B, 1]
    logits, _, cache = model.extend(params, prev, d.cache)
    d = d.replace(q=rule.q_log_probs(logits[:, 0], setup.warp), cache=cache,
                  passes=d.passes + d.active,
                  nonfinite=d.nonfinite | (d.active & nonfinite_rows(logits)))
    return decide(d)

  if unrolled:
    # Every row drafts K tokens: unrolled, the loop costs ~35 us less per step on XLA:CPU.
    return jax.lax.fori_loop(0, K - 1, lambda _, d: body(d), decide(d), unroll=True)
  return jax.lax.while_loop(lambda d: (d.step < K) & jnp.any(d.active), body, decide(d))


UNROLL_MAX_GAMMA = 8   # longer fixed-length draft loops stay rolled (compile time)


def _draft_feed(rule, anchors: Anchors, s: SpecState):
  """Where to rewind the draft and what to feed it: the draft encodings of the last two committed
  tokens, packed left. Returns (start [B], feed [B, 2W], count [B] valid entries of feed).

  The committed generated tokens t_0 .. t_{g-1} occupy sum_i len(image(t_i)) draft entries after
  draft_base; start skips all but the last two (at g == 1 the older one is the draft's own prompt
  anchor at draft_base - 1). Example, W = 2, image lengths of t_0..t_3 = [1, 2, 1, 2], g = 4:
  start = draft_base + 3, feed = image(t_2) ++ image(t_3) ++ [0] (count 3). With a shared vocab
  (W = 1) this is start = draft_base + g - 2 and feed = last_two.
  """
  g = s.lengths
  _, lens = rule.draft_images(s.tokens)                                  # [B, N]
  before = jnp.arange(s.tokens.shape[1])[None, :] < (g - 2)[:, None]
  start = anchors.draft_base + jnp.sum(jnp.where(before, lens, 0), axis=1) - (g == 1)
  old_ids, old_len = rule.draft_images(s.last_two[:, 0])
  anchor = jnp.zeros_like(old_ids).at[:, 0].set(anchors.draft_anchor)
  old_ids = jnp.where((g == 1)[:, None], anchor, old_ids)
  old_len = jnp.where(g == 1, 1, old_len)
  new_ids, new_len = rule.draft_images(s.last_two[:, 1])
  both = jnp.concatenate([old_ids, new_ids], axis=1)                     # [B, 2W]
  j = jnp.arange(both.shape[1])[None, :]
  width = old_ids.shape[1]
  src = jnp.where(j < old_len[:, None], j, j - old_len[:, None] + width)
  count = (old_len + new_len).astype(jnp.int32)
  feed = jnp.where(j < count[:, None], jnp.take_along_axis(both, jnp.minimum(src, 2 * width - 1),
                                                           axis=1), 0)
  return start.astype(jnp.int32), feed.astype(jnp.int32), count


def _step_keys(keys: jax.Array, gamma: int, all_steps: bool):
  """step -> fold_in(keys[b], step) [B]. all_steps: derive every step's keys at once (one PRNG
  call per block when all gamma steps run); else per step (variable-length drafts stop early)."""
  if not all_steps:
    return lambda step: jax.vmap(lambda k: jax.random.fold_in(k, step))(keys)
  table = jax.vmap(lambda k: jax.vmap(lambda i: jax.random.fold_in(k, i))(
      jnp.arange(gamma, dtype=jnp.uint32)))(keys)                         # [B, K]
  return lambda step: jnp.take(table, jnp.minimum(step, gamma - 1), axis=1)


def _decide(rule, step_keys, rule_state, budget, d: _Drafts) -> _Drafts:
  """Ask the rule whether each row keeps drafting (never past `budget` [B] drafts, if given);
  propose draft `step` from q."""
  keep = d.active & rule.keep_drafting(d.q, d.step, rule_state)
  if budget is not None:
    keep = keep & (d.step < budget)
  token = rule.propose(d.q, step_keys(d.step)).astype(jnp.int32)
  stop = rule.stop_after(d.q, d.step, rule_state)
  return d.replace(step=d.step + 1, tokens=d.tokens.at[:, d.step].set(token),
                   q_logp=d.q_logp.at[:, d.step].set(d.q.astype(jnp.float32)),
                   draft_len=d.draft_len + keep, active=keep & ~stop)


def _commit(setup: Setup, anchors: Anchors, s: SpecState, live, d: _Drafts, n, next_token):
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
  stats = s.stats.add(blocks=live, drafted=as_int(d.draft_len),
                      accepted=as_int(jnp.minimum(n, count)),
                      verified=as_int(jnp.minimum(jnp.minimum(n + 1, d.draft_len), count)),
                      emitted=count,
                      target_passes=live, draft_passes=as_int(d.passes))
  return s.replace(
      tokens=write_rows(s.tokens, write_at, out), lengths=lengths, done=done,
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
