"""The real coder pair on an input-grounded task: the answer repeats most of its input (rename a
variable, add type hints, add a docstring), where prompt lookup drafts well.

    python -m specjax.decode --config qwen_coder_edit.py --config.draft.method=ngram
    python -m eval.latency --config qwen_coder_edit.py --config.draft.method=ngram --num_prompts 6

Greedy, chat prompts (the instruct model answers with the edited code), 128 new tokens. The
prompts were written for this measurement, not taken from a benchmark.
"""

from specjax.configs import common, qwen_coder

_CODE = (
    "def moving_average(values, width):\n"
    "    out = []\n"
    "    total = 0.0\n"
    "    for i, x in enumerate(values):\n"
    "        total += x\n"
    "        if i >= width:\n"
    "            total -= values[i - width]\n"
    "        if i >= width - 1:\n"
    "            out.append(total / width)\n"
    "    return out\n"
)
_CLASS = (
    "class Inventory:\n"
    "    def __init__(self):\n"
    "        self.items = {}\n\n"
    "    def add(self, name, count):\n"
    "        self.items[name] = self.items.get(name, 0) + count\n\n"
    "    def remove(self, name, count):\n"
    "        if self.items.get(name, 0) < count:\n"
    "            raise ValueError(name)\n"
    "        self.items[name] -= count\n\n"
    "    def total(self):\n"
    "        return sum(self.items.values())\n"
)
PROMPTS = (
    f"Rename the variable `total` to `window_sum` in this function. Reply with the code only.\n\n"
    f"{_CODE}",
    f"Add type hints to this function. Reply with the code only.\n\n{_CODE}",
    f"Rename the attribute `items` to `stock` in this class. Reply with the code only.\n\n{_CLASS}",
    f"Add type hints to every method of this class. Reply with the code only.\n\n{_CLASS}",
    f"Add a one-line docstring to this function. Reply with the code only.\n\n{_CODE}",
    f"Add a one-line docstring to every method of this class. Reply with the code only.\n\n"
    f"{_CLASS}",
)


def get_config():
  c = qwen_coder.get_config()
  c.draft.vocab_top_k = 0        # prompt lookup, this config's drafter, has no head to cut
  c.decode = common.decode(gamma=4, temperature=0.0, max_new_tokens=128, chat=True)
  c.prompts = list(PROMPTS)
  return c
