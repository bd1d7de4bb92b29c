"""The embedded T5 pair: an encoder-decoder target and a much smaller draft trained here on the
conditional stdlib task (function -> first docstring sentence), built on first use (specjax.zoo).

    python -m specjax.decode --config tiny_t5.py --prompt "def add(a, b):\n    return a + b"
    python -m eval.quality --config tiny_t5.py
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.target = ml_collections.ConfigDict(dict(checkpoint="builtin:tiny_t5/target", dtype="float32"))
  c.draft = ml_collections.ConfigDict(dict(checkpoint="builtin:tiny_t5/draft_distilled",
                                           dtype="float32"))
  c.draft_raw = ml_collections.ConfigDict(dict(checkpoint="builtin:tiny_t5/draft",
                                               dtype="float32"))
  c.rule = ml_collections.ConfigDict(dict(name="exact"))
  c.decode = ml_collections.ConfigDict(dict(
      gamma=4, max_new_tokens=32, temperature=1.0, top_k=0, top_p=1.0, seed=0, max_len=0,
      batch_size=1))
  c.data = ml_collections.ConfigDict(dict(task="stdlib_sum", tokenizer="stdlib:bpe:2000",
                                          max_prompt_len=96, max_target_len=32))
  c.prompts = ["def add(a, b):\n    return a + b\n"]
  return c
