r"""DistillSpec: distil the draft (student) towards the target (teacher).

    python -m train.distill --config distill_tiny.py --workdir runs/distill_tiny \
        [--config.distill.recipe=gkd] [--config.train.steps=200]

Resumes from WORKDIR's latest checkpoint (a workdir serves one job with one set of models, data
and loss, recorded in WORKDIR/run.json, and one run at a time); metrics go to the console and
WORKDIR/metrics.jsonl. Ctrl-C saves a checkpoint of the current step and exits with status 130
(rerun to resume).
"""

from __future__ import annotations

import sys

from specjax.app import cli, config, training
from specjax.distill import trainer

INTERRUPTED = 130          # the shell's status for a run stopped by SIGINT


def main(argv: list[str] | None = None, pretrain: bool = False, doc: str = __doc__) -> int:
  prog = "train.pretrain" if pretrain else "train.distill"
  p = cli.parser(f"python -m {prog}", doc)
  p.add_argument("--config", required=True, help="a shipped config name or a config file")
  p.add_argument("--workdir", required=True, help="checkpoints and metrics.jsonl go here")
  args, overrides = cli.parse(p, argv)

  def go():
    cli.setup()
    cfg = config.load_config(args.config, overrides)
    training.check_sections(cfg, args.config, pretrain)
    training.check_overrides_apply(cfg, overrides, pretrain)
    try:
      training.run(cfg, args.workdir, pretrain=pretrain,
                   inputs=config.input_paths(args.config, cfg))
    except trainer.TrainingInterrupted as stopped:    # Ctrl-C: a checkpoint was saved
      print(f"{prog}: {stopped}", file=sys.stderr)
      return INTERRUPTED
    except trainer.TrainingAbandoned as stopped:      # a second Ctrl-C: no wait on the save
      print(f"{prog}: {stopped}", file=sys.stderr)
      cli.exit_now(INTERRUPTED)
    except KeyboardInterrupt:                          # before the first step, or a second Ctrl-C
      print(f"{prog}: interrupted (nothing saved now: a rerun resumes from the workdir's latest "
            f"checkpoint, if any)", file=sys.stderr)
      return INTERRUPTED

  return cli.run(prog, go)


if __name__ == "__main__":
  sys.exit(main())
