"""DistillSpec main pair at TPU v4 pod scale: T5 v1.1 XL target (teacher), T5 v1.1 Small draft.

    python -m train.distill --config distill_t5_xl_small.py --workdir /mnt/BUCKET/distill_xl_small
    # a local path, or a bucket mounted on every host (gcsfuse): gs:// URLs are refused
    # on every host of the pod (jax.distributed.initialize finds the peers on TPU):
    #   --config.distributed.enabled=true

Table B.1: Adafactor, LR 3e-4 (5k warmup, constant to 150k, cosine to 3e-5 at 300k), batch 32,
300k steps, dropout 0; GKD (on-policy, FKL) by default, temperature 1. Mesh: data x model = 16 x 4
(64 chips); set --config.mesh.* to match the slice. Checkpoints resolve through the local Hugging
Face cache (no download at run time): --config.target.checkpoint=/path/to/t5-v1_1-xl.

Data: TFDS xsum when prepared (--config.data.data_dir=DIR, --config.data.tokenizer= the
checkpoint's spiece.model). Without it, a logged notice and the offline stand-in: stdlib_sum
(stdlib function -> first docstring sentence) under stdlib:unigram:8000:2000000 (8000 ids, fit
32128).
--config.data.source=markov trains on the synthetic Markov chain instead. Every eval_every steps:
on-policy TVD and alpha / tau of exact SD (gamma = decode.gamma) on held-out prompts.
"""

import ml_collections

from specjax.configs import common


def get_config():
  c = ml_collections.ConfigDict()
  c.target = ml_collections.ConfigDict(dict(
      checkpoint="google/t5-v1_1-xl", dtype="bfloat16", init_from=""))
  c.draft = ml_collections.ConfigDict(dict(
      checkpoint="google/t5-v1_1-small", dtype="float32", init_from=""))
  c.data = ml_collections.ConfigDict(dict(
      source="task", task="xsum", tokenizer="", data_dir="", vocab_size=32128, prompt_len=1024,
      target_len=64, seed=0, eos_id=1, pad_id=0))
  c.distill = common.distill(recipe="gkd")
  c.train = common.training(eval_prompts=8)
  c.decode = common.decode(gamma=5, max_new_tokens=64)
  c.pretrain = ml_collections.ConfigDict(dict(model="draft", steps=100_000, learning_rate=3e-4))
  c.mesh = common.mesh(16, 4)
  c.distributed = common.distributed()
  return c
