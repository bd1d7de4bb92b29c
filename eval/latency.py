"""Batch-1 latency: target-only autoregressive decoding vs speculative decoding on the same prompts.

    python -m eval.latency --config tiny.py
    python -m eval.latency --config tiny.py --gamma 1,3,5,7 --output_json latency.json

Both are timed after compilation (compile time reported apart), median of --repeats runs per
prompt. Also measured: the cost ratio c = draft step / target step, the verify cost ratio
v = target pass over gamma+1 tokens / single-token target pass, and the predicted speedups
tau/(c*gamma+1) (the paper's) and tau/(c*gamma+v) (the cost model with v).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--output_json")
  args, rest = p.parse_known_args(argv)
  return args, rest


def time_decoding(dec: runner.Decoder, prompts, key, repeats):
  """Total median seconds, tokens and compile seconds over batch-1 runs of every prompt."""
  total_s, tokens, compile_s, rows = 0.0, 0, 0.0, []
  for i, text in enumerate(prompts):
    prompt, draft_prompt = dec.encode([text])
    k = jax.random.fold_in(key, i)
    gen, comp, median = timing.timed(lambda: dec.generate(prompt, k, draft_prompt), repeats)
    total_s += median
    compile_s += comp
    tokens += int(gen.lengths[0])
    rows += runner.stats_rows(gen.stats, 1)
  return total_s, tokens, compile_s, runner.aggregate(rows)


def measure(dec: runner.Decoder, prompts, repeats: int, seed: int) -> dict:
  key = jax.random.PRNGKey(seed)
  ar = dataclasses.replace(dec, draft=None)
  ar_s, ar_tokens, ar_compile, _ = time_decoding(ar, prompts, key, repeats)
  sd_s, sd_tokens, sd_compile, stats = time_decoding(dec, prompts, key, repeats)
  probe, draft_probe = dec.encode(prompts[:1])
  cap = lambda model, p: (1 if model.is_encoder_decoder else p.tokens.shape[1]) + \
      dec.max_new_tokens + dec.gamma                       # the cache size decoding uses
  target, draft = dec.target, dec.draft
  t1 = timing.step_time(target.model, target.params, probe, 1, cap(target.model, probe))
  tv = timing.step_time(target.model, target.params, probe, dec.gamma + 1,
                        cap(target.model, probe))
  d1 = timing.step_time(draft.model, draft.params, draft_probe, 1, cap(draft.model, draft_probe))
  c, v = d1 / t1, tv / t1
  tau, alpha = stats.get("block_efficiency", 1.0), stats.get("acceptance_rate", 0.0)
  ar_ms, sd_ms = 1e3 * ar_s / ar_tokens, 1e3 * sd_s / sd_tokens
  return dict(
      rule=dec.rule_name,
      gamma=dec.gamma, prompts=len(prompts), ar_tokens=ar_tokens, sd_tokens=sd_tokens,
      ar_ms_per_token=ar_ms, sd_ms_per_token=sd_ms, speedup=ar_ms / sd_ms,
      predicted_speedup=tau / (c * dec.gamma + 1), model_predicted_speedup=tau / (c * dec.gamma + v),
      block_efficiency=tau, acceptance_rate=alpha, cost_ratio=c, verify_cost_ratio=v,
      target_step_ms=1e3 * t1, draft_step_ms=1e3 * d1, compile_s=ar_compile + sd_compile,
      device=jax.devices()[0].device_kind)


COLUMNS = ("rule", "gamma", "ar_ms_per_token", "sd_ms_per_token", "speedup", "predicted_speedup",
           "model_predicted_speedup", "block_efficiency", "acceptance_rate", "cost_ratio",
           "verify_cost_ratio", "compile_s")


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
