"""Task quality of target-only, draft-only (raw and distilled) and speculative decoding.

    python -m eval.quality --config tiny.py --output_json quality.json
    python -m eval.quality --config tiny_t5.py --num_examples 128

Modes: target, draft_raw_only, draft_only (the distilled draft), sd_RULE (with the distilled draft)
and sd_RULE_raw_draft (with the raw draft: the acceptance-rate gain of distillation).
Each mode decodes the same validation prompts with the config's decode settings (same seed) and
scores the outputs against the references with the task's metric (ROUGE for the stdlib tasks).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax

from specjax import runner
from specjax.config import load_config
from specjax.data import metrics


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m eval.quality", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="tiny.py")
  p.add_argument("--num_examples", type=int, default=64)
  p.add_argument("--batch_size", type=int, default=16)
  p.add_argument("--output_json")
  return p.parse_known_args(argv)


def decoders(config) -> dict:
  """Mode name -> Decoder, for every model the config names."""
  out = {"target": runner.build_single(config, "target")}
  for section in ("draft_raw", "draft"):
    if config.get(section) and config[section].get("checkpoint"):
      out[f"{section}_only"] = runner.build_single(config, section)
  out[f"sd_{config.rule.name}"] = runner.build(config, use_draft=True)
  if config.get("draft_raw") and config.draft_raw.get("checkpoint"):   # DistillSpec's comparison
    out[f"sd_{config.rule.name}_raw_draft"] = runner.build(config, use_draft=True,
                                                          draft_section="draft_raw")
  return out


def main(argv=None) -> int:
  args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
  runner.enable_compilation_cache()
  config = load_config(args.config, overrides)
  source = runner.eval_source(config)
  examples = source.eval_examples("validation", args.num_examples)
  prompts, refs = [p for p, _ in examples], [r for _, r in examples]
  metric = source.task.metric or "rouge"
  key = jax.random.PRNGKey(int(config.decode.seed))
  report = {"config": args.config, "metric": metric, "examples": len(prompts),
            "temperature": float(config.decode.temperature), "modes": {}}
  for mode, dec in decoders(config).items():
    texts, stats = runner.generate_texts(dec, prompts, key, args.batch_size)
    scores = metrics.evaluate(metric, texts, refs)
    report["modes"][mode] = {**scores, "examples": len(texts), **runner.aggregate(stats)}
    print(f"{mode:>20}: " + ", ".join(f"{k} {v:.2f}" for k, v in scores.items()), flush=True)
  if args.output_json:
    with open(args.output_json, "w") as f:
      json.dump(report, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
