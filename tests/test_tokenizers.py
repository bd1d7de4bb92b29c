"""Tokenizers: SentencePiece training on a small stdlib slice, round trips, caching, HF loading."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from specjax.data import stdlib_corpus, tokenizer
from specjax.data.source import Source, SourceConfig
from specjax.data.tasks import get_task

TRICKY = ["def f(x):\n    return x  \n\n\tpass\r\n", "  leading and trailing  ",
          "héllo 世界 🎉",
          "a\u00a0b ﬁ", "x" * 300, "", "\n\n", "    \"\"\"Doc.\"\"\"\n"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  mp = pytest.MonkeyPatch()
  mp.setenv("SPECJAX_CACHE", str(tmp_path_factory.mktemp("cache")))
  stdlib_corpus._MEMO.clear()
  yield stdlib_corpus.load_corpus(verbose=False)
  stdlib_corpus._MEMO.clear()
  mp.undo()


@pytest.fixture(scope="module")
def toks(cache, tmp_path_factory):
  """Unigram on 0.5 MB (its trainer is the slow one: ~4 s) and BPE on 1.5 MB (~1 s)."""
  out, train = tmp_path_factory.mktemp("sp"), cache.lm_split("train")
  return {kind: tokenizer.Tokenizer.load(tokenizer.train_sentencepiece(
      tokenizer._take_chars(train, chars), out / f"{kind}.model", model_type=kind,
      vocab_size=vocab)) for kind, vocab, chars in (("unigram", 1200, 500_000),
                                                     ("bpe", 600, 1_500_000))}


def test_special_ids_and_vocab_sizes(toks):
  for tok, vocab in ((toks["unigram"], 1200), (toks["bpe"], 600)):
    assert (tok.pad_id, tok.eos_id, tok.unk_id, tok.bos_id) == (0, 1, 2, 3)
    assert tok.vocab_size == vocab
    assert tok.id_to_piece(0) == "<pad>" and tok.id_to_piece(1) == "</s>"
    assert tok.piece_to_id("\n") > 3
  assert toks["unigram"].encode("return self") != toks["bpe"].encode("return self")


@pytest.mark.parametrize("kind", ["unigram", "bpe"])
def test_text_round_trips(toks, kind, cache):
  tok = toks[kind]
  for text in TRICKY + list(cache.lm_split("validation")[:50]):
    assert tok.decode(tok.encode(text)) == text
  ids = tok.encode("héllo 世界 🎉")
  assert tok.unk_id not in ids                                          # byte fallback, no <unk>


def test_decode_drops_specials_and_out_of_range_ids(toks):
  tok = toks["bpe"]
  ids = tok.encode("x = 1")
  assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id, tok.vocab_size + 5]) == "x = 1"
  assert tok.decode(np.asarray(ids, np.int32)) == "x = 1"


def test_decode_is_concatenative_on_ascii(toks):
  tok = toks["unigram"]
  text = "    def run(self, items):\n        return [x + 1 for x in items]\n"
  ids = tok.encode(text)
  for k in range(len(ids) + 1):
    assert tok.decode(ids[:k]) + tok.decode(ids[k:]) == text


def test_indentation_is_cheap(toks):
  tok = toks["unigram"]
  assert len(tok.encode("        x")) <= 3                                # not one token per space


def test_stdlib_tokenizer_is_cached_by_settings(cache, caplog):
  caplog.set_level(logging.INFO, logger="specjax")
  first = tokenizer.stdlib_tokenizer("bpe", 400, max_chars=300_000)
  assert "training SentencePiece bpe vocab=400" in caplog.text
  caplog.clear()
  again = tokenizer.stdlib_tokenizer("bpe", 400, max_chars=300_000)
  assert again.path == first.path and "training" not in caplog.text
  other = tokenizer.stdlib_tokenizer("bpe", 420, max_chars=300_000, verbose=False)
  assert other.path != first.path and other.vocab_size == 420
  assert tokenizer.get_tokenizer(first.path).encode("import os") == first.encode("import os")
  assert tokenizer.get_tokenizer("stdlib:bpe:400:300000").path == first.path   # chars in the spec


def test_source_with_real_tokenizer(toks, cache):
  cfg = SourceConfig(batch_size=4, max_prompt_len=128, max_target_len=24)
  source = Source(get_task("stdlib_sum"), toks["bpe"], cfg)
  batch = source.batch(0)
  assert batch.prompt.tokens.shape[1] in (16, 32, 64, 128) and batch.targets.shape == (4, 24)
  inp, ref = source.eval_examples("test", 1)[0]
  assert ref == get_task("stdlib_sum").examples("test")[0][1]
  lm = Source(get_task("stdlib_lm"), toks["bpe"], SourceConfig(batch_size=2, lm_prompt_len=16))
  prompt_text, continuation = lm.eval_examples("validation", 1)[0]
  assert (prompt_text + continuation) in cache.lm_split("validation")[0] + "\n"


def test_bad_specs_have_clear_errors(tmp_path):
  with pytest.raises(ValueError, match="stdlib:<unigram|bpe>"):
    tokenizer.get_tokenizer("stdlib:wordpiece:100")
  with pytest.raises(FileNotFoundError, match="no SentencePiece model"):
    tokenizer.Tokenizer.load(tmp_path / "missing.model")
  with pytest.raises(ValueError, match="model_type"):
    tokenizer.train_sentencepiece(["a"], tmp_path / "x.model", model_type="char")


def test_hf_tokenizer_from_local_directory(tmp_path):
  tk = pytest.importorskip("tokenizers")
  transformers = pytest.importorskip("transformers")
  bpe = tk.Tokenizer(tk.models.BPE())
  bpe.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = tk.decoders.ByteLevel()
  trainer = tk.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                   initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
  bpe.train_from_iterator(["def foo(x):\n    return x + 1\n"] * 20, trainer)
  transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>") \
      .save_pretrained(tmp_path)
  tok = tokenizer.get_tokenizer(str(tmp_path))
  assert isinstance(tok, tokenizer.HFTokenizer)
  assert tok.eos_id == 0 and tok.pad_id == tok.eos_id == tok.bos_id    # GPT-2 style fallbacks
  text = "def foo(x):\n\treturn héllo  "
  ids = tok.encode(text)
  assert tok.decode(ids) == text and tok.decode(ids + [tok.eos_id]) == text
  assert tok.id_to_piece(ids[0]) and tok.vocab_size == len(tok.tok)


def test_a_checkpoint_directory_with_spm_model_gives_that_tokenizer(toks, tmp_path):
  """A specjax-trained checkpoint (config.json of a GPT-2-style model, spm.model beside it, as
  the embedded pairs are saved): the directory is its SentencePiece tokenizer, as a data
  section's `builtin:PAIR/ROLE` names it; transformers would read the directory as a GPT-2
  tokenizer of 1 id that encodes every text to no ids."""
  pytest.importorskip("transformers")
  own = toks["bpe"]
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
  (tmp_path / tokenizer.SPM_FILE).write_bytes(open(own.path, "rb").read())
  tok = tokenizer.get_tokenizer(str(tmp_path))
  text = "def f(x):\n    return x\n"
  assert isinstance(tok, tokenizer.Tokenizer) and tok.vocab_size == own.vocab_size
  assert tok.encode(text) == own.encode(text) and tok.encode(text)


def test_tokenizer_files_without_a_vocabulary_are_refused(tmp_path):
  pytest.importorskip("transformers")
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
  (tmp_path / "tokenizer_config.json").write_text("{}")
  with pytest.raises(ValueError, match="encodes text to no ids: copy the model's tokenizer.json"):
    tokenizer.get_tokenizer(str(tmp_path))


def test_a_directorys_cache_key_reads_its_files_not_its_vocabulary(toks, tmp_path):
  """cache_key of an HF tokenizer digests its files (no fingerprint: that re-serialises the
  whole vocabulary); a copy of the files gives the same key, another tokenizer file another; a
  SentencePiece tokenizer is keyed by its fingerprint."""
  import shutil
  import tiny_checkpoints   # tests/ is on sys.path under pytest
  tiny_checkpoints.byte_level_bpe(tmp_path / "a")
  shutil.copytree(tmp_path / "a", tmp_path / "b")
  a, b = (tokenizer.get_tokenizer(str(tmp_path / n)) for n in "ab")
  key = tokenizer.cache_key(a)
  assert key.startswith("files-") and key == tokenizer.cache_key(b)
  assert "fingerprint" not in vars(a) and "fingerprint" not in vars(b)   # never computed
  shutil.copytree(tmp_path / "a", tmp_path / "c")
  spec = json.loads((tmp_path / "c" / "tokenizer.json").read_text())
  spec["normalizer"] = {"type": "Lowercase"}                        # other ids for "A"
  (tmp_path / "c" / "tokenizer.json").write_text(json.dumps(spec))
  assert tokenizer.cache_key(tokenizer.get_tokenizer(str(tmp_path / "c"))) != key
  assert tokenizer.cache_key(toks["bpe"]) == toks["bpe"].fingerprint


def test_tokenizers_are_loaded_under_the_transformers_lock(tmp_path, monkeypatch):
  """transformers' lazy module is not thread-safe on first use (training loads its data's
  tokenizer in a thread while the models' tokenizers load): every load holds one lock."""
  import tiny_checkpoints   # tests/ is on sys.path under pytest
  tiny_checkpoints.byte_level_bpe(tmp_path)
  held = []

  class Recording:
    def __enter__(self):
      held.append(True)
    def __exit__(self, *exc):
      held.append(False)

  monkeypatch.setattr(tokenizer, "TRANSFORMERS", Recording())
  tok = tokenizer.get_tokenizer(str(tmp_path))
  assert held == [True, False] and tok.encode("def f")
