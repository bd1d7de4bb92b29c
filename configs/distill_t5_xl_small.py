"""DistillSpec main pair at TPU v4 pod scale: T5 v1.1 XL target (teacher), T5 v1.1 Small draft.

    python -m train.distill --config distill_t5_xl_small.py --workdir gs://BUCKET/distill_xl_small
    # on every host of the pod (jax.distributed.initialize finds the peers on TPU):
    #   --config.distributed.enabled=true

Table B.1: Adafactor, LR 3e-4 (5k warmup, constant to 150k, cosine to 3e-5 at 300k), batch 32,
300k steps, dropout 0; GKD (on-policy, FKL) by default, temperature 1. Mesh: data x model = 16 x 4
(64 chips); set --config.mesh.* to match the slice. Checkpoints resolve through the local Hugging
Face cache (no download at run time): --config.target.checkpoint=/path/to/t5-v1_1-xl.
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.target = ml_collections.ConfigDict(dict(
      checkpoint="google/t5-v1_1-xl", dtype="bfloat16", init_from=""))
  c.draft = ml_collections.ConfigDict(dict(
      checkpoint="google/t5-v1_1-small", dtype="float32", init_from=""))
  c.data = ml_collections.ConfigDict(dict(
      source="markov", vocab_size=32128, prompt_len=1024, target_len=64, seed=0, eos_id=1,
      pad_id=0))
  c.distill = ml_collections.ConfigDict(dict(
      recipe="gkd", loss="fkl", beta=0.5, lambda1=0.0, lambda2=1.0, temperature=1.0))
  c.train = ml_collections.ConfigDict(dict(
      steps=300_000, batch_size=32, learning_rate=3e-4, warmup_steps=5_000, decay_start=150_000,
      final_lr_ratio=0.1, optimizer="adafactor", seed=0, log_every=100, checkpoint_every=2_000,
      eval_every=5_000, async_checkpoint=True, progress=True))
  c.pretrain = ml_collections.ConfigDict(dict(model="draft", steps=100_000, learning_rate=3e-4))
  c.mesh = ml_collections.ConfigDict(dict(data=16, model=4))
  c.distributed = ml_collections.ConfigDict(dict(
      enabled=False, coordinator="", num_processes=0, process_id=-1))
  return c
