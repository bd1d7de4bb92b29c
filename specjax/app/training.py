"""`train.pretrain` / `train.distill` from a config: models from their sections (checkpoints
resolved, or built from fields), multi-host set-up, then `fit`."""

from __future__ import annotations

from specjax import sharding
from specjax.app import builders, resolve
from specjax.app.fit import fit


def run(config, workdir: str, pretrain: bool = False):
  dist = builders.section(config, "distributed")
  if dist.get("enabled"):
    pid = dist.get("process_id", -1)
    sharding.initialize_distributed(dist.get("coordinator") or None,
                                    dist.get("num_processes") or None,
                                    pid if pid is not None and pid >= 0 else None)
  cfg = builders.train_config(config, pretrain)
  role = builders.section(config, "pretrain").get("model", "target") if pretrain else "draft"
  student = resolve.build_model(builders.model_spec(config, role), cfg.seed)
  teacher = (None if pretrain
             else resolve.build_model(builders.model_spec(config, "target"), cfg.seed + 1))
  return fit(config, workdir, student, teacher, pretrain=pretrain)
