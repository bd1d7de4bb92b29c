r"""Train SPRINTER's verifier for a (target, draft) pair (docs/papers/sprinter.md §2).

    python -m train.verifier --config sprinter_tiny.py --workdir runs/sprinter_tiny \
        [--config.verifier.lam=1.5] [--config.verifier.features=B] [--config.verifier.mlp_width=64]

Writes WORKDIR/params (Orbax), WORKDIR/verifier.json and WORKDIR/metrics.json (label balance per
prefix group, held-out AUROC, true/false-positive rates at the threshold), and prints the metrics.
Decode with it: --config.rule.name=sprinter --config.rule.verifier=WORKDIR.
"""

from __future__ import annotations

import json
import sys

from specjax.app import cli, config, sprinter_train


def main(argv: list[str] | None = None) -> int:
  p = cli.parser("python -m train.verifier", __doc__)
  p.add_argument("--config", required=True, help="a shipped config name or a config file")
  p.add_argument("--workdir", required=True, help="the verifier, its metadata and metrics")
  args, overrides = cli.parse(p, argv)

  def go():
    cli.setup()
    cfg = config.load_config(args.config, overrides)
    metrics = sprinter_train.run_from_config(cfg, args.workdir)
    shown = {k: v for k, v in metrics.items() if k != "val_loss_history"}
    print(json.dumps(shown, indent=2, sort_keys=True), flush=True)

  return cli.run("train.verifier", go)


if __name__ == "__main__":
  sys.exit(main())
