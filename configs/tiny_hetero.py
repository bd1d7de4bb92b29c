"""The embedded default with a draft on ANOTHER tokenizer (Timor et al., ICML'25): the target of
tiny.py (stdlib:bpe:2000) and a draft trained on stdlib:unigram:8000 (specjax.zoo).

    python -m specjax.decode --config tiny_hetero.py                                 # TLI
    python -m specjax.decode --config tiny_hetero.py --config.rule.name=union
    python -m specjax.decode --config tiny_hetero.py --config.rule.name=slem --config.decode.temperature=0
    python -m specjax.decode --config tiny_hetero.py --config.rule.name=slrs --config.rule.max_depth=2

rule.name: intersection / union run in the jitted loop with a VocabMap built from the two
tokenizers (overlap printed at start-up; refused below rule.min_overlap); slem / slrs run the
host-driven string-level loop (specjax.decoding.string_level), batch 1.
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.target = ml_collections.ConfigDict(dict(checkpoint="builtin:tiny/target", dtype="float32",
                                            tokenizer="stdlib:bpe:2000"))
  c.draft = ml_collections.ConfigDict(dict(checkpoint="builtin:tiny/draft_other_vocab",
                                           dtype="float32", tokenizer="stdlib:unigram:8000"))
  c.rule = ml_collections.ConfigDict(dict(name="intersection", min_overlap=0.05))
  c.decode = ml_collections.ConfigDict(dict(
      gamma=4, max_new_tokens=64, temperature=1.0, top_k=0, top_p=1.0, seed=0, max_len=0,
      batch_size=1, lookbehind=10))
  c.data = ml_collections.ConfigDict(dict(task="stdlib_lm", tokenizer="stdlib:bpe:2000",
                                          lm_prompt_len=32, max_target_len=64))
  c.prompts = [
      "def read_lines(path):\n    \"\"\"Return the lines of a text file.\"\"\"\n",
      "class Stack:\n    def __init__(self):\n",
      "import os\nimport sys\n\n\ndef main(argv):\n",
  ]
  return c
