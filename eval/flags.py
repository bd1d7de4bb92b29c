"""Command-line values the eval tools check before any work: counts that must be positive and
output paths that must be writable (specjax.app.outputs), so that a long run never ends in a
refusal it could have made at the start."""

from __future__ import annotations

import pathlib

from specjax.app import outputs


def check_counts(**counts: int) -> None:
  """Refuse a count flag below 1: check_counts(num_prompts=0) -> '--num_prompts must be ...'."""
  for name, value in counts.items():
    if value < 1:
      raise ValueError(f"--{name} must be at least 1, got {value}")


def parse_gammas(text: str, flag: str = "--gamma") -> list[int]:
  """'1,3,5' -> [1, 3, 5]; '' -> [] (the config's gamma). `flag` names the flag in errors."""
  try:
    gammas = [int(g) for g in text.split(",") if g.strip()]
  except ValueError:
    raise ValueError(f"{flag} must be comma-separated whole numbers, e.g. 1,3,5; "
                     f"got {text!r}") from None
  if any(g < 1 for g in gammas):
    raise ValueError(f"{flag} values must be at least 1, got {text!r}")
  return gammas


def output_file(path: str | None, flag: str) -> pathlib.Path | None:
  """The absolute output path, refused now if it cannot be written; None when not asked for."""
  return None if path is None else outputs.check_output_file(path, flag)
