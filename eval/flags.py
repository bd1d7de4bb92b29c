"""Command-line values the eval tools check before any work: counts that must be positive and
output paths that must be writable (specjax.app.outputs), so that a long run never ends in a
refusal it could have made at the start."""

from __future__ import annotations

import pathlib
import sys

from specjax.app import outputs


def check_counts(**counts: int) -> None:
  """Refuse a count flag below 1: check_counts(num_prompts=0) -> '--num_prompts must be ...'."""
  for name, value in counts.items():
    if value < 1:
      raise ValueError(f"--{name} must be at least 1, got {value}")


def parse_gammas(text: str | None, flag: str = "--gamma") -> list[int]:
  """'1,3,5' -> [1, 3, 5]; None (the flag not given) -> [] (the caller's default). An empty
  list or item ('', '3,,4') is refused. `flag` names the flag in errors."""
  if text is None:
    return []
  items = text.split(",")
  if not all(g.strip() for g in items):
    raise ValueError(f"{flag} {text!r} has an empty value: give comma-separated whole numbers, "
                     f"e.g. 1,3,5 (or leave {flag} out for its default)")
  try:
    gammas = [int(g) for g in items]
  except ValueError:
    raise ValueError(f"{flag} must be comma-separated whole numbers, e.g. 1,3,5; "
                     f"got {text!r}") from None
  if any(g < 1 for g in gammas):
    raise ValueError(f"{flag} values must be at least 1, got {text!r}")
  return gammas


def names(text: str, flag: str, example: str) -> list[str]:
  """'target, exact,' -> ['target', 'exact']: a comma-separated list that names at least one
  item; an empty one is refused with `example`."""
  items = [t.strip() for t in text.split(",") if t.strip()]
  if not items:
    raise ValueError(f"{flag} {text!r} names nothing: give comma-separated names, e.g. {example}")
  return items


def output_file(path: str | None, flag: str) -> pathlib.Path | None:
  """The absolute output path, refused now if it cannot be written; None when not asked for."""
  return None if path is None else outputs.check_output_file(path, flag)


if __name__ == "__main__":         # a library module: say which tool to run, not exit 0
  sys.exit("eval.flags is a library, not a tool: python -m eval.latency, eval.bench, ... check their flags with it")
