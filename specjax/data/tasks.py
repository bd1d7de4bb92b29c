"""Text tasks by name: the offline stdlib tasks and the paper's TFDS datasets.

A task is a frozen dataclass with `name`, `kind` ("lm": decoder-only continuation, the LM1B
setup; "seq2seq": input -> output, the T5 setup; "completion": a decoder-only model's prompt ->
its continuation), `metric` (a key of `metrics.METRICS`, None for
LM tasks, which are scored by likelihood) and `examples(split) -> Sequence[(input, target)]`
(random access; LM targets are ""). `Source` turns a task and a tokenizer into batches.

| name | kind | data | metric |
|---|---|---|---|
| stdlib_lm | lm | Python stdlib code chunks (offline) | - |
| stdlib_sum | seq2seq | stdlib function -> docstring summary (offline) | ROUGE-2 / ROUGE-L |
| lm1b | lm | TFDS lm1b | - |
| xsum, cnn_dailymail | seq2seq | TFDS | ROUGE |
| wmt14_en_de | seq2seq | TFDS wmt14_translate/de-en, en -> de | BLEU |
| gsm8k | seq2seq | TFDS huggingface:gsm8k/main | final-answer accuracy |
| file:PATH | completion | a local file of prompts and the texts written for them | - |

`file:PATH` reads what `python -m specjax.decode --input_file P --output_json PATH` writes (its
"results": {"prompt", "text", ...} each), or a JSON list or JSON lines of objects with "prompt"
and "text": a model's own text as training data. Trained with the NLL loss, a draft learns to write what the target wrote
(sequence-level distillation, which needs no shared vocabulary: configs/distill_qwen_coder_smollm.py).
Every 20th record is the validation split, the others the train split.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Sequence

from specjax.data import stdlib_corpus
from specjax.data.tfds_tasks import PAPER_TASKS, TfdsTask


@dataclasses.dataclass(frozen=True)
class StdlibTask:
  name: str
  kind: str
  metric: str | None

  def examples(self, split: str) -> Sequence[tuple[str, str]]:
    return _stdlib_examples(self.kind, split)


@functools.lru_cache(maxsize=None)
def _stdlib_examples(kind: str, split: str) -> tuple[tuple[str, str], ...]:
  corpus = stdlib_corpus.load_corpus()
  if kind == "lm":
    return tuple((text, "") for text in corpus.lm_split(split))
  return corpus.sum_split(split)


class TaskFileError(ValueError):
  """A file: task whose file cannot be read as prompt / text records; the message says why."""


@dataclasses.dataclass(frozen=True)
class FileTask:
  """Prompt -> completion records of a local file (the module docstring's `file:PATH`)."""
  path: str
  kind: str = "completion"
  metric: str | None = None
  held_out_every: int = 20

  @property
  def name(self) -> str:
    return f"file:{self.path}"

  def examples(self, split: str) -> Sequence[tuple[str, str]]:
    rows = _file_records(self.path)
    held_out = [i % self.held_out_every == self.held_out_every - 1 for i in range(len(rows))]
    return tuple(r for r, out in zip(rows, held_out) if out == (split != "train"))


@functools.lru_cache(maxsize=None)
def _file_records(path: str) -> tuple[tuple[str, str], ...]:
  """(prompt, text) of every record of a decode --output_json report (its "results"), a JSON
  list or a JSON-lines file."""
  form = ('the report specjax.decode --output_json writes, a JSON list or JSON lines of objects '
          'with "prompt" and "text"')
  try:
    raw = Path(path).expanduser().read_text(encoding="utf-8")
  except FileNotFoundError:
    raise TaskFileError(f"task file:{path}: {path} does not exist (write it with python -m "
                        f"specjax.decode --input_file PROMPTS --output_json {path})") from None
  except (IsADirectoryError, UnicodeDecodeError) as err:
    raise TaskFileError(f"task file:{path}: cannot read it as UTF-8 text ({err}); give {form}") \
        from None
  try:
    whole, as_one = json.loads(raw), None
  except json.JSONDecodeError as err:
    whole, as_one = None, err              # JSON lines, or not JSON: its lines say where
  records = whole.get("results", [whole]) if isinstance(whole, dict) else whole
  if whole is None:
    records = []
    for number, line in enumerate(raw.splitlines(), 1):
      if not line.strip():
        continue
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError as err:
        # A first line that is no JSON value is a document cut short (a killed decode's
        # report): the whole document's error says where it ends.
        why = as_one if not records else f"line {number}: {err}"
        raise TaskFileError(f"task file:{path} is not JSON ({why}); give {form}") from None
  if not isinstance(records, list):
    raise TaskFileError(f"task file:{path} holds no list of records; give {form}")
  bad = [i for i, r in enumerate(records) if not (isinstance(r, dict) and isinstance(
      r.get("prompt"), str) and isinstance(r.get("text"), str))]
  if bad or not records:
    where = (f"record {bad[0]} has no \"prompt\" and \"text\" strings" if bad
             else "it holds no records")
    raise TaskFileError(f"task file:{path}: {where}; give {form}")
  if not any(r["text"] for r in records):       # every step would train on 0 tokens, and exit 0
    raise TaskFileError(f"task file:{path}: the \"text\" of every one of its {len(records)} "
                        f"records is empty, so there is nothing to train on; give {form} whose "
                        f"texts hold the completions")
  return tuple((r["prompt"], r["text"]) for r in records)


OFFLINE_TASKS = (StdlibTask("stdlib_lm", "lm", None), StdlibTask("stdlib_sum", "seq2seq", "rouge"))
TASK_NAMES = tuple(t.name for t in OFFLINE_TASKS + PAPER_TASKS)


def get_task(name: str, *, data_dir: str | None = None,
             max_examples: int | None = None) -> StdlibTask | TfdsTask:
  """A task by name (or `file:PATH`); `data_dir` / `max_examples` apply to the TFDS tasks only."""
  if name.startswith("file:") and name[len("file:"):].strip():
    return FileTask(name[len("file:"):])
  for task in OFFLINE_TASKS:
    if task.name == name:
      return task
  for task in PAPER_TASKS:
    if task.name == name:
      return dataclasses.replace(task, data_dir=data_dir, max_examples=max_examples)
  raise ValueError(f"unknown task {name!r}: use one of {TASK_NAMES}, or file:PATH")
