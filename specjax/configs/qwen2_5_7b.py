r"""A real pair by hub ids: Qwen2.5-7B-Instruct (target) with Qwen2.5-0.5B-Instruct (draft), one
tokenizer (the target's embedding has 152,064 rows, the draft's 151,936: the draft's logits are
fitted to the target's width), chat prompts, the exact rule (the output law is the target's).

Hub ids resolve through the local Hugging Face cache only (no download at run time): fetch the
two checkpoints once on a machine with network access, e.g.

    huggingface-cli download Qwen/Qwen2.5-7B-Instruct
    huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct

then

    python -m specjax.decode --config qwen2_5_7b.py --prompt "Explain speculative decoding."
    python -m specjax.decode --config qwen2_5_7b.py \
        --config.target.checkpoint=/path/to/Qwen2.5-7B-Instruct \
        --config.draft.checkpoint=/path/to/Qwen2.5-0.5B-Instruct

Weights load as bfloat16 (the 7B target takes ~15 GB; float32 twice that); on XLA:CPU float32
runs faster if memory allows (`--config.target.dtype=float32 --config.draft.dtype=float32`).
"""

import ml_collections

from specjax.configs import common

TARGET = "Qwen/Qwen2.5-7B-Instruct"
DRAFT = "Qwen/Qwen2.5-0.5B-Instruct"
PROMPTS = (
    "Explain in two sentences what speculative decoding is.",
    "Write a Python function that returns the n-th Fibonacci number.",
)


def get_config():
  c = ml_collections.ConfigDict()
  c.target = common.model(TARGET, "bfloat16")
  c.draft = common.draft(DRAFT, "bfloat16")
  c.rule = common.rule("exact")
  c.decode = common.decode(gamma=4, temperature=0.7, max_new_tokens=128, chat=True)
  c.mesh = common.mesh(1, 1)        # one device; --config.mesh.* to shard
  c.distributed = common.distributed()
  c.prompts = list(PROMPTS)
  return c
