"""Start-up of a decoding run: import, config, load, trace / lower / compile per program, the
generation, exit and peak host memory, each run in a fresh process, cold (an empty persistent
compilation cache) and warm (the same cache again).

    python -m eval.startup --config tiny.py --output_json startup.json --output_md startup.md
    python -m eval.startup --config t5_xl_small.py --config.target.checkpoint=DIR \\
        --config.draft.checkpoint=DIR --config.target.dtype=float32 --config.draft.dtype=float32
    python -m eval.startup --t5_benchmark /tmp/t5_depth      # issue 14's depth benchmark
    python -m eval.startup --t5_memory /tmp/t5_memory        # a bfloat16 T5's memory
    python -m eval.startup --gpt2_memory /tmp/gpt2_memory    # GPT-2's, by weight format

Every case runs `eval.startup_probe` (what `specjax.decode` does for one prompt, timed phase by
phase) --repeats times as a cold run followed by a warm one, each repeat with a new empty cache
(JAX_COMPILATION_CACHE_DIR); the cases alternate within a repeat so that a busy machine slows
them alike. `whole_s` is the process's wall time from spawn to exit; `first_s` the time until
the generation returned (what a user waits for; the whole generation is one compiled call).
The table holds medians over repeats.

--t5_benchmark DIR writes two random T5 v1.1 checkpoints of T5 Small's width (d_model 512,
6 heads x 64, d_ff 1024, a 400-piece BPE tokenizer) into DIR, one of XL depth (24 + 24 layers)
and one of 2 + 2, and times target-only decoding of 8 tokens with each, in the scanned layout
(--config.target.layers=scan) and the default (auto: unrolled on CPU), and speculative decoding
with the deep target and the shallow draft.

--t5_memory DIR writes one random T5 of 185M params (T5_MEMORY: 4 + 4 layers, d_model 1024,
vocabulary 32128, untied head) into DIR and runs it loaded as bfloat16, scanned and unrolled:
the rows' anonymous-memory columns against the weights' MiB show what loading and decoding hold.
--gpt2_memory DIR does the same for a random GPT-2 of GPT-2 Medium's shape (GPT2_MEMORY: 355M
params, tied head, float32 safetensors) loaded as float32, bfloat16 and int8.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import multiprocessing
import os
import pathlib
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from eval import flags
from specjax.app import cli, outputs
from specjax.app.config import input_paths, load_config

PHASES = ("python", "import", "config", "load", "trace", "lower", "compile", "run", "exit")
COLUMNS = ("case", "cache", "whole_s", "cpu_s", "first_s", *(f"{p}_s" for p in PHASES), "fetched",
           "compiled", "rss_mb", "weights_mb", "largest_mb", "load_anon_mb", "anon_mb")
T5_WIDTH = dict(d_model=512, d_kv=64, d_ff=1024, num_heads=6, feed_forward_proj="gated-gelu",
                tie_word_embeddings=False)
T5_DEPTHS = {"deep": 24, "shallow": 2}
# --t5_memory: 185M params (354 MiB in bfloat16), most of them in 8 layers and an untied head
T5_MEMORY = dict(vocab_size=32128, d_model=1024, d_kv=64, num_heads=16, d_ff=2816,
                 feed_forward_proj="gated-gelu", num_layers=4, num_decoder_layers=4,
                 tie_word_embeddings=False)
# --gpt2_memory: GPT-2 Medium's shape, 355M params (1.4 GB in float32), the table tied
GPT2_MEMORY = dict(vocab_size=50257, n_positions=1024, d_model=1024, num_layers=24, num_heads=16,
                   d_ff=4096)
# Per family: the config its probes run under and the weight formats they load it in.
MEMORY = {
    "t5": ("t5_xl_small.py", {"bf16 scan": ("--config.target.dtype=bfloat16",
                                            "--config.target.layers=scan"),
                              "bf16 auto": ("--config.target.dtype=bfloat16",
                                            "--config.target.layers=auto")}),
    "gpt2": ("tiny.py", {f"{name}": (f"--config.target.dtype={dtype}",
                                     f"--config.target.quant={quant}",
                                     "--config.target.layout=in_out")
                         for name, dtype, quant in (("f32", "float32", ""),
                                                    ("bf16", "bfloat16", ""),
                                                    ("int8", "float32", "int8"))}),
}


class ProbeError(ValueError):
  """A probe process that failed or ran too long (one line: exit status 2 at the CLI)."""


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  overrides: tuple[str, ...] = ()


def probe_command(config: str, prompt: str, case: Case, out: pathlib.Path) -> list[str]:
  return [sys.executable, "-m", "eval.startup_probe", "--config", config, "--prompt", prompt,
          "--out", str(out), *case.overrides]


def run_probe(command: list[str], compile_cache: pathlib.Path, timeout: float) -> dict:
  """One fresh process: the probe's report plus its wall time from spawn to exit and the CPU
  seconds it used (user + system: less moved than wall time by other work on the machine)."""
  out = pathlib.Path(command[command.index("--out") + 1])
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(compile_cache)}
  env.pop("SPECJAX_DEBUG", None)
  with open(out.with_suffix(".log"), "w+") as log:
    start = time.time()
    proc = subprocess.Popen(command, env={**env, "SPECJAX_STARTUP_T0": repr(start)},
                            stdout=log, stderr=log)
    status, usage = wait(proc, timeout)
    wall = time.time() - start
    if status != 0:
      log.seek(0)
      last = (log.read().strip().splitlines() or ["(no output)"])[-1]
      raise ProbeError(f"the probe failed ({' '.join(command[2:4])} ...): {last}")
  return {**json.loads(out.read_text()), "wall_s": wall,
          "cpu_s": usage.ru_utime + usage.ru_stime}


def wait(proc: subprocess.Popen, timeout: float):
  """(exit status, resource usage) of a child, killed past `timeout` seconds."""
  deadline = time.time() + timeout
  try:
    while time.time() < deadline:
      pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
      if pid:
        proc.returncode = os.waitstatus_to_exitcode(status)
        return proc.returncode, usage
      time.sleep(0.02)
  except BaseException:         # Ctrl-C, SIGTERM: the probe must not outlive its directory
    proc.kill()
    proc.wait()
    raise
  proc.kill()
  proc.wait()
  raise ProbeError(f"the probe ran past {timeout:.0f} s and was stopped")


def row(report: dict) -> dict:
  """A probe report -> the table's columns (seconds)."""
  phases, marks, jax_ = report["phases"], report["marks"], report["jax"]
  totals = jax_["totals"]
  traced = totals.get("trace_s", 0.0) + totals.get("lower_s", 0.0) + totals.get("compile_s", 0.0)
  fetched = jax_.get("cache_hits", 0)
  return {"whole_s": report["wall_s"], "cpu_s": report["cpu_s"], "first_s": marks["generate"],
          "python_s": phases["python"],
          "import_s": phases["import_jax"] + phases["import_specjax"],
          "config_s": phases["config"], "load_s": phases["load"] + phases["encode"],
          "trace_s": totals.get("trace_s", 0.0), "lower_s": totals.get("lower_s", 0.0),
          "compile_s": totals.get("compile_s", 0.0),
          "run_s": max(phases["generate"] - traced, 0.0),
          "exit_s": report["wall_s"] - marks["decode"],
          "fetched": fetched, "compiled": jax_.get("cache_requests", 0) - fetched,
          "rss_mb": round(report["max_rss_mb"]), "tokens": report["tokens"],
          **{k: _mb(report.get(k)) for k in ("weights_mb", "largest_mb", "load_anon_mb",
                                             "anon_mb")},
          "decode_s": phases["decode"], "programs": jax_["programs"]}


def measure(cases: list[Case], config: str, prompt: str, repeats: int, work: pathlib.Path,
            timeout: float = 600) -> list[dict]:
  """Per repeat and case: a cold run on an empty cache, then a warm one; returns every run."""
  runs = []
  for r in range(repeats):
    for cache in ("cold", "warm"):
      for i, case in enumerate(cases):
        out = work / f"probe_{r}_{i}_{cache}.json"
        report = run_probe(probe_command(config, prompt, case, out), work / f"cache_{r}_{i}",
                           timeout)
        runs.append({"case": case.name, "cache": cache, "repeat": r, **row(report)})
        print(f"{case.name:>24} {cache}: {runs[-1]['whole_s']:.2f} s", flush=True)
  return runs


def medians(runs: list[dict]) -> list[dict]:
  """One row per (case, cache) in first-seen order: the median of every numeric column."""
  keys = list(dict.fromkeys((r["case"], r["cache"]) for r in runs))
  out = []
  for case, cache in keys:
    same = [r for r in runs if (r["case"], r["cache"]) == (case, cache)]
    numeric = [c for c in COLUMNS[2:] if isinstance(same[0][c], (int, float))]
    out.append({"case": case, "cache": cache,
                **{c: statistics.median(r[c] for r in same) if c in numeric else same[0][c]
                   for c in COLUMNS[2:]}})
  return out


COUNTS = ("fetched", "compiled", "rss_mb", "weights_mb", "largest_mb", "load_anon_mb", "anon_mb")


def _mb(value) -> int | str:
  return "-" if value is None else round(value)


def table(rows: list[dict]) -> str:
  fmt = lambda c, v: str(v) if isinstance(v, str) else f"{v:g}" if c in COUNTS else \
      f"{v:.2f}" if isinstance(v, float) else str(v)
  lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  return "\n".join(lines + ["| " + " | ".join(fmt(c, r[c]) for c in COLUMNS) + " |"
                            for r in rows])


def ratios(rows: list[dict], pairs: list[tuple[str, str]]) -> list[str]:
  """'A / B cold: 1.08x wall, 1.05x CPU' lines: whole cold and warm runs of each pair."""
  by = {(r["case"], r["cache"]): r for r in rows}
  return [f"{a} / {b} {cache}: {by[(a, cache)]['whole_s'] / by[(b, cache)]['whole_s']:.2f}x "
          f"wall, {by[(a, cache)]['cpu_s'] / by[(b, cache)]['cpu_s']:.2f}x CPU"
          for a, b in pairs for cache in ("cold", "warm") if (a, cache) in by and (b, cache) in by]


def _written(writer, root: pathlib.Path):
  """writer(root) run in a spawned process first, then here (finding its files): the writer's
  peak memory stays out of the probes' peak RSS, which Linux carries across fork and exec."""
  child = multiprocessing.get_context("spawn").Process(target=writer, args=(root,))
  child.start()
  child.join()
  if child.exitcode:
    raise ProbeError(f"writing the random checkpoints into {root} failed (exit {child.exitcode})")
  return writer(root)


def _spm(root: pathlib.Path) -> pathlib.Path:
  """A 400-piece BPE of stdlib text at root/spm.model (the random T5s' tokenizer)."""
  import inspect
  import string
  import textwrap

  from specjax.data.tokenizer import train_sentencepiece
  root.mkdir(parents=True, exist_ok=True)
  if (root / "spm.model").exists():
    return root / "spm.model"
  source = inspect.getsource(string) + inspect.getsource(textwrap)
  return train_sentencepiece(source[:12000].split("\n\n"), root / "spm.model", model_type="bpe",
                             vocab_size=400, num_threads=1)


def write_t5_pair(root: pathlib.Path) -> dict[str, pathlib.Path]:
  """Random T5 checkpoints of T5_WIDTH at T5_DEPTHS (HF layout, spm.model beside), reused when
  DIR already holds them."""
  import jax

  from specjax.models import hf_import
  from specjax.models.t5 import T5, T5Config
  dirs = {name: root / name for name in T5_DEPTHS}
  if all((d / "model.safetensors").exists() for d in dirs.values()):
    return dirs
  spm = _spm(root)
  for name, depth in T5_DEPTHS.items():
    model = T5(T5Config(vocab_size=400, num_layers=depth, num_decoder_layers=depth, **T5_WIDTH))
    hf_import.save_model(model, model.init_params(jax.random.PRNGKey(depth)), dirs[name])
    shutil.copy(spm, dirs[name] / "spm.model")
  return dirs


def write_memory_model(family: str, root: pathlib.Path) -> pathlib.Path:
  """A random model of the family's memory shape (T5_MEMORY, GPT2_MEMORY; HF layout, float32
  safetensors, spm.model beside: a larger embedding than the tokenizer is fine) in
  root/FAMILY_memory, reused when DIR already holds it."""
  import jax

  from specjax.models import hf_import
  path = root / f"{family}_memory"
  if not (path / "model.safetensors").exists():
    if family == "t5":
      from specjax.models.t5 import T5, T5Config
      model = T5(T5Config(**T5_MEMORY))
    else:
      from specjax.models.decoder import Decoder, DecoderConfig
      model = Decoder(DecoderConfig(**GPT2_MEMORY))
    hf_import.save_model(model, jax.jit(model.init_params)(jax.random.PRNGKey(0)), path)
    shutil.copy(_spm(root), path / "spm.model")
  return path


def memory_cases(family: str, path: pathlib.Path) -> list[Case]:
  """Target-only runs of the family's memory model in each of MEMORY's weight formats: the
  loader's and the decoding loop's anonymous memory against the weights."""
  common = ("--config.decode.max_new_tokens=4", f"--config.target.checkpoint={path}",
            "--config.draft.checkpoint=")
  return [Case(name, (*common, *flags_)) for name, flags_ in MEMORY[family][1].items()]


def t5_cases(dirs: dict[str, pathlib.Path]) -> list[Case]:
  """Target-only runs of each depth in both layouts, and SD with the deep target."""
  common = ("--config.decode.max_new_tokens=8", "--config.target.dtype=float32",
            "--config.draft.dtype=float32")
  cases = [Case(f"{name} {layers}", (*common, f"--config.target.checkpoint={dirs[name]}",
                                     "--config.draft.checkpoint=",
                                     f"--config.target.layers={layers}"))
           for layers in ("scan", "auto") for name in T5_DEPTHS]
  cases.append(Case("sd deep+shallow scan", (
      *common, f"--config.target.checkpoint={dirs['deep']}",
      f"--config.draft.checkpoint={dirs['shallow']}", "--config.target.layers=scan",
      "--config.draft.layers=scan")))
  return cases


DEFAULT_CONFIG = "tiny.py"


def parse_args(argv):
  p = cli.parser("python -m eval.startup", __doc__)
  p.add_argument("--config", default=DEFAULT_CONFIG)
  p.add_argument("--prompt", default="def f(x):")
  p.add_argument("--case", action="append", default=[],
                 help="NAME=OVERRIDES: a case with its own --config.* flags (repeatable)")
  p.add_argument("--t5_benchmark", help="DIR for the random T5 pair of the depth benchmark")
  p.add_argument("--t5_memory", help="DIR for the random bfloat16-loaded T5 of the memory cases")
  p.add_argument("--gpt2_memory", help="DIR for the random GPT-2 of the memory cases")
  p.add_argument("--repeats", type=int, default=1)
  p.add_argument("--output_json")
  p.add_argument("--output_md")
  return cli.parse(p, argv)


def cases_from(args, overrides: list[str]) -> list[Case]:
  if args.t5_benchmark:
    return t5_cases(_written(write_t5_pair, pathlib.Path(args.t5_benchmark).absolute()))
  family = _memory_family(args)
  if family:
    root = pathlib.Path(getattr(args, f"{family}_memory")).absolute()
    return memory_cases(family, _written(functools.partial(write_memory_model, family), root))
  cases = []
  for text in args.case:
    name, sep, flags_ = text.partition("=")
    if not sep or not name:
      raise ValueError(f"--case takes NAME=OVERRIDES, e.g. 'scan=--config.target.layers=scan'; "
                       f"got {text!r}")
    cases.append(Case(name, (*overrides, *shlex.split(flags_))))
  return cases or [Case("run", tuple(overrides))]


def check_no_case_flags(args, overrides: list[str], flag: str) -> None:
  """Refuse --config, --case and --config.* overrides with `flag` (--t5_benchmark, --t5_memory,
  --gpt2_memory), whose cases and config are fixed: they would be ignored."""
  ignored = ([f"--config {args.config}"] if args.config != DEFAULT_CONFIG else []) + \
      [f"--case {c}" for c in args.case] + list(overrides)
  if ignored:
    raise ValueError(f"{flag} runs fixed cases under a config of its own, and would ignore "
                     f"{' '.join(ignored)}: drop {'it' if len(ignored) == 1 else 'them'}, or "
                     f"leave out {flag} to time that config")


def _memory_family(args) -> str | None:
  return next((f for f in MEMORY if getattr(args, f"{f}_memory")), None)


def check_outputs(config: str, cases: list[Case], outs: dict) -> None:
  """Refuse an output (flag -> path or None) that is an input of a case (its config file, a
  checkpoint) or another output's file."""
  inputs = {}
  for case in cases:
    inputs.update(input_paths(config, load_config(config, list(case.overrides))))
  for flag, path in outs.items():
    outputs.check_not_input(path, inputs, flag)
  given = [(flag, path) for flag, path in outs.items() if path]
  for i, (flag, path) in enumerate(given):
    for other, other_path in given[:i]:
      if path == other_path and not outputs.writes_in_place(path):
        raise outputs.OutputPathError(f"{flag} {path} is also {other}: give each its own file")


def main(argv=None) -> int:
  args, overrides = parse_args(argv)

  def go():
    flags.check_counts(repeats=args.repeats)
    out_json = flags.output_file(args.output_json, "--output_json")
    out_md = flags.output_file(args.output_md, "--output_md")
    given = [f for f in ("--t5_benchmark", "--t5_memory", "--gpt2_memory") if getattr(args, f[2:])]
    if len(given) > 1:
      raise ValueError(f"{' and '.join(given)}: give one of them per run")
    if given:
      check_no_case_flags(args, overrides, given[0])
    for flag in given:                  # a file there was a FileExistsError traceback
      outputs.check_workdir(getattr(args, flag[2:]), flag)
    family = _memory_family(args)
    written = bool(given)               # cases on checkpoints written here: none exist yet
    config = (MEMORY[family][0] if family else "t5_xl_small.py" if written else args.config)
    probe_cases = None if written else cases_from(args, overrides)
    check_outputs(config, probe_cases or [Case("run", tuple(overrides))],
                  {"--output_json": out_json, "--output_md": out_md})
    cases = probe_cases or cases_from(args, overrides)
    try:
      with tempfile.TemporaryDirectory(prefix="specjax-startup-") as work:
        runs = measure(cases, config, args.prompt, args.repeats, pathlib.Path(work))
    except KeyboardInterrupt:    # the probe stopped, its caches and checkpoints removed
      print("eval.startup: interrupted; nothing measured is kept", file=sys.stderr)
      return 130
    rows = medians(runs)
    pairs = [(f"deep {lay}", f"shallow {lay}") for lay in ("scan", "auto")]
    text = "\n".join([table(rows), "", *ratios(rows, pairs)]) + "\n"
    print(text, end="")
    if out_md:
      outputs.write_text(out_md, text)
    if out_json:
      outputs.write_json(out_json, {"config": config, "repeats": args.repeats, "rows": rows,
                                    "runs": runs, "cases": [dataclasses.asdict(c) for c in cases]})

  return cli.run("eval.startup", go)


if __name__ == "__main__":
  sys.exit(main())
