"""Timing helpers shared by the eval tools: compile apart, then the median of repeats."""

from __future__ import annotations

import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from specjax import drafting
from specjax.decoding import speculative
from specjax.models import kv_cache, prompting


def once(fn):
  """(result, seconds) of one call, waiting for the device. A result with `seconds` (another
  program's generation, eval.llamacpp, whose wall time includes loading its model) is timed by
  what it reports."""
  start = time.perf_counter()
  result = jax.block_until_ready(fn())
  return result, getattr(result, "seconds", time.perf_counter() - start)


def progress():
  """A `say(message)` that prints to stderr with the seconds since this call: an eval tool's
  progress lines from its first second."""
  start = time.perf_counter()
  return lambda msg: print(f"[{time.perf_counter() - start:7.1f} s] {msg}", file=sys.stderr,
                           flush=True)


@functools.partial(jax.jit, static_argnames=("model", "width", "steps"))
def _extend_loop(model, params, cache, width: int, steps: int):
  """`steps` target/draft passes over `width` tokens at a fixed position (rolled back each time)."""
  tokens = jnp.ones((cache.lengths.shape[0], width), jnp.int32)
  base = cache.lengths

  def body(_, carry):
    c, acc = carry
    logits, _, c = model.extend(params, tokens, c)
    # Reduce over every logit so that XLA cannot prune the head or unused positions.
    return kv_cache.rollback(c, base), acc + jnp.sum(logits, axis=(1, 2))

  _, acc = jax.lax.fori_loop(0, steps, body, (cache, jnp.zeros(base.shape, jnp.float32)))
  return acc


def alternating(calls: dict, repeats: int) -> dict:
  """calls: {name: fn}. Compile each, then run them in turn `repeats` times, so that drift on a
  shared machine hits all alike. Returns {name: (result, compile_s, median_s)}."""
  first = {name: once(fn) for name, fn in calls.items()}
  times = {name: [] for name in calls}
  for _ in range(repeats):
    for name, fn in calls.items():
      times[name].append(once(fn)[1])
  medians = {name: statistics.median(t) for name, t in times.items()}
  return {name: (first[name][0], max(first[name][1] - medians[name], 0.0), medians[name])
          for name in calls}


def step_loop(model, params, prompt, width: int, capacity: int, steps: int = 64):
  """A call running `steps` model passes over `width` tokens after the prompt, at batch = prompt
  rows, with a cache of `capacity` entries: the size decoding uses, since a pass's cost grows
  with it."""
  prefix = prompting.prefix_len(model, prompt)
  cache = model.init_cache(prompt.tokens.shape[0], max(capacity, prefix + width),
                           prompting.enc_len(model, prompt))
  _, _, cache = model.prefill(params, prompt, cache)
  return functools.partial(_extend_loop, model, params, cache, width, steps)


@functools.partial(jax.jit, static_argnames=("head", "steps"))
def _head_loop(head, params, cache, steps: int):
  """`steps` draft-head passes over one (feature, token) pair, rolled back each time."""
  batch = cache.lengths.shape[0]
  features = jnp.ones((batch, 1, head.hidden_size), head.dtype)
  tokens = jnp.ones((batch, 1), jnp.int32)
  base = cache.lengths

  def body(_, carry):
    c, acc = carry
    logits, _, c = head.extend(params, features, tokens, c)
    return kv_cache.rollback(c, base), acc + jnp.sum(logits, axis=(1, 2))

  _, acc = jax.lax.fori_loop(0, steps, body, (cache, jnp.zeros(base.shape, jnp.float32)))
  return acc


def head_step_loop(head, params, batch: int, capacity: int, filled: int, steps: int = 64):
  """A call running `steps` passes of a draft head (models/draft_head.py) over one position,
  with `filled` of its cache's `capacity` entries in use (what the cost model's c reads)."""
  cache = head.init_cache(batch, capacity)
  cache = cache.replace(lengths=jnp.full((batch,), min(filled, capacity - 1), jnp.int32))
  return functools.partial(_head_loop, head, params, cache, steps)


def cost_probes(target, target_params, draft, draft_params, prompt, draft_prompt, rule,
                gamma: int, max_new: int, steps: int, widths=()) -> dict:
  """Calls for the cost model's probes, each `steps` passes with the caches speculative decoding
  at `gamma` uses: "t1" the target over one token, "t{w}" over w tokens for each of `widths`
  (a verify pass: w = gamma + 1), "d1" the draft over one token (none for a drafter without a
  model, draft None: its c is 0)."""
  def cap(model, p, is_draft=False):
    drafter = drafting.as_drafter(model, rule) if is_draft else None
    return speculative.reserve(gamma, drafter).need(prompting.prefix_len(model, p), max_new)
  t_cap = cap(target, prompt)
  probes = {f"t{w}": step_loop(target, target_params, prompt, w, t_cap, steps)
            for w in (1, *widths)}
  if draft is not None:
    probes["d1"] = step_loop(draft, draft_params, draft_prompt, 1,
                             cap(draft, draft_prompt, True), steps)
  return probes


if __name__ == "__main__":         # a library module: say which tool to run, not exit 0
  sys.exit("eval.timing is a library, not a tool: python -m eval.latency and eval.bench time with it")
