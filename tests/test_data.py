"""Data layer: stdlib corpus extraction and splits, batching, metrics, TFDS errors."""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import types

import numpy as np
import pytest

from specjax.data import metrics, stdlib_corpus, tasks
from specjax.data.source import Source, SourceConfig
from specjax.models.prompting import bucket
from specjax.data.tfds_tasks import MissingDataError


# ---------------------------------------------------------------- corpus

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """The full corpus, extracted fresh into a temporary cache (~4 s), then reloaded from it."""
  mp = pytest.MonkeyPatch()
  mp.setenv("SPECJAX_CACHE", str(tmp_path_factory.mktemp("cache")))
  stdlib_corpus._MEMO.clear()
  fresh = stdlib_corpus.load_corpus(verbose=False)
  stdlib_corpus._MEMO.clear()
  cached = stdlib_corpus.load_corpus(verbose=False)
  assert cached == fresh
  yield fresh
  stdlib_corpus._MEMO.clear()
  mp.undo()


def test_split_of_is_a_stable_hash():
  # pinned: a change of hash or thresholds would silently move examples between splits
  got = [stdlib_corpus.split_of(f"example {i}") for i in (0, 1, 6, 12, 17)]
  assert got == ["test", "train", "test", "validation", "validation"]
  counts = {s: 0 for s in stdlib_corpus.SPLITS}
  for i in range(20000):
    counts[stdlib_corpus.split_of(f"text number {i}")] += 1
  assert 800 < counts["validation"] < 1200 and 800 < counts["test"] < 1200
  assert stdlib_corpus.split_of("def f():\n  return 1") == "train"
  assert stdlib_corpus.split_of("x", valid_frac=1.0) == "validation"
  assert stdlib_corpus.split_of("x", valid_frac=0.0, test_frac=1.0) == "test"


def test_file_list_is_sorted_and_filtered():
  files = stdlib_corpus.list_files(stdlib_corpus.stdlib_root())
  assert files == sorted(files) and len(files) > 300
  assert "argparse.py" in files and "json/decoder.py" in files and "unittest/case.py" in files
  for f in files:
    parts = f.split("/")
    assert not set(parts) & stdlib_corpus.SKIP_DIRS, f
    assert not parts[-1].startswith(("test_", "_sysconfigdata")), f


def test_extraction_is_deterministic_and_order_free():
  root = stdlib_corpus.stdlib_root()
  files = [f for f in stdlib_corpus.list_files(root) if f.startswith(("json/", "email/"))]
  a = stdlib_corpus.extract(root, files)
  shuffled = files[:]
  random.Random(0).shuffle(shuffled)
  b = stdlib_corpus.extract(root, shuffled)
  assert a == b and a.digest and len(a.lm) > 50 and len(a.summaries) > 50


def test_corpus_splits_do_not_overlap(corpus):
  for get in (corpus.lm_split, lambda s: [p for p, _ in corpus.sum_split(s)]):
    train = set(get("train"))
    held_out = set(get("validation")) | set(get("test"))
    assert train and held_out and not train & held_out
    assert not set(get("validation")) & set(get("test"))
  total = len(corpus.lm)
  assert total > 5000 and len(corpus.summaries) > 2500
  assert 0.03 < len(corpus.lm_split("validation")) / total < 0.07


def test_summary_pairs_drop_docstring_and_nested_functions():
  source = '''
import os

def outer(path):
    """Return the absolute path. Longer text here.

    More details.
    """

    def inner(x):
        """Inner helper that must not become an example."""
        return x
    return inner(os.path.abspath(path))


class Box:
    @property
    def size(self):
        """Number of items in the box."""
        return len(self.items)

    def stub(self):
        """An abstract method with no body."""
        raise NotImplementedError
'''
  pairs = stdlib_corpus.summary_pairs(source)
  assert [s for _, s in pairs] == ["Return the absolute path.", "Number of items in the box."]
  code, _ = pairs[0]
  assert code.startswith("def outer(path):\n    def inner(x):") and "absolute path" not in code
  assert pairs[1][0] == "@property\ndef size(self):\n    return len(self.items)"


def test_code_chunks_are_bounded_substrings():
  lines = [f"x_{i} = {i}  " for i in range(400)]
  source = "\n".join(line if i % 7 else "" for i, line in enumerate(lines))
  stripped = "\n".join(line.rstrip() for line in source.splitlines())
  chunks = stdlib_corpus.code_chunks(source)
  assert len(chunks) > 3
  for chunk in chunks:
    assert stdlib_corpus.CHUNK_MIN <= len(chunk) <= stdlib_corpus.CHUNK_MAX and chunk in stripped


# ---------------------------------------------------------------- batching

class CharTokenizer:
  """One id per character (ids 4..259) with the specjax special ids."""
  pad_id, eos_id, unk_id, bos_id, vocab_size = 0, 1, 2, 3, 260

  def encode(self, text):
    return [4 + (ord(c) % 256) for c in text]

  def decode(self, ids):
    return "".join(chr(i - 4) for i in ids if i >= 4)


@dataclasses.dataclass(frozen=True)
class ListTask:
  name: str
  kind: str
  metric: str | None
  data: tuple

  def examples(self, split):
    return self.data if split == "train" else self.data[:7]


def _seq2seq_task(n=40):
  rng = random.Random(1)
  data = tuple(("a" * rng.randint(1, 90) + str(i), f"out {i}" * rng.randint(1, 3))
               for i in range(n))
  return ListTask("toy_sum", "seq2seq", "rouge", data)


def test_bucket():
  assert [bucket(n, 256) for n in (1, 16, 17, 33, 64, 65, 200, 256)] == \
      [16, 16, 32, 64, 64, 128, 256, 256]
  assert bucket(90, 100) == 100 and bucket(3, 100, minimum=4) == 4 and bucket(300) == 512
  with pytest.raises(ValueError, match="exceeds the cap"):
    bucket(300, 256)


def test_seq2seq_batch_padding_and_buckets():
  cfg = SourceConfig(batch_size=2, max_prompt_len=64, max_target_len=12)
  source = Source(_seq2seq_task(), CharTokenizer(), cfg)
  widths = set()
  for step in range(20):
    b = source.batch(step)
    tokens, lengths = np.asarray(b.prompt.tokens), np.asarray(b.prompt.lengths)
    targets, mask = np.asarray(b.targets), np.asarray(b.mask)
    widths.add(tokens.shape[1])
    assert tokens.shape[1] in (16, 32, 64) and tokens.shape[1] >= lengths.max()
    assert tokens.shape[1] == bucket(int(lengths.max()), 64)
    assert targets.shape == mask.shape == (2, 12)
    for row in range(2):
      n, m = lengths[row], mask[row].sum()
      assert tokens[row, n - 1] == 1 and (tokens[row, n:] == 0).all()       # EOS, then padding
      assert targets[row, m - 1] == 1 and (targets[row, m:] == 0).all()
      assert mask[row, :m].all() and (targets[row, :m] != 0).all()
  assert widths == {16, 32, 64}                                       # buckets vary per batch


def test_lm_batch_is_prefix_and_continuation():
  text = "".join(chr(97 + i % 26) for i in range(100))
  task = ListTask("toy_lm", "lm", None, ((text, ""), ("short", "")))
  cfg = SourceConfig(batch_size=2, lm_prompt_len=10, max_target_len=20, seed=3)
  source = Source(task, CharTokenizer(), cfg)
  ids = [3] + CharTokenizer().encode(text)
  prompt, target = source.encode_example(text, "")
  assert prompt == ids[:10] and target == ids[10:30]                   # window full: no EOS
  prompt, target = source.encode_example("short", "")
  assert prompt == [3] + CharTokenizer().encode("short")[:4] and target == [4 + ord("t"), 1]
  b = source.batch(0)
  assert b.prompt.tokens.shape == (2, 10) and b.targets.shape == (2, 20)   # the cap is a bucket


def test_batches_are_deterministic_and_resume_exactly():
  cfg = SourceConfig(batch_size=8, max_prompt_len=64, max_target_len=12, seed=5)
  a = Source(_seq2seq_task(), CharTokenizer(), cfg)
  b = Source(_seq2seq_task(), CharTokenizer(), cfg)
  run = [a.batch(s) for s in range(12)]                               # 40 examples: crosses epochs
  for s in (11, 3, 7, 0):                                             # a fresh source, any order
    again = b.batch(s)
    for x, y in zip((run[s].prompt.tokens, run[s].targets, run[s].mask),
                    (again.prompt.tokens, again.targets, again.mask)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  for epoch in range(2):                                              # each epoch: a permutation
    seen = np.concatenate([a.indices(s) for s in range(epoch * 5, epoch * 5 + 5)])
    assert sorted(seen) == list(range(40))
  other = Source(_seq2seq_task(), CharTokenizer(), dataclasses.replace(cfg, seed=6))
  assert not np.array_equal(a.indices(0), other.indices(0))
  assert not np.array_equal(a.indices(0), a.indices(5))               # epochs reshuffle


def test_shards_concatenate_to_the_global_batch():
  source = Source(_seq2seq_task(), CharTokenizer(), SourceConfig(batch_size=8, max_prompt_len=128))
  full = source.batch(3)
  parts = [source.batch(3, shard=(i, 4)) for i in range(4)]
  np.testing.assert_array_equal(np.concatenate([np.asarray(p.targets) for p in parts]),
                                np.asarray(full.targets))
  with pytest.raises(ValueError, match="shard"):
    source.batch(0, shard=(0, 3))


def test_eval_examples_follow_eval_batches():
  source = Source(_seq2seq_task(), CharTokenizer(), SourceConfig(batch_size=4, max_prompt_len=128))
  pairs = source.eval_examples("validation", 7)
  assert pairs == [(inp, out) for inp, out in _seq2seq_task().data[:7]]
  got = list(source.eval_batches("validation", 6))
  assert [len(p) for _, p in got] == [4, 2] and got[1][1] == pairs[4:6]
  assert source.decode_outputs(got[0][0].prompt.tokens, got[0][0].prompt.lengths) == \
      [inp for inp, _ in pairs[:4]]
  prompt = source.encode_prompts(["abc", "x" * 40])
  assert prompt.tokens.shape == (2, 64) and list(np.asarray(prompt.lengths)) == [4, 41]


def test_stdlib_tasks_are_registered(corpus):
  lm, summ = tasks.get_task("stdlib_lm"), tasks.get_task("stdlib_sum")
  assert lm.kind == "lm" and summ.kind == "seq2seq" and summ.metric == "rouge"
  inp, out = summ.examples("validation")[0]
  assert inp.startswith(("def ", "async def ", "@")) and out
  assert lm.examples("test")[0][1] == ""
  with pytest.raises(ValueError, match="unknown task"):
    tasks.get_task("imagenet")


# ---------------------------------------------------------------- metrics

def test_rouge_known_values():
  assert metrics.rouge_n("the cat sat", "the cat ran", 2) == pytest.approx(0.5)
  assert metrics.rouge_n("The Cat, sat!", "the cat sat", 1) == pytest.approx(1.0)
  # LCS("a b c d", "a c d e") = 3 -> P = R = 3/4
  assert metrics.rouge_l("a b c d", "a c d e") == pytest.approx(0.75)
  assert metrics.rouge_n("", "x y", 2) == 0.0
  scores = metrics.rouge(["the cat sat", "a b c d"], ["the cat ran", "a c d e"])
  assert scores["rouge2"] == pytest.approx(100 * (0.5 + 1 / 3) / 2)
  assert scores["rougeL"] == pytest.approx(100 * (2 / 3 + 0.75) / 2)


def test_bleu_matches_sacrebleu_values():
  # reference values computed with sacrebleu 2.x corpus_bleu (13a, exp smoothing)
  assert metrics.corpus_bleu(["the cat sat on the mat"], ["the cat is on the mat"]) == \
      pytest.approx(37.99178428257963)
  assert metrics.corpus_bleu(["a b c d"], ["a b x y z"]) == pytest.approx(24.880469496253564)
  assert metrics.corpus_bleu(["same text here ok"], ["same text here ok"]) == pytest.approx(100)
  assert metrics.bleu_tokens("Hello, world.") == ["Hello", ",", "world", "."]
  with pytest.raises(ValueError, match="references"):
    metrics.corpus_bleu(["a"], [])


def test_exact_match_and_gsm8k():
  assert metrics.exact_match(["a  b", "c"], ["a b", "d"]) == 50.0
  assert metrics.gsm8k_answer("so 3 + 4 = 7 apples\n#### 1,234") == "1234"
  assert metrics.gsm8k_answer("she has 12 then 15.0") == "15"
  assert metrics.gsm8k_accuracy(["answer is 42", "no number"], ["#### 42", "#### 7"]) == 50.0
  assert metrics.evaluate("rouge", ["x y"], ["x y"])["rouge2"] == pytest.approx(100)
  with pytest.raises(ValueError, match="unknown metric"):
    metrics.evaluate("meteor", [], [])


# ---------------------------------------------------------------- TFDS

def test_tfds_missing_package_says_how_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)         # import fails
  with pytest.raises(MissingDataError) as err:
    tasks.get_task("xsum", data_dir="/data/tfds").examples("train")
  msg = str(err.value)
  assert "pip install 'specjax[data]'" in msg and "tfds build xsum --data_dir=/data/tfds" in msg


def _fake_tfds(builder):
  module = types.ModuleType("tensorflow_datasets")
  module.builder = lambda name, data_dir=None: builder(name, data_dir)
  return module


def test_tfds_unprepared_dataset_says_how_to_prepare(monkeypatch, tmp_path):
  fake = lambda name, data_dir: types.SimpleNamespace(data_dir=tmp_path / name / "1.0.0")
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", _fake_tfds(fake))
  with pytest.raises(MissingDataError) as err:
    tasks.get_task("wmt14_en_de", data_dir=str(tmp_path)).examples("validation")
  msg = str(err.value)
  assert "not prepared" in msg and f"tfds build wmt14_translate/de-en --data_dir={tmp_path}" in msg


def test_tfds_prepared_dataset_reads_pairs(monkeypatch, tmp_path):
  (tmp_path / "dataset_info.json").write_text("{}")
  records = [{"question": b"How many?", "answer": b"2 + 2 = 4\n#### 4"}]
  splits_seen = []

  def as_data_source(split):
    splits_seen.append(split)
    return records
  fake = lambda name, data_dir: types.SimpleNamespace(data_dir=tmp_path,
                                                      as_data_source=as_data_source)
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", _fake_tfds(fake))
  pairs = tasks.get_task("gsm8k", max_examples=10).examples("validation")
  assert list(pairs) == [("How many?", "2 + 2 = 4\n#### 4")] and splits_seen == ["test[:10]"]


def test_unreadable_cache_is_rebuilt(corpus, monkeypatch):
  calls = []
  monkeypatch.setattr(stdlib_corpus, "extract", lambda: calls.append(1) or corpus)
  stdlib_corpus._MEMO.clear()
  paths = list(stdlib_corpus.cache_dir().glob("stdlib-corpus-*.json.gz"))
  assert len(paths) == 1
  paths[0].write_bytes(b"not gzip")
  assert stdlib_corpus.load_corpus(verbose=False) == corpus and calls == [1]
  stdlib_corpus._MEMO.clear()
  assert stdlib_corpus.load_corpus(verbose=False) == corpus and calls == [1]   # rewritten


# ---------------------------------------------------------------- file:PATH (a model's own text)

def _records(n):
  return [{"prompt": f"def f{i}(x):\n" + "#" * i, "text": f"    return {i}", "tokens": [i]}
          for i in range(n)]


def test_file_task_reads_decode_output_and_json_lines(tmp_path):
  """decode --output_json's JSON list and JSON lines give the same records; every 20th is the
  validation split, the others train, and together they are the file."""
  report, listed, lines = tmp_path / "out.json", tmp_path / "list.json", tmp_path / "out.jsonl"
  report.write_text(json.dumps({"settings": {}, "results": _records(45)}, indent=1))
  listed.write_text(json.dumps(_records(45)))
  lines.write_text("".join(json.dumps(r) + "\n\n" for r in _records(45)))
  pairs = [(r["prompt"], r["text"]) for r in _records(45)]
  for path in (report, listed, lines):
    task = tasks.get_task(f"file:{path}")
    assert (task.name, task.kind) == (f"file:{path}", "completion")
    train, held = task.examples("train"), task.examples("validation")
    assert list(held) == [pairs[19], pairs[39]] and len(train) == 43
    assert sorted(train + held) == sorted(pairs)


@pytest.mark.parametrize("content, match", [
    (None, "does not exist.*--output_json"),
    ("{\"results\": 3}", "holds no list of records"),
    ("[{\"prompt\": \"a\"}]", "record 0 has no .prompt. and .text. strings"),
    ("[]", "holds no records"),
    ("[{\"prompt\": \"a\", \"text\": \"\"}, {\"prompt\": \"\", \"text\": \"\"}]",
     "every one of its 2 records is empty, so there is nothing to train on"),   # probe round 8
    ("{\"prompt\": \"a\", \"text\": ", "is not JSON"),
    (b"\xff\xfe", "UTF-8"),
])
def test_file_task_refuses_a_file_it_cannot_read(tmp_path, content, match):
  path = tmp_path / f"bad{len(str(content))}.json"
  if isinstance(content, bytes):
    path.write_bytes(content)
  elif content is not None:
    path.write_text(content)
  with pytest.raises(tasks.TaskFileError, match=match):
    tasks.get_task(f"file:{path}").examples("train")


def test_completion_batch_keeps_the_prompts_end_and_the_text_without_eos():
  """A completion example: [BOS] + the prompt's last tokens (the continuation depends on them),
  then the text's first tokens with no EOS (a text cut at a token limit has no end)."""
  tok = CharTokenizer()
  task = ListTask("toy_completion", "completion", None, (("abcdefghij", "xyz"), ("ab", "x" * 30)))
  source = Source(task, tok, SourceConfig(batch_size=2, max_prompt_len=5, max_target_len=8))
  assert source.encode_example("abcdefghij", "xyz") == ([3] + tok.encode("ghij"), tok.encode("xyz"))
  assert source.encode_example("ab", "x" * 30) == ([3] + tok.encode("ab"), tok.encode("x" * 8))
  b = source.batch(0)
  assert b.prompt.tokens.shape == (2, 5) and b.targets.shape == (2, 8)
  assert sorted(np.asarray(b.mask).sum(1).tolist()) == [3, 8]
  assert source.eval_examples("validation", 1) == [("ghij", "xyz")]
