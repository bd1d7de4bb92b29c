r"""An EAGLE-style draft head for the embedded tiny target (specjax.app.zoo), trained on the
target's own features and outputs over Python standard-library code, then decoding with it:

    python -m train.distill --config head_tiny.py --workdir runs/head_tiny
    python -m specjax.decode --config tiny.py --config.draft.method=head \
        --config.draft.checkpoint=runs/head_tiny

The head (models/draft_head.py) is one decoder layer of the target's shape over
[the target's hidden state ; the embedding of the next token], read through the target's own LM
head; distill.student=head trains it with DistillSpec's divergence plus a feature regression
(distill/head.py). It cannot sample outputs of its own, so the data are the dataset's prompts
with the teacher's sampled continuations (lambda2=0). Before the first step and every
eval_every steps: alpha / tau of exact speculative decoding with the head (eval_alpha,
eval_tau). About two minutes on a 2-core CPU after the pair is built.
"""

import ml_collections

from specjax.configs import common


def get_config():
  c = ml_collections.ConfigDict()
  c.target = common.model("builtin:tiny/target")
  c.data = ml_collections.ConfigDict(dict(
      source="task", task="stdlib_lm", tokenizer="builtin:tiny/target", data_dir="",
      vocab_size=2000, prompt_len=16, target_len=48, seed=0, eos_id=1, pad_id=0))
  c.distill = common.distill(student="head", loss="fkl", lambda1=0.0, lambda2=0.0)
  c.train = common.training(
      steps=300, batch_size=16, learning_rate=3e-3, warmup_steps=10, decay_start=150,
      optimizer="adamw", log_every=50, checkpoint_every=100, eval_every=100, eval_at_start=True,
      eval_prompts=8)
  c.decode = common.decode(gamma=4, max_new_tokens=32, temperature=1.0)
  c.mesh = common.mesh(-1, 1)
  c.distributed = common.distributed()
  return c
