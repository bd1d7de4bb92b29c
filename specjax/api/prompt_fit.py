"""Prompts against the cache: how long a prompt may be, `decode.truncate=left`, and the refusal
that says so in numbers.

A model's cache holds `limit` positions (decode.max_len, else its position table); decoding
reserves `per_token * max_new_tokens + fixed` of them after the prompt (a speculative block's
gamma, a cross-tokenizer draft's several draft tokens per target token), so the longest prompt
that fits is `limit - reserved`. Example: n_positions 256, max_new_tokens 64, gamma 4 (exact
SD): 256 - (64 + 4) = 188 tokens; a draft on another tokenizer whose longest spelling of a target
token is 5 draft tokens: 256 - (5 * 64 + 4) < 0, no prompt fits, and max_new_tokens may be at most
(256 - 4 - n) // 5 for an n-token prompt.

max_new_tokens here is the limit itself, never the bucket the loops compile for
(decoding/state.new_tokens_bucket): a prompt that fits 40 new tokens is not refused because 40's
bucket is 64 (a cache sized by the loop holds the bucket only where the position table allows).

A model without a position table (rotary, relative) bounds no prompt, but its cache must still
fit in memory: `check_cache_memory` refuses a call whose KV cache alone would outgrow the
machine (max_new_tokens=10**9 once compiled for 37 s and then failed to allocate 28 TB).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax

from specjax.api.errors import UsageError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Room:
  """One model's cache budget: positions, where that number comes from, and what decoding
  reserves after the prompt (per_token * max_new_tokens + fixed)."""
  model: str                     # "the target", "the draft"
  limit: int
  limit_from: str                # "--config.decode.max_len", "its n_positions"
  max_new_tokens: int
  per_token: int = 1             # cache positions one new token may take
  fixed: int = 0                 # positions beyond the new tokens (a verify block)
  fixed_from: str = ""           # "gamma 4"
  prefix: str = "--config.decode."   # how messages name the settings ("": Python arguments)

  @property
  def reserved(self) -> int:
    return self.per_token * self.max_new_tokens + self.fixed

  @property
  def longest(self) -> int:
    """The longest prompt (in this model's tokens) that fits."""
    return self.limit - self.reserved

  def largest_max_new_tokens(self, prompt_len: int) -> int | None:
    """The most new tokens that leave room for a prompt of prompt_len (None: any number)."""
    if not self.per_token:
      return None
    return (self.limit - self.fixed - prompt_len) // self.per_token

  def largest_gamma(self, prompt_len: int) -> int | None:
    """The longest verify block (gamma) that leaves room for the prompt and the new tokens (None:
    the fixed positions are not a verify block)."""
    if not self.fixed_from.startswith("gamma"):
      return None
    return self.limit - self.per_token * self.max_new_tokens - prompt_len

  def describe(self) -> str:
    per = "" if self.per_token == 1 else f", each up to {self.per_token} draft tokens,"
    fixed = f" + {self.fixed_from}" if self.fixed else ""
    return (f"{self.model}'s cache holds {self.limit} positions ({self.limit_from}) and decoding "
            f"reserves {self.reserved} of them (max_new_tokens {self.max_new_tokens}{per}{fixed})")


class PromptTooLongError(ValueError):
  """A prompt its model's cache cannot hold; the message gives both lengths and the fixes."""

  def __init__(self, text: str, tokens: int, room: Room, keep_at_least: int):
    self.tokens, self.room = tokens, room
    fixes = []
    if room.longest >= keep_at_least:
      fixes = ["shorten the prompt",
               f"pass {room.prefix}truncate=left (keeps its last {room.longest} tokens)"]
    most = room.largest_max_new_tokens(tokens)
    if most is not None and most >= 1:
      fixes.append(f"lower {room.prefix}max_new_tokens (at most {most} for this prompt)")
    gamma = room.largest_gamma(tokens)
    if gamma is not None and 1 <= gamma < room.fixed:
      fixes.append(f"lower {room.prefix}gamma (at most {gamma} for this prompt)")
    if room.limit_from == f"{room.prefix}max_len":
      fixes.append(f"raise {room.limit_from}")
    elif most is not None and most < 1 and not (gamma is not None and gamma >= 1):
      fixes.append("use a model with a longer position table")
    fits = (f"the longest prompt that fits is {room.longest} token"
            f"{'s' if room.longest > 1 else ''}" if room.longest > 0 else "no prompt fits")
    fixes = ", ".join(fixes[:-1]) + (", or " if len(fixes) > 1 else "") + fixes[-1]
    super().__init__(f"prompt {_quote(text)} has {tokens} tokens for {room.model}; "
                     f"{room.describe()}, so {fits}: {fixes}")


def _quote(text, width: int = 30) -> str:
  """A prompt as messages name it: its text's first `width` characters, or its first 8 ids."""
  if not isinstance(text, str):
    ids = [int(i) for i in text]
    return f"of ids [{', '.join(map(str, ids[:8]))}{', ...' if len(ids) > 8 else ''}]"
  return repr(text if len(text) <= width else text[:width] + "...")


def fit(rows: list[list[int]], texts, room: Room | None, *, truncate: str,
        encoder_decoder: bool, bos: bool) -> list[list[int]]:
  """Rows that fit `room`: unchanged, cut on the left (truncate='left'; a decoder-only row keeps
  its BOS, an encoder row its final EOS), or refused with PromptTooLongError.

  Example (decoder-only, BOS 3, room 3): [3, 7, 8, 9, 10] -> [3, 9, 10] (2 tokens dropped)."""
  if room is None:
    return rows
  head = int(bos and not encoder_decoder)            # a decoder-only row's BOS stays first
  keep = 2 if (head or encoder_decoder) else 1       # its marker (BOS / EOS) and one text token
  out = []
  for row, text in zip(rows, texts):
    if len(row) > room.longest and (truncate != "left" or room.longest < keep):
      raise PromptTooLongError(text, len(row), room, keep)
    out.append(row if len(row) <= room.longest else _cut_left(row, room, head, text))
  return out


def _cut_left(row: list[int], room: Room, head: int, text: str) -> list[int]:
  """The first `head` tokens (a BOS) and the last ones that fit; the cut is logged."""
  kept = row[:head] + row[len(row) - (room.longest - head):]
  log.warning("prompt %s: dropped the first %d of its %d tokens to fit %s's cache "
              "(%struncate=left)", _quote(text), len(row) - len(kept), len(row), room.model,
              room.prefix)
  return kept


def memory_bytes() -> int:
  """The memory a cache can live in: the default device's (bytes_limit, GPU / TPU), else the
  host's physical memory (CPU)."""
  stats = jax.devices()[0].memory_stats() or {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"]) * jax.device_count()
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def warn_past_context(model, model_name: str, prompt_len: int, max_new_tokens: int,
                      prefix: str) -> None:
  """Log a warning where the longest prompt and its new tokens run past the context a rotary
  model was trained for (config's max_position_embeddings: Qwen2.5, 32,768): nothing bounds them
  there, and a 116k-token prompt was padded to 131,072 positions without a word."""
  trained = getattr(getattr(model, "config", None), "max_position_embeddings", None)
  if isinstance(trained, int) and prompt_len + max_new_tokens > trained:
    log.warning("a prompt of %d tokens and %d new tokens run past the %d positions %s was "
                "trained for (max_position_embeddings): its text there is unreliable, and the "
                "cache and the time grow with it; %struncate='left' with %smax_len=%d keeps the "
                "last tokens", prompt_len, max_new_tokens, trained, model_name, prefix, prefix,
                trained)


def check_cache_memory(model, model_name: str, batch: int, positions: int, enc_len: int,
                       max_new_tokens: int, prefix: str) -> None:
  """UsageError naming max_new_tokens when `model`'s KV cache of `positions` x `batch` rows
  (abstract: nothing is allocated) takes more than memory_bytes()."""
  cache = jax.eval_shape(lambda: model.init_cache(batch, positions, enc_len))
  need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
  have = memory_bytes()
  if need <= have:
    return
  most = max(int(max_new_tokens * have / need), 1)
  raise UsageError(f"{prefix}max_new_tokens={max_new_tokens}: {model_name}'s KV cache would take "
                   f"{need / 2**30:,.0f} GiB ({positions:,} positions x {batch} rows), more "
                   f"than the {have / 2**30:,.0f} GiB of memory here: lower {prefix}max_new_tokens "
                   f"(at most about {most:,})")
