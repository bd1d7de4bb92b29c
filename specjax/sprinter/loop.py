"""SPRINTER's decoding loop (docs/papers/sprinter.md): sequential approximate verification, one jitted
lax.while_loop. The caller brings a loaded verifier (`specjax.sprinter.verifier.load`) and its
params; this module never touches the disk.

Each step, for every row that is not done:
  1. sample one draft token x ~ q (q comes from the draft pass over the last committed token);
  2. the verifier scores a draft hidden state (reading "A": the state that produced q, so the
     decision does not depend on x; reading "B": the state after feeding x) -> accept iff
     s >= threshold. A row also needs the target when it has gamma_max consecutive accepts;
  3. only if some row needs it (lax.cond), the target ingests each row's pending tokens in one
     chunk of width W = gamma_max + 1 (padded; the cache lengths do the masking) and gives p;
  4. rows that called the target run the one-token speculative test: keep x w.p. min(1, p/q),
     else resample from norm(max(0, p - q)). Other rows keep x. Commit one token per row.

Target cache invariant ("lazy"): it holds the committed stream up to each row's own point T;
stream[T:] are the pending tokens: the token committed by the row's last target call (or the
prompt's last token) plus the drafts accepted since, at most W of them.

Keys: row b's step at generated length g uses k = fold_in(row_key_b, g): x ~ q with k itself (so
an always-accepting verifier reproduces `autoregressive.generate` on the draft bit for bit),
fold_in(k, 1) for the uniform, fold_in(k, 2) for the residual sample, fold_in(k, 3) for the
verifier (random test verifiers only).

With `mesh=` the same `loop` runs sharded (decoding/sharded.py); the verifier's params are
replicated.

The warp, the threshold and max_new_tokens are traced (`knobs`), as in the speculative loop: the
program is compiled for max_new_tokens' bucket (state.new_tokens_bucket), so another
temperature, top_p, threshold or limit of the same bucket reuses it.
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
from specjax.acceptance import base
from specjax.decoding import autoregressive as ar
from specjax.decoding import sharded
from specjax.decoding.state import (DRAFT, STAT_FIELDS, TARGET, Generation, SpecStats, loop_jit,
                                    Reserve, auto_capacity, is_stop, new_tokens_bucket,
                                    run_loop, stop_ids, write_rows)
from specjax.models import Prompt, prompting
from specjax.models import kv_cache

# SprinterStats' counters beyond SpecStats (what a report lists for SPRINTER runs).
EXTRA_FIELDS = ("target_calls", "rejections", "forced", "target_tokens", "batched_calls")


@flax.struct.dataclass(kw_only=True)
class SprinterStats(SpecStats):
  """SpecStats plus SPRINTER's counters, int32 [B] each.

  Meaning of the SpecStats fields here: a block is a round (N verifier accepts, then the token
  the target checked; a trailing run without a target call counts as a round); every draft token
  is drafted and verified (by the verifier or the target), accepted when the output token is the
  draft token, so alpha = accepted / verified is Thm A.4's acceptance rate; target_passes =
  prefill + target_calls; draft_passes = prefill + one per step (+ one per replaced token under
  reading B). Invariants: target_calls = rejections + forced; emitted = target_calls + verifier
  accepts; target_tokens = sum over calls of the chunk length N + 1.
  """
  target_calls: jax.Array    # [B] loop target calls (the paper's rounds ending in F_p)
  rejections: jax.Array      # [B] verifier rejections
  forced: jax.Array          # [B] calls forced by gamma_max although the verifier accepted
  target_tokens: jax.Array   # [B] tokens ingested by those calls
  batched_calls: jax.Array   # [B] batched target invocations while the row was live

  @classmethod
  def zeros(cls, batch: int) -> "SprinterStats":
    return cls(**{f: jnp.zeros((batch,), jnp.int32)
                  for f in STAT_FIELDS + EXTRA_FIELDS + ("nonfinite",)})

  def totals(self) -> dict[str, int]:
    return {f: int(np.sum(np.asarray(getattr(self, f)))) for f in STAT_FIELDS + EXTRA_FIELDS}


@dataclasses.dataclass(frozen=True)
class Setup:
  """Everything static about one generation (the jit cache key)."""
  target: Any
  draft: Any
  verifier: Any         # a Verifier, or any frozen object with .features ("A" | "B") and
                        # .score(params, hidden[B, D], keys[B]) -> [B] (test verifiers)
  threshold: Any        # float; traced in a compiled call (None in the jit key)
  cap: int              # consecutive verifier accepts before a forced target call
  width: int            # target chunk width: the most pending tokens a row can have
  max_new: int          # the token buffer: new_tokens_bucket(max_new_tokens)
  warp: sampling.Warp   # traced in a compiled call (None in the jit key)
  eos: tuple[int, ...]  # stop ids; (): none
  max_len: int          # cache capacity of both models
  mesh: Any = None      # a ('data', 'model') Mesh: the loop runs sharded over it
  limit: Any = None     # max_new_tokens itself (<= max_new); traced, None in the jit key


@flax.struct.dataclass(kw_only=True)
class SeqState:
  """The loop state (the sequential analogue of SpecState)."""
  tokens: jax.Array          # [B, N] int32 generated tokens
  lengths: jax.Array         # [B] int32 tokens generated so far (g)
  done: jax.Array            # [B] bool
  run_len: jax.Array         # [B] int32 verifier accepts since the row's last target call
  q_logp: jax.Array          # [B, V] f32 warped draft log-probs of the next token
  hidden: jax.Array          # [B, D] f32 draft hidden state at the last committed token
  target_cache: kv_cache.KVCache   # committed stream up to each row's T (lengths)
  draft_cache: kv_cache.KVCache    # the whole committed stream
  key: jax.Array             # [B] per-row keys
  stats: SprinterStats


@flax.struct.dataclass(kw_only=True)
class Anchors:
  target_base: jax.Array     # [B] target prompt-stream length (prefill's cache length)
  target_anchor: jax.Array   # [B] last token of the target's prompt stream


def generate(target, target_params, draft, draft_params, verifier, verifier_params,
             prompt: Prompt, key: jax.Array, *, threshold: float, gamma_max: int | None,
             max_new_tokens: int, warp: sampling.Warp, eos_id: int | Sequence[int] | None,
             max_len: int | None = None, debug: bool = False, mesh=None) -> Generation:
  """SPRINTER decoding of up to max_new_tokens per row; stats are SprinterStats.

  gamma_max: consecutive verifier accepts before a forced target call (None: no cap; 0: every
  token goes to the target). key: one PRNG key (row b uses fold_in(key, b)) or per-row keys [B].
  debug=True runs the same step function from a Python loop (one jitted call per step).
  mesh: a ('data', 'model') Mesh to decode on (decoding/sharded.py); the tokens are those of one
  device. Raises NonFiniteLogitsError if either model's logits held NaN / inf.
  """
  setup = _validate(target, draft, verifier, prompt, threshold=threshold, gamma_max=gamma_max,
                    max_new_tokens=max_new_tokens, warp=warp, eos_id=eos_id, max_len=max_len)
  setup, knobs = split_knobs(dataclasses.replace(setup, mesh=mesh))
  keys = sampling.as_row_keys(key, prompt.tokens.shape[0])
  params = (target_params, draft_params, verifier_params)

  def start():                      # debug: one jitted step per call (blocks is always 1)
    state, anchors = _init_jit(setup, params, prompt, keys, knobs)
    return state, lambda s, blocks: _step_jit(setup, params, anchors, s, knobs)

  return run_loop(lambda: run(setup, params, prompt, keys, knobs), start,
                  lambda: sharded.generate(loop, setup, (target, draft, None), params, (prompt,),
                                           keys, knobs),
                  mesh=mesh, max_new=max_new_tokens, models=(target, draft), debug=debug)


def reserve(gamma_max: int | None, max_new_tokens: int) -> Reserve:
  """New tokens and one target chunk of up to gamma_max + 1 (a run of verifier accepts and the
  token after it; None: no cap), never wider than the bucket of max_new_tokens, for which the
  loop is compiled."""
  bucket = new_tokens_bucket(max_new_tokens)
  width = min(_cap(gamma_max, bucket), bucket - 1) + 1
  return Reserve(per_token=1, fixed=width, what=f"a target chunk of gamma_max + 1 = {width}")


def _cap(gamma_max: int | None, bucket: int) -> int:
  """Consecutive verifier accepts before a forced target call: run_len <= g <= max_new_tokens - 1
  at any step, so a cap of the bucket never binds (None: no cap)."""
  return bucket if gamma_max is None else min(int(gamma_max), bucket)


def _validate(target, draft, verifier, prompt, *, threshold, gamma_max, max_new_tokens, warp,
              eos_id, max_len) -> Setup:
  """Host-side checks with actionable messages, before anything is traced."""
  ar.check_batch(max_new_tokens, prompt, warp)
  if draft.vocab_size != target.vocab_size:
    raise ValueError(f"SPRINTER needs a draft whose logits width is the target's, and the "
                     f"draft's is {draft.vocab_size}, the target's {target.vocab_size}: decode "
                     f"this pair with a same-vocabulary rule (exact, greedy, ...), which fits "
                     f"the draft's logits to the target's width")
  if getattr(verifier, "hidden_size", draft.hidden_size) != draft.hidden_size:
    raise ValueError(f"the verifier reads hidden states of size {verifier.hidden_size} but the "
                     f"draft's are {draft.hidden_size}: it was trained on another draft")
  if gamma_max is not None and (isinstance(gamma_max, bool) or
                                not isinstance(gamma_max, numbers.Integral) or gamma_max < 0):
    raise ValueError(f"gamma_max (consecutive verifier accepts before a forced target call) "
                     f"must be an integer >= 0 or None (no cap), got {gamma_max!r}")
  # The chunk's width is the bucket's, so that every limit of the bucket shares the program.
  bucket = new_tokens_bucket(max_new_tokens)
  cap = _cap(gamma_max, bucket)
  room = reserve(gamma_max, max_new_tokens)
  width = room.fixed
  prefix = max(prompting.prefix_len(target, prompt), prompting.prefix_len(draft, prompt))
  need = room.need(prefix, max_new_tokens)
  if max_len is None:
    max_len = auto_capacity(need, room.need(prefix, bucket), (target, draft))
  kv_cache.check_capacity(need, int(max_len), f"prompt + max_new_tokens + gamma_max + 1 ({width})")
  return Setup(target=target, draft=draft, verifier=verifier, threshold=float(threshold),
               cap=cap, width=width, max_new=bucket, warp=warp, eos=stop_ids(eos_id),
               max_len=int(max_len), limit=max_new_tokens)


@loop_jit(static_argnums=0)
def run(setup: Setup, params, prompt: Prompt, keys: jax.Array, knobs) -> SeqState:
  """The whole generation as one compiled call; returns the final state (caches included).
  params = (target_params, draft_params, verifier_params); knobs = (warp, limit, threshold),
  traced (the setup's own are ignored)."""
  return loop(setup, params, (prompt,), keys, knobs)


def split_knobs(setup: Setup) -> tuple[Setup, tuple]:
  """(the static setup, the traced knobs (warp, limit, threshold) a compiled call takes)."""
  knobs = (setup.warp, np.int32(setup.limit), np.float32(setup.threshold))
  return dataclasses.replace(setup, warp=None, limit=None, threshold=None), knobs


def with_knobs(setup: Setup, knobs) -> Setup:
  """The setup with the traced (warp, limit, threshold) of a compiled call in it."""
  warp, limit, threshold = knobs
  return dataclasses.replace(setup, warp=warp, limit=limit, threshold=threshold)


def loop(setup: Setup, params, prompts, keys: jax.Array, knobs) -> SeqState:
  """`run` before jit (decoding/sharded.py jits it with explicit shardings); prompts = (the
  prompt,). With setup.mesh the state is pinned to its shardings every step."""
  setup = with_knobs(setup, knobs)
  state, anchors = init(setup, params, prompts[0], keys)
  one_step = functools.partial(step, setup, params, anchors)
  return jax.lax.while_loop(lambda s: ~jnp.all(s.done),
                            lambda s: sharded.pin(one_step(s), setup.mesh),
                            sharded.pin(state, setup.mesh))


def init(setup: Setup, params, prompt: Prompt, keys: jax.Array) -> tuple[SeqState, Anchors]:
  """Prefill both models. The target is rolled back by one token so that the prompt's last
  token is pending (the first target call reads p at it); the draft keeps it and gives q."""
  target, draft = setup.target, setup.draft
  tparams, dparams, _ = params
  batch = prompt.tokens.shape[0]
  tcache = sharded.init_cache(target, batch, setup.max_len, prompting.enc_len(target, prompt),
                              setup.mesh)
  t_logits, _, tcache = target.prefill(tparams, prompt, tcache)
  anchors = Anchors(target_base=tcache.lengths, target_anchor=prompting.stream_anchor(target, prompt))
  dcache = sharded.init_cache(draft, batch, setup.max_len, prompting.enc_len(draft, prompt),
                              setup.mesh)
  q_logits, hidden, dcache = draft.prefill(dparams, prompt, dcache)       # [B, V], [B, D]
  ones = jnp.ones((batch,), jnp.int32)
  state = SeqState(
      tokens=jnp.zeros((batch, setup.max_new), jnp.int32), lengths=jnp.zeros((batch,), jnp.int32),
      done=jnp.zeros((batch,), bool), run_len=jnp.zeros((batch,), jnp.int32),
      q_logp=setup.warp.log_probs(q_logits), hidden=hidden.astype(jnp.float32),
      target_cache=kv_cache.rollback(tcache, tcache.lengths - 1), draft_cache=dcache, key=keys,
      stats=SprinterStats.zeros(batch).add(target_passes=ones, draft_passes=ones)
      .flag(TARGET, sampling.nonfinite_rows(t_logits)).flag(DRAFT, sampling.nonfinite_rows(q_logits)))
  return state, anchors


def step(setup: Setup, params, anchors: Anchors, s: SeqState) -> SeqState:
  """One token for every row that is not done."""
  tparams, dparams, vparams = params
  live = ~s.done                                                          # [B]
  keys = sampling.position_keys(s.key, s.lengths)
  x = sampling.categorical(s.q_logp, keys)                                # [B]
  fed = None
  feature = s.hidden
  if setup.verifier.features == "B":
    fed = setup.draft.extend(dparams, x[:, None], s.draft_cache)         # x at slot t
    feature = fed[1][:, 0].astype(jnp.float32)
  accept = setup.verifier.score(vparams, feature, sampling.fold_rows(keys, 3)) >= setup.threshold
  rejected = live & ~accept
  forced = live & accept & (s.run_len >= setup.cap)
  need = rejected | forced
  p_logp, tcache, pending, t_bad = jax.lax.cond(
      jnp.any(need), functools.partial(_target_chunk, setup, tparams, anchors, s),
      functools.partial(_skip_target, s), need)
  y, kept = _resolve(x, s.q_logp, p_logp, need, keys)
  replaced = live & (y != x)
  q_logp, hidden, dcache, refed, d_bad = _draft_update(setup, dparams, s, live, y, fed, replaced)
  stats = s.stats.add(
      blocks=live & (s.run_len == 0), drafted=live, accepted=live & kept, verified=live,
      emitted=live, target_passes=need, draft_passes=live + refed, target_calls=need,
      rejections=rejected, forced=forced, target_tokens=jnp.where(need, pending, 0),
      batched_calls=live & jnp.any(need)).flag(TARGET, need & t_bad).flag(DRAFT, live & d_bad)
  return _commit(setup, s, live, y, need).replace(
      q_logp=q_logp, hidden=hidden, target_cache=tcache, draft_cache=dcache, stats=stats)


def _target_chunk(setup: Setup, tparams, anchors: Anchors, s: SeqState, need):
  """Feed every row's pending tokens stream[T : base+g] in one [B, W] extend; read p at each
  row's last pending token. Rows in `need` advance T to base+g, the others keep their T (their
  writes sit past T and are overwritten later).

  Worked example, W 3, base 4 (prompt of 4 tokens, anchor a = its last token):
    row 0: T 3, g 0 -> pending [a], feed [a, ., .], p at index 0, T -> 4.
    row 1: T 6, g 4 -> generated[2:4] pending, feed [t2, t3, .], p at index 1, T -> 8.
  """
  T, g = s.target_cache.lengths, s.lengths
  base = anchors.target_base
  idx = (T - base)[:, None] + jnp.arange(setup.width)[None, :]           # [B, W] generated index
  gathered = jnp.take_along_axis(s.tokens, jnp.clip(idx, 0, setup.max_new - 1), axis=1)
  feed = jnp.where(idx < 0, anchors.target_anchor[:, None], gathered)
  logits, _, cache = setup.target.extend(tparams, feed, s.target_cache)  # [B, W, V]
  pending = base + g - T                                                  # [B] in 1..W for need
  last = jnp.clip(pending - 1, 0, setup.width - 1)
  p_logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
  cache = kv_cache.rollback(cache, jnp.where(need, base + g, T))
  return (setup.warp.log_probs(p_logits), cache, pending.astype(jnp.int32),
          sampling.nonfinite_rows(p_logits))


def _skip_target(s: SeqState, need):
  del need
  return (jnp.zeros_like(s.q_logp), s.target_cache, jnp.zeros_like(s.lengths),
          jnp.zeros_like(s.done))


def _resolve(x, q_logp, p_logp, need, keys):
  """Rows in `need`: keep x iff u < p(x)/q(x), else a residual sample; others keep x.
  Returns (token [B], kept [B]: the output is the draft token)."""
  u = jax.vmap(jax.random.uniform)(sampling.fold_rows(keys, 1))           # [B]
  log_p = jnp.take_along_axis(p_logp, x[:, None], axis=1)[:, 0]
  log_q = jnp.take_along_axis(q_logp, x[:, None], axis=1)[:, 0]
  keep = jnp.log(u) < log_p - log_q
  resampled = sampling.categorical(base.residual_log_probs(p_logp, q_logp),
                                   sampling.fold_rows(keys, 2))
  y = jnp.where(need & ~keep, resampled, x)
  return y.astype(jnp.int32), ~need | keep


def _draft_update(setup: Setup, dparams, s: SeqState, live, y, fed, replaced):
  """q and the hidden state for the next step: feed y (reading A), or keep the pass over x and
  re-feed y at x's slot only where the target replaced x (reading B). Done rows are frozen.
  Returns (q_logp, hidden, draft_cache, refed [B] int32, [B] non-finite draft logits)."""
  model = setup.draft
  if fed is None:
    logits, hidden, cache = model.extend(dparams, y[:, None], s.draft_cache)
    refed = jnp.zeros_like(s.lengths)
  else:
    def refeed(_):
      rewound = kv_cache.rollback(fed[2], fed[2].lengths - 1)
      return model.extend(dparams, y[:, None], rewound)
    logits, hidden, cache = jax.lax.cond(jnp.any(replaced), refeed, lambda _: fed, None)
    logits = jnp.where(replaced[:, None, None], logits, fed[0])
    hidden = jnp.where(replaced[:, None, None], hidden, fed[1])
    refed = replaced.astype(jnp.int32)
  cache = kv_cache.rollback(cache, jnp.where(live, cache.lengths, s.draft_cache.lengths))
  q_logp = jnp.where(live[:, None], setup.warp.log_probs(logits[:, 0]), s.q_logp)
  hidden = jnp.where(live[:, None], hidden[:, 0].astype(jnp.float32), s.hidden)
  return q_logp, hidden, cache, refed, sampling.nonfinite_rows(logits)


def _commit(setup: Setup, s: SeqState, live, y, need) -> SeqState:
  """Write y at each live row's length; done at EOS or max_new_tokens."""
  write_at = jnp.where(live, s.lengths, setup.max_new)                   # max_new: dropped
  lengths = s.lengths + live
  done = s.done | (live & (is_stop(y, setup.eos) | (lengths >= setup.limit)))
  return s.replace(tokens=write_rows(s.tokens, write_at, y), lengths=lengths,
                   done=done, run_len=jnp.where(need, 0, s.run_len + live))


_init_jit = jax.jit(lambda setup, params, prompt, keys, knobs:
                    init(with_knobs(setup, knobs), params, prompt, keys), static_argnums=0)
_step_jit = jax.jit(lambda setup, params, anchors, s, knobs:
                    step(with_knobs(setup, knobs), params, anchors, s),
                    static_argnums=0, donate_argnums=3)
