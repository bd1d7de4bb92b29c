"""The embedded default (the default config): a decoder-only target and a much smaller draft,
trained here on Python standard-library code on first use (specjax.zoo), then cached.

    python -m specjax.decode                                    # same as --config tiny.py
    python -m specjax.decode --config tiny.py --config.rule.name=greedy --config.decode.temperature=0
    python -m eval.latency --config tiny.py --gamma 1,3,5,7

`draft` is the DistillSpec-distilled draft; `draft_raw` the same draft before distillation.
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.target = ml_collections.ConfigDict(dict(checkpoint="builtin:tiny/target", dtype="float32"))
  c.draft = ml_collections.ConfigDict(dict(checkpoint="builtin:tiny/draft_distilled",
                                           dtype="float32"))
  c.draft_raw = ml_collections.ConfigDict(dict(checkpoint="builtin:tiny/draft", dtype="float32"))
  c.rule = ml_collections.ConfigDict(dict(name="exact"))
  c.decode = ml_collections.ConfigDict(dict(
      gamma=4, max_new_tokens=64, temperature=1.0, top_k=0, top_p=1.0, seed=0, max_len=0,
      batch_size=1))
  c.data = ml_collections.ConfigDict(dict(task="stdlib_lm", tokenizer="stdlib:bpe:2000",
                                          lm_prompt_len=32, max_target_len=64))
  c.prompts = [
      "def read_lines(path):\n    \"\"\"Return the lines of a text file.\"\"\"\n",
      "class Stack:\n    def __init__(self):\n",
      "import os\nimport sys\n\n\ndef main(argv):\n",
  ]
  return c
