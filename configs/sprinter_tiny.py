"""SPRINTER on the embedded pair (builtin:tiny target, DistillSpec-distilled draft): train the
verifier, then decode with it.

    python -m train.verifier --config sprinter_tiny.py --workdir runs/sprinter_tiny
    python -m specjax.decode --config sprinter_tiny.py      # rule sprinter, verifier from above

The `verifier` section drives training (lam, the data and the optimizer) and stores the decoding
defaults (threshold tau, gamma_max) in the workdir; `rule` points decoding at that workdir
(threshold / gamma_max < 0 there: use the saved values).
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.target = ml_collections.ConfigDict(dict(checkpoint="builtin:tiny/target", dtype="float32"))
  c.draft = ml_collections.ConfigDict(dict(checkpoint="builtin:tiny/draft_distilled",
                                           dtype="float32"))
  c.verifier = ml_collections.ConfigDict(dict(
      workdir="runs/sprinter_tiny", features="A", mlp_width=0, lam=1.2, threshold=0.5,
      gamma_max=8, cont_len=20, mix_prob=0.5, num_sequences=1024, batch_rows=64,
      learning_rate=1e-3, batch_size=256, max_epochs=20, patience=3, pos_weight=0.0,
      val_fraction=0.1, test_fraction=0.1, seed=0))
  c.rule = ml_collections.ConfigDict(dict(name="sprinter", verifier="runs/sprinter_tiny",
                                          threshold=-1.0, gamma_max=-1))
  c.decode = ml_collections.ConfigDict(dict(
      gamma=4, max_new_tokens=64, temperature=1.0, top_k=0, top_p=1.0, seed=0, max_len=0,
      batch_size=1))
  c.data = ml_collections.ConfigDict(dict(task="stdlib_lm", tokenizer="stdlib:bpe:2000",
                                          lm_prompt_len=32, max_target_len=64, eos_id=1))
  c.prompts = [
      "def read_lines(path):\n    \"\"\"Return the lines of a text file.\"\"\"\n",
      "class Stack:\n    def __init__(self):\n",
      "import os\nimport sys\n\n\ndef main(argv):\n",
  ]
  return c
