"""eval.bench (real model shapes, random weights, an acceptance knob, the roofline) and
eval.trace (the device-kernel summary), at a CPU-sized scale."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from eval import bench, roofline, shapes, trace
from specjax.acceptance import base
from specjax.api import results
from specjax.decoding import speculative
from specjax.sampling import Warp

REPO = Path(__file__).resolve().parent.parent
SMALL = ["--scale", "16", "--batches", "1", "--gammas", "2", "--new_tokens", "8",
         "--prompt_len", "16", "--repeats", "1", "--probe_steps", "2"]


def _pair(name: str, tmp_path, scale: int = 16, quant: str = ""):
  t_cfg, d_cfg = (shapes.scaled(c, scale) for c in shapes.SHAPES[name])
  d_cfg = dict(d_cfg, vocab_size=t_cfg["vocab_size"])
  return (shapes.build(t_cfg, tmp_path / "t", 0, dtype="float32", quant=quant),
          shapes.build(d_cfg, tmp_path / "d", 1, dtype="float32", quant=quant))


@pytest.mark.slow   # 27 s; the README's eval.bench row runs a small bench by default
def test_a_small_run_writes_its_records_and_a_second_run_resumes(tmp_path, capsys):
  out, md = tmp_path / "bench.json", tmp_path / "bench.md"
  argv = [*SMALL, "--shapes", "qwen-coder-1.5b-90m", "--peak", "0.1,1",
          "--output_json", str(out), "--output_md", str(md)]
  assert bench.main(argv) == 0
  data = json.loads(out.read_text())
  (record,) = data["records"]
  assert data["environment"]["device"] == jax.devices()[0].device_kind
  assert record["shape"] == "qwen-coder-1.5b-90m" and record["batch"] == 1
  assert record["target_params"] > record["draft_params"] > 0
  timings = ("ar_ms_per_step", "target_step_ms", "draft_step_ms", "roofline_pct", "ar_compile_s")
  assert all(np.isfinite(record[k]) for k in timings), record     # values: not asserted on
  assert record["floor_ms"] > 0
  (sd,) = record["sd"]
  assert sd["gamma"] == 2 and 1 <= sd["tau"] <= 3 and np.isfinite(sd["ms_per_token"])
  assert sd["expected_tau"] == pytest.approx(1 + 0.8 + 0.64)
  assert "| qwen-coder-1.5b-90m | 1 |" in md.read_text()
  capsys.readouterr()
  assert bench.main(argv) == 0                    # resumed: nothing left to measure
  assert "already, skipped" in capsys.readouterr().err
  assert len(json.loads(out.read_text())["records"]) == 1
  assert bench.main([*argv, "--quant", "int8"]) == 0          # int8 weights: a case of its own
  first, int8 = json.loads(out.read_text())["records"]
  assert int8["quant"] == "int8" and first["quant"] is None and int8["case"] != first["case"]
  assert int8["weight_bytes"] < 0.6 * first["weight_bytes"]    # int8 bytes, not bfloat16
  assert "| qwen-coder-1.5b-90m | 1 | default | int8 |" in md.read_text()


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "gpt-5"], "choose from qwen-coder-1.5b"),
    (["--alpha", "1.5"], "a probability"),
    (["--peak", "fast"], "'TBps,TFLOPs'"),
    (["--batches", "0"], "at least 1"),
    (["--gammas", ""], "--gammas '' has an empty value"),
    (["--new_tokens", "1"], "--new_tokens must be at least 2 (a decoding step is timed as "
                            "the difference of n tokens and 1), got 1"),   # it said "got 0"
    (["--quant", "int8", "--shapes", "qwen2.5-7b,t5-xl"], "t5-xl has no int8 layers"),
])
def test_bad_flags_are_refused_before_any_work(argv, message, tmp_path, capsys):
  assert bench.main([*argv, "--output_json", str(tmp_path / "b.json")]) == 2
  assert message in capsys.readouterr().err
  assert not (tmp_path / "b.json").exists()


def test_a_file_with_cases_left_is_marked_partial_and_ctrl_c_keeps_the_measured(
    tmp_path, monkeypatch, capsys):
  """Probe round 8: an interrupted bench left a file that did not say cases were missing."""
  def measure(name, batch, run, scale, tmp, peak, say):
    if batch == 8 and stop:
      raise KeyboardInterrupt
    return {"case": bench.case_key(name, batch, scale, run), "shape": name, "batch": batch}
  monkeypatch.setattr(bench, "measure", measure)
  monkeypatch.setattr(bench, "table", lambda records: "")
  out, stop = tmp_path / "b.json", True
  argv = [*SMALL, "--shapes", "qwen-coder-1.5b-90m", "--batches", "1,8", "--output_json", str(out)]
  assert bench.main(argv) == 130
  assert ("eval.bench: interrupted with 1 of 2 cases left: " in capsys.readouterr().err)
  data = json.loads(out.read_text())
  assert [r["batch"] for r in data["records"]] == [1] and data["partial"] == {"cases_left": 1}
  stop = False
  assert bench.main(argv) == 0
  data = json.loads(out.read_text())
  assert [r["batch"] for r in data["records"]] == [1, 8] and "partial" not in data


def test_a_file_of_other_results_is_refused(tmp_path, capsys):
  other = tmp_path / "other.json"
  other.write_text('[{"gamma": 3}]')
  assert bench.main([*SMALL, "--output_json", str(other)]) == 2
  assert "is not an eval.bench results file" in capsys.readouterr().err
  assert other.read_text() == '[{"gamma": 3}]'


def test_a_file_measured_with_other_settings_is_refused_not_skipped(tmp_path, capsys):
  """A rerun with another --alpha or --gammas skipped the shape as measured, and a resumed run
  could mix settings in one table that has no column for them."""
  run = bench.Run(prompt_len=16, new_tokens=8, gammas=(2,), alpha=0.8)
  key = bench.case_key("qwen-coder-1.5b-90m", 1, 16, run)
  same = dict(case=key, shape="qwen-coder-1.5b-90m", batch=1, prompt_len=16, new_tokens=8,
              alpha=0.8, sd=[dict(gamma=2)])
  bench.check_same_run([same], run, "b.json")
  other = bench.Run(prompt_len=16, new_tokens=8, gammas=(3,), alpha=0.3)
  assert bench.case_key("qwen-coder-1.5b-90m", 1, 16, other) != key
  with pytest.raises(ValueError, match=r"b.json holds qwen-coder-1.5b-90m b1 measured with "
                     r"prompt_len 16, new_tokens 8, gammas 2, alpha 0.8; this run measures "
                     r"p16/n8/g3/a0.3: use another --output_json"):
    bench.check_same_run([same], other, "b.json")


# qwen2.5-7b's pair is built by test_step_cost_counts_what_a_decoding_step_reads below.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "qwen2.5-7b"
                                  else n for n in shapes.SHAPES])
def test_every_shape_scales_to_a_consistent_model(name, tmp_path):
  for cfg in shapes.SHAPES[name]:
    for n in (1, 2, 16, 64):
      small = shapes.scaled(cfg, n)
      if cfg["model_type"] == "t5":
        assert small["d_kv"] * small["num_heads"] >= 8
      else:
        assert small["num_attention_heads"] % small["num_key_value_heads"] == 0
  (target, t_params), (draft, d_params) = _pair(name, tmp_path)
  assert target.config.vocab_size == draft.config.vocab_size


def test_step_cost_counts_what_a_decoding_step_reads(tmp_path):
  (target, params), (draft, d_params) = _pair("qwen2.5-7b", tmp_path)      # untied / tied
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
  table = params["token_embed"]["embedding"]
  cfg = target.config
  cost = roofline.step_cost(target, params, batch=2, positions=10)
  # An untied table is gathered (2 rows), not read whole; the head is read whole.
  assert cost["weight_bytes"] == nbytes(params) - table.nbytes + 2 * table.nbytes // table.shape[0]
  assert cost["cache_bytes"] == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 10 * 2 * 4
  tied = roofline.step_cost(draft, d_params, batch=1, positions=10)
  assert tied["weight_bytes"] == nbytes(d_params)          # the table is the head: read whole
  assert roofline.floor_s(cost, (1e12, 1e30)) == pytest.approx(
      (cost["weight_bytes"] + cost["cache_bytes"]) / 1e12)
  assert roofline.floor_s(cost, (1e30, 1e9)) == pytest.approx(cost["flops"] / 1e9)
  assert roofline.floor_s(cost, None) is None


def test_int8_step_cost_reads_the_int8_output_layer_not_the_table(tmp_path):
  """A tied int8 model keeps the float table for the input lookup (gathered, B rows) and reads
  its int8 copy as the output layer; an untied one reads its int8 head."""
  (target, params), (draft, d_params) = _pair("qwen2.5-7b", tmp_path, quant="int8")
  assert draft.config.quant == "int8" and draft.config.tie_word_embeddings
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
  for model, tree in ((target, params), (draft, d_params)):
    table = tree["token_embed"]["embedding"]
    assert tree["lm_head"]["kernel"].dtype == np.int8
    cost = roofline.step_cost(model, tree, batch=1, positions=10)
    assert cost["weight_bytes"] == nbytes(tree) - table.nbytes + table.nbytes // table.shape[0]


def test_t5_step_cost_leaves_the_encoder_out(tmp_path):
  (target, params), _ = _pair("t5-xl", tmp_path)
  cost = roofline.step_cost(target, params, batch=1, positions=4)
  encoder = sum(x.nbytes for x in jax.tree.leaves(params["encoder"]))
  whole = sum(x.nbytes for x in jax.tree.leaves(params))
  assert cost["weight_bytes"] < whole - encoder + 1 and encoder > 0


def test_peaks_come_from_the_device_kind_or_the_flag():
  assert roofline.peaks("NVIDIA H100 80GB HBM3") == (3.35e12, 989e12)
  assert roofline.peaks("NVIDIA H200") == (4.8e12, 989e12)
  assert roofline.peaks("TPU v5 lite") == (0.819e12, 197e12)
  assert roofline.peaks("TPU v5p")[0] == 2.765e12
  assert roofline.peaks("cpu") is None
  assert roofline.peaks("cpu", "1.5,20") == (1.5e12, 20e12)


class _Broken(bench.SetAcceptance):
  """The knob at half its alpha: what a wrong rule looks like to the test below."""

  def verify(self, draft_tokens, draft_len, q_logp, p_logp, keys, rule_state):
    uniforms, _ = base.verify_streams(keys, draft_tokens.shape[1])
    n = base.prefix_accepted(uniforms < self.alpha / 2, draft_len)
    return n, jax.numpy.argmax(base.take_position(p_logp, n), -1).astype(np.int32), rule_state


@pytest.mark.parametrize("rule, holds", [(bench.SetAcceptance(alpha=0.6), True),
                                         (_Broken(alpha=0.6), False)])
def test_the_knob_sets_the_acceptance_rate(rule, holds, tmp_path):
  """32 rows x ~17 blocks x 4 drafts: over 1000 drafts tested, the acceptance rate's standard
  error is under 0.016, so 0.05 holds the knob (3 sigma) and the broken one (alpha 0.3) fails."""
  (target, t_params), (draft, d_params) = _pair("qwen-coder-1.5b-90m", tmp_path, scale=32)
  prompt = bench.prompts(target, 32, 8, 0)
  gen = speculative.generate(target, t_params, draft, d_params, prompt, jax.random.PRNGKey(3),
                             rule=rule, gamma=4, max_new_tokens=48, warp=Warp(temperature=0.0),
                             eos_id=None)
  stats = results.aggregate(results.stats_rows(gen.stats, 32))
  assert stats["verified"] > 1000
  assert (abs(stats["acceptance_rate"] - 0.6) < 0.05) == holds, stats


def test_trace_summary_merges_overlaps_and_counts_gaps():
  events = [("gemm", 0, 10), ("reduce", 5, 10), ("gemm", 30, 10), ("copy", 45, 5)]
  s = trace.summarize(events, steps=2)
  assert s["kernels"] == 4 and s["kernels_per_step"] == 2
  assert s["span_ms"] == pytest.approx(50e-6)
  assert s["busy_pct"] == pytest.approx(100 * (15 + 10 + 5) / 50)      # [0,15] [30,40] [45,50]
  assert [t["name"] for t in s["top"]] == ["gemm", "reduce", "copy"]
  assert trace.summarize([], 1) is None


def test_trace_of_a_backend_without_a_device_plane_is_none():
  if jax.default_backend() != "cpu":
    pytest.skip("XLA:CPU records no device plane")
  assert trace.profile(lambda: jax.numpy.ones(3) + 1, steps=1) is None


CPU_PROFILE = """
import json, jax, jax.numpy as jnp
from eval import trace
w = jnp.ones((256, 512)); x = jnp.ones((4, 256))
f = jax.jit(lambda x, w: jnp.tanh(x @ w).sum(-1))
print(json.dumps(trace.profile(lambda: f(x, w), steps=1)))
"""


def test_trace_reads_xla_cpu_ops_when_the_flag_records_them():
  """With --xla_cpu_enable_xprof_traceme the CPU gets a summary of its ops (numbering cut, the
  executor's own spans left out); the test above is the same call without the flag."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_enable_xprof_traceme=true")
  proc = subprocess.run([sys.executable, "-c", CPU_PROFILE], env=env, cwd=REPO, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  s = json.loads(proc.stdout.strip().splitlines()[-1])
  names = [t["name"] for t in s["top"]]
  assert s["kernels"] >= 1 and s["kernel_ms"] > 0, s
  assert not any(n.startswith(("ThunkExecutor", "SlinkyThreadPool", "end: ")) for n in names)
  assert not any(n.rsplit(".", 1)[-1].isdigit() for n in names), names


@pytest.mark.slow        # 80 s of the default run's 15 minutes; run with -m slow
def test_gpu_check_script_runs_the_bench_on_cpu(tmp_path):
  """tools/gpu_check.sh's flow (the README's accelerator command) on this CPU: ALLOW_CPU, no
  suite, one small shape (also standing in for the 7B one): the defaults, the command-buffer
  flags, int8 weights, then batch 8."""
  # XLA_FLAGS empty: the suite's own compile flags would be recorded as the rows' flags.
  env = {**os.environ, "ALLOW_CPU": "1", "SUITE_S": "0", "BENCH_S": "240", "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "",
         "SHAPES": "qwen-coder-1.5b-90m", "BIG": "qwen-coder-1.5b-90m",
         "BENCH_ARGS": "--scale 32 --new_tokens 4 --prompt_len 8 --repeats 1 --probe_steps 1 "
                       "--gammas 2 --batches 1"}
  proc = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), str(tmp_path / "out")],
                        env=env, capture_output=True, text=True, timeout=400)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  records = json.loads((tmp_path / "out" / "bench.json").read_text())["records"]
  combos = {(r["layers"], r["quant"], r["xla_flags"]) for r in records}
  assert combos == {("unrolled", None, None), ("unrolled", "int8", None),
                    ("unrolled", None, "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL")
                    }, combos
  assert "== done" in proc.stdout
