"""Prompt lookup: a drafter with no model that proposes what followed the last n tokens the
last time they appeared in the row's prompt or its own output (transformers'
`prompt_lookup_num_tokens`, vLLM's and SGLang's `ngram` proposer).

Per block and row: the committed stream is the prompt followed by the generated tokens; its
last n tokens, for n from ngram_max down to ngram_min, are looked up in the stream before them;
the most recent match followed by gamma tokens wins (else the earliest, followed by the most),
and the up to gamma tokens that followed it are the drafts. No match:
no drafts, and the block is the target's own step (the loop verifies at its narrowest width).
Its q is one-hot: a proposal that depends only on the history, which the exact rule accepts with
probability p(x) and whose residual is p without x, so the output law is the target's.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from specjax.drafting.base import Block, Drafter, Proposal

MISSING = -1     # a stream position past the row's end: matches no token


@dataclasses.dataclass(frozen=True)
class NGram(Drafter):
  """The prompt-lookup drafter. ngram_max >= ngram_min >= 1: the longest and shortest suffix
  looked up (longer suffixes first: they predict better)."""
  ngram_max: int = 3
  ngram_min: int = 1
  name: ClassVar[str] = "ngram"
  what: ClassVar[str] = "prompt lookup"
  one_hot: ClassVar[bool] = True

  @property
  def variable_count(self) -> bool:
    return True

  @property
  def may_propose_none(self) -> bool:
    return True

  def __post_init__(self):
    ok = lambda v: isinstance(v, int) and not isinstance(v, bool)
    if not (ok(self.ngram_min) and ok(self.ngram_max) and 1 <= self.ngram_min <= self.ngram_max):
      raise ValueError(f"ngram_min={self.ngram_min!r}, ngram_max={self.ngram_max!r}: prompt lookup "
                       f"needs whole numbers with 1 <= ngram_min <= ngram_max (e.g. 1 and 3)")

  def init(self, params, draft_prompt, new_cache, gamma: int):
    """No model and no cache; the anchors are the prompt, which the lookup reads."""
    del params, new_cache, gamma
    return None, dict(history=draft_prompt.tokens,
                      history_len=draft_prompt.lengths.astype(jnp.int32))

  def propose(self, params, anchors, state, block: Block) -> Proposal:
    """The block's proposals with their one-hot q [B, K, V]; no draft pass."""
    del params
    tokens, count = self.lookup(anchors["history"], anchors["history_len"], block.tokens,
                                block.lengths, block.gamma)
    count = jnp.where(block.live, count, 0)
    q_logp = jnp.where(jax.nn.one_hot(tokens, block.vocab, dtype=bool), 0.0, -jnp.inf)
    none = jnp.zeros(block.live.shape, bool)
    return Proposal(tokens=tokens, q_logp=q_logp, count=count, passes=count * 0,
                    nonfinite=none, state=state)

  def lookup(self, history: jax.Array, history_len: jax.Array, tokens: jax.Array,
             lengths: jax.Array, gamma: int) -> tuple[jax.Array, jax.Array]:
    """history [B, P] (the prompt, valid below history_len [B]), tokens [B, N] (generated, valid
    below lengths [B]) -> (drafts [B, gamma] int32, 0 past each row's count; count [B])."""
    stream, end = committed_stream(history, history_len, tokens, lengths)
    start = jnp.full(end.shape, -1, jnp.int32)
    # An n-gram with a token after it fits in a stream of more than n tokens: longer windows
    # match nothing, and tracing them all (ngram_max 10**5) would not finish compiling.
    longest = min(self.ngram_max, stream.shape[1] - 1)
    for n in range(longest, self.ngram_min - 1, -1):
      found = best_match(stream, end, n, gamma)                           # [B], -1: none
      start = jnp.where((start < 0) & (found >= 0), found + n, start)
    t = start[:, None] + jnp.arange(gamma)[None, :]                      # [B, K]
    valid = (start[:, None] >= 0) & (t < end[:, None])
    drafts = jnp.where(valid, jnp.take_along_axis(stream, jnp.clip(t, 0, stream.shape[1] - 1),
                                                  axis=1), 0)
    return drafts.astype(jnp.int32), jnp.sum(valid, axis=1).astype(jnp.int32)


def committed_stream(history, history_len, tokens, lengths) -> tuple[jax.Array, jax.Array]:
  """The prompt then the generated tokens, packed left: (stream [B, P+N], MISSING past each
  row's end; end [B] = history_len + lengths)."""
  width = history.shape[1] + tokens.shape[1]
  j = jnp.arange(width)[None, :]
  hl = history_len[:, None]
  from_history = jnp.take_along_axis(history, jnp.clip(j, 0, history.shape[1] - 1), axis=1)
  from_output = jnp.take_along_axis(tokens, jnp.clip(j - hl, 0, tokens.shape[1] - 1), axis=1)
  end = (history_len + lengths).astype(jnp.int32)
  stream = jnp.where(j < hl, from_history, jnp.where(j < end[:, None], from_output, MISSING))
  return stream.astype(jnp.int32), end


def best_match(stream: jax.Array, end: jax.Array, n: int, gamma: int) -> jax.Array:
  """A start i of stream[i:i+n] == stream[end-n:end] with i + n < end (a token follows the
  match, and the suffix is not matched with itself): the last one followed by gamma tokens, else
  the first (followed by the most); -1 where none (or end < n + 1). In a run of one repeated
  token the last match is the suffix shifted by one, followed by a single token."""
  batch, width = stream.shape
  padded = jnp.pad(stream, ((0, 0), (0, n)), constant_values=MISSING)
  i = jnp.arange(width)[None, :]
  match = (i + n < end[:, None]) & (end[:, None] >= n + 1)
  for k in range(n):
    suffix_k = jnp.take_along_axis(stream, jnp.clip(end - n + k, 0, width - 1)[:, None], axis=1)
    match = match & (jax.lax.dynamic_slice_in_dim(padded, k, width, axis=1) == suffix_k)
  full = match & (i + n + gamma <= end[:, None])
  last_full = jnp.max(jnp.where(full, i, -1), axis=1)
  first = jnp.min(jnp.where(match, i, width), axis=1)
  return jnp.where(last_full >= 0, last_full, jnp.where(first < width, first, -1)).astype(jnp.int32)
