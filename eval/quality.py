"""Task quality of target-only, draft-only (raw and distilled) and speculative decoding.

    python -m eval.quality --config tiny.py --output_json quality.json
    python -m eval.quality --config tiny_t5.py --num_examples 128

Modes: target, draft_raw_only, draft_only (the distilled draft), sd_RULE (with the distilled draft)
and sd_RULE_raw_draft (with the raw draft: the acceptance-rate gain of distillation).
Each mode decodes the same validation prompts with the config's decode settings (same seed) and
scores the outputs against the references with the task's metric (ROUGE for the stdlib tasks).
--output_json is rewritten (atomically, strict JSON) as each mode finishes, with `partial`
(modes_done, modes) until the last one is in; Ctrl-C exits 130 and keeps the modes finished.
"""

from __future__ import annotations

import sys

import jax

from eval import flags
from specjax.app import builders, cli, methods, outputs, resolve, runner
from specjax.app.config import input_paths, load_config
from specjax.data import metrics


def parse_args(argv):
  p = cli.parser("python -m eval.quality", __doc__)
  p.add_argument("--config", default="tiny.py")
  p.add_argument("--num_examples", type=int, default=64)
  p.add_argument("--batch_size", type=int, default=16)
  p.add_argument("--output_json")
  return cli.parse(p, argv)


def decoders(config) -> dict:
  """Mode name -> Method, for every model the config names."""
  has = lambda role: bool(builders.section(config, role).get("checkpoint"))
  rule = builders.rule_section(config).get("name", "")
  out = {"target": methods.autoregressive(config)}
  for role in ("draft_raw", "draft"):
    if has(role):
      out[f"{role}_only"] = methods.autoregressive(config, target_role=role)
  out[f"sd_{rule}"] = methods.build(config)
  if has("draft_raw"):                                   # DistillSpec's comparison
    out[f"sd_{rule}_raw_draft"] = methods.build(config, draft_role="draft_raw")
  return out


def main(argv=None) -> int:
  args, overrides = parse_args(argv)

  def go():
    flags.check_counts(num_examples=args.num_examples, batch_size=args.batch_size)
    output = flags.output_file(args.output_json, "--output_json")
    cli.setup()
    config = load_config(args.config, overrides)
    outputs.check_not_input(output, input_paths(args.config, config), "--output_json")
    source = resolve.eval_source(config)
    examples = source.eval_examples("validation", args.num_examples)
    prompts, refs = [p for p, _ in examples], [r for _, r in examples]
    metric = source.task.metric or "rouge"
    key = jax.random.PRNGKey(builders.decode_settings(config).seed)
    report = {"config": args.config, "metric": metric, "examples": len(prompts),
              "temperature": builders.decode_settings(config).temperature, "modes": {}}
    chosen = decoders(config)
    try:
      for mode, method in chosen.items():
        rows = runner.generate_texts(method, prompts, key, args.batch_size)
        scores = metrics.evaluate(metric, [text for _, _, text, _, _ in rows], refs)
        report["modes"][mode] = {**scores, "examples": len(rows),
                                 **runner.aggregate([st for _, _, _, st, _ in rows])}
        print(f"{mode:>20}: " + ", ".join(f"{k} {v:.2f}" for k, v in scores.items()), flush=True)
        # Marked partial until the last mode is in: a killed run's file says it is incomplete.
        report.pop("partial", None)
        if len(report["modes"]) < len(chosen):
          report["partial"] = {"modes_done": len(report["modes"]), "modes": len(chosen)}
        if output:             # rewritten after every mode: a failure keeps the modes done
          outputs.write_json(output, report)
    except KeyboardInterrupt:
      print(f"eval.quality: interrupted after {len(report['modes'])} of {len(chosen)} modes"
            + (f"; {output} holds them, marked partial" if output and report["modes"] else ""),
            file=sys.stderr)
      return 130

  return cli.run("eval.quality", go)


if __name__ == "__main__":
  sys.exit(main())
