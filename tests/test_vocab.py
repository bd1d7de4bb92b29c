"""Cross-vocabulary rules (union, TLI) on the synthetic testbed of papers/hetero_vocab.md §6:
alphabet {a, b}, T = {a, b, ab, ba, aab}, D = {a, b, aa, bb, ab}, longest-prefix tokenizers,
models p(.|last 2 chars), q(.|last 2 chars); plus a non-injective draft (squashes 'aa' -> 'a')."""

from __future__ import annotations

import dataclasses
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling
from specjax.acceptance import base, registry, vocab
from specjax.decoding import speculative
from specjax.models import Prompt
from specjax.models import kv_cache
from specjax.testing import chi_square_pvalue, sequence_counts

T_PIECES = ["a", "b", "ab", "ba", "aab"]
D_PIECES = ["a", "b", "aa", "bb", "ab"]
CONTEXTS = ["", "a", "b", "aa", "ab", "ba", "bb"]


@dataclasses.dataclass(frozen=True, eq=False)
class ToyTok:
  """Greedy longest-prefix tokenizer over `pieces` (the theory's T(s)); squash: 'a'+ -> 'a'."""
  pieces: tuple
  squash: bool = False
  eos_id = None
  bos_id = None
  pad_id = None
  unk_id = None

  @property
  def vocab_size(self):
    return len(self.pieces)

  def encode(self, text):
    if self.squash:
      text = re.sub("a+", "a", text)
    ids = []
    while text:
      best = max((i for i, p in enumerate(self.pieces) if text.startswith(p)),
                 key=lambda i: len(self.pieces[i]))
      ids.append(best)
      text = text[len(self.pieces[best]):]
    return ids

  def decode(self, ids):
    return "".join(self.pieces[i] for i in ids if 0 <= i < len(self.pieces))

  def id_to_piece(self, i):
    return self.pieces[i]

  def piece_to_id(self, piece):
    return self.pieces.index(piece)


def ctx_index(text: str) -> int:
  return CONTEXTS.index(text[-2:])


@dataclasses.dataclass(frozen=True)
class CharModel:
  """Model contract over a toy vocabulary: logits = table[context(last 2 chars of the text)].
  The previous token is read back from the cache, so wrong draft feeding changes the law."""
  pieces: tuple
  is_encoder_decoder = False
  hidden_size = 1
  dtype = jnp.float32
  n_positions = None            # the rest of models.Model: no position bound, no heads
  decoder_start_id = 0
  heads = None
  layout, quant = "in_out", ""

  @property
  def vocab_size(self):
    return len(self.pieces)

  def ctx_table(self):
    v = len(self.pieces)
    out = np.zeros((v + 1, v), np.int32)       # row v: no previous token
    for prev in range(v + 1):
      for tok in range(v):
        text = (self.pieces[prev] if prev < v else "") + self.pieces[tok]
        out[prev, tok] = ctx_index(text)
    return jnp.asarray(out)

  def init_cache(self, batch, max_len, enc_len=0):
    return kv_cache.init_cache(layers=1, batch=batch, max_len=max_len, heads=1, head_dim=1)

  def _run(self, params, tokens, cache, start):
    ids = tokens.astype(jnp.float32)[None, :, :, None, None]
    k = jax.vmap(kv_cache.write_layer, in_axes=(0, 0, None))(cache.k, ids, start)
    stored = k[0, :, 0, :, 0].astype(jnp.int32)                           # [B, S]
    pos = start[:, None] + jnp.arange(tokens.shape[1])[None, :]
    prev = jnp.take_along_axis(stored, jnp.maximum(pos - 1, 0), axis=1)
    prev = jnp.where(pos == 0, self.vocab_size, prev)
    logits = params["table"][self.ctx_table()[prev, tokens]]              # [B, T, V]
    return logits, cache.replace(k=k, lengths=start + tokens.shape[1])

  def prefill(self, params, prompt, cache):
    logits, cache = self._run(params, prompt.tokens, cache, jnp.zeros_like(cache.lengths))
    last = jnp.take_along_axis(logits, (prompt.lengths - 1)[:, None, None], axis=1)[:, 0]
    return last, None, cache.replace(lengths=prompt.lengths.astype(jnp.int32))

  def extend_entries(self, params, tokens, cache, select=None):
    logits, _ = self._run(params, tokens, cache, cache.lengths)
    if select is not None:
      logits = jnp.take_along_axis(logits, select[:, None, None], axis=1)    # [B, 1, V]
    ids = tokens.astype(jnp.float32)[None, :, :, None, None]
    return logits, None, (ids, jnp.zeros_like(ids))

  def extend(self, params, tokens, cache, select=None):
    logits, _, (k, v) = self.extend_entries(params, tokens, cache, select)
    return logits, None, kv_cache.append(cache, k, v)


def tables(seed: int, scale: float = 1.5):
  rng = np.random.default_rng(seed)
  return (scale * rng.normal(size=(len(CONTEXTS), len(T_PIECES))),
          scale * rng.normal(size=(len(CONTEXTS), len(D_PIECES))))


def softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def target_law(p_table, prompt_text: str, n: int) -> dict:
  """Exact law of n target tokens after prompt_text (no EOS): all 5^n sequences."""
  p = softmax(np.asarray(p_table, np.float64))
  law = {}
  for seq in itertools.product(range(len(T_PIECES)), repeat=n):
    text, mass = prompt_text, 1.0
    for t in seq:
      mass *= p[ctx_index(text), t]
      text += T_PIECES[t]
    law[seq] = mass
  return law


def toy_vocab(squash: bool = False):
  return vocab.build(ToyTok(tuple(T_PIECES)), ToyTok(tuple(D_PIECES), squash), verbose=False)


# ----------------------------------------------------------------------------- vocabulary maps

def test_toy_maps_and_images():
  vm = toy_vocab()
  assert list(vm.d2t) == [0, 1, -1, -1, 2] and list(vm.t2d) == [0, 1, 4, -1, -1]
  assert vm.overlap == 3 and vm.share == pytest.approx(0.6)
  assert vm.images[3, :vm.image_len[3]].tolist() == [1, 0]        # 'ba' -> 'b' 'a'
  assert vm.images[4, :vm.image_len[4]].tolist() == [2, 1]        # 'aab' -> 'aa' 'b'
  for d in vm.inter_d:
    assert vm.t2d[vm.d2t[d]] == d and T_PIECES[vm.d2t[d]] == D_PIECES[d]
  with pytest.raises(ValueError, match="below the minimum"):
    registry.get("intersection", vocab=vm, min_overlap=0.7)
  with pytest.raises(ValueError, match="needs vocab=VocabMap"):
    registry.get("union")
  with pytest.raises(ValueError, match=r"'union': min_overlap .* in \[0, 1\], got 1.5"):
    registry.get("union", vocab=vm, min_overlap=1.5)
  rule = registry.get("intersection", vocab=vm)
  assert hash(rule) == hash(registry.get("intersection", vocab=vm))   # static-arg friendly


def test_space_markers_and_byte_tokens():
  @dataclasses.dataclass(frozen=True)
  class Pieces:
    pieces: tuple
    eos_id: int = 0
    def id_to_piece(self, i): return self.pieces[i]
    @property
    def vocab_size(self): return len(self.pieces)
    def encode(self, text): return [self.pieces.index(text)] if text in self.pieces else []
    def decode(self, ids): return "".join(self.pieces[i] for i in ids)
  t = Pieces(("</s>", "<0x61>", "▁the", "a", "x"))
  d = Pieces(("<eos>", "Ġthe", "<0x61>", "y"))
  vm = vocab.build(t, d, verbose=False)
  assert vm.t2d.tolist() == [0, 2, 1, 2, -1]      # '<0x61>' and 'a' are one string
  assert vm.d2t.tolist() == [0, 2, 3, -1]         # ... whose canonical target id is 'a'


# ------------------------------------------------------------------------- one-step exactness

def _one_step_q(kind, p, q):
  """Analytic q-hat over T in float64 (q over D): union q', TLI q-tilde (scatter-add)."""
  vm = toy_vocab()
  inter = vm.inter_d
  qi = q[inter] / (q[inter].sum() if kind == "intersection" else 1.0)
  out = np.zeros(len(T_PIECES))
  np.add.at(out, vm.d2t[inter], qi)
  return out


@pytest.mark.parametrize("kind", ["union", "intersection"])
def test_one_step_exact(kind):
  p_tab, q_tab = tables(0)
  vm = toy_vocab()
  rule = registry.get(kind, vocab=vm)
  for c in range(len(CONTEXTS)):
    p, q = softmax(p_tab[c]), softmax(q_tab[c])
    qh = _one_step_q(kind, p, q)
    alpha = np.minimum(p, qh).sum()
    res = np.maximum(p - qh, 0)
    law = np.minimum(p, qh) + (1 - alpha) * res / res.sum()
    np.testing.assert_allclose(law, p, atol=1e-12, rtol=0)
    got = np.exp(np.asarray(rule.q_log_probs(jnp.asarray(q_tab[c], jnp.float32), sampling.Warp())))
    np.testing.assert_allclose(got, qh, atol=1e-6)


def test_acceptance_ordering_random():
  rng = np.random.default_rng(1)
  p = rng.dirichlet(np.ones(8) * 0.5, size=10_000)
  q = rng.dirichlet(np.ones(8) * 0.5, size=10_000)
  inter = np.arange(5)                         # 5 shared ids; 3 target-only, 3 draft-only
  union = np.minimum(p[:, inter], q[:, inter]).sum(1)
  qt = q[:, inter] / q[:, inter].sum(1, keepdims=True)
  tli = np.minimum(p[:, inter], qt).sum(1)
  assert np.all(tli >= union - 1e-12) and np.mean(tli > union + 1e-9) > 0.9
  psi = rng.dirichlet(np.ones(8), size=10_000)
  assert np.all(np.minimum(p, psi).sum(1) >= (p * psi).sum(1))     # SLRS >= SLEM
  assert np.all((p ** 2).sum(1) < 1)                               # Thm 3.1


# ------------------------------------------------------------------ whole-sequence losslessness

PROMPT = "ba"                          # T: [ba]; D: [b, a] (or [b, a] squashed as well)


class Mutant(vocab.Intersection):
  """Residual p instead of norm((p - q)+): not lossless; the test must catch it."""

  def verify(self, draft_tokens, draft_len, q_logp, p_logp, keys, rule_state):
    n, nxt = base.rejection_verify(draft_tokens, draft_len, q_logp, p_logp, keys,
                                   lambda x: x, residual=False)
    return n, nxt, rule_state


def run_loop(rule, runs: int, seed: int, squash: bool = False, n: int = 4, gamma: int = 3,
             empty_contexts: tuple[str, ...] = ()):
  """empty_contexts: contexts where the draft gives every shared token logit -inf (q̃ is empty)."""
  p_tab, q_tab = tables(seed)
  rows = [ctx_index(c) for c in empty_contexts]
  q_tab[np.ix_(rows, toy_vocab(squash).inter_d)] = -np.inf
  target, draft = CharModel(tuple(T_PIECES)), CharModel(tuple(D_PIECES))
  t_ids = ToyTok(tuple(T_PIECES)).encode(PROMPT)
  d_ids = ToyTok(tuple(D_PIECES), squash).encode(PROMPT)
  prompt = Prompt(tokens=jnp.tile(jnp.asarray([t_ids], jnp.int32), (runs, 1)),
                  lengths=jnp.full((runs,), len(t_ids), jnp.int32))
  dprompt = Prompt(tokens=jnp.tile(jnp.asarray([d_ids], jnp.int32), (runs, 1)),
                   lengths=jnp.full((runs,), len(d_ids), jnp.int32))
  gen = speculative.generate(
      target, {"table": jnp.asarray(p_tab, jnp.float32)}, draft,
      {"table": jnp.asarray(q_tab, jnp.float32)}, prompt, jax.random.PRNGKey(seed), rule=rule,
      gamma=gamma, max_new_tokens=n, warp=sampling.Warp(), eos_id=None, draft_prompt=dprompt)
  law = target_law(np.asarray(p_tab, np.float32), PROMPT, n)
  return law, sequence_counts(gen.tokens, gen.lengths), gen


def lossless(law, counts, runs) -> tuple[bool, float, float]:
  pval = chi_square_pvalue(law, counts)
  tv = 0.5 * sum(abs(law[s] - counts.get(s, 0) / runs) for s in law)
  bound = 0.5 * np.sqrt(len(law) / runs) + 3 / np.sqrt(runs)
  return pval > 1e-3 and tv <= bound, pval, tv


def test_tli_lossless_and_mutant_fails():
  runs = 50_000     # the mutant's TV is 0.196 at 50k rows (and at 200k); the bound is 0.069
  vm = toy_vocab()
  law, counts, gen = run_loop(vocab.Intersection(vocab=vm), runs, seed=3)
  ok, pval, tv = lossless(law, counts, runs)
  assert ok, (pval, tv)
  assert 0 < gen.stats.alpha() < 1 and gen.stats.tau() > 1
  law, counts, _ = run_loop(Mutant(vocab=vm), runs, seed=3)
  assert not lossless(law, counts, runs)[0]


class _AcceptsUnproposable(vocab.Intersection):
  """The old TLI: a draft with q̃(x) = 0 passed the ratio test (log u < log p - (-inf) = inf).
  -1e30 for -inf reproduces it: the ratio still accepts, exp(-1e30) = 0 keeps the residual."""

  def verify(self, draft_tokens, draft_len, q_logp, p_logp, keys, rule_state):
    return super().verify(draft_tokens, draft_len, jnp.maximum(q_logp, -1e30), p_logp, keys,
                          rule_state)


def test_tli_without_shared_draft_mass_rejects_and_decodes_from_the_target():
  """After an 'a' the draft puts no mass on T ∩ D: those drafts are arbitrary ids with q̃ = 0,
  rejected, and the token comes from p (Alg 4's AR step): the law stays the target's. The old
  rule accepted them (TV 0.20 here) and fails the same test."""
  runs, empty = 50_000, ("a", "aa", "ba")
  vm = toy_vocab()
  law, counts, gen = run_loop(vocab.Intersection(vocab=vm), runs, seed=3, n=3,
                              empty_contexts=empty)
  ok, pval, tv = lossless(law, counts, runs)
  assert ok, (pval, tv)
  assert 0 < gen.stats.alpha() < 1                         # other contexts still accept drafts
  law, counts, _ = run_loop(_AcceptsUnproposable(vocab=vm), runs, seed=3, n=3,
                            empty_contexts=empty)
  ok, pval, tv = lossless(law, counts, runs)
  assert not ok and tv > 0.1, (pval, tv)


@pytest.mark.parametrize("warp", [sampling.Warp(), sampling.Warp(temperature=0.0),
                                  sampling.Warp(temperature=0.8, top_k=2, top_p=0.9)])
def test_tli_q_is_empty_without_finite_shared_logits(warp):
  """No NaN, and no one-hot on the first shared id at temperature 0."""
  vm = toy_vocab()
  logits = jnp.asarray([[-jnp.inf, -jnp.inf, 0.5, 1.0, -jnp.inf],      # only 'aa', 'bb' finite
                        [0.2, -1.0, 0.5, 1.0, 0.3]])
  q = np.exp(np.asarray(vocab.Intersection(vocab=vm).q_log_probs(logits, warp)))
  np.testing.assert_array_equal(q[0], 0.0)
  assert q[1].sum() == pytest.approx(1.0, abs=1e-6) and not np.isnan(q).any()


@pytest.mark.slow
@pytest.mark.parametrize("kind,squash", [("union", False), ("union", True),
                                         ("intersection", True)])
def test_lossless_slow(kind, squash):
  runs = 200_000
  rule = registry.get(kind, vocab=toy_vocab(squash))
  law, counts, _ = run_loop(rule, runs, seed=4, squash=squash)
  ok, pval, tv = lossless(law, counts, runs)
  assert ok, (pval, tv)


def test_first_position_acceptance_matches_analytic():
  """Measured acceptance of the first draft of the first block vs sum_I min(p, q-hat)."""
  runs = 20_000
  for kind in ("union", "intersection"):
    rule = registry.get(kind, vocab=toy_vocab())
    _, _, gen = run_loop(rule, runs, seed=5, n=2, gamma=1)
    p_tab, q_tab = tables(5)
    # after the first token y ~ p('ba'), the block drafts from context last2('ba' + y)
    p0 = softmax(np.asarray(p_tab, np.float64))
    alpha = sum(p0[ctx_index(PROMPT), y] * np.minimum(
        softmax(p_tab[ctx_index(PROMPT + T_PIECES[y])]),
        _one_step_q(kind, None, softmax(q_tab[ctx_index(PROMPT + T_PIECES[y])]))).sum()
        for y in range(len(T_PIECES)))
    measured = gen.stats.totals()["accepted"] / runs
    assert abs(measured - alpha) < 4 * np.sqrt(alpha * (1 - alpha) / runs) + 1e-3, (kind,)
