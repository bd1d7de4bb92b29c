"""DistillSpec LM1B pair (Appendix B): 234M GPT-like target, 33M draft, T5 32k vocabulary.

    python -m train.pretrain --config distill_lm1b.py --workdir runs/lm1b_target
    python -m train.distill --config distill_lm1b.py --workdir runs/lm1b_distill \
        --config.target.init_from=runs/lm1b_target --config.distill.recipe=f_distill

128 input and 128 output tokens. Table B.1 optimisation: Adafactor 3e-4, batch 32, 300k steps,
5k warmup, constant to 150k, cosine to 0.1x. Data defaults to the offline Markov stand-in
(LM1B itself needs TFDS); --config.mesh.model shards heads / mlp / vocab across devices.
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.target = ml_collections.ConfigDict(dict(arch="decoder", preset="target", init_from=""))
  c.draft = ml_collections.ConfigDict(dict(arch="decoder", preset="draft", init_from=""))
  c.data = ml_collections.ConfigDict(dict(
      source="markov", vocab_size=32128, prompt_len=128, target_len=128, seed=0, eos_id=1,
      pad_id=0))
  c.distill = ml_collections.ConfigDict(dict(
      recipe="f_distill", loss="tvd", beta=0.5, lambda1=0.0, lambda2=0.5, temperature=1.0))
  c.train = ml_collections.ConfigDict(dict(
      steps=300_000, batch_size=32, learning_rate=3e-4, warmup_steps=5_000, decay_start=150_000,
      final_lr_ratio=0.1, optimizer="adafactor", seed=0, log_every=100, checkpoint_every=2_000,
      eval_every=5_000, async_checkpoint=True, progress=True))
  c.pretrain = ml_collections.ConfigDict(dict(model="target", steps=300_000, learning_rate=3e-4))
  c.mesh = ml_collections.ConfigDict(dict(data=-1, model=1))
  c.distributed = ml_collections.ConfigDict(dict(
      enabled=False, coordinator="", num_processes=0, process_id=-1))
  return c
