"""Deterministic batches: task + tokenizer + `SourceConfig` -> `Batch` for any step.

`Source.batch(step)` is a pure function of (step, seed): train rows come from a per-epoch
permutation of the train split (`np.random.default_rng([seed, epoch])`), so a run resumed at step s
sees exactly the batches it would have seen; other splits are read in order (row i of
`batch(step, split)` is example `step * batch_size + i`, wrapping around).

Formats (right-padded with `pad_id`, `mask` marks valid target tokens, EOS included):
* lm:      prompt = the first `lm_prompt_len` tokens of [BOS] + text;
           targets = the next `max_target_len` tokens, + EOS if the text ends inside the window.
* seq2seq: prompt = input tokens cut to `max_prompt_len - 1`, + EOS;
           targets = output tokens cut to `max_target_len - 1`, + EOS.
* completion: prompt = [BOS] + the last input tokens, `max_prompt_len` in all (a continuation
           depends on the prompt's end); targets = the first `max_target_len` output tokens, no
           EOS (a model's text recorded up to a token limit has no end of its own).

Shapes: targets are always [B, max_target_len]; the prompt width is the smallest bucket (a power
of two >= `min_bucket`, or the cap itself) that holds the batch's longest prompt, so a jitted
function sees at most ~log2(cap / min_bucket) + 1 prompt shapes.
Example: caps 256, min_bucket 16, longest prompt 37 -> prompt tokens [B, 64].
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Sequence

import jax.numpy as jnp
import numpy as np

from specjax.data.batch import Batch
from specjax.models import prompting


KINDS = ("lm", "seq2seq", "completion")


@dataclasses.dataclass(frozen=True)
class SourceConfig:
  batch_size: int = 32
  max_prompt_len: int = 256     # seq2seq input tokens (EOS included); cap for encode_prompts
  max_target_len: int = 64      # output tokens (EOS included)
  lm_prompt_len: int = 32       # lm: prompt tokens (BOS included)
  min_bucket: int = 16
  seed: int = 0


class Source:
  """Batches of one task under one tokenizer; see the module docstring for the formats."""

  def __init__(self, task, tokenizer, config: SourceConfig = SourceConfig()):
    if task.kind not in KINDS:
      raise ValueError(f"task {task.name!r} has kind {task.kind!r}; expected one of {KINDS}")
    if config.max_target_len < 1 or config.lm_prompt_len < 1 or config.max_prompt_len < 2:
      raise ValueError(f"bad lengths in {config}: need max_target_len >= 1, lm_prompt_len >= 1, "
                       "max_prompt_len >= 2")
    self.task, self.tokenizer, self.config = task, tokenizer, config
    self._examples: dict[str, Sequence[tuple[str, str]]] = {}
    self._perms: dict[int, np.ndarray] = {}

  @property
  def prompt_cap(self) -> int:
    return self.config.lm_prompt_len if self.task.kind == "lm" else self.config.max_prompt_len

  def examples(self, split: str) -> Sequence[tuple[str, str]]:
    if split not in self._examples:
      self._examples[split] = self.task.examples(split)
      if not len(self._examples[split]):
        raise ValueError(f"task {self.task.name!r} has no {split} examples")
    return self._examples[split]

  def steps_per_epoch(self, split: str = "train") -> int:
    return math.ceil(len(self.examples(split)) / self.config.batch_size)

  def indices(self, step: int, split: str = "train") -> np.ndarray:
    """Example indices of the global batch at `step`: [batch_size] int64."""
    n, size = len(self.examples(split)), self.config.batch_size
    pos = step * size + np.arange(size, dtype=np.int64)
    if split != "train":
      return pos % n
    epochs = pos // n
    return np.asarray([self._perm(int(e), n)[p % n] for e, p in zip(epochs, pos)], np.int64)

  def _perm(self, epoch: int, n: int) -> np.ndarray:
    if epoch not in self._perms:
      if len(self._perms) >= 2:
        self._perms.pop(min(self._perms))
      self._perms[epoch] = np.random.default_rng([self.config.seed, epoch]).permutation(n)
    return self._perms[epoch]

  def encode_example(self, inp: str, target: str) -> tuple[list[int], list[int]]:
    """(prompt ids, target ids) of one example, truncated, with BOS/EOS as documented above."""
    tok, cfg = self.tokenizer, self.config
    if self.task.kind == "lm":
      ids = prompting.encode(tok, inp, encoder_decoder=False)
      k = max(1, min(cfg.lm_prompt_len, len(ids) - 1))
      rest = ids[k:]
      tail = rest[:cfg.max_target_len] if len(rest) >= cfg.max_target_len else rest + [tok.eos_id]
      return ids[:k], tail
    if self.task.kind == "completion":
      ids = prompting.encode(tok, inp, encoder_decoder=False)
      head = ids[:int(prompting.has_bos(tok))]                          # the BOS, kept
      prompt = head + ids[len(head):][-(cfg.max_prompt_len - len(head)):]
      return prompt, tok.encode(target)[:cfg.max_target_len]
    prompt = prompting.encode(tok, inp, encoder_decoder=True, cap=cfg.max_prompt_len)
    return prompt, tok.encode(target)[:cfg.max_target_len - 1] + [tok.eos_id]

  def batch(self, step: int, split: str = "train", shard: tuple[int, int] = (0, 1)) -> Batch:
    """The batch at `step`; with shard=(i, n) only rows [i*B/n, (i+1)*B/n) (one host's share)."""
    index, count = shard
    size = self.config.batch_size
    if size % count or not 0 <= index < count:
      raise ValueError(f"cannot take shard {shard} of a batch of {size} rows")
    rows = self.indices(step, split)[index * size // count:(index + 1) * size // count]
    examples = self.examples(split)
    return self._collate([self.encode_example(*examples[int(i)]) for i in rows])

  def _collate(self, pairs: list[tuple[list[int], list[int]]]) -> Batch:
    pad, cfg = self.tokenizer.pad_id, self.config
    prompt = prompting.batch([p for p, _ in pairs], pad, self.prompt_cap, cfg.min_bucket)
    targets, target_len = prompting.pad_rows([t for _, t in pairs], cfg.max_target_len, pad)
    mask = np.arange(cfg.max_target_len)[None, :] < target_len[:, None]           # [B, L]
    return Batch(prompt=prompt, targets=jnp.asarray(targets), mask=jnp.asarray(mask))

  def eval_examples(self, split: str = "validation", n: int | None = None) -> list[tuple[str, str]]:
    """(prompt_text, reference_text) of the first n examples of `split`, in `batch(step, split)`
    order. The prompt text is what the model sees (decoded after truncation); the reference is the
    full target text for seq2seq and the decoded continuation window for lm."""
    examples = self.examples(split)
    out = []
    for inp, target in examples[:len(examples) if n is None else n]:
      prompt, tail = self.encode_example(inp, target)
      reference = self.tokenizer.decode(tail) if self.task.kind == "lm" else target
      out.append((self.tokenizer.decode(prompt), reference))
    return out

  def eval_batches(self, split: str = "validation",
                   n: int | None = None) -> Iterator[tuple[Batch, list[tuple[str, str]]]]:
    """(batch, its examples' (prompt_text, reference_text)) over the first n examples; the last
    batch keeps the full batch size (rows past n repeat earlier examples) so that shapes stay
    fixed: use only the first len(pairs) rows of each batch."""
    total = len(self.examples(split)) if n is None else min(n, len(self.examples(split)))
    pairs = self.eval_examples(split, total)
    size = self.config.batch_size
    for step in range(math.ceil(total / size)):
      yield self.batch(step, split), pairs[step * size:(step + 1) * size]

  def encode_prompts(self, texts: Sequence[str]) -> prompting.Prompt:
    """User prompts -> bucketed Prompt in this task's format (models.prompting), cut to the cap."""
    rows = [prompting.encode(self.tokenizer, t, encoder_decoder=self.task.kind == "seq2seq",
                             cap=self.prompt_cap) for t in texts]
    return prompting.batch(rows, self.tokenizer.pad_id, self.prompt_cap, self.config.min_bucket)

  def decode_outputs(self, tokens, lengths=None) -> list[str]:
    """Generated ids [B, N] -> texts, each row cut at its length and at its first EOS."""
    rows = np.asarray(tokens).tolist()
    lengths = [None] * len(rows) if lengths is None else np.asarray(lengths).tolist()
    return [prompting.decode(self.tokenizer, row, n) for row, n in zip(rows, lengths)]


def make_source(task: str, tokenizer: str, config: SourceConfig = SourceConfig(), *,
                data_dir: str | None = None, max_examples: int | None = None) -> Source:
  """A Source from config strings: a task name (`tasks.TASK_NAMES`) and a tokenizer spec
  (`tokenizer.get_tokenizer`: "stdlib:unigram:8000", a .model file or an HF directory)."""
  from specjax.data.tasks import get_task
  from specjax.data.tokenizer import get_tokenizer
  return Source(get_task(task, data_dir=data_dir, max_examples=max_examples),
                get_tokenizer(tokenizer), config)
