"""Chunked (streaming) decoding, several stop ids, and counters that stop at what was committed:
the loops' host-driven form gives the tokens of the one-call form, on_chunk sees every commit and
can end rows, and any of several EOS ids ends a row."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from specjax import testing
from specjax.decoding import autoregressive, speculative
from specjax.models import Prompt
from specjax.sampling import Warp

V = 6
MODEL = testing.ToyAR(V, 12)
TARGET = MODEL.init_params(jax.random.PRNGKey(0))
DRAFT = {"table": testing.draft_table(jax.random.PRNGKey(1), TARGET["table"], "poor")}
ROWS = [[1], [2, 3], [3, 1, 2, 2], [4, 5]]
KEY = jax.random.PRNGKey(7)


def _spec(**kwargs):
  kwargs = {"rule": "exact", "gamma": 3, "max_new_tokens": 10, "warp": Warp(), "eos_id": 0,
            **kwargs}
  return speculative.generate(MODEL, TARGET, MODEL, DRAFT, Prompt.from_lists(ROWS), KEY, **kwargs)


def _ar(**kwargs):
  kwargs = {"max_new_tokens": 10, "warp": Warp(), "eos_id": 0, **kwargs}
  return autoregressive.generate(MODEL, TARGET, Prompt.from_lists(ROWS), KEY, **kwargs)


class Recorder:
  """on_chunk that keeps what it saw and can stop one row once it holds `stop_at` tokens."""

  def __init__(self, stop_row: int | None = None, stop_at: int = 0):
    self.seen, self.stop_row, self.stop_at = [], stop_row, stop_at

  def __call__(self, tokens, lengths):
    self.seen.append((tokens.copy(), lengths.copy()))
    stop = np.zeros(len(lengths), bool)
    if self.stop_row is not None and lengths[self.stop_row] >= self.stop_at:
      stop[self.stop_row] = True
    return stop


@pytest.mark.parametrize("chunk_blocks", [1, 3])
def test_chunked_speculative_decoding_equals_one_call(chunk_blocks):
  whole = _spec()
  rec = Recorder()
  chunked = _spec(on_chunk=rec, chunk_blocks=chunk_blocks)
  np.testing.assert_array_equal(chunked.tokens, whole.tokens)
  np.testing.assert_array_equal(chunked.lengths, whole.lengths)
  assert chunked.stats.totals() == whole.stats.totals()
  lengths = np.stack([seen[1] for seen in rec.seen])             # [chunks, B]
  assert (np.diff(lengths, axis=0) >= 0).all() and (lengths[0] == 1).all()
  assert len(rec.seen) >= 2


def test_chunked_autoregressive_decoding_equals_one_call():
  whole = _ar()
  chunked = _ar(on_chunk=Recorder(), chunk_blocks=2)
  np.testing.assert_array_equal(chunked.tokens, whole.tokens)
  np.testing.assert_array_equal(chunked.lengths, whole.lengths)


def test_on_chunk_ends_a_row_and_leaves_the_others():
  whole = _spec(eos_id=None)
  cut = _spec(eos_id=None, on_chunk=Recorder(stop_row=1, stop_at=2))
  assert 2 <= int(cut.lengths[1]) < 10 == int(whole.lengths[1])
  n = int(cut.lengths[1])
  np.testing.assert_array_equal(cut.tokens[1, :n], whole.tokens[1, :n])
  for row in (0, 2, 3):
    np.testing.assert_array_equal(cut.tokens[row], whole.tokens[row])


def _first_stop(row, ids):
  hits = [i for i, t in enumerate(row) if t in ids]
  return hits[0] + 1 if hits else len(row)


@pytest.mark.parametrize("loop", ["speculative", "autoregressive"])
def test_any_of_several_eos_ids_ends_a_row(loop):
  run = _spec if loop == "speculative" else _ar
  free = run(eos_id=None, max_new_tokens=12)
  tokens = np.asarray(free.tokens)
  # Two ids that occur in the free-running output: each alone, and both, stop where they should.
  common = np.bincount(tokens[:, 1:].ravel(), minlength=V).argsort()[::-1]
  a, b = int(common[0]), int(common[1])
  both = run(eos_id=(a, b), max_new_tokens=12)
  for row in range(len(ROWS)):
    want = _first_stop(tokens[row].tolist(), {a, b})
    assert int(both.lengths[row]) == want, (row, a, b, tokens[row])
    np.testing.assert_array_equal(both.tokens[row, :want], tokens[row, :want])
  only_a = run(eos_id=a, max_new_tokens=12)
  assert (np.asarray(only_a.lengths) >= np.asarray(both.lengths)).all()


def test_negative_eos_id_is_refused():
  with pytest.raises(ValueError, match="eos_id must be None"):
    _spec(eos_id=-1)


@pytest.mark.parametrize("max_new", [1, 2, 3])
def test_counters_stop_at_what_was_committed(max_new):
  # A draft equal to the target accepts every draft: a block of gamma 3 would commit 4 tokens,
  # but max_new_tokens cuts it; accepted must not exceed what was emitted after the first token.
  gen = speculative.generate(MODEL, TARGET, MODEL, TARGET, Prompt.from_lists(ROWS), KEY,
                             rule="exact", gamma=3, max_new_tokens=max_new, warp=Warp(),
                             eos_id=None)
  t = gen.stats.totals()
  assert t["emitted"] == max_new * len(ROWS)
  assert t["accepted"] <= t["verified"] <= t["drafted"]
  per_row = np.asarray(gen.stats.accepted)
  assert (per_row <= max_new - 1).all(), per_row


@pytest.mark.parametrize("loop", ["speculative", "autoregressive"])
def test_a_chunked_loop_chooses_its_compiler_options_once(monkeypatch, loop):
  """The chunk program's compiler options follow the arguments' dtypes (state.LoopJit), which no
  chunk changes: they are read once per generation, not by walking every param leaf at each of
  its chunks (a host cost on every block of a streamed run)."""
  from specjax.decoding import state
  walks = []
  real = state.has_16bit_floats
  monkeypatch.setattr(state, "has_16bit_floats", lambda tree: walks.append(1) or real(tree))
  rec = Recorder()
  gen = (_spec if loop == "speculative" else _ar)(on_chunk=rec, chunk_blocks=1)
  assert len(rec.seen) >= 3 and len(walks) == 1
  whole = (_spec if loop == "speculative" else _ar)()
  np.testing.assert_array_equal(np.asarray(gen.tokens), np.asarray(whole.tokens))
