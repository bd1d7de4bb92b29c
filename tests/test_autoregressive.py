from __future__ import annotations

import jax
import numpy as np
import pytest

from specjax import sampling, testing
from specjax.decoding import autoregressive
from specjax.models import Prompt
from specjax.models.kv_cache import CacheOverflowError
from specjax.sampling import Warp

V, EOS = 4, 0
MODEL = testing.ToyAR(V, 6)
PARAMS = MODEL.init_params(jax.random.PRNGKey(0))
ROWS = [[1], [2, 3], [3, 1, 2, 2], [1, 1, 1], [2], [3, 3], [1, 2, 3, 1, 2], [2, 2]]
WIDTH = 5  # singles padded like the batch: one compile (padding does not change the output)


def test_output_law_matches_enumeration():
  warp = Warp(temperature=1.0)
  n = 40000
  gen = autoregressive.generate(MODEL, PARAMS, Prompt.from_lists([[2, 1]] * n),
                                jax.random.PRNGKey(1), max_new_tokens=4, warp=warp, eos_id=EOS)
  law = testing.enumerate_law(MODEL, PARAMS, [2, 1], max_new_tokens=4, warp=warp, eos_id=EOS)
  counts = testing.sequence_counts(gen.tokens, gen.lengths)
  assert testing.chi_square_pvalue(law, counts) > 1e-3


def test_rows_end_at_eos_or_max_and_pad_with_zero():
  gen = autoregressive.generate(MODEL, PARAMS, Prompt.from_lists(ROWS), jax.random.PRNGKey(2),
                                max_new_tokens=6, warp=Warp(), eos_id=3)
  tokens, lengths = np.asarray(gen.tokens), np.asarray(gen.lengths)
  for row, n in zip(tokens, lengths):
    assert 1 <= n <= 6
    assert 3 not in row[:n - 1]
    assert n == 6 or row[n - 1] == 3
    assert (row[n:] == 0).all()
  np.testing.assert_array_equal(gen.stats.emitted, lengths)
  np.testing.assert_array_equal(gen.stats.target_passes, lengths)


def test_batch_rows_equal_single_row_runs():
  keys = sampling.row_keys(jax.random.PRNGKey(3), len(ROWS))
  kwargs = dict(max_new_tokens=5, warp=Warp(temperature=1.0, top_k=3), eos_id=EOS)
  batch = autoregressive.generate(MODEL, PARAMS, Prompt.from_lists(ROWS), keys, **kwargs)
  for b, row in enumerate(ROWS):
    single = autoregressive.generate(MODEL, PARAMS, Prompt.from_lists([row], pad_to=WIDTH),
                                     keys[b:b + 1], **kwargs)
    np.testing.assert_array_equal(single.tokens[0], batch.tokens[b])
    assert int(single.lengths[0]) == int(batch.lengths[b])


def test_single_key_means_fold_in_row():
  prompt = Prompt.from_lists(ROWS)
  kwargs = dict(max_new_tokens=5, warp=Warp(), eos_id=EOS)
  a = autoregressive.generate(MODEL, PARAMS, prompt, jax.random.PRNGKey(4), **kwargs)
  b = autoregressive.generate(MODEL, PARAMS, prompt,
                              sampling.row_keys(jax.random.PRNGKey(4), len(ROWS)), **kwargs)
  np.testing.assert_array_equal(a.tokens, b.tokens)


def test_greedy_follows_the_table_argmax():
  gen = autoregressive.generate(MODEL, PARAMS, Prompt.from_lists(ROWS), jax.random.PRNGKey(5),
                                max_new_tokens=5, warp=Warp(temperature=0.0), eos_id=None)
  table = np.asarray(PARAMS["table"])
  for row, out in zip(ROWS, np.asarray(gen.tokens)):
    prev, pos, want = row[-1], len(row) - 1, []
    for _ in range(5):
      prev = int(np.argmax(table[min(pos, 5), prev]))
      want.append(prev)
      pos += 1
    assert list(out) == want


def test_cache_too_small_is_refused_before_jit():
  with pytest.raises(CacheOverflowError, match="cache"):
    autoregressive.generate(MODEL, PARAMS, Prompt.from_lists(ROWS), jax.random.PRNGKey(0),
                            max_new_tokens=8, warp=Warp(), eos_id=EOS, max_len=8)
  with pytest.raises(ValueError, match="max_new_tokens"):
    autoregressive.generate(MODEL, PARAMS, Prompt.from_lists(ROWS), jax.random.PRNGKey(0),
                            max_new_tokens=0, warp=Warp(), eos_id=EOS)
