"""Pretrain / fine-tune one model with the NLL loss (the same trainer as DistillSpec).

    python -m train.pretrain --config distill_tiny.py --workdir runs/tiny_target

Trains the config section named by `pretrain.model` (default `target`) on the config's data, then
exports WORKDIR/params, which `--config.target.init_from=WORKDIR` loads in train.distill.
"""

from __future__ import annotations

import sys

from train import distill

if __name__ == "__main__":
  sys.exit(distill.main(pretrain=True, doc=__doc__))
