"""DistillSpec: distil the draft (student) towards the target (teacher).

    python -m train.distill --config distill_tiny.py --workdir runs/distill_tiny \
        [--config.distill.recipe=gkd] [--config.train.steps=200]

Resumes from WORKDIR's latest checkpoint; metrics go to the console and WORKDIR/metrics.jsonl.
"""

from __future__ import annotations

import sys

from specjax.app import cli, config, training


def main(argv: list[str] | None = None, pretrain: bool = False, doc: str = __doc__) -> int:
  prog = "train.pretrain" if pretrain else "train.distill"
  p = cli.parser(f"python -m {prog}", doc)
  p.add_argument("--config", required=True, help="a shipped config name or a config file")
  p.add_argument("--workdir", required=True, help="checkpoints and metrics.jsonl go here")
  args, overrides = cli.parse(p, argv)

  def go():
    cli.setup()
    training.run(config.load_config(args.config, overrides), args.workdir, pretrain=pretrain)

  return cli.run(prog, go)


if __name__ == "__main__":
  sys.exit(main())
