r"""DistillSpec LM1B pair (Appendix B): 234M GPT-like target, 33M draft, T5 32k vocabulary.

    python -m train.pretrain --config distill_lm1b.py --workdir runs/lm1b_target
    python -m train.distill --config distill_lm1b.py --workdir runs/lm1b_distill \
        --config.target.init_from=runs/lm1b_target --config.distill.recipe=f_distill

128 input and 128 output tokens. Table B.1 optimisation: Adafactor 3e-4, batch 32, 300k steps,
5k warmup, constant to 150k, cosine to 0.1x; --config.mesh.model shards heads / mlp / vocab.

Data: TFDS lm1b when prepared (--config.data.data_dir=DIR; the paper's tokenizer is T5's
SentencePiece model: --config.data.tokenizer=/path/to/spiece.model). Without it, a logged notice
and the offline stand-in: stdlib_lm (Python stdlib code) under stdlib:unigram:8000:2000000 (8000
ids, trained on 2M characters of it), which fit the models' 32128. --config.data.source=markov
trains on the synthetic Markov chain instead.
Every eval_every steps: on-policy TVD and alpha / tau of exact SD (gamma = decode.gamma) on
train.eval_prompts held-out prompts, in metrics.jsonl.
"""

import ml_collections

from specjax.configs import common


def get_config():
  c = ml_collections.ConfigDict()
  c.target = ml_collections.ConfigDict(dict(arch="decoder", preset="target", init_from=""))
  c.draft = ml_collections.ConfigDict(dict(arch="decoder", preset="draft", init_from=""))
  c.data = ml_collections.ConfigDict(dict(
      source="task", task="lm1b", tokenizer="", data_dir="", vocab_size=32128, prompt_len=128,
      target_len=128, seed=0, eos_id=1, pad_id=0))
  c.distill = common.distill(recipe="f_distill", loss="tvd", lambda2=0.5)
  c.train = common.training(eval_prompts=8)
  c.decode = common.decode(gamma=4, max_new_tokens=64)
  c.pretrain = ml_collections.ConfigDict(dict(model="target", steps=300_000, learning_rate=3e-4))
  c.mesh = common.mesh(-1, 1)
  c.distributed = common.distributed()
  return c
