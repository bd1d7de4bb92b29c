"""Probe round 5: a killed decode run's progress file (OUT.partial) resumes only as specjax wrote
it, and a change of what is printed (decode.stream) does not refuse it."""

from __future__ import annotations

import pytest

from specjax.app import progress

SETTINGS = {"decode": {"gamma": 4, "stream": True}, "prompts": ["a", "b"]}


def _row(prompt: str, **drop) -> dict:
  row = {"prompt": prompt, "text": "x", "tokens": [1], "stats": {}}
  return {k: v for k, v in row.items() if k not in drop}


@pytest.mark.parametrize("rows, why", [
    ([_row("a"), _row("b"), _row("a")], "3 results for 2 prompts"),       # was accepted
    ([_row("a", tokens=0)], "result 0 lacks tokens"),                     # was "missing key"
    ([_row("b")], "result 0 is for another prompt than prompt 0"),
    ({"a": 1}, "no list of results for 2 prompts"),
])
def test_a_progress_file_specjax_did_not_write_is_refused(tmp_path, rows, why):
  kept = progress.Progress(tmp_path / "out.json", SETTINGS)
  kept.save(rows)
  with pytest.raises(progress.ProgressError, match=f"out.json.partial is not a run's progress "
                     f"as specjax.decode writes it \\({why}\\): delete it to start over"):
    kept.rows()


def test_the_same_run_resumes_whether_it_streams_or_not(tmp_path):
  progress.Progress(tmp_path / "out.json", SETTINGS).save([_row("a")])
  quiet = {**SETTINGS, "decode": {"gamma": 4, "stream": False}}
  assert progress.Progress(tmp_path / "out.json", quiet).rows() == [_row("a")]
  other = {**SETTINGS, "decode": {"gamma": 5, "stream": True}}
  with pytest.raises(progress.ProgressError, match="differs in decode.gamma"):
    progress.Progress(tmp_path / "out.json", other).rows()


def test_help_texts_keep_their_line_continuations():
  """A module docstring (what --help prints) that shows a command continued with a backslash is
  a raw string: `python -m specjax.decode --help` printed the two lines run together."""
  import ast
  from pathlib import Path
  root = Path(__file__).resolve().parent.parent
  bad = []
  for path in sorted([*root.glob("specjax/**/*.py"), *root.glob("eval/*.py"),
                      *root.glob("train/*.py")]):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) else None
    if doc is None or not isinstance(getattr(doc, "value", None), ast.Constant):
      continue
    source = ast.get_source_segment(path.read_text(encoding="utf-8"), doc) or ""
    if " \\\n" in source and "\\\n" not in doc.value.value:
      bad.append(str(path.relative_to(root)))
  assert not bad, f"make these module docstrings raw (r\"\"\"): {bad}"


def test_a_training_run_refuses_a_verifier_workdir(tmp_path):
  """train.pretrain / train.distill replaced a SPRINTER verifier's params/ without a word
  (train.verifier already refused the reverse)."""
  from specjax.app import training
  from specjax.app.config import ConfigError, load_config
  (tmp_path / "verifier.json").write_text("{}")
  with pytest.raises(ConfigError, match=r"holds a SPRINTER verifier \(verifier.json\): a training "
                                        r"run there would replace its params/"):
    training.run(load_config("distill_tiny.py"), str(tmp_path), pretrain=True)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["verifier.json"]


def test_the_stats_line_says_when_blocks_ran_past_a_stop_string():
  """"6 tokens ... tau 3.00, blocks 6" read as a contradiction: the counters count the decoded
  tokens, the first number the ones returned."""
  from specjax.app import runner
  times = {"tokens": 6, "decode_s": 0.5, "ms_per_token": 83.3, "compile_s": 1.0}
  stats = {"emitted": 18, "blocks": 6, "block_efficiency": 3.0}
  line = runner.summary_line(stats, times, 2.0)
  assert line.startswith("stats: 6 tokens (18 decoded: blocks ran past a stop string), decode")
  assert runner.summary_line({**stats, "emitted": 6}, times, 2.0).startswith(
      "stats: 6 tokens, decode")


def test_a_config_with_a_draft_and_no_rule_section_decodes_with_exact_sd():
  """It decoded with the target alone without a word (specjax.generate: rule=None is exact)."""
  from specjax.app import builders, methods
  from specjax.app.config import load_config
  config = load_config("tiny.py")
  del config["rule"]
  assert methods.method_name(config) == "speculative"
  assert builders.rule(config).rule_name == "exact"
  assert methods.method_name(load_config("tiny.py", ["--config.rule.name="])) == "autoregressive"


def test_a_recipe_refuses_the_users_own_loss_and_mixture():
  """--config.distill.recipe=supkd --config.distill.loss=tvd trained fkl without a word."""
  from specjax.app import training
  from specjax.app.config import ConfigError, load_config
  flags = ["--config.distill.recipe=supkd", "--config.distill.loss=tvd",
           "--config.distill.lambda2=0.7"]
  with pytest.raises(ConfigError, match=r"--config.distill.loss, --config.distill.lambda2 has no "
                     r"effect with --config.distill.recipe=supkd \(it trains with loss fkl, "
                     r"lambda1 1, lambda2 0\): drop it, or choose"):
    training.check_overrides_apply(load_config("distill_tiny.py", flags), flags, pretrain=False)
  flags = ["--config.distill.loss=tvd", "--config.distill.lambda2=0.7"]
  training.check_overrides_apply(load_config("distill_tiny.py", flags), flags, pretrain=False)


@pytest.mark.parametrize("override, message", [
    ("--config.train.final_lr_ratio=-1", r"final_lr_ratio must be in \[0, 1\]"),   # lr < 0
    ("--config.train.final_lr_ratio=nan", r"final_lr_ratio must be in \[0, 1\]"),
    ("--config.train.decay_start=-5", "decay_start must be >= 0"),
    ("--config.train.seed=-1", r"seed must be a whole number in \[0, 4294967295\], got -1"),
])
def test_schedules_that_would_train_backwards_are_refused(override, message):
  """A negative final ratio trained by gradient ascent once the decay began; nan was reported as
  a divergence with advice about the learning rate."""
  from specjax.app import builders
  from specjax.app.config import ConfigError, load_config
  with pytest.raises(ConfigError, match=message):
    builders.train_config(load_config("distill_tiny.py", [override]))


def test_markov_ids_beyond_the_models_vocabulary_are_refused():
  """--config.data.vocab_size=1000 with 128-id models ended as "training diverged ... lower the
  learning rate"."""
  import types
  from specjax.app import builders, fit
  from specjax.app.config import ConfigError, load_config
  models = [types.SimpleNamespace(vocab_size=128), types.SimpleNamespace(vocab_size=256)]
  spec = builders.data_spec(load_config("distill_tiny.py", ["--config.data.vocab_size=1000"]))
  with pytest.raises(ConfigError, match=r"--config.data.vocab_size=1000: the Markov data's ids "
                                        r"must fit the models' vocabulary of 128"):
    fit.check_data_vocab(spec, models)
  fit.check_data_vocab(builders.data_spec(load_config("distill_tiny.py")), models)


def test_a_run_killed_before_its_first_checkpoint_starts_its_log_again(tmp_path):
  """Its step-0 eval record was written twice."""
  import json
  from specjax.distill.metrics_log import MetricsLog
  log = MetricsLog(tmp_path, show=lambda record: None)
  log.resume(0)
  assert not (tmp_path / "metrics.jsonl").exists()          # a first run: nothing to mark
  log.write(0, {"eval_alpha": 0.5, "event": "before training"})
  log.write(1, {"loss": 2.0})                               # then killed, no checkpoint
  log.resume(0)
  log.write(0, {"eval_alpha": 0.5, "event": "before training"})
  lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert lines == [{"event": "restart", "step": 0},
                   {"step": 0, "eval_alpha": 0.5, "event": "before training"}]


def test_a_verifier_trained_on_another_draft_is_refused(tmp_path):
  """It scored another draft's hidden states without a word (verifier.json recorded no draft)."""
  from specjax.app import builders, methods
  from specjax.app.config import ConfigError, load_config
  config = load_config("sprinter_tiny.py")
  draft = builders.model_name(config, "draft")
  assert draft == "builtin:tiny/draft_distilled"
  meta = {"models": {"target": "builtin:tiny/target", "draft": draft}}
  methods.check_verifier_draft(meta, draft, "W", "draft")
  methods.check_verifier_draft({}, "builtin:tiny/draft", "W", "draft")     # saved before: taken
  with pytest.raises(ConfigError, match=r"the verifier in W was trained on the hidden states of "
                     r"the draft builtin:tiny/draft_distilled, and this run's draft is "
                     r"builtin:tiny/draft: set --config.draft.checkpoint"):
    methods.check_verifier_draft(meta, "builtin:tiny/draft", "W", "draft")
  (tmp_path / "d").mkdir()
  local = load_config("sprinter_tiny.py", [f"--config.draft.checkpoint={tmp_path}/d/../d"])
  assert builders.model_name(local, "draft") == str((tmp_path / "d").resolve())


def test_the_python_api_refuses_a_verifier_trained_on_another_draft(tmp_path, monkeypatch):
  """specjax.generate(rule='sprinter') scored any same-width draft's hidden states: the verifier
  now records its draft's checkpoint directory, which the loaded draft must come from."""
  import types
  from specjax.api import decoder
  from specjax.api.errors import UsageError
  from specjax.app import resolve, sprinter_train
  from specjax.app.config import load_config
  config = load_config("sprinter_tiny.py", [f"--config.draft.checkpoint={tmp_path}/d"])
  monkeypatch.setattr(resolve, "checkpoint_dir", lambda spec: tmp_path / "d" / ".." / "d")
  meta = {"models": sprinter_train._models(config)}
  assert meta["models"]["draft_dir"] == str((tmp_path / "d").resolve())
  loaded_from = lambda path: types.SimpleNamespace(path=path)
  decoder._check_verifier_draft(meta, loaded_from(tmp_path / "d"), "W")
  decoder._check_verifier_draft({}, loaded_from(tmp_path / "e"), "W")     # saved before: taken
  with pytest.raises(UsageError, match=f"the verifier in W was trained on the hidden states of "
                     f"the draft in {tmp_path / 'd'}, and this draft was loaded from "
                     f"{tmp_path / 'e'}: pass draft=specjax.load"):
    decoder._check_verifier_draft(meta, loaded_from(tmp_path / "e"), "W")
