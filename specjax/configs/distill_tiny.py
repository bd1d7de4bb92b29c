r"""DistillSpec in miniature: tiny GPT-style target and draft on a seeded Markov language (CPU, minutes).

    python -m train.pretrain --config distill_tiny.py --workdir runs/tiny_target
    python -m train.distill --config distill_tiny.py --workdir runs/tiny_distill \
        --config.target.init_from=runs/tiny_target

Without init_from the target is a random (near-uniform) model: still a valid smoke/throughput run.
On the offline stdlib corpus instead of the Markov language (vocab 512 covers the tokenizer):
    --config.data.source=task --config.data.task=stdlib_lm --config.data.tokenizer=stdlib:unigram:512
    --config.data.vocab_size=512 --config.target.vocab_size=512 --config.draft.vocab_size=512
Recipes: --config.distill.recipe=seqkd|supkd|imitkd|f_distill|gkd (empty: loss/lambda1/lambda2).
"""

import ml_collections

from specjax.configs import common


def get_config():
  c = ml_collections.ConfigDict()
  vocab = 128
  c.target = ml_collections.ConfigDict(dict(
      arch="decoder", vocab_size=vocab, n_positions=32, d_model=64, num_layers=2, num_heads=4,
      d_ff=128, bos_token_id=1, eos_token_id=1, pad_token_id=0, init_from=""))
  c.draft = ml_collections.ConfigDict(dict(
      arch="decoder", vocab_size=vocab, n_positions=32, d_model=32, num_layers=1, num_heads=2,
      d_ff=64, bos_token_id=1, eos_token_id=1, pad_token_id=0, init_from=""))
  c.data = ml_collections.ConfigDict(dict(
      source="markov", vocab_size=vocab, prompt_len=8, target_len=16, seed=0, eos_id=1, pad_id=0,
      task="stdlib_lm", tokenizer="stdlib:unigram:512"))
  c.distill = common.distill()
  c.train = ml_collections.ConfigDict(dict(
      steps=200, batch_size=16, learning_rate=1e-2, warmup_steps=10, decay_start=100,
      final_lr_ratio=0.1, optimizer="adafactor", seed=0, log_every=20, checkpoint_every=50,
      eval_every=50, eval_prompts=8, async_checkpoint=True, progress=True))
  c.decode = common.decode(gamma=4, max_new_tokens=16)
  c.pretrain = ml_collections.ConfigDict(dict(model="target", steps=300, learning_rate=1e-2))
  c.mesh = common.mesh(-1, 1)
  c.distributed = common.distributed()
  return c
