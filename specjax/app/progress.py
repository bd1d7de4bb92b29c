"""A decode run's finished prompts, kept beside its --output_json so that a killed run resumes.

`python -m specjax.decode ... --output_json OUT` rewrites OUT.partial (atomically) after every
batch with the prompts finished so far and the settings that produced them (the config and the
prompt list). Run the same command again after a kill (SIGKILL, a crash, a reboot) and it starts
after the last saved batch: prompt i still draws with fold_in(key, i), so the resumed results are
those of an uninterrupted run. OUT.partial is removed once OUT is written. A partial left by a
command with other settings is refused, naming what differs, rather than mixed in or overwritten.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable

from specjax.app import outputs

log = logging.getLogger(__name__)

SUFFIX = ".partial"
VERSION = 1
ROW_KEYS = ("prompt", "text", "tokens", "stats")
DISPLAY_ONLY = ("stream",)       # decode settings that change only what is printed


class ProgressError(ValueError):
  """A progress file that cannot be resumed from; the message names it and the fix."""


class Progress:
  """OUT.partial for one run: `rows()` the finished prompts of an earlier run of the same
  settings, `save(rows)` after each batch, `finish()` once OUT is written. Another tool keeps its
  own state under `key` (`load(check)`, `save(state)`), written by `tool`."""

  def __init__(self, output: str | os.PathLike, settings: dict, tool: str = "specjax.decode",
               key: str = "results"):
    self.path = Path(str(output) + SUFFIX)
    self.tool, self.key = tool, key
    self.settings = json.loads(json.dumps(outputs.strict(settings), default=str))
    for name in DISPLAY_ONLY:
      (self.settings.get("decode") or {}).pop(name, None)

  def load(self, check: Callable[[object], str]):
    """The state an earlier run with these settings saved (None when there is none); check(state)
    says why it is not one this tool wrote ("" when it is)."""
    if not self.path.exists():
      return None
    try:
      saved = json.loads(self.path.read_text(encoding="utf-8"))
      settings, state = saved["settings"], saved[self.key]
    except (OSError, ValueError, KeyError, TypeError) as err:
      raise ProgressError(f"{self.path} (a killed run's progress) cannot be read ({err}): delete "
                          f"it to start over") from None
    if settings != self.settings or saved.get("version") != VERSION:
      raise ProgressError(f"{self.path} holds the progress of a run with other settings "
                          f"({_differences(settings, self.settings)}): rerun that command to "
                          f"finish it, or delete the file to start over")
    why = check(state)
    if why:
      raise ProgressError(f"{self.path} is not a run's progress as {self.tool} writes it "
                          f"({why}): delete it to start over")
    return state

  def rows(self) -> list[dict]:
    """The results saved by an earlier run with these settings ([] when there is none):
    [{"prompt", "text", "tokens", "stats"}] in prompt order."""
    prompts = self.settings.get("prompts", [])
    rows = self.load(lambda rows: _not_rows(rows, prompts))
    if rows is None:
      return []
    log.info("resuming: %d of %d prompts were decoded by an earlier run (%s)", len(rows),
             len(prompts), self.path)
    return rows

  def save(self, state) -> None:
    outputs.write_json(self.path, {"version": VERSION, "settings": self.settings,
                                   self.key: state})

  def finish(self) -> None:
    self.path.unlink(missing_ok=True)


def _not_rows(rows, prompts: list) -> str:
  """Why `rows` are not the first results of `prompts` ("" when they are)."""
  if not isinstance(rows, list) or len(rows) > len(prompts):
    return f"{len(rows) if isinstance(rows, list) else 'no list of'} results for " \
           f"{len(prompts)} prompts"
  for i, (row, prompt) in enumerate(zip(rows, prompts)):
    missing = [k for k in ROW_KEYS if not isinstance(row, dict) or k not in row]
    if missing:
      return f"result {i} lacks {', '.join(missing)}"
    if row["prompt"] != prompt:
      return f"result {i} is for another prompt than prompt {i}"
  return ""


def _flat(tree, prefix: str = "") -> dict:
  if not isinstance(tree, dict):
    return {prefix.rstrip("."): tree}
  return {k: v for key, value in tree.items() for k, v in _flat(value, f"{prefix}{key}.").items()}


def _differences(saved: dict, now: dict) -> str:
  """'differs in KEY, ...': the dotted settings keys whose values differ (four at most)."""
  a, b = _flat(saved), _flat(now)
  keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
  return "differs in " + ", ".join(keys[:4]) + (", ..." if len(keys) > 4 else "")
