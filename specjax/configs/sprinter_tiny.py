"""SPRINTER on the embedded pair (builtin:tiny target, DistillSpec-distilled draft): train the
verifier, then decode with it.

    python -m train.verifier --config sprinter_tiny.py --workdir runs/sprinter_tiny
    python -m specjax.decode --config sprinter_tiny.py      # method sprinter, verifier from above

The `verifier` section drives training (lam, the data and the optimizer) and stores the decoding
defaults (threshold tau, gamma_max) in the workdir; `rule` points decoding at that workdir
(threshold / gamma_max < 0 there: use the saved values). The verifier's text prefixes are the
stdlib task's (`data.source="task"`, the pair's own BPE tokenizer), the text the pair was
trained on.
"""

import ml_collections

from specjax.configs import common


def get_config():
  c = ml_collections.ConfigDict()
  c.target = common.model("builtin:tiny/target")
  c.draft = common.draft("builtin:tiny/draft_distilled")
  c.verifier = ml_collections.ConfigDict(dict(
      workdir="runs/sprinter_tiny", features="A", mlp_width=0, lam=1.2, threshold=0.5,
      gamma_max=8, cont_len=20, mix_prob=0.5, num_sequences=1024, batch_rows=64,
      learning_rate=1e-3, batch_size=256, max_epochs=20, patience=3, pos_weight=0.0,
      val_fraction=0.1, test_fraction=0.1, seed=0))
  c.rule = common.rule("sprinter", verifier="runs/sprinter_tiny", threshold=-1.0, gamma_max=-1)
  c.decode = common.decode()
  c.mesh = common.mesh(1, 1)        # one device; --config.mesh.* to shard
  c.distributed = common.distributed()
  c.data = common.stdlib_lm_data(source="task", eos_id=1)   # the verifier's text prefixes
  c.prompts = list(common.STDLIB_PROMPTS)
  return c
