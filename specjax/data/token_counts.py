"""How often each token id occurs in the stdlib corpus under a tokenizer: the frequencies from
which a sub-vocabulary draft head (models/sub_vocab.py) keeps its K ids.

The train split of `stdlib_lm` (data/stdlib_corpus.py), the Python code every machine has, is
counted once per tokenizer and corpus (a few seconds for the Qwen tokenizer) and cached under
cache_dir() as a `.npy` of int64 counts [V]; ids the tokenizer never produces count 0.
"""

from __future__ import annotations

import io
import logging
import time

import numpy as np

from specjax.data import stdlib_corpus
from specjax.data.tokenizer import cache_key
from specjax.data.cache import atomic_write_bytes, cache_dir, settings_key

log = logging.getLogger(__name__)

COUNT_VERSION = 1


def stdlib_counts(tokenizer, vocab_size: int) -> np.ndarray:
  """counts [vocab_size] int64 of every id in the train split of the stdlib corpus, encoded by
  `tokenizer` (encode; its files or fingerprint: data/tokenizer.cache_key); cached per
  tokenizer, corpus and vocab_size."""
  corpus = stdlib_corpus.load_corpus()
  key = settings_key({"v": COUNT_VERSION, "tok": cache_key(tokenizer), "corpus": corpus.digest,
                      "vocab": vocab_size})
  path = cache_dir() / f"token-counts-{key}.npy"
  try:
    counts = np.load(path, allow_pickle=False)
    if counts.shape == (vocab_size,):
      return counts
  except (OSError, ValueError):
    pass
  start = time.perf_counter()
  log.info("counting token frequencies in the stdlib corpus (once per tokenizer) ...")
  counts = count(tokenizer, corpus.lm_split("train"), vocab_size)
  buffer = io.BytesIO()
  np.save(buffer, counts, allow_pickle=False)
  atomic_write_bytes(path, buffer.getvalue())
  log.info("counted %d tokens in %.1fs -> %s", counts.sum(), time.perf_counter() - start, path)
  return counts


def count(tokenizer, texts, vocab_size: int) -> np.ndarray:
  """counts [vocab_size] int64 of the ids of `texts` encoded one by one; ValueError naming the
  first id at or above vocab_size (a tokenizer larger than the model)."""
  ids = np.fromiter((i for text in texts for i in tokenizer.encode(text)), np.int64)
  if ids.size and ids.max() >= vocab_size:
    raise ValueError(f"the tokenizer produced id {int(ids.max())}, outside the model's "
                     f"{vocab_size} rows")
  return np.bincount(ids, minlength=vocab_size)
