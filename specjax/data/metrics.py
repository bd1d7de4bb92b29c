"""Task-quality metrics, dependency-free: ROUGE-N/L, corpus BLEU, exact match, GSM8K accuracy.

* ROUGE follows the `rouge-score` package without stemming: lower-case, every run of characters
  outside [a-z0-9] is a separator; per-example F1, averaged and reported x100.
  (Checked against rouge-score 0.1.2 with use_stemmer=False.)
* BLEU follows sacrebleu's defaults: corpus-level 4-gram BLEU, 13a tokenisation, brevity penalty,
  "exp" smoothing of zero n-gram counts, x100 (checked against sacrebleu 2.x).
* exact match compares whitespace-normalised strings; GSM8K accuracy compares the final numbers
  (the text after "####" if present, else the last number in the text).
The packages themselves are not needed: these are a few dozen lines, and the tests pin known values.
"""

from __future__ import annotations

import collections
import math
import re
from typing import Callable, Sequence


def rouge_tokens(text: str) -> list[str]:
  return re.sub(r"[^a-z0-9]+", " ", text.lower()).split()


def _f1(overlap: int, n_pred: int, n_ref: int) -> float:
  if overlap == 0 or n_pred == 0 or n_ref == 0:
    return 0.0
  precision, recall = overlap / n_pred, overlap / n_ref
  return 2 * precision * recall / (precision + recall)


def _ngrams(tokens: Sequence[str], n: int) -> collections.Counter:
  return collections.Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def rouge_n(prediction: str, reference: str, n: int = 2) -> float:
  """ROUGE-N F1 in [0, 1]. Example: rouge_n("the cat sat", "the cat ran", 2) == 0.5."""
  pred, ref = _ngrams(rouge_tokens(prediction), n), _ngrams(rouge_tokens(reference), n)
  return _f1(sum((pred & ref).values()), sum(pred.values()), sum(ref.values()))


def _lcs(a: Sequence[str], b: Sequence[str]) -> int:
  prev = [0] * (len(b) + 1)
  for x in a:
    cur = [0]
    for j, y in enumerate(b):
      cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
    prev = cur
  return prev[-1]


def rouge_l(prediction: str, reference: str) -> float:
  """ROUGE-L F1 (longest common subsequence of tokens) in [0, 1]."""
  pred, ref = rouge_tokens(prediction), rouge_tokens(reference)
  return _f1(_lcs(pred, ref), len(pred), len(ref))


def rouge(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
  _check(predictions, references)
  n = max(len(predictions), 1)
  pairs = list(zip(predictions, references))
  return {"rouge1": 100 * sum(rouge_n(p, r, 1) for p, r in pairs) / n,
          "rouge2": 100 * sum(rouge_n(p, r, 2) for p, r in pairs) / n,
          "rougeL": 100 * sum(rouge_l(p, r) for p, r in pairs) / n}


def bleu_tokens(text: str) -> list[str]:
  """sacrebleu's 13a tokeniser (mteval-v13a): split off punctuation and symbols."""
  line = text.replace("<skipped>", "").replace("-\n", "").replace("\n", " ")
  if "&" in line:
    for entity, char in (("&quot;", '"'), ("&amp;", "&"), ("&lt;", "<"), ("&gt;", ">")):
      line = line.replace(entity, char)
  line = f" {line} "
  line = re.sub(r"([\{-\~\[-\` -\&\(-\+\:-\@\/])", r" \1 ", line)
  line = re.sub(r"([^0-9])([\.,])", r"\1 \2 ", line)
  line = re.sub(r"([\.,])([^0-9])", r" \1 \2", line)
  line = re.sub(r"([0-9])(-)", r"\1 \2 ", line)
  return line.split()


def corpus_bleu(predictions: Sequence[str], references: Sequence[str], max_n: int = 4) -> float:
  """Corpus BLEU x100 with one reference per prediction (sacrebleu defaults)."""
  _check(predictions, references)
  correct, total, pred_len, ref_len = [0] * max_n, [0] * max_n, 0, 0
  for p, r in zip(predictions, references):
    pt, rt = bleu_tokens(p), bleu_tokens(r)
    pred_len, ref_len = pred_len + len(pt), ref_len + len(rt)
    for n in range(1, max_n + 1):
      pc, rc = _ngrams(pt, n), _ngrams(rt, n)
      correct[n - 1] += sum((pc & rc).values())
      total[n - 1] += max(len(pt) - n + 1, 0)
  if pred_len == 0 or correct[0] == 0:
    return 0.0
  log_p, smooth = 0.0, 1.0
  for c, t in zip(correct, total):
    if t == 0:
      return 0.0
    if c == 0:
      smooth *= 2
      log_p += math.log(1.0 / (smooth * t))
    else:
      log_p += math.log(c / t)
  brevity = 1.0 if pred_len >= ref_len else math.exp(1 - ref_len / pred_len)
  return 100 * brevity * math.exp(log_p / max_n)


def exact_match(predictions: Sequence[str], references: Sequence[str]) -> float:
  _check(predictions, references)
  norm = lambda s: " ".join(s.split())
  hits = sum(norm(p) == norm(r) for p, r in zip(predictions, references))
  return 100 * hits / max(len(predictions), 1)


def gsm8k_answer(text: str) -> str | None:
  """The final number of a GSM8K solution: after '####' if present, else the last number."""
  tail = text.split("####")[-1] if "####" in text else text
  numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", tail)
  if not numbers:
    return None
  value = numbers[0 if "####" in text else -1].replace(",", "")
  return value[:-2] if value.endswith(".0") else value


def gsm8k_accuracy(predictions: Sequence[str], references: Sequence[str]) -> float:
  _check(predictions, references)
  hits = sum(gsm8k_answer(p) is not None and gsm8k_answer(p) == gsm8k_answer(r)
             for p, r in zip(predictions, references))
  return 100 * hits / max(len(predictions), 1)


def keys(metric: str) -> tuple[str, ...]:
  """The keys evaluate(metric, ...) returns (rouge: rouge1, rouge2, rougeL)."""
  return tuple(evaluate(metric, [""], [""]))


def _check(predictions: Sequence[str], references: Sequence[str]) -> None:
  if len(predictions) != len(references):
    raise ValueError(f"{len(predictions)} predictions for {len(references)} references")


METRICS: dict[str, Callable[[Sequence[str], Sequence[str]], dict[str, float]]] = {
    "rouge": rouge,
    "bleu": lambda p, r: {"bleu": corpus_bleu(p, r)},
    "exact_match": lambda p, r: {"exact_match": exact_match(p, r)},
    "gsm8k": lambda p, r: {"accuracy": gsm8k_accuracy(p, r)},
}


def evaluate(metric: str, predictions: Sequence[str],
             references: Sequence[str]) -> dict[str, float]:
  """Score predictions with a metric by name (a task's `metric` field); all values are x100."""
  if metric not in METRICS:
    raise ValueError(f"unknown metric {metric!r}: use one of {sorted(METRICS)}")
  return METRICS[metric](predictions, references)
