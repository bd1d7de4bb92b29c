"""Cross-tokenizer decoding between two model families (#15 item 4): a tiny random Llama draft with
a Llama-2-style Metaspace BPE ("▁" spaces, <0xNN> byte-fallback pieces) for a tiny random Qwen2
target with a byte-level BPE ("Ġ" spaces, every byte a printable character; its embedding padded
past the tokenizer as Qwen's is). Both are loaded as checkpoints through app.resolve; the
vocabulary map of the token-level rules (intersection, union) and the string-level methods (SLEM,
SLRS) run between them. No torch: tests/tiny_checkpoints.py writes the checkpoints."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from specjax import sampling
from specjax.acceptance import registry, vocab
from specjax.app import builders, resolve
from specjax.decoding import autoregressive, speculative
from specjax.decoding import string_level as sl
from specjax.models import Prompt, prompting

import tiny_checkpoints  # noqa: E402  (tests/ is on sys.path under pytest)

GREEDY = sampling.Warp(temperature=0.0)
TEXT = "def push(self, item):\n"
NEW = 10


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  """(target, draft) LoadedModels: Qwen2 + byte-level BPE, Llama + Metaspace BPE."""
  tdir = tiny_checkpoints.qwen2_checkpoint(tmp_path_factory.mktemp("qwen2"))
  ddir = tiny_checkpoints.llama_checkpoint(tmp_path_factory.mktemp("llama"))
  load = lambda role, path: resolve.load(builders.ModelSpec(role=role, checkpoint=str(path),
                                                            layers="unrolled"))
  return load("target", tdir), load("draft", ddir)


@pytest.fixture(scope="module")
def vmap(pair):
  target, draft = pair
  return vocab.build(target.tokenizer, draft.tokenizer, target_width=target.model.vocab_size,
                     draft_width=draft.model.vocab_size, verbose=False)


def _prompt(loaded, text=TEXT) -> Prompt:
  ids = prompting.encode(loaded.tokenizer, text, encoder_decoder=False)
  return Prompt.from_lists([ids])


def _target_greedy(pair) -> list[int]:
  target, _ = pair
  gen = autoregressive.generate(target.model, target.params, _prompt(target),
                                jax.random.PRNGKey(0), max_new_tokens=NEW, warp=GREEDY,
                                eos_id=None)
  return np.asarray(gen.tokens[0, :int(gen.lengths[0])]).tolist()


def test_the_families_and_their_tokenizers(pair):
  target, draft = pair
  assert (target.model.config.model_type, draft.model.config.model_type) == ("qwen2", "llama")
  assert target.model.vocab_size == 320 > target.tokenizer.vocab_size == 300  # padded: fine
  assert draft.model.vocab_size == draft.tokenizer.vocab_size
  assert target.tokenizer.id_to_piece(target.tokenizer.encode(" ~")[0]) == "Ġ"
  assert [draft.tokenizer.id_to_piece(i) for i in draft.tokenizer.encode("a ~")][-1] == "<0x7E>"


def test_vocab_map_pairs_space_markers_and_byte_fallback_pieces(pair, vmap):
  target, draft = pair
  ttok, dtok = target.tokenizer, draft.tokenizer
  t_id, d_id = ttok.piece_to_id, dtok.piece_to_id
  assert vmap.t2d[t_id("~")] == d_id("<0x7E>")            # a byte the draft only has as fallback
  assert vmap.t2d[t_id("Ġ")] == d_id("▁")                 # the two spellings of a space
  assert vmap.t2d[t_id("Ċ")] == d_id("\n")                # byte-level newline, a plain piece
  assert vmap.d2t[d_id("<0x7E>")] == t_id("~")
  assert vmap.t2d[ttok.eos_id] == dtok.eos_id and vmap.d2t[dtok.eos_id] == ttok.eos_id
  t_bytes = vocab._strings(ttok)
  d_bytes = vocab._strings(dtok)
  for t, d in enumerate(vmap.t2d[:ttok.vocab_size]):      # every pair spells one string
    if d >= 0 and t != ttok.eos_id:
      assert t_bytes[t] == d_bytes[d], (ttok.id_to_piece(t), dtok.id_to_piece(int(d)))
  assert (vmap.t2d[ttok.vocab_size:] == -1).all()         # the padded ids have no image
  assert vmap.target_vocab == 300 and 0.5 < vmap.share < 1.0


def test_overlap_message_counts_target_tokens(vmap):
  assert vmap.report().startswith(f"vocabulary overlap: {vmap.overlap} of 300 target tokens "
                                  f"({100 * vmap.share:.1f}%) also in the draft's 376")
  with pytest.raises(ValueError, match=r"of 300 target tokens .*below the minimum 99.0% for rule "
                                       r"'intersection'"):
    registry.get("intersection", vocab=vmap, min_overlap=0.99)


@pytest.mark.parametrize("rule", ["intersection", "union"])
def test_token_level_rules_greedy_equal_target_decoding(pair, vmap, rule):
  target, draft = pair
  want = _target_greedy(pair)
  gen = speculative.generate(target.model, target.params, draft.model, draft.params,
                             _prompt(target), jax.random.PRNGKey(0),
                             rule=registry.get(rule, vocab=vmap), gamma=3, max_new_tokens=NEW,
                             warp=GREEDY, eos_id=None, draft_prompt=_prompt(draft))
  got = np.asarray(gen.tokens[0, :int(gen.lengths[0])]).tolist()
  assert got == want
  assert max(got) < target.tokenizer.vocab_size              # real target tokens, not padding
  assert target.tokenizer.decode(got) == target.tokenizer.tok.decode(got)
  assert int(gen.stats.drafted[0]) > 0


def test_slem_equals_target_decoding_and_slrs_emits_target_tokens(pair):
  target, draft = pair
  ttok, dtok = target.tokenizer, draft.tokenizer
  x_t = prompting.encode(ttok, TEXT, encoder_decoder=False)
  x_d = prompting.encode(dtok, TEXT, encoder_decoder=False)
  args = (target.model, target.params, ttok, draft.model, draft.params, dtok, x_t, x_d)
  slem = sl.generate(*args, jax.random.PRNGKey(0), method="slem", gamma=3, max_new_tokens=NEW,
                     warp=GREEDY, eos_id=None)
  assert slem.tokens.tolist() == _target_greedy(pair)
  assert slem.text == ttok.decode(slem.tokens.tolist())
  slrs = sl.generate(*args, jax.random.PRNGKey(1), method="slrs", max_new_tokens=2,
                     max_depth=2, warp=sampling.Warp(top_k=4), eos_id=None)
  assert len(slrs.tokens) == 2 and max(slrs.tokens) < ttok.vocab_size


def test_a_draft_with_the_targets_tokenizer_and_other_padding_rows(pair, tmp_path):
  """qwen2_5_7b.py's pair: one tokenizer, embeddings padded to 152,064 and 151,936 rows. Every
  same-vocabulary rule refused it ("draft vocab size differs"); the draft's logits are now fitted
  to the target's width, and greedy SD gives the target's tokens."""
  import specjax
  target, _ = pair
  ddir = tiny_checkpoints.qwen2_checkpoint(tmp_path / "d", seed=3, pad_to=256)
  draft = specjax.load(str(ddir), layers="unrolled")
  assert draft.model.vocab_size != target.model.vocab_size
  alone = specjax.generate(target, [TEXT], temperature=0.0, max_new_tokens=NEW).tokens
  for rule in ("exact", "greedy"):
    out = specjax.generate(target, [TEXT], draft=draft, rule=rule, temperature=0.0,
                           max_new_tokens=NEW)
    assert out.tokens == alone, rule
