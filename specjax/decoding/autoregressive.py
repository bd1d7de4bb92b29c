"""Target-only autoregressive decoding: the whole generation is one jitted lax.while_loop.

Row b draws output token t with key fold_in(row_key_b, t), so a row's output does not depend on
the batch it sits in. The first token comes from prefill's logits; each later step feeds the last
token with one `extend` call. Rows stop independently at EOS or max_new_tokens. With `mesh=` the
same `loop` runs sharded (decoding/sharded.py).

max_new_tokens is traced: the program is compiled for its bucket (state.new_tokens_bucket: the
token buffer, and the cache when max_len is not given), so 20 and 30 share one program.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling
from specjax.decoding import sharded
from specjax.decoding.state import (TARGET, Generation, OnChunk, Reserve, SpecState, SpecStats,
                                    auto_capacity, chunk_loop, is_stop, loop_jit,
                                    new_tokens_bucket, run_loop, stop_ids,
                                    write_rows)
from specjax.models import Prompt
from specjax.models import kv_cache, prompting


def check_batch(max_new_tokens: int, prompt: Prompt, warp: sampling.Warp) -> None:
  """What every loop checks first: max_new_tokens >= 1, a prompt batch [B, P] with lengths [B],
  and a warp whose per-row values (if any) are for B rows. Raises ValueError."""
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if prompt.tokens.ndim != 2 or prompt.lengths.shape != prompt.tokens.shape[:1]:
    raise ValueError(f"prompt.tokens must be [B, P] and prompt.lengths [B]; got "
                     f"{prompt.tokens.shape} and {prompt.lengths.shape}")
  if warp.rows not in (None, prompt.tokens.shape[0]):
    raise ValueError(f"the warp has per-row values for {warp.rows} rows and the prompt batch "
                     f"{prompt.tokens.shape[0]}: give one value, or one per row")


# One position per new token (a done row still extends by one: its write is dropped).
RESERVE = Reserve(per_token=1, fixed=0)


@dataclasses.dataclass(frozen=True)
class Setup:
  """Everything static about one generation (the jit cache key); warp and limit are None in the
  key and the traced values inside the compiled loop (`with_knobs`)."""
  model: Any
  warp: sampling.Warp
  eos: tuple[int, ...]   # stop ids; (): none
  max_new: int      # the token buffer: new_tokens_bucket(max_new_tokens)
  max_len: int      # cache capacity
  mesh: Any = None  # a ('data', 'model') Mesh: the loop runs sharded over it
  limit: Any = None  # [] int32, traced: max_new_tokens itself (<= max_new)


def with_knobs(setup: Setup, knobs) -> Setup:
  """The setup with the traced (warp, limit) of a compiled call in it."""
  warp, limit = knobs
  return dataclasses.replace(setup, warp=warp, limit=limit)


def generate(model, params, prompt: Prompt, key: jax.Array, *, max_new_tokens: int,
             warp: sampling.Warp, eos_id: int | Sequence[int] | None, max_len: int | None = None,
             mesh=None, on_chunk: OnChunk | None = None, chunk_blocks: int = 1,
             check_finite: bool = True) -> Generation:
  """Sample up to max_new_tokens per row from the (warped) target.

  key: one PRNG key (row b uses fold_in(key, b)) or per-row keys [B]. max_len: cache size
  (default: just enough); checked on the host before anything is compiled. mesh: a ('data',
  'model') Mesh to decode on (decoding/sharded.py); the tokens are those of one device.
  on_chunk: streaming, as in speculative.generate (chunks of `chunk_blocks` steps; one device).
  Raises NonFiniteLogitsError if the model's logits held NaN / inf (instead of returning the
  tokens sampled from them); check_finite=False skips that host read (gen.stats.nonfinite holds
  the flags: training, whose device-side finite check sees the same weights' loss).
  """
  check_batch(max_new_tokens, prompt, warp)
  prefix, bucket = prompting.prefix_len(model, prompt), new_tokens_bucket(max_new_tokens)
  need = RESERVE.need(prefix, max_new_tokens)
  max_len = (auto_capacity(need, RESERVE.need(prefix, bucket), (model,)) if max_len is None
             else int(max_len))
  kv_cache.check_capacity(need, max_len, "prompt + max_new_tokens")
  keys = sampling.as_row_keys(key, prompt.tokens.shape[0])
  # The warp and the limit are traced arguments, not part of the static setup: another
  # temperature, top_p, top_k of its bucket or max_new_tokens of its bucket reuses the loop.
  setup = Setup(model, None, stop_ids(eos_id), bucket, max_len, mesh)
  knobs = (warp, np.int32(max_new_tokens))

  def start():
    state = _init_jit(setup, params, prompt, keys, knobs)
    chunk = _chunk_jit.jitted(setup, params, state, 1, knobs)     # options chosen once
    return state, lambda s, steps: chunk(setup, params, s, steps, knobs)

  return run_loop(lambda: _run(setup, params, prompt, keys, knobs), start,
                  lambda: sharded.generate(loop, setup, (model,), (params,), (prompt,), keys,
                                           knobs),
                  mesh=mesh, max_new=max_new_tokens, models=(model,), on_chunk=on_chunk,
                  chunk_blocks=chunk_blocks, check=check_finite)


@loop_jit(static_argnums=0)
def _run(setup: Setup, params, prompt, keys, knobs) -> SpecState:
  return loop(setup, (params,), (prompt,), keys, knobs)


def loop(setup: Setup, params, prompts, keys, knobs) -> SpecState:
  """`_run` before jit (decoding/sharded.py jits it with explicit shardings): params = (the
  model's,), prompts = (its prompt,), knobs = (warp, limit), traced. With setup.mesh the state
  is pinned every step."""
  (params,), (prompt,) = params, prompts
  setup = with_knobs(setup, knobs)
  state = _init(setup, params, prompt, keys)
  step = functools.partial(_step, setup, params)
  return jax.lax.while_loop(lambda s: ~jnp.all(s.done),
                            lambda s: sharded.pin(step(s), setup.mesh),
                            sharded.pin(state, setup.mesh))


def _init(setup: Setup, params, prompt, keys) -> SpecState:
  model, max_new = setup.model, setup.max_new
  batch = prompt.tokens.shape[0]
  cache = sharded.init_cache(model, batch, setup.max_len, prompting.enc_len(model, prompt),
                             setup.mesh)
  logits, _, cache = model.prefill(params, prompt, cache)                # [B, V]
  first = setup.warp.sample(logits, sampling.position_keys(keys, jnp.zeros((batch,), jnp.int32)))
  ones = jnp.ones((batch,), jnp.int32)
  return SpecState(
      tokens=jnp.zeros((batch, max_new), jnp.int32).at[:, 0].set(first),
      lengths=ones, done=is_stop(first, setup.eos) | (setup.limit <= 1),
      last_two=jnp.stack([prompting.stream_anchor(model, prompt), first], axis=1),
      target_cache=cache, drafter_state=None, rule_state=(), key=keys,
      stats=SpecStats.zeros(batch).add(blocks=ones, emitted=ones, target_passes=ones)
      .flag(TARGET, sampling.nonfinite_rows(logits)))


def _step(setup: Setup, params, s: SpecState) -> SpecState:
  """One token for every row that is not done; a row ends at a stop id or at setup.limit."""
  live = ~s.done                                                          # [B]
  logits, _, cache = setup.model.extend(params, s.last_two[:, 1:], s.target_cache)   # [B, 1, V]
  token = setup.warp.sample(logits[:, 0], sampling.position_keys(s.key, s.lengths))
  cache = kv_cache.rollback(cache, jnp.where(live, cache.lengths, s.target_cache.lengths))
  write_at = jnp.where(live, s.lengths, setup.max_new)                    # max_new: dropped
  lengths = s.lengths + live
  done = s.done | (live & (is_stop(token, setup.eos) | (lengths >= setup.limit)))
  shifted = jnp.stack([s.last_two[:, 1], token], axis=1)
  return s.replace(
      tokens=write_rows(s.tokens, write_at, token), lengths=lengths, done=done,
      last_two=jnp.where(live[:, None], shifted, s.last_two), target_cache=cache,
      stats=s.stats.add(blocks=live, emitted=live, target_passes=live)
      .flag(TARGET, live & sampling.nonfinite_rows(logits)))


@functools.partial(jax.jit, static_argnums=0)
def _init_jit(setup: Setup, params, prompt, keys, knobs) -> SpecState:
  return _init(with_knobs(setup, knobs), params, prompt, keys)


@loop_jit(static_argnums=(0, 3), donate_argnums=2)
def _chunk_jit(setup: Setup, params, state: SpecState, steps: int, knobs) -> SpecState:
  step = functools.partial(_step, with_knobs(setup, knobs), params)
  return chunk_loop(step, state, steps)
