"""DistillSpec's main pair: T5 v1.1 XL target, T5 v1.1 Small draft.

    python -m specjax.decode --config t5_xl_small.py --prompt "summarize: ..."
    python -m specjax.decode --config t5_xl_small.py \
        --config.target.checkpoint=/path/to/t5-v1_1-xl --config.draft.checkpoint=/path/to/t5-v1_1-small

Hub ids resolve through the local Hugging Face cache only (no download at run time).
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.target = ml_collections.ConfigDict(dict(checkpoint="google/t5-v1_1-xl", dtype="bfloat16"))
  c.draft = ml_collections.ConfigDict(dict(checkpoint="google/t5-v1_1-small", dtype="bfloat16"))
  c.rule = ml_collections.ConfigDict(dict(name="exact"))
  c.decode = ml_collections.ConfigDict(dict(
      gamma=5, max_new_tokens=64, temperature=0.0, top_k=0, top_p=1.0, seed=0,
      max_len=0, batch_size=1))
  return c
