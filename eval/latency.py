"""Batch-1 latency: target-only autoregressive decoding vs speculative decoding on the same prompts.

    python -m eval.latency --config tiny.py
    python -m eval.latency --config tiny.py --gamma 1,3,5,7 --output_json latency.json

Both are timed after compilation (compile time reported apart), alternating, median of --repeats
runs per prompt: whole generations (ms/token, speedup) and the decode phase after the first token
(decode ms/token, decode_speedup; the first token, i.e. prefill, is reported apart as in vLLM's
TTFT/TPOT), which is what the cost model describes: model_efficiency = decode_speedup /
tau/(c*gamma+v). Also measured: the cost ratio c = draft step / target step, the verify cost ratio
v = target pass over gamma+1 tokens / single-token target pass, and the predicted speedups
tau/(c*gamma+1) (the paper's) and tau/(c*gamma+v) (the cost model with v).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys

import jax

from eval import timing
from specjax import runner
from specjax.config import load_config


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m eval.latency", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="tiny.py")
  p.add_argument("--gamma", default="", help="comma-separated gammas to sweep (default: config)")
  p.add_argument("--num_prompts", type=int, default=8)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--output_json")
  args, rest = p.parse_known_args(argv)
  return args, rest


def time_decoding(decoders: dict, prompts, key, repeats, first_token: bool = True,
                  probes: dict | None = None) -> dict:
  """Batch-1 runs of every prompt by every decoder, alternating (timing.alternating). Per
  decoder: summed medians of whole generations (total_s) and, with first_token, of first tokens
  alone (first_s: every model's prefill + one token, the time to first token); tokens; compile
  seconds; aggregated statistics. probes ({name: fn}) join every prompt's alternation, so that
  what they measure shares the machine's state with the runs; each maps to its median seconds."""
  acc = {name: dict(total_s=0.0, first_s=0.0, tokens=0, compile_s=0.0, rows=[])
         for name in decoders}
  probes = probes or {}
  probe_s = {name: [] for name in probes}
  for i, text in enumerate(prompts):
    k = jax.random.fold_in(key, i)
    calls = {("probe", name): fn for name, fn in probes.items()}
    for name, dec in decoders.items():
      prompt, draft_prompt = dec.encode([text])
      calls[(name, "all")] = functools.partial(dec.generate, prompt, k, draft_prompt)
      if first_token:
        first = dataclasses.replace(dec, max_new_tokens=1)
        calls[(name, "first")] = functools.partial(first.generate, prompt, k, draft_prompt)
    timed = timing.alternating(calls, repeats)
    for name, a in acc.items():
      gen, comp, median = timed[(name, "all")]
      _, first_comp, first_median = timed.get((name, "first"), (None, 0.0, 0.0))
      a["total_s"] += median
      a["first_s"] += first_median
      a["compile_s"] += comp + first_comp
      a["tokens"] += int(gen.lengths[0])
      a["rows"] += runner.stats_rows(gen.stats, 1)
    for name in probes:
      probe_s[name].append(timed[("probe", name)][2])
  for a in acc.values():
    a["stats"] = runner.aggregate(a.pop("rows"))
  return {**acc, **{name: statistics.median(t) for name, t in probe_s.items()}}


def measure(dec: runner.Decoder, prompts, repeats: int, seed: int) -> dict:
  probe, draft_probe = dec.encode(prompts[:1])
  cap = lambda model, p: (1 if model.is_encoder_decoder else p.tokens.shape[1]) + \
      dec.max_new_tokens + dec.gamma                       # the cache size decoding uses
  target, draft = dec.target, dec.draft
  steps = 32   # passes per probe call
  probes = {"t1": timing.step_loop(target.model, target.params, probe, 1,
                                   cap(target.model, probe), steps),
            "tv": timing.step_loop(target.model, target.params, probe, dec.gamma + 1,
                                   cap(target.model, probe), steps),
            "d1": timing.step_loop(draft.model, draft.params, draft_probe, 1,
                                   cap(draft.model, draft_probe), steps)}
  runs = time_decoding({"ar": dataclasses.replace(dec, draft=None), "sd": dec}, prompts,
                       jax.random.PRNGKey(seed), repeats, probes=probes)
  ar, sd, stats = runs["ar"], runs["sd"], runs["sd"]["stats"]
  t1, tv, d1 = (runs[name] / steps for name in ("t1", "tv", "d1"))
  c, v = d1 / t1, tv / t1
  tau, alpha = stats.get("block_efficiency", 1.0), stats.get("acceptance_rate", 0.0)
  per_token = lambda r: 1e3 * r["total_s"] / r["tokens"]
  # After the first token: what the cost model describes (prefill and the first token apart).
  decode = lambda r: 1e3 * (r["total_s"] - r["first_s"]) / max(r["tokens"] - len(prompts), 1)
  model_predicted = tau / (c * dec.gamma + v)
  return dict(
      rule=dec.rule_name,
      gamma=dec.gamma, prompts=len(prompts), ar_tokens=ar["tokens"], sd_tokens=sd["tokens"],
      ar_ms_per_token=per_token(ar), sd_ms_per_token=per_token(sd),
      speedup=per_token(ar) / per_token(sd),
      ar_first_token_ms=1e3 * ar["first_s"] / len(prompts),
      sd_first_token_ms=1e3 * sd["first_s"] / len(prompts),
      ar_decode_ms_per_token=decode(ar), sd_decode_ms_per_token=decode(sd),
      decode_speedup=decode(ar) / decode(sd),
      predicted_speedup=tau / (c * dec.gamma + 1), model_predicted_speedup=model_predicted,
      model_efficiency=decode(ar) / decode(sd) / model_predicted,
      block_efficiency=tau, acceptance_rate=alpha, cost_ratio=c, verify_cost_ratio=v,
      target_step_ms=1e3 * t1, draft_step_ms=1e3 * d1,
      compile_s=ar["compile_s"] + sd["compile_s"], device=jax.devices()[0].device_kind)


COLUMNS = ("rule", "gamma", "ar_ms_per_token", "sd_ms_per_token", "speedup",
           "ar_decode_ms_per_token", "sd_decode_ms_per_token", "decode_speedup",
           "predicted_speedup", "model_predicted_speedup", "model_efficiency", "block_efficiency",
           "acceptance_rate", "cost_ratio", "verify_cost_ratio", "compile_s")


def table(records: list[dict]) -> str:
  def fmt(v):
    return f"{v:.3f}" if isinstance(v, float) else str(v)
  lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  lines += ["| " + " | ".join(fmt(r[c]) for c in COLUMNS) + " |" for r in records]
  return "\n".join(lines)


def main(argv=None) -> int:
  args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
  runner.enable_compilation_cache()
  config = load_config(args.config, overrides)
  dec = runner.build(config, use_draft=True)
  prompts = runner.eval_prompts(config, args.num_prompts)
  gammas = [int(g) for g in args.gamma.split(",") if g] or [dec.gamma]
  records = []
  for g in gammas:
    records.append(measure(dataclasses.replace(dec, gamma=g), prompts, args.repeats,
                           int(config.decode.seed)))
    print(table(records[-1:]) if len(records) == 1 else table(records[-1:]).splitlines()[-1],
          flush=True)
  if args.output_json:
    with open(args.output_json, "w") as f:
      json.dump(records if len(records) > 1 else records[0], f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
