"""The embedded default (the default config): a decoder-only target and a much smaller draft,
trained here on Python standard-library code on first use (specjax.app.zoo), then cached.

    python -m specjax.decode                                    # same as --config tiny.py
    python -m specjax.decode --config tiny.py --config.rule.name=greedy --config.decode.temperature=0
    python -m eval.latency --config tiny.py --gamma 1,3,5,7

`draft` is the DistillSpec-distilled draft; `draft_raw` the same draft before distillation.
"""

import ml_collections

from specjax.configs import common


def get_config():
  c = ml_collections.ConfigDict()
  common.embedded_pair(c, "tiny")
  c.rule = common.rule("exact")
  c.decode = common.decode()
  c.mesh = common.mesh(1, 1)        # one device; --config.mesh.* to shard
  c.distributed = common.distributed()
  c.data = common.stdlib_lm_data()
  c.prompts = list(common.STDLIB_PROMPTS)
  return c
