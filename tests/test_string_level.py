"""SLEM / SLRS (string_level.py): alignment, psi, losslessness on the §6 testbed (a table Backend
driving the same host loop), and equality with target decoding on real tiny models."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling
from specjax.acceptance import vocab
from specjax.decoding import autoregressive, speculative, string_level as sl
from specjax.models import Prompt, prompting
from tests.test_vocab import (D_PIECES, PROMPT, T_PIECES, ToyTok, ctx_index, lossless,
                              softmax, tables, target_law)


# ----------------------------------------------------------------------------------- alignment

def test_align_hf_cases():
  assert sl.align([1, 2, 3], [4, 5, 6]) is None
  for new in ([1, 2, 3, 4, 5], [2, 3, 4, 5]):
    a = sl.align([1, 2, 3], new)
    assert (a.disc, a.fresh) == (0, [4, 5])
  assert sl.align([1, 2, 3], [1, 2, 3]).fresh == []
  a = sl.align([7, 1, 2, 3], [1, 2, 9, 4])
  assert (a.start, a.disc, a.repl, a.fresh) == (2, 1, [9], [4])


def test_conversion_round_trips():
  t, d = ToyTok(tuple(T_PIECES)), ToyTok(tuple(D_PIECES))
  assert d.decode(sl.convert(t.encode("aabba"), t, d)) == "aabba"
  # drafts 'aa' 'b' after the prompt 'ba': the target re-encoding of the window 'baaab'
  x_d = d.encode("ba") + d.encode("aab")
  assert t.decode(sl.draft_to_target(x_d, 2, t.encode("ba"), d, t)) == "aab"
  # after the target emitted 'aab' the draft stream spells the target text again
  new = sl.resync_draft(x_d + [3], t.encode("ba") + t.encode("aab"), 1, t, d, 2, 1)
  assert d.decode(new) == "baaab"


# -------------------------------------------------------------------- the table backend (§6)

class TableBackend:
  """p(.|last 2 chars), q(.|last 2 chars) from tables; numpy sampling."""

  def __init__(self, p_tab, q_tab, t, d, rng):
    self.p, self.q = softmax(np.asarray(p_tab, np.float64)), softmax(np.asarray(q_tab, np.float64))
    self.t, self.d, self.rng = t, d, rng

  def draft_propose(self, x_d, k, g):
    text, out = self.d.decode(x_d), []
    for _ in range(k):
      out.append(int(self.rng.choice(len(D_PIECES), p=self.q[ctx_index(text)])))
      text += D_PIECES[out[-1]]
    return out

  def target_sample(self, x_t, cands, g):
    text, out = self.t.decode(x_t), []
    for j in range(len(cands) + 1):
      out.append(int(self.rng.choice(len(T_PIECES), p=self.p[ctx_index(text)])))
      if j < len(cands):
        text += T_PIECES[cands[j]]
    return out

  def draft_logprobs(self, x_d, paths):
    return np.log(np.stack([self.q[ctx_index(self.d.decode(list(x_d) + list(p)))]
                            for p in paths]))

  def target_logprobs(self, x_t):
    return np.log(self.p[ctx_index(self.t.decode(x_t))])


def _setup(seed, squash=False):
  t, d = ToyTok(tuple(T_PIECES)), ToyTok(tuple(D_PIECES), squash)
  p_tab, q_tab = tables(seed)
  return t, d, p_tab, q_tab


def test_psi_sums_to_one_and_pruned_trie_is_exact():
  for squash in (False, True):
    t, d, p_tab, q_tab = _setup(0, squash)
    be = TableBackend(p_tab, q_tab, t, d, np.random.default_rng(0))
    prop = sl.Proposer(t, d, max_depth=3)
    for text in ("", "a", "ab", "bb"):
      x_d = d.encode("b" + text)
      full = sl.psi(be, x_d, prop)
      assert abs(sum(full.values()) - 1) < 1e-12
      for tok in range(len(T_PIECES)):
        assert abs(sl.psi(be, x_d, prop, tok).get(tok, 0.0) - full.get(tok, 0.0)) < 1e-12
      p = np.exp(be.target_logprobs(t.encode("b" + text)))
      ps = np.array([full.get(i, 0.0) for i in range(len(T_PIECES))])
      alpha = np.minimum(p, ps).sum()
      res = np.maximum(p - ps, 0)
      law = np.minimum(p, ps) + (1 - alpha) * res / max(res.sum(), 1e-300)
      np.testing.assert_allclose(law, p, atol=1e-12, rtol=0)


def _string_runs(method, runs, seed, squash=False, n=4):
  t, d, p_tab, q_tab = _setup(seed, squash)
  rng = np.random.default_rng(seed)
  be = TableBackend(p_tab, q_tab, t, d, rng)
  counts, rounds = {}, []

  def check(s):                        # §6.5: the streams spell the same text after every round
    norm = lambda text: d.decode(d.encode(text))            # modulo the draft's normaliser
    assert norm(d.decode(s.x_d)) == norm(t.decode(s.x_t))

  for i in range(runs):
    s = sl.run(be, t, d, t.encode(PROMPT), d.encode(PROMPT), method=method, gamma=3,
               max_new_tokens=n, eos_id=None, rng=rng, on_round=check if i < 200 else None)
    key = tuple(s.out)
    counts[key] = counts.get(key, 0) + 1
    rounds.append(s.stats)
  return target_law(p_tab, PROMPT, n), counts, rounds


@pytest.mark.parametrize("method", ["slem", "slrs"])
def test_string_level_lossless_quick(method):
  runs = 3000
  law, counts, stats = _string_runs(method, runs, seed=6)
  ok, pval, tv = lossless(law, counts, runs)
  assert ok, (pval, tv)
  acc = sum(s["accepted"] for s in stats)
  assert acc > 0


@pytest.mark.slow
@pytest.mark.parametrize("method,squash", [("slem", False), ("slrs", False), ("slem", True),
                                           ("slrs", True)])
def test_string_level_lossless_full(method, squash):
  runs = 200_000
  law, counts, _ = _string_runs(method, runs, seed=7, squash=squash)
  ok, pval, tv = lossless(law, counts, runs)
  assert ok, (pval, tv)


# ------------------------------------------------------------------------ real tiny models

TEXT = ("def read_lines(path):\n    with open(path) as f:\n        return f.read().split()\n"
        "class Stack:\n    def __init__(self):\n        self.items = []\n"
        "    def push(self, item):\n        self.items.append(item)\n") * 4


@functools.lru_cache(maxsize=None)
def _tokenizers(tmp):
  from specjax.data import tokenizer as tk
  import pathlib
  lines = TEXT.splitlines(keepends=True)
  t = tk.train_sentencepiece(lines * 5, pathlib.Path(tmp) / "t.model", model_type="bpe",
                             vocab_size=320)
  d = tk.train_sentencepiece(lines * 5, pathlib.Path(tmp) / "d.model", model_type="unigram",
                             vocab_size=300)
  return tk.Tokenizer.load(t), tk.Tokenizer.load(d)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
  from specjax.testing import tiny_decoder
  ttok, dtok = _tokenizers(str(tmp_path_factory.mktemp("tok")))
  target, tparams = tiny_decoder(seed=1, vocab_size=ttok.vocab_size)
  draft, dparams = tiny_decoder(seed=2, vocab_size=dtok.vocab_size)
  return ttok, dtok, target, tparams, draft, dparams


def prompt_ids(tok, text):
  return prompting.encode(tok, text, encoder_decoder=False)


def _ar(real, prompt_text, key, warp, n):
  ttok, _, target, tparams, _, _ = real
  ids = prompting.encode(ttok, prompt_text, encoder_decoder=False)
  prompt = Prompt(tokens=np.asarray([ids], np.int32), lengths=np.asarray([len(ids)], np.int32))
  gen = autoregressive.generate(target, tparams, prompt, key, max_new_tokens=n, warp=warp,
                                eos_id=None)
  return [int(x) for x in np.asarray(gen.tokens[0, :int(gen.lengths[0])])], prompt


def test_slem_and_tli_equal_target_decoding(real):
  ttok, dtok, target, tparams, draft, dparams = real
  key, n = jax.random.PRNGKey(0), 12
  text = "def push(self, item):\n"
  for warp in (sampling.Warp(temperature=0.0), sampling.Warp(temperature=1.0)):
    want, prompt = _ar(real, text, key, warp, n)
    got = sl.generate(target, tparams, ttok, draft, dparams, dtok, prompt_ids(ttok, text),
                      prompt_ids(dtok, text), key, method="slem", gamma=3,
                      max_new_tokens=n, warp=warp, eos_id=None)
    assert got.tokens.tolist() == want, warp
    assert got.text == ttok.decode(want)
    assert int(got.stats.emitted[0]) == n


def test_tli_greedy_equals_target_decoding(real):
  ttok, dtok, target, tparams, draft, dparams = real
  key, n = jax.random.PRNGKey(0), 12
  text = "def push(self, item):\n"
  vm = vocab.build(ttok, dtok, target_width=target.vocab_size, draft_width=draft.vocab_size)
  dids = prompting.encode(dtok, text, encoder_decoder=False)
  dprompt = Prompt(tokens=np.asarray([dids], np.int32), lengths=np.asarray([len(dids)], np.int32))
  want, prompt = _ar(real, text, key, sampling.Warp(temperature=0.0), n)
  gen = speculative.generate(target, tparams, draft, dparams, prompt, key,
                             rule=vocab.Intersection(vocab=vm), gamma=3, max_new_tokens=n,
                             warp=sampling.Warp(temperature=0.0), eos_id=None, draft_prompt=dprompt)
  assert np.asarray(gen.tokens[0]).tolist() == want


def test_slrs_real_models_runs(real):
  ttok, dtok, target, tparams, draft, dparams = real
  got = sl.generate(target, tparams, ttok, draft, dparams, dtok, prompt_ids(ttok, "x = "),
                    prompt_ids(dtok, "x = "), jax.random.PRNGKey(1), method="slrs",
                    max_new_tokens=3, max_depth=2, warp=sampling.Warp(top_k=8), eos_id=None)
  assert len(got.tokens) == 3 and int(got.stats.emitted[0]) == 3
  assert int(got.stats.target_passes[0]) == 3


def test_slem_reuses_its_programs_across_temperatures_and_limits(real):
  """The warp is traced and the caches are sized for the buckets of the prompt and max_new_tokens:
  another temperature, or a limit or prompt of the same buckets, compiles nothing."""
  ttok, _, target, _, draft, _ = real
  models = (target, draft)
  assert sl.default_capacity(models, 10, 9, 3) == sl.default_capacity(models, 14, 12, 3)
  assert sl.default_capacity(models, 10, 9, 3) < sl.default_capacity(models, 10, 17, 3)
  logits = jnp.zeros((4, ttok.vocab_size), jnp.float32)
  sample = lambda t: sl._sample_positions(sampling.Warp(temperature=t), logits, jnp.int32(0),
                                          jax.random.PRNGKey(0), jnp.int32(0))
  sample(1.0)
  before = sl._sample_positions._cache_size()
  sample(0.5)
  assert sl._sample_positions._cache_size() == before
