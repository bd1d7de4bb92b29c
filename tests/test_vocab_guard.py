"""A draft whose tokenizer gives other ids than the target's is refused by the rules that read draft
ids as target ids (exact, greedy, lenient, fuzzy, adaptive, SPRINTER), naming the cross-tokenizer
rules; what decides the ids is compared (pieces, merges, pre-tokenizer, special ids), not files or
sizes: two tokenizers that differ only in their chat template pass."""

from __future__ import annotations

import inspect
import shutil
import string
import textwrap

import pytest

from test_cli_end_to_end import VOCAB, _tiny_pair

from specjax.app import config, methods
from specjax.app.config import ConfigError
from specjax.data import tokenizer as tokenizer_lib
from specjax.data.tokenizer import train_sentencepiece
from specjax.models import hf_import


def _spm(root, name: str, source: str):
  return train_sentencepiece(source[:12000].split("\n\n"), root / f"{name}.model",
                             model_type="bpe", vocab_size=VOCAB, num_threads=1)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  """A target and two drafts of the same size: one with the target's SentencePiece model (a copy
  elsewhere), one with a model of as many pieces trained on other text."""
  root = tmp_path_factory.mktemp("vocab")
  ours = _spm(root, "ours", inspect.getsource(string) + inspect.getsource(textwrap))
  other = _spm(root, "other", inspect.getsource(inspect))
  (target, tparams), (draft, dparams) = _tiny_pair()
  out = {"target": hf_import.save_model(target, tparams, root / "target")}
  shutil.copy(ours, out["target"] / "spm.model")
  for name, spm_file in (("same", ours), ("other", other)):
    out[name] = hf_import.save_model(draft, dparams, root / name)
    shutil.copy(spm_file, out[name] / "spm.model")
  return out


def _build(dirs, draft: str, rule: str, *extra: str):
  cfg = config.load_config("tiny.py", [f"--config.target.checkpoint={dirs['target']}",
                                       f"--config.draft.checkpoint={dirs[draft]}",
                                       f"--config.rule.name={rule}", *extra])
  return methods.build(cfg)


@pytest.mark.parametrize("rule", ["exact", "greedy", "lenient", "fuzzy", "adaptive"])
def test_a_draft_with_another_tokenizer_is_refused_by_same_vocabulary_rules(dirs, rule):
  with pytest.raises(ConfigError, match=r"draft's tokenizer .* is not the target's .*"
                                        r"intersection, union, slem or slrs"):
    _build(dirs, "other", rule)


def test_the_same_tokenizer_in_another_file_passes_and_cross_rules_take_another(dirs):
  assert _build(dirs, "same", "exact").name == "speculative"
  assert _build(dirs, "other", "intersection").rule.rule_name == "intersection"


def test_hf_fingerprint_ignores_the_chat_template_and_sees_a_new_token(tmp_path):
  from test_fetch import _tiny_gguf
  gguf_file = tmp_path / "tiny.gguf"
  _tiny_gguf(gguf_file)
  base = tokenizer_lib.HFTokenizer.from_gguf(gguf_file).tok
  base.save_pretrained(tmp_path / "a")
  base.chat_template = "{{ messages[0]['content'] }}"
  base.save_pretrained(tmp_path / "b")
  base.add_tokens(["<extra>"])
  base.save_pretrained(tmp_path / "c")
  a, b, c = (tokenizer_lib.get_tokenizer(str(tmp_path / n)) for n in "abc")
  assert tokenizer_lib.same_vocabulary(a, b)
  assert not tokenizer_lib.same_vocabulary(a, c)


def test_the_same_tokenizer_files_are_the_same_vocabulary_without_the_fingerprint(tmp_path,
                                                                                monkeypatch):
  """A converted pair's byte-identical tokenizer files pass without parsing the vocabulary; a
  copy whose generation_config.json names another EOS id does not pass on its files (its
  fingerprint, which holds the special ids, decides and refuses it)."""
  from test_fetch import _tiny_gguf
  gguf_file = tmp_path / "tiny.gguf"
  _tiny_gguf(gguf_file)
  tokenizer_lib.HFTokenizer.from_gguf(gguf_file).tok.save_pretrained(tmp_path / "a")
  shutil.copytree(tmp_path / "a", tmp_path / "copy")
  shutil.copytree(tmp_path / "a", tmp_path / "other_eos")
  (tmp_path / "other_eos" / "generation_config.json").write_text('{"eos_token_id": 3}')
  a, copy, other_eos = (tokenizer_lib.get_tokenizer(str(tmp_path / n))
                        for n in ("a", "copy", "other_eos"))
  assert other_eos.eos_ids != a.eos_ids
  parsed = []
  real = tokenizer_lib.HFTokenizer.fingerprint.func
  monkeypatch.setattr(tokenizer_lib.HFTokenizer, "fingerprint",
                      property(lambda self: parsed.append(self.path) or real(self)))
  assert tokenizer_lib.same_vocabulary(a, copy) and parsed == []
  assert not tokenizer_lib.same_vocabulary(a, other_eos) and parsed


def test_a_checkpoint_without_tokenizer_files_is_refused_naming_them(dirs, tmp_path):
  bare = tmp_path / "bare"
  shutil.copytree(dirs["target"], bare)
  (bare / "spm.model").unlink()
  with pytest.raises(tokenizer_lib.TokenizerNotFoundError,
                     match=r"holds no tokenizer \(looked for tokenizer.json, .*--config.target."
                           r"tokenizer"):
    tokenizer_lib.get_tokenizer(str(bare))
  cfg = config.load_config("tiny.py", [f"--config.target.checkpoint={bare}",
                                       "--config.draft.checkpoint="])
  with pytest.raises(tokenizer_lib.TokenizerNotFoundError):
    methods.build(cfg)
