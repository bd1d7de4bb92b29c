"""eval.startup: the start-up benchmark's bookkeeping, its refusals, cli.setup's compile cache
settings, and one cold + warm pair of probe processes on a tiny T5 (the warm run compiles
nothing: every program comes from the persistent cache)."""

from __future__ import annotations

import gc
import json
import mmap
import shutil
import subprocess
import sys
import time

import jax
import pytest

from eval import startup, startup_probe
from specjax.app import cli


def test_the_decode_command_imports_no_checkpoint_library():
  """orbax.checkpoint is imported where a checkpoint is saved or restored (specjax/checkpoint.py),
  not by every command's start-up."""
  code = "import sys, specjax.decode; print(sorted(m for m in sys.modules if 'orbax' in m))"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout[-2000:], out.stderr[-2000:])


def test_union_of_spans_counts_each_second_once():
  assert startup_probe.union_seconds([]) == 0
  assert startup_probe.union_seconds([(5, 6), (0, 2), (1, 3)]) == 4
  assert startup_probe.union_seconds([(0, 10), (2, 3)]) == 10


def _report(wall: float, trace: float) -> dict:
  phases = {"python": 0.1, "import_jax": 1.0, "import_specjax": 2.0, "config": 0.1, "load": 3.0,
            "encode": 0.1, "generate": 4.0, "decode": 0.2}
  marks, t = {}, 0.0
  for name, seconds in phases.items():
    t += seconds
    marks[name] = t
  return {"phases": phases, "marks": marks, "wall_s": wall, "cpu_s": wall / 2, "tokens": 8, "max_rss_mb": 100.0,
          "weights_mb": 40.0, "largest_mb": 10.0, "load_anon_mb": 60.0, "anon_mb": 70.2,
          "jax": {"totals": {"trace_s": trace, "lower_s": 0.5, "compile_s": 1.5},
                  "programs": {"jit(_run)": {"compile_s": 1.5}}, "cache_requests": 3,
                  "cache_hits": 2}}


def test_rows_medians_table_and_ratios():
  row = startup.row(_report(wall=12.0, trace=1.0))
  assert row["import_s"] == 3.0 and row["load_s"] == pytest.approx(3.1)
  assert row["run_s"] == pytest.approx(1.0)              # generate 4 - (trace + lower + compile)
  assert row["exit_s"] == pytest.approx(12.0 - 10.5) and row["first_s"] == pytest.approx(10.3)
  assert (row["fetched"], row["compiled"]) == (2, 1)
  assert (row["weights_mb"], row["load_anon_mb"], row["anon_mb"]) == (40, 60, 70)
  assert startup.row({**_report(12.0, 1.0), "anon_mb": None})["anon_mb"] == "-"
  runs = [{"case": c, "cache": k, **startup.row(_report(w, 1.0))}
          for c, k, w in [("deep scan", "cold", 13.0), ("shallow scan", "cold", 10.0),
                          ("deep scan", "cold", 11.0), ("shallow scan", "cold", 10.0)]]
  rows = startup.medians(runs)
  assert [(r["case"], r["whole_s"]) for r in rows] == [("deep scan", 12.0), ("shallow scan", 10.0)]
  assert startup.ratios(rows, [("deep scan", "shallow scan")]) == [
      "deep scan / shallow scan cold: 1.20x wall, 1.20x CPU"]
  lines = startup.table(rows).splitlines()
  assert lines[0].startswith("| case | cache | whole_s |") and "| deep scan | cold | 12.00 |" in lines[2]


@pytest.mark.parametrize("argv,message", [
    (["--repeats", "0"], "--repeats must be at least 1, got 0"),
    (["--case", "no-name"], "--case takes NAME=OVERRIDES"),
    (["--output_md", "/nonexistent/dir/t.md"], "does not exist")])
def test_refusals_before_any_run(argv, message, monkeypatch, capsys):
  monkeypatch.setattr(startup, "measure", lambda *a, **k: pytest.fail("ran probes"))
  assert startup.main(argv) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and message in err, err


@pytest.fixture
def restored_jax_cache_config():
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
  old = {n: getattr(jax.config, n) for n in names}
  yield
  for n, v in old.items():
    jax.config.update(n, v)
  gc.unfreeze()


def test_setup_persists_every_program_where_told(tmp_path, monkeypatch, restored_jax_cache_config):
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "cc"))
  cli.setup()
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "cc")
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
  assert gc.get_freeze_count() > 0


def _tiny_t5_checkpoint(root):
  import inspect
  import string
  import textwrap

  from specjax.data.tokenizer import train_sentencepiece
  from specjax.models import hf_import
  from specjax.models.t5 import T5, T5Config
  source = inspect.getsource(string) + inspect.getsource(textwrap)
  spm = train_sentencepiece(source[:12000].split("\n\n"), root / "spm.model", model_type="bpe",
                            vocab_size=400, num_threads=1)
  model = T5(T5Config(vocab_size=400, d_model=32, d_kv=8, d_ff=64, num_heads=4, num_layers=1,
                      num_decoder_layers=1))
  path = hf_import.save_model(model, model.init_params(jax.random.PRNGKey(0)), root / "t5")
  shutil.copy(spm, path / "spm.model")
  return path


def test_cold_then_warm_probe_on_a_tiny_t5(tmp_path, monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  path = _tiny_t5_checkpoint(tmp_path)
  case = startup.Case("tiny", (f"--config.target.checkpoint={path}", "--config.draft.checkpoint=",
                               "--config.target.dtype=float32",
                               "--config.decode.max_new_tokens=4"))
  cold, warm = startup.measure([case], "t5_xl_small.py", "def f(x):", 1, tmp_path)
  for run in (cold, warm):
    assert run["tokens"] == 4 and run["whole_s"] >= run["first_s"] > run["import_s"] > 0, run
    assert any(name.startswith("jit(") for name in run["programs"]), run["programs"]
  assert cold["compiled"] > 0 and cold["fetched"] == 0
  assert warm["compiled"] == 0 and warm["fetched"] == cold["compiled"]    # nothing compiled again
  assert json.loads((tmp_path / "probe_0_0_warm.json").read_text())["method"] == "autoregressive"


def test_the_probe_samples_anonymous_memory():
  anon = startup_probe.AnonPeak()
  if anon.peak is None:
    pytest.skip("no /proc/self/status")
  # 64 MiB of fresh anonymous pages, touched: a mapping of its own, since a heap block could
  # reuse pages the worker process already holds (freed by earlier tests, still resident)
  block = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  block[::4096] = b"x" * len(block[::4096])
  time.sleep(0.1)                        # a few samples while it is held
  block.close()
  assert anon.take() >= anon.now() + 50


@pytest.mark.slow   # writes a 355M-param GPT-2 (1.4 GB) and runs it six times (~70 s)
def test_gpt2_memory_runs_each_weight_format_within_the_loaders_bound(tmp_path):
  """`eval.startup --gpt2_memory DIR` (docs/results.md): float32, bfloat16 and int8 loads of a
  GPT-2 Medium-shaped model decode within weights + largest tensor + 512 MiB, loading and
  decoding (int8: each layer's kernel quantized as it is read, quant.put_layers; stacking the
  float32 MLP kernels first put the int8 load 150 MiB over)."""
  out = tmp_path / "rows.json"
  assert startup.main(["--gpt2_memory", str(tmp_path / "gpt2"), "--output_json", str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert sorted({r["case"] for r in rows}) == ["bf16", "f32", "int8"]
  weights = {"f32": 1354, "bf16": 677, "int8": 540}                   # MiB, 355M params
  for r in rows:
    assert abs(r["weights_mb"] - weights[r["case"]]) < 20, r
    assert r["load_anon_mb"] <= r["weights_mb"] + r["largest_mb"] + 512, r
    assert r["anon_mb"] <= r["weights_mb"] + r["largest_mb"] + 512, r


def test_one_written_model_per_run(tmp_path, capsys):
  argv = ["--t5_memory", str(tmp_path / "a"), "--gpt2_memory", str(tmp_path / "b")]
  assert startup.main(argv) == 2
  assert "--t5_memory and --gpt2_memory: give one of them per run" in capsys.readouterr().err
  assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow   # writes a 185M-param T5 (0.7 GB) and runs it four times (~30 s)
def test_t5_memory_runs_the_bfloat16_t5_within_the_loaders_bound(tmp_path, capsys):
  """`eval.startup --t5_memory DIR` (README, docs/results.md): both layouts decode, the weights
  are the bfloat16 model's, and loading and decoding stay within weights + largest tensor +
  512 MiB (decoding/state.py's CPU loop options: no float32 copy of the weights, scanned or
  unrolled)."""
  out = tmp_path / "rows.json"
  assert startup.main(["--t5_memory", str(tmp_path / "t5"), "--output_json", str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert sorted({r["case"] for r in rows}) == ["bf16 auto", "bf16 scan"]
  for r in rows:
    assert 340 <= r["weights_mb"] <= 370, r                  # 185M params in 2 bytes
    assert r["load_anon_mb"] <= r["weights_mb"] + r["largest_mb"] + 512, r
    assert r["anon_mb"] <= r["weights_mb"] + r["largest_mb"] + 512, r


def test_sigterm_stops_the_probe_and_removes_its_directory(monkeypatch, capsys):
  """SIGTERM while a probe runs: the probe is killed (it outlived its parent and wrote into a
  removed directory), the temporary directory is removed and the run exits 130."""
  import os
  import signal
  import threading
  seen = {}

  def measure(cases, config, prompt, repeats, work):
    seen["work"] = work
    seen["proc"] = proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    startup.wait(proc, timeout=30)
    raise AssertionError("SIGTERM did not stop the wait")

  monkeypatch.setattr(startup, "measure", measure)
  monkeypatch.setattr(startup, "check_outputs", lambda *a: None)
  monkeypatch.setattr(startup, "cases_from", lambda *a: [])
  before = signal.getsignal(signal.SIGTERM)
  assert startup.main(["--config", "tiny.py"]) == 130
  assert "eval.startup: interrupted" in capsys.readouterr().err
  assert seen["proc"].returncode is not None and not seen["work"].exists()
  assert signal.getsignal(signal.SIGTERM) is before
