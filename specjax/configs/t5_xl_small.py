r"""DistillSpec's main pair: T5 v1.1 XL target, T5 v1.1 Small draft.

    python -m specjax.decode --config t5_xl_small.py --prompt "summarize: ..."
    python -m specjax.decode --config t5_xl_small.py \
        --config.target.checkpoint=/path/to/t5-v1_1-xl --config.draft.checkpoint=/path/to/t5-v1_1-small

Hub ids resolve through the local Hugging Face cache only (no download at run time).
"""

import ml_collections

from specjax.configs import common


def get_config():
  c = ml_collections.ConfigDict()
  c.target = common.model("google/t5-v1_1-xl", "bfloat16")
  c.draft = common.draft("google/t5-v1_1-small", "bfloat16")
  c.rule = common.rule("exact")
  c.decode = common.decode(gamma=5, temperature=0.0)
  c.mesh = common.mesh(1, 1)        # one device; --config.mesh.* to shard
  c.distributed = common.distributed()
  return c
