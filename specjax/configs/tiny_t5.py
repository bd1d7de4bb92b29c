"""The embedded T5 pair: an encoder-decoder target and a much smaller draft trained here on the
conditional stdlib task (function -> first docstring sentence), built on first use (specjax.app.zoo).

    python -m specjax.decode --config tiny_t5.py --prompt "def add(a, b):\n    return a + b"
    python -m eval.quality --config tiny_t5.py
"""

import ml_collections

from specjax.configs import common


def get_config():
  c = ml_collections.ConfigDict()
  common.embedded_pair(c, "tiny_t5")
  c.rule = common.rule("exact")
  c.decode = common.decode(max_new_tokens=32)
  c.mesh = common.mesh(1, 1)        # one device; --config.mesh.* to shard
  c.distributed = common.distributed()
  c.data = ml_collections.ConfigDict(dict(task="stdlib_sum", tokenizer="stdlib:bpe:2000",
                                          max_prompt_len=96, max_target_len=32))
  c.prompts = ["def add(a, b):\n    return a + b\n"]
  return c
