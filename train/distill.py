"""DistillSpec: distil the draft (student) towards the target (teacher).

    python -m train.distill --config distill_tiny.py --workdir runs/distill_tiny \
        [--config.distill.recipe=gkd] [--config.train.steps=200]

Resumes from WORKDIR's latest checkpoint; metrics go to the console and WORKDIR/metrics.jsonl.
"""

from __future__ import annotations

import argparse
import sys


def parse(argv: list[str], description: str) -> tuple[argparse.Namespace, list[str]]:
  """--config FILE and --workdir DIR; every --config.a.b=v is an override for load_config."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--config", required=True, help="config file or bare name in configs/")
  parser.add_argument("--workdir", required=True, help="checkpoints and metrics.jsonl go here")
  args, rest = parser.parse_known_args(argv)
  bad = [a for a in rest if not a.startswith("--config.")]
  if bad:
    parser.error(f"unrecognized arguments {bad}: overrides take the form --config.a.b=value")
  return args, rest


def main(argv: list[str] | None = None, pretrain: bool = False) -> None:
  from specjax.config import load_config
  from specjax.distill import trainer
  args, overrides = parse(sys.argv[1:] if argv is None else argv, __doc__.splitlines()[0])
  config = load_config(args.config, overrides)
  trainer.run_from_config(config, args.workdir, pretrain=pretrain)


if __name__ == "__main__":
  main()
