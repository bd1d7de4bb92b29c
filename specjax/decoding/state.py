"""The state carried through the decoding loops, their per-row statistics, and their result."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.kv_cache import KVCache

STAT_FIELDS = ("blocks", "drafted", "accepted", "verified", "emitted", "target_passes",
               "draft_passes")

# SpecStats.nonfinite bits: which model's logits held NaN or +inf at some pass of the row.
TARGET, DRAFT = 1, 2
_ROLES = {TARGET: "target", DRAFT: "draft"}


class NonFiniteLogitsError(ValueError):
  """A model produced NaN / inf logits while decoding; carries the `role` and the `rows`."""

  def __init__(self, role: str, model, rows: list[int]):
    dtype = jnp.dtype(model.dtype).name
    super().__init__(
        f"the {role} model ({type(model).__name__}, {dtype} weights) produced non-finite logits "
        f"(NaN or inf) in rows {rows}: likely a float16 overflow or damaged weights; load it "
        f"with dtype=float32 or bfloat16, or check the checkpoint")
    self.role, self.rows = role, rows



@dataclasses.dataclass(frozen=True)
class Reserve:
  """The cache positions a loop takes in one model after its prompt: per_token * max_new_tokens
  + fixed (`what` names the fixed ones in messages). The one formula for a loop's cache capacity:
  each loop's `reserve(...)` says its numbers, and the loop, prompt fitting (api/prompt_fit.py)
  and eval.latency all size caches by it."""
  per_token: int = 1         # positions one new token may take (a cross-tokenizer draft: more)
  fixed: int = 0             # positions beyond the new tokens (a verify block)
  what: str = ""             # "gamma 4"

  def need(self, prefix: int, max_new: int) -> int:
    """Cache positions for a prompt prefix of `prefix` positions and max_new new tokens."""
    return prefix + self.per_token * max_new + self.fixed


MIN_NEW_BUCKET = 16    # the smallest token buffer a loop compiles


def new_tokens_bucket(max_new: int) -> int:
  """The token buffer a loop compiles for max_new_tokens: the next power of two, at least
  MIN_NEW_BUCKET, so that every limit of one bucket shares a program (the real limit is a traced
  value of the loop). Example: 5 -> 16, 20 -> 32, 30 -> 32, 33 -> 64."""
  return max(MIN_NEW_BUCKET, 1 << (int(max_new) - 1).bit_length())


def position_limit(model) -> int | None:
  """The most cache positions a decoder-only model's position table allows (None: rotary or
  relative positions, or an encoder-decoder: no bound)."""
  return None if model.is_encoder_decoder else model.n_positions


def auto_capacity(need: int, bucket_need: int, models) -> int:
  """The cache size of a loop called without max_len: room for a whole bucket of new tokens
  (bucket_need), so that the limits of one bucket share the cache's shape, cut to the smallest
  position table of `models`, and never below `need` (the positions the call itself takes: a
  need past a position table is then refused by the model, as it was).
  Example: need 60, bucket_need 76, tables [64] -> 64; no table -> 76."""
  tables = [n for m in models if (n := position_limit(m)) is not None]
  return max(need, min([bucket_need] + tables))


@flax.struct.dataclass(kw_only=True)
class SpecStats:
  """Per-row counters, int32 [B] each. A block is one target pass and the tokens it commits.

  The first token comes from the target's prefill: it counts as a block that drafted nothing and
  emitted one token (so blocks == target_passes and emitted == the row's generated length). The
  draft's prefill counts as one draft pass. `verified` counts the drafts the rule looked at:
  the accepted ones plus the first rejected one (drafts after a rejection are never verified).
  Autoregressive decoding reports blocks == target_passes == emitted and zero drafts.
  """
  blocks: jax.Array          # [B] target passes that committed tokens (prefill included)
  drafted: jax.Array         # [B] draft tokens proposed and offered for verification
  accepted: jax.Array        # [B] draft tokens accepted
  verified: jax.Array        # [B] draft tokens verified (accepted + first rejection)
  emitted: jax.Array         # [B] tokens committed (== Generation.lengths)
  target_passes: jax.Array   # [B] target forward passes (prefill + one extend per block)
  draft_passes: jax.Array    # [B] draft forward passes (prefill + drafting steps)
  nonfinite: jax.Array       # [B] int32 bits TARGET | DRAFT: that model's logits were NaN/+inf

  @classmethod
  def zeros(cls, batch: int) -> "SpecStats":
    return cls(**{f: jnp.zeros((batch,), jnp.int32) for f in STAT_FIELDS + ("nonfinite",)})

  def add(self, **increments) -> "SpecStats":
    return self.replace(**{f: getattr(self, f) + jnp.asarray(v, jnp.int32)
                           for f, v in increments.items()})

  def flag(self, bit: int, rows: jax.Array) -> "SpecStats":
    """Set `bit` (TARGET or DRAFT) in the rows where `rows` [B] is True."""
    return self.replace(nonfinite=self.nonfinite | jnp.where(rows, bit, 0).astype(jnp.int32))

  def alpha_per_row(self) -> jax.Array:
    """[B] acceptance rate accepted / verified (nan where nothing was verified)."""
    return _ratio(self.accepted, self.verified)

  def tau_per_row(self) -> jax.Array:
    """[B] block efficiency emitted / blocks (nan for rows with no block)."""
    return _ratio(self.emitted, self.blocks)

  def totals(self) -> dict[str, int]:
    return {f: int(np.sum(np.asarray(getattr(self, f)))) for f in STAT_FIELDS}

  def alpha(self) -> float:
    """Aggregated acceptance rate: sum accepted / sum verified over rows (nan if none verified)."""
    t = self.totals()
    return t["accepted"] / t["verified"] if t["verified"] else float("nan")

  def tau(self) -> float:
    """Aggregated block efficiency: sum emitted / sum blocks over rows."""
    t = self.totals()
    return t["emitted"] / t["blocks"] if t["blocks"] else float("nan")

  def to_dict(self) -> dict[str, float]:
    """Host-side summary: summed counters plus alpha and tau (JSON-ready)."""
    return {**self.totals(), "alpha": self.alpha(), "tau": self.tau()}


def _ratio(num: jax.Array, den: jax.Array) -> jax.Array:
  num, den = jnp.asarray(num, jnp.float32), jnp.asarray(den, jnp.float32)
  return jnp.where(den > 0, num / jnp.maximum(den, 1.0), jnp.nan)


@flax.struct.dataclass(kw_only=True)
class SpecState:
  """Everything one decoding loop carries from block to block (docs/design.md §4).

  Loop invariant (speculative): the committed stream of row b is its prompt stream (decoder-only:
  the prompt; T5: the decoder start token) followed by tokens[b, :lengths[b]]. The target cache
  holds that stream minus its last ("pending") token; last_two[b] are its last two tokens.
  The autoregressive loop uses the same state with drafter_state=None.
  """
  tokens: jax.Array          # [B, N] int32 generated tokens (garbage-free: 0 past lengths)
  lengths: jax.Array         # [B] int32 tokens generated so far
  done: jax.Array            # [B] bool, EOS emitted or max_new_tokens (the real limit) reached
  last_two: jax.Array        # [B, 2] int32 last two committed stream tokens (prompt included)
  target_cache: KVCache      # target KV cache: stream minus the pending token
  drafter_state: Any         # the drafter's (a draft model: its KV cache, covering at least the
  #                            stream minus its last two tokens); None without one
  rule_state: Any            # the rule's pytree; leaves with a leading [B] axis
  key: jax.Array             # [B] per-row keys (fold_in(key, row))
  stats: SpecStats


@flax.struct.dataclass(kw_only=True)
class Generation:
  """Result of a decoding call."""
  tokens: jax.Array          # [B, N] int32 generated tokens, 0 after each row's end
  lengths: jax.Array         # [B] int32 tokens generated, EOS included
  stats: SpecStats


def host_value(x: jax.Array) -> np.ndarray:
  """x on the host; a global array whose shards live on other processes too (multi-host rows) is
  gathered from every process first."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def check_finite(gen: "Generation", target, draft=None) -> "Generation":
  """gen, or NonFiniteLogitsError naming the model whose logits held NaN / inf (the target
  first). A host read of [B] flags, once per generation, after the loop."""
  flags = host_value(gen.stats.nonfinite)
  for bit, model in ((TARGET, target), (DRAFT, draft)):
    rows = np.nonzero(flags & bit)[0].tolist()
    if rows:
      raise NonFiniteLogitsError(_ROLES[bit], model, rows)
  return gen


def stop_ids(eos) -> tuple[int, ...]:
  """The stop ids of a decoding loop: None -> () (no EOS: rows run to max_new_tokens), one id,
  or a sequence of ids (Qwen ends at <|endoftext|> and <|im_end|>). Negative ids are refused:
  no loop gives them a meaning."""
  if eos is None:
    return ()
  ids = (eos,) if isinstance(eos, (int, np.integer)) else tuple(eos)
  if any(isinstance(i, bool) or int(i) != i or int(i) < 0 for i in ids):
    raise ValueError(f"eos_id must be None, a token id >= 0 or a sequence of them, got {eos!r}")
  return tuple(dict.fromkeys(int(i) for i in ids))


def is_stop(tokens: jax.Array, eos: tuple[int, ...]) -> jax.Array:
  """tokens == any of the stop ids (static), elementwise; all False when eos is ()."""
  hit = jnp.zeros(tokens.shape, bool)
  for i in eos:
    hit = hit | (tokens == i)
  return hit


def write_rows(buffer: jax.Array, at: jax.Array, values: jax.Array) -> jax.Array:
  """buffer[b, at[b, ...]] = values[b, ...] per row; indices past the buffer are dropped.
  buffer [B, N], at and values [B] or [B, K]. One scatter batched over rows, so that rows split
  over devices are written where they live."""
  return jax.vmap(lambda row, i, v: row.at[i].set(v, mode="drop"))(buffer, at, values)


@jax.jit   # eagerly, these few ops cost ~1 ms per call
def finish(state: SpecState) -> Generation:
  """The Generation of a final state: its token buffer [B, N] (N: the bucket) with everything
  past each row's length zeroed. One program per buffer width: `cut` trims it to the limit."""
  valid = jnp.arange(state.tokens.shape[1])[None, :] < state.lengths[:, None]
  return Generation(tokens=jnp.where(valid, state.tokens, 0), lengths=state.lengths,
                    stats=state.stats)


def cut(gen: Generation, max_new: int) -> Generation:
  """gen with tokens [B, N] trimmed to [B, max_new] (past max_new they are zeros: no row is
  longer). Trimmed on the host and put back where they were, since a device slice would compile
  one program per max_new; a buffer already max_new wide is returned as it is, unread."""
  if gen.tokens.shape[1] == max_new:
    return gen
  tokens = np.ascontiguousarray(host_value(gen.tokens)[:, :max_new])
  return gen.replace(tokens=jax.device_put(tokens, gen.tokens.sharding))


# on_chunk(tokens [B, N], lengths [B]) -> rows to stop now ([B] bool) or None; numpy on the host.
OnChunk = Callable[[np.ndarray, np.ndarray], Optional[np.ndarray]]


def drive(state: SpecState, advance: Callable[[SpecState], SpecState],
          on_chunk: OnChunk | None = None) -> SpecState:
  """The host loop of a chunked generation: `advance` runs one compiled chunk of blocks (the
  state donated to it) until every row is done. After the prefill and after each chunk,
  on_chunk sees the committed tokens (streaming, stop strings) and may end rows: they are marked
  done and keep what they committed. Returns the final state."""
  while True:
    if on_chunk is not None:
      stop = on_chunk(np.asarray(state.tokens), np.asarray(state.lengths))
      if stop is not None and np.any(stop):
        state = state.replace(done=state.done | jnp.asarray(stop, bool))
    if bool(jnp.all(state.done)):
      return state
    state = advance(state)


def chunk_loop(step: Callable[[SpecState], SpecState], state: SpecState, blocks: int) -> SpecState:
  """At most `blocks` applications of step while some row is not done (inside jit)."""
  def body(carry):
    i, s = carry
    return i + 1, step(s)
  return jax.lax.while_loop(lambda c: (c[0] < blocks) & ~jnp.all(c[1].done), body,
                            (jnp.int32(0), state))[1]


# XLA:CPU's dots read 16-bit weights as float32, and while-loop invariant code motion hoists those
# converts out of the decoding loop and the layer scan: a float32 copy of every scanned bfloat16
# weight held for the whole call (three times the weights' bytes in all), read at twice their
# bytes every step. Without the pass each layer converts what it reads when it runs; float32
# weights have nothing to hoist.
CPU_LOOP_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
# XLA:CPU's default scheduler (concurrency-optimized) runs those converts as early as it can, so
# unrolled layers still made every layer's float32 copy at once; the memory-optimized scheduler
# converts each where its layer runs. Loops over float32 or int8 weights, which convert nothing,
# keep the default: there the memory-optimized order decoded a few percent slower.
CPU_16BIT_LOOP_OPTIONS = {**CPU_LOOP_OPTIONS,
                          "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def has_16bit_floats(tree) -> bool:
  """Whether any leaf of `tree` (arrays, ShapeDtypeStructs or dtypes) is a 16-bit float."""
  for leaf in jax.tree_util.tree_leaves(tree):
    dtype = getattr(leaf, "dtype", leaf)
    if isinstance(dtype, np.dtype) and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2:
      return True
  return False


def loop_compiler_options(tree) -> dict | None:
  """The compiler options of a decoding loop whose arguments are `tree`: on the CPU,
  CPU_16BIT_LOOP_OPTIONS where some leaf is a 16-bit float and CPU_LOOP_OPTIONS otherwise; None
  (XLA's defaults) on accelerators."""
  if jax.default_backend() != "cpu":
    return None
  return CPU_16BIT_LOOP_OPTIONS if has_16bit_floats(tree) else CPU_LOOP_OPTIONS


class LoopJit:
  """A decoding loop's jax.jit: compiled with loop_compiler_options(its arguments) where the
  default backend is the CPU, as jax.jit elsewhere (accelerators keep XLA's defaults)."""

  def __init__(self, fun: Callable, **jit_kwargs):
    functools.update_wrapper(self, fun)
    self._default = jax.jit(fun, **jit_kwargs)
    self._cpu = jax.jit(fun, compiler_options=CPU_LOOP_OPTIONS, **jit_kwargs)
    self._cpu_16bit = jax.jit(fun, compiler_options=CPU_16BIT_LOOP_OPTIONS, **jit_kwargs)

  def jitted(self, *args, **kwargs):
    """The jax.jit that a call with these arguments runs."""
    options = loop_compiler_options((args, kwargs))
    if options is None:
      return self._default
    return self._cpu_16bit if options is CPU_16BIT_LOOP_OPTIONS else self._cpu

  def __call__(self, *args, **kwargs):
    return self.jitted(*args, **kwargs)(*args, **kwargs)

  def lower(self, *args, **kwargs):
    return self.jitted(*args, **kwargs).lower(*args, **kwargs)

  def _cache_size(self) -> int:
    return sum(j._cache_size() for j in (self._default, self._cpu, self._cpu_16bit))


def loop_jit(**jit_kwargs) -> Callable[[Callable], LoopJit]:
  """Decorator: LoopJit(fun, **jit_kwargs) (static_argnums, donate_argnums as jax.jit)."""
  return lambda fun: LoopJit(fun, **jit_kwargs)


# start() -> (the state after the prefill, advance(state, blocks) -> the state after that many
# more blocks, the state donated): a loop's chunked form.
Start = Callable[[], "tuple[SpecState, Callable[[SpecState, int], SpecState]]"]


def run_loop(whole: Callable[[], SpecState], start: Start, on_mesh: Callable[[], Generation], *,
             mesh, max_new: int, models: tuple, on_chunk: OnChunk | None = None,
             debug: bool = False, chunk_blocks: int = 1, check: bool = True) -> Generation:
  """The front end every jitted loop shares: on a mesh the sharded program (`on_mesh`); with
  on_chunk (streaming) or debug the chunked form driven from the host (`start`, chunks of
  chunk_blocks blocks; debug: one block per call); else the whole generation in one compiled call
  (`whole`). Then the tokens cut to max_new (`cut`) and the finite check naming the model
  (models: target, then draft); check=False leaves it to the caller (stats.nonfinite), with no
  host read of the flags."""
  verdict = (lambda gen: check_finite(gen, *models)) if check else (lambda gen: gen)
  if mesh is not None:
    if debug or on_chunk is not None:
      raise ValueError("debug=True and on_chunk step the loop from the host on one device: "
                       "leave mesh unset")
    return verdict(cut(on_mesh(), max_new))
  if debug or on_chunk is not None:
    state, advance = start()
    blocks = 1 if debug else chunk_blocks
    state = drive(state, lambda s: advance(s, blocks), on_chunk)
  else:
    state = whole()
  return verdict(cut(finish(state), max_new))
