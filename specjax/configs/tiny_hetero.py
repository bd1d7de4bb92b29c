"""The embedded default with a draft on ANOTHER tokenizer (Timor et al., ICML'25): the target of
tiny.py (stdlib:bpe:2000) and a draft trained on stdlib:unigram:8000 (specjax.app.zoo).

    python -m specjax.decode --config tiny_hetero.py                                 # TLI
    python -m specjax.decode --config tiny_hetero.py --config.rule.name=union
    python -m specjax.decode --config tiny_hetero.py --config.rule.name=slem --config.decode.temperature=0
    python -m specjax.decode --config tiny_hetero.py --config.rule.name=slrs --config.rule.max_depth=2

rule.name: intersection / union run in the jitted loop with a VocabMap built from the two
tokenizers (overlap logged at start-up; refused below rule.min_overlap); slem / slrs run the
host-driven string-level loop (specjax.decoding.string_level), batch 1.
"""

import ml_collections

from specjax.configs import common


def get_config():
  c = ml_collections.ConfigDict()
  c.target = common.model("builtin:tiny/target", tokenizer="stdlib:bpe:2000")
  c.draft = common.draft("builtin:tiny/draft_other_vocab")   # its own tokenizer (spm.model)
  c.rule = common.rule("intersection")      # min_overlap: 0.05 by default
  # A target token can take several draft tokens (5 for this pair) and the draft's cache has
  # 256 positions: 64 new tokens could need 5 * 64 + gamma of them before the prompt.
  c.decode = common.decode(max_new_tokens=32)
  c.mesh = common.mesh(1, 1)        # one device; --config.mesh.* to shard
  c.distributed = common.distributed()
  c.data = common.stdlib_lm_data()
  c.prompts = list(common.STDLIB_PROMPTS)
  return c
