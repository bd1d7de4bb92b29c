"""Text as it is generated: each row's committed tokens -> the text that can be shown now.

The decoding loops call back after every chunk of blocks with the committed ids (state.drive);
`RowText` decodes a row's ids and returns only what is new and final: text is held back while it
ends in an incomplete UTF-8 sequence (the tokenizer decodes half a character as U+FFFD) or in the
beginning of a stop string, and a stop string ends the row (transformers' `stop_strings`, vLLM's
`stop`: the text is cut before it). `Streamer` does this for every row of a batch and tells the
loop which rows to end.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

import numpy as np

from specjax.models import prompting

REPLACEMENT = "\ufffd"     # what a byte-level tokenizer decodes an incomplete character to


@dataclasses.dataclass
class RowText:
  """One row's text as its tokens arrive; `shown` characters have been handed out."""
  tokenizer: object
  stop: tuple[str, ...] = ()
  shown: int = 0
  stopped: bool = False

  def update(self, ids: Sequence[int]) -> str:
    """The row's committed ids (all of them, cut at EOS by decode) -> the text new since the last
    call that is final; sets `stopped` when a stop string appeared (the text ends before it)."""
    text = prompting.decode(self.tokenizer, ids)
    cut = self.stop_at(text)
    if cut is not None:
      self.stopped = True
      end = cut
    else:
      end = len(text) - self.held_back(text)
    new = text[self.shown:max(end, self.shown)]
    self.shown = max(end, self.shown)
    return new

  def stop_at(self, text: str) -> int | None:
    """Where the first stop string starts in text (None: none there)."""
    hits = [i for s in self.stop if (i := text.find(s)) >= 0]
    return min(hits) if hits else None

  def held_back(self, text: str) -> int:
    """Characters at the end of text that may still change: an incomplete character, and before
    it the longest suffix that begins a stop string (its next character may be the one still
    incomplete: with stop "\\n🦜", "42\\n" + half the parrot holds back the newline too)."""
    whole = text.rstrip(REPLACEMENT)
    return len(text) - len(whole) + max((k for s in self.stop for k in range(1, len(s))
                                         if whole.endswith(s[:k])), default=0)


class Finished(NamedTuple):
  """A finished row: its generated ids, its text, and why it ended: "stop" (an end-of-sequence
  id of the tokenizer, or a stop string) or "length" (max_new_tokens generated), as vLLM's and
  OpenAI's finish_reason."""
  ids: list[int]
  text: str
  finish_reason: str


def final_text(tokenizer, ids: Sequence[int], stop: tuple[str, ...]) -> Finished:
  """The Finished row of generated `ids`: cut at its EOS, and at the first stop string if one
  appears (text before it; ids up to the token that completed it)."""
  ids = [int(t) for t in ids]
  text = prompting.decode(tokenizer, ids)
  row = RowText(tokenizer, stop)
  cut = row.stop_at(text)
  if cut is None:
    ended = bool(set(ids) & set(prompting.eos_ids(tokenizer)))
    return Finished(ids, text, "stop" if ended else "length")
  keep = next(k for k in range(1, len(ids) + 1)
              if row.stop_at(prompting.decode(tokenizer, ids[:k])) is not None)
  return Finished(ids[:keep], text[:cut], "stop")


class Streamer:
  """on_chunk for a batch: per row a RowText; `show(row, text)` gets each row's new text (None:
  nothing is shown, only stop strings are checked). Returns the rows to end."""

  def __init__(self, tokenizer, batch: int, stop: tuple[str, ...] = (),
               show: Callable[[int, str], None] | None = None):
    self.rows = [RowText(tokenizer, tuple(stop)) for _ in range(batch)]
    self.show = show

  def __call__(self, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    for b, row in enumerate(self.rows):
      if row.stopped:
        continue
      new = row.update(tokens[b, :lengths[b]])
      if new and self.show is not None:
        self.show(b, new)
    return np.asarray([row.stopped for row in self.rows])
