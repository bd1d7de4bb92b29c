"""What a generation returns to Python: texts, generated ids and statistics per row and in all."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from specjax.decoding.state import STAT_FIELDS as SPEC_FIELDS
from specjax.sprinter.loop import EXTRA_FIELDS

STAT_FIELDS = SPEC_FIELDS + EXTRA_FIELDS


@dataclasses.dataclass(frozen=True)
class Result:
  """One `generate` call's output, in the order of its prompts.

  texts: the generated text per prompt (without the prompt), cut at its end-of-sequence token
  and before the first stop string. tokens: the generated ids per prompt (without the prompt;
  through the token that completed a stop string). stats: counters of the decoding work summed
  over the prompts (emitted: tokens decoded, those of a row's last block past a stop string
  included, as stop strings are checked between blocks; accepted, verified, blocks, target_passes,
  draft_passes, ... as the method reports them) with acceptance_rate (alpha, accepted over
  verified) and block_efficiency (tau, emitted tokens per block) where they apply.
  row_stats: the counters of each prompt. finish_reasons: per prompt "stop" (it ended at an
  end-of-sequence id or a stop string) or "length" (it generated max_new_tokens), as vLLM's and
  OpenAI's finish_reason."""
  texts: list[str]
  tokens: list[list[int]]
  stats: dict
  row_stats: list[dict]
  finish_reasons: list[str]


class Row(NamedTuple):
  """One prompt's output as the decoding front door (api.decoder.batches) yields it."""
  ids: list[int]
  text: str
  stats: dict
  finish_reason: str


def stats_rows(stats, batch: int) -> list[dict]:
  """Per-row statistics dicts of a Generation's stats (every field the method reports)."""
  if stats is None:
    return [{} for _ in range(batch)]
  arrays = {f: np.asarray(getattr(stats, f)) for f in STAT_FIELDS if hasattr(stats, f)}
  return [{f: int(a[i]) for f, a in arrays.items()} for i in range(batch)]


def aggregate(rows: list[dict]) -> dict:
  """Summed counters plus acceptance_rate (alpha; None where a draft proposed tokens but none was
  verified: max_new_tokens=1, or a stop string in the first block; absent for the target alone)
  and block_efficiency (tau)."""
  total = {f: sum(r.get(f, 0) for r in rows) for f in STAT_FIELDS if any(f in r for r in rows)}
  if total.get("verified"):
    total["acceptance_rate"] = total["accepted"] / total["verified"]
  elif total.get("drafted") or total.get("draft_passes"):
    total["acceptance_rate"] = None
  if total.get("blocks"):
    total["block_efficiency"] = total["emitted"] / total["blocks"]
  return total
