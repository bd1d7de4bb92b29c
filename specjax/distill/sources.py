"""The training data of a run, opened with its preparation timed and logged.

`open_source(options, batch_size)` is the trainer's source (deterministic `.batch(step, split)`):
* kind "markov": the seeded Markov stand-in (`data.MarkovSource`), built in O(vocab * k);
* kind "task": a text task under a tokenizer (`specjax.data.source.Source`). A paper task read from
  TFDS that is not prepared on this machine (or tensorflow-datasets is not installed) falls back to
  its offline analogue on the Python stdlib corpus (lm -> stdlib_lm, seq2seq -> stdlib_sum), with a
  logged notice, under the options' tokenizer or, when none is set, `OFFLINE_TOKENIZER`.

Training batches have fixed shapes (the prompt is always padded to its cap), so the update step
compiles once.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from specjax.data import source as source_lib
from specjax.data import tasks, tokenizer as tokenizer_lib
from specjax.data.tfds_tasks import MissingDataError
from specjax.distill import data as data_lib

log = logging.getLogger(__name__)

OFFLINE_ANALOGUE = {"lm": "stdlib_lm", "seq2seq": "stdlib_sum"}
# Fits the T5 / LM1B vocabularies (32128). Trained on the corpus's first 2M characters: 5-6.5 s in
# a cold run on 2 cores (beside the model builds) against 34 s for all 7.8M, which was the largest
# part of the wait before the first step; 1.7% more tokens per character on held-out text.
OFFLINE_TOKENIZER = "stdlib:unigram:8000:2000000"
KINDS = ("markov", "task")


class UnknownSourceError(ValueError):
  def __init__(self, kind: str):
    self.kind = kind
    super().__init__(f"unknown data source {kind!r}: use one of {', '.join(KINDS)}")


class VocabTooSmallError(ValueError):
  """The tokenizer has more ids than the models' vocabulary."""

  def __init__(self, tokenizer: str, tokenizer_vocab: int, model_vocab: int):
    self.tokenizer, self.tokenizer_vocab, self.model_vocab = tokenizer, tokenizer_vocab, model_vocab
    super().__init__(f"tokenizer {tokenizer} has {tokenizer_vocab} ids but the models have "
                     f"vocab_size {model_vocab}")


@dataclasses.dataclass(frozen=True)
class DataOptions:
  """What the training data is: the source kind and, for tasks, the task and its tokenizer."""
  kind: str = "markov"           # markov | task
  task: str = ""                 # a specjax.data.tasks name
  tokenizer: str = ""            # a tokenizer spec; "" -> OFFLINE_TOKENIZER
  vocab_size: int = 0            # the models' vocabulary
  prompt_len: int = 8            # prompt tokens (lm) / input tokens (seq2seq), EOS included
  target_len: int = 16
  seed: int = 0
  data_dir: str = ""             # TFDS data_dir ("" -> TFDS_DATA_DIR or its default)


def open_source(options: DataOptions, batch_size: int):
  """The training source for `options` (module docstring); logs what was prepared and how long
  it took."""
  started = time.perf_counter()
  if options.kind == "markov":
    source = data_lib.MarkovSource(options.vocab_size, batch_size, options.prompt_len,
                                   options.target_len, options.seed)
    log.info("data: Markov chain over %d ids (%d successors each), built in %.2fs",
             options.vocab_size, source.successor_table.shape[1], time.perf_counter() - started)
    return source
  if options.kind != "task":
    raise UnknownSourceError(options.kind)
  task = tasks.get_task(options.task, data_dir=options.data_dir or None)
  if isinstance(task, tasks.FileTask):    # refused before a tokenizer is trained (a minute)
    task.examples("train")
  tokenizer_spec = options.tokenizer or OFFLINE_TOKENIZER
  tokenizer = tokenizer_lib.get_tokenizer(tokenizer_spec)
  if tokenizer.vocab_size > options.vocab_size:
    raise VocabTooSmallError(tokenizer_spec, tokenizer.vocab_size, options.vocab_size)
  cap = options.prompt_len
  config = source_lib.SourceConfig(batch_size=batch_size, max_prompt_len=cap,
                                   max_target_len=options.target_len, lm_prompt_len=cap,
                                   min_bucket=cap, seed=options.seed)
  source = _available(task, tokenizer, config, tokenizer_spec)
  source.batch(0)                              # encodes a first batch: counted in the time
  log.info("data: task %s (%d train examples) with tokenizer %s (%d ids), ready in %.1fs",
           source.task.name, len(source.examples("train")), tokenizer_spec, tokenizer.vocab_size,
           time.perf_counter() - started)
  return source


def _available(task, tokenizer, config, tokenizer_spec: str) -> source_lib.Source:
  """A Source of `task` if its data is on this machine, else of its offline analogue."""
  source = source_lib.Source(task, tokenizer, config)
  try:
    source.examples("train")
    return source
  except MissingDataError as err:
    analogue = tasks.get_task(OFFLINE_ANALOGUE[task.kind])
    log.warning("data: %s is not available here (%s). Training on the offline %s corpus (Python "
                "stdlib) with tokenizer %s instead; the data source 'markov' selects the "
                "synthetic chain.", task.name, str(err).split(". ")[0], analogue.name,
                tokenizer_spec)
    return source_lib.Source(analogue, tokenizer, config)
