"""Train SPRINTER's verifier for a (target, draft) pair (sprinter.md §2).

    python -m train.verifier --config sprinter_tiny.py --workdir runs/sprinter_tiny \
        [--config.verifier.lam=1.5] [--config.verifier.features=B] [--config.verifier.mlp_width=64]

Writes WORKDIR/params (Orbax), WORKDIR/verifier.json and WORKDIR/metrics.json (label balance per
prefix group, held-out AUROC, true/false-positive rates at the threshold), and prints the metrics.
Decode with it: --config.rule.name=sprinter --config.rule.verifier=WORKDIR.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str] | None = None) -> dict:
  from specjax import verifier
  from specjax.config import load_config
  from train.distill import parse
  args, overrides = parse(sys.argv[1:] if argv is None else argv, __doc__.splitlines()[0])
  metrics = verifier.run_from_config(load_config(args.config, overrides), args.workdir)
  shown = {k: v for k, v in metrics.items() if k != "val_loss_history"}
  print(json.dumps(shown, indent=2, sort_keys=True), flush=True)
  return metrics


if __name__ == "__main__":
  main()
