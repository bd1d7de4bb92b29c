"""Text tasks by name: the offline stdlib tasks and the paper's TFDS datasets.

A task is a frozen dataclass with `name`, `kind` ("lm": decoder-only continuation, the LM1B
setup; "seq2seq": input -> output, the T5 setup), `metric` (a key of `metrics.METRICS`, None for
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
"""

from __future__ import annotations

import dataclasses
import functools
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


OFFLINE_TASKS = (StdlibTask("stdlib_lm", "lm", None), StdlibTask("stdlib_sum", "seq2seq", "rouge"))
TASK_NAMES = tuple(t.name for t in OFFLINE_TASKS + PAPER_TASKS)


def get_task(name: str, *, data_dir: str | None = None,
             max_examples: int | None = None) -> StdlibTask | TfdsTask:
  """A task by name; `data_dir` / `max_examples` apply to the TFDS tasks only."""
  for task in OFFLINE_TASKS:
    if task.name == name:
      return task
  for task in PAPER_TASKS:
    if task.name == name:
      return dataclasses.replace(task, data_dir=data_dir, max_examples=max_examples)
  raise ValueError(f"unknown task {name!r}: use one of {TASK_NAMES}")
