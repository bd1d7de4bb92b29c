"""Probe round 4: a Ctrl-C between batches, and the eval tools' refusals of flags that ask for
nothing (eval.versus --methods ''), for what cannot fit (eval.humaneval's longest problem,
eval.agreement's --text_tokens) and for what changes nothing (eval.agreement's --variant flags
that do not reach the target). (The tokenizer of a `builtin:` pair's directory is
tests/test_tokenizers.py's.)"""

from __future__ import annotations

import types

import pytest

from eval import agreement, flags, humaneval, versus
from specjax.api.results import Row
from specjax.app import runner
from specjax.app.config import ConfigError

PROMPTS = [f"p{i}" for i in range(5)]


def _fake_batches(method, prompts, key, stream=None, pad_batches=True, first=0):
  """decoder.batches' contract without models: per batch (prompts, Rows)."""
  for start in range(first, len(prompts), method.settings.batch_size):
    chunk = prompts[start:start + method.settings.batch_size]
    yield chunk, [Row([i], f"text of {p}", {"emitted": 1}, "stop") for i, p in enumerate(chunk)]


@pytest.fixture
def method(monkeypatch):
  monkeypatch.setattr(runner.decoder, "batches", _fake_batches)
  monkeypatch.setattr(runner, "formatted", lambda method, prompts: list(prompts))
  return types.SimpleNamespace(settings=types.SimpleNamespace(batch_size=2), label="fake",
                               streams=False, mesh=None)


def _interrupt_on(call: int):
  calls = []

  def fn(*_):
    calls.append(1)
    if len(calls) == call:
      raise KeyboardInterrupt
  return fn


@pytest.mark.parametrize("where", ["on_batch", "show"])
def test_ctrl_c_while_saving_or_printing_keeps_the_finished_rows(method, where):
  """A Ctrl-C that landed while a batch's rows were printed or saved to OUT.partial escaped as
  a bare KeyboardInterrupt: specjax.decode said 'interrupted' and wrote no --output_json. Now
  every row finished before it is in Interrupted.rows (the decode report's partial output)."""
  kwargs = ({"on_batch": _interrupt_on(2)} if where == "on_batch"
            else {"show": _interrupt_on(3)})
  with pytest.raises(runner.Interrupted) as err:
    runner.generate_texts(method, PROMPTS, key=None, batch_size=2, **kwargs)
  done = [row[0] for row in err.value.rows]
  assert done == (PROMPTS[:4] if where == "on_batch" else PROMPTS[:2]), done
  rows = runner.generate_texts(method, PROMPTS, key=None, batch_size=2)
  assert [r[2] for r in rows] == [f"text of {p}" for p in PROMPTS]


def test_versus_refuses_methods_that_name_nothing(capsys):
  for text in ("", ",", " , "):
    with pytest.raises(ValueError, match=r"--methods .* names nothing: give comma-separated "
                       r"names, e.g. target,exact"):
      flags.names(text, "--methods", "target,exact")
  assert flags.names(" target, exact,", "--methods", "x") == ["target", "exact"]
  # before any model is loaded: one line, exit 2
  assert versus.main(["--config", "tiny.py", "--methods", ""]) == 2
  err = capsys.readouterr().err
  assert "names nothing" in err and "Traceback" not in err, err


class _Room:
  def __init__(self, longest, most):
    self.longest, self._most = longest, most

  def largest_max_new_tokens(self, prompt_len):
    return self._most

  def describe(self):
    return "the target's cache holds 256 positions"


class _Method:
  def __init__(self, room):
    self._room = room

  def with_settings(self, **_):
    return self

  def models(self):
    return ["target"]

  def room(self, loaded):
    return self._room

  def encode_text(self, loaded, text):
    return text.split()


PROBLEMS = [{"task_id": "T/0", "prompt": "a b"}, {"task_id": "T/1", "prompt": "a b c d e"}]


def test_humaneval_names_the_problem_that_no_max_new_tokens_fits():
  """It advised '--max_new_tokens 0 or less', a value it refuses itself."""
  with pytest.raises(ConfigError) as err:
    humaneval.check_room(_Method(_Room(longest=3, most=-2)), PROBLEMS, 8)
  assert str(err.value).endswith("the longest problem prompt (T/1) takes 5: no --max_new_tokens "
                                 "fits: leave that problem out (--limit, --offset) or use a model "
                                 "with more positions"), err.value
  with pytest.raises(ConfigError, match=r"\(T/1\) takes 5: use --max_new_tokens 3 or less$"):
    humaneval.check_room(_Method(_Room(longest=3, most=3)), PROBLEMS, 8)
  humaneval.check_room(_Method(_Room(longest=5, most=8)), PROBLEMS, 8)


def test_agreement_refuses_variant_flags_that_do_not_reach_the_target():
  """--variant=--config.draft.quant=int8 reported 'identical, KL 0': the variant is the target
  decoding alone, which no draft, rule or gamma flag changes."""
  agreement.check_variant(["--config.target.quant=int8", "--config.target.layout=out_in"])
  for bad in (["--config.draft.quant=int8"], ["--config.target.dtype=bfloat16",
                                              "--config.rule.name=greedy"]):
    with pytest.raises(ValueError, match=rf"--variant {bad[-1]}: the variant is the target "
                       r"decoding alone with other --config.target.\* settings"):
      agreement.check_variant(bad)
  with pytest.raises(ValueError, match="give the variant's flags"):
    agreement.check_variant([])


def test_agreement_refuses_text_longer_than_the_targets_positions():
  base = types.SimpleNamespace(target=types.SimpleNamespace(
      model=types.SimpleNamespace(is_encoder_decoder=False, n_positions=256)))
  agreement.check_length(base, 256)
  with pytest.raises(ValueError, match=r"--text_tokens 300: the target reads at most 256 "
                     r"positions \(its n_positions\): use --text_tokens 256 or less"):
    agreement.check_length(base, 300)
  base.target.model.n_positions = None            # rotary positions: no bound
  agreement.check_length(base, 10**6)


def test_agreement_says_when_no_held_out_text_is_that_long(monkeypatch):
  """It ended in 'fmean requires at least one data point'."""
  corpus = types.SimpleNamespace(lm_split=lambda split: ["a b c", "a b c d e f"])
  monkeypatch.setattr(agreement.stdlib_corpus, "load_corpus", lambda: corpus)
  base = types.SimpleNamespace(target=types.SimpleNamespace(
      tokenizer=types.SimpleNamespace(encode=str.split)))
  with pytest.raises(ValueError, match=r"--text_tokens 7: no held-out text is that long under "
                     r"the target's tokenizer \(the longest has 6 tokens\): use --text_tokens 6 "
                     r"or less"):
    agreement.teacher_forced(base, base, num_texts=2, length=7)


def test_a_per_row_threshold_is_refused_before_anything_is_decoded():
  """--config.rule.threshold=(0.1,0.2) decoded a first batch and failed at the next batch of
  another size (a rule's rows are a batch's, not the prompts)."""
  from specjax.acceptance import registry
  from specjax.api import rules
  from specjax.api.errors import UsageError
  from specjax.app import methods
  from specjax.app.config import load_config
  fuzzy = registry.rule_class("fuzzy")
  rules.check_one_value_each(fuzzy, {"threshold": 0.3})
  with pytest.raises(UsageError, match=r"rule 'fuzzy': threshold=\(0.1, 0.2\) gives one value "
                     r"per batch row; a decoder's rule takes one value: give one number"):
    rules.check_one_value_each(fuzzy, {"threshold": (0.1, 0.2)})
  config = load_config("tiny.py", ["--config.rule.name=fuzzy",
                                   "--config.rule.threshold=(0.1,0.2)"])
  with pytest.raises(ConfigError, match=r"--config.rule.threshold=\(0.1, 0.2\) gives one value"):
    methods.speculative(config)             # refused before the tiny pair is built or loaded


def test_an_empty_target_checkpoint_is_refused_not_read_from_the_working_directory(
    tmp_path, monkeypatch, capsys):
  """distill_tiny.py's target (a shape for training) or --config.target.checkpoint= resolved ""
  as a path: the model or .gguf file in the working directory was loaded without a word."""
  from specjax import decode
  from specjax.api import loading
  from specjax.models.hf_import import CheckpointNotFoundError
  (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')   # a checkpoint here
  monkeypatch.chdir(tmp_path)
  with pytest.raises(CheckpointNotFoundError, match="no checkpoint named"):
    loading.checkpoint_dir("")
  assert decode.main(["--config", "tiny.py", "--config.target.checkpoint= ", "--prompt", "x"]) == 2
  err = capsys.readouterr().err
  assert err.strip() == ("specjax.decode: error: --config.target.checkpoint is empty: name the "
                         "target's checkpoint (a directory, a .gguf file, a cached hub id, "
                         "pypi:PAIR/ROLE or builtin:PAIR/ROLE) with "
                         "--config.target.checkpoint=..."), err
  # Round 5: distill_tiny.py's target has no checkpoint field, so that advice led to another
  # refusal ("unknown config field").
  assert decode.main(["--config", "distill_tiny.py", "--config.target.init_from=x",
                      "--prompt", "x"]) == 2
  assert "target section has no checkpoint field: it describes a model to train" in \
      capsys.readouterr().err


@pytest.mark.parametrize("drafter, flag", [
    ("early_exit", "--config.draft.quant=int8"),
    ("early_exit", "--config.draft.checkpoint=/elsewhere"),
    ("ngram", "--config.draft.dtype=bfloat16"),
    ("head", "--config.draft.quant=int4"),
])
def test_draft_settings_that_the_drafter_never_reads_are_refused(drafter, flag):
  """--config.draft.method=early_exit --config.draft.quant=int8 decoded as without the flag (and
  the report's settings recorded an int8 draft that never ran)."""
  from specjax.app.config import load_config
  method = [f"--config.draft.method={drafter}"]
  read = {"early_exit": ["--config.draft.exit_layer=1"], "ngram": ["--config.draft.ngram_max=2"],
          "head": ["--config.draft.checkpoint=runs/head"]}[drafter]
  overrides = [*method, *read]
  runner.check_overrides_apply(load_config("tiny.py", overrides), overrides)   # what it reads
  overrides += [flag]
  with pytest.raises(ConfigError, match=rf"^{flag}: --config.draft.method={drafter} reads only "
                     r"draft.method, .* of the draft section, so this has no effect: drop it, or "
                     r"draft with a model \(--config.draft.method=model\)$"):
    runner.check_overrides_apply(load_config("tiny.py", overrides), overrides)
  model = ["--config.draft.quant=int8", "--config.draft.dtype=bfloat16"]      # a model reads them
  runner.check_overrides_apply(load_config("tiny.py", model), model)


def _start(argv0: str, then: str):
  import subprocess
  import sys
  code = (f"import sys; sys.argv[:1] = [{argv0!r}]; sys.orig_argv = ['python', '-m', "
          f"'specjax.decode']; import specjax; {then}")
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_ctrl_c_while_a_command_imports_prints_one_line():
  """A Ctrl-C in the first second of `python -m specjax.decode` (jax importing, before main's
  own handler) printed Python's KeyboardInterrupt traceback."""
  done = _start("-m", "raise KeyboardInterrupt")           # as `python -m specjax.X` starts
  assert done.stderr == "specjax.decode: interrupted\n" and done.returncode != 0, done
  done = _start("-m", "raise ValueError('other errors keep their report')")
  assert "Traceback" in done.stderr and "other errors keep their report" in done.stderr
  done = _start("script.py", "raise KeyboardInterrupt")    # a user's program importing specjax
  assert "Traceback" in done.stderr and "KeyboardInterrupt" in done.stderr, done


def test_agreement_refuses_a_variant_with_another_tokenizer_before_decoding(monkeypatch):
  """--variant=--config.target.checkpoint=OTHER_FAMILY decoded both models and then failed on a
  shape error in the KL. Rows padded to another count (one tokenizer) are compared on the ids
  both have."""
  tok = lambda path, fp: types.SimpleNamespace(path=path, fingerprint=fp)
  loaded = lambda t: types.SimpleNamespace(target=types.SimpleNamespace(tokenizer=t))
  monkeypatch.setattr(agreement.tokenizer_lib, "_fast_files_digest", lambda t: None)
  agreement.check_comparable(loaded(tok("/a", 1)), loaded(tok("/b", 1)))
  with pytest.raises(ValueError, match=r"--variant: the variant's tokenizer \(/b\) is not the "
                     r"target's \(/a\), so their ids cannot be compared"):
    agreement.check_comparable(loaded(tok("/a", 1)), loaded(tok("/b", 2)))
