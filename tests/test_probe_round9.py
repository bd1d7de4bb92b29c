"""Defects found by the ninth probe round (sampled laws by chi-square tests), each with the
behaviour it had."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from specjax import testing
from specjax.acceptance import registry
from specjax.decoding import speculative
from specjax.models import Prompt
from specjax.sampling import Warp


@pytest.mark.parametrize("divergence", ["js_m", "js", "kl", "rkl"])
def test_fuzzy_threshold_0_accepts_nothing_from_a_draft_equal_to_the_target(divergence):
  """Threshold 0 is target-only decoding (strict <). With the draft equal to the target, these
  divergences rounded to about -1e-8 and the draft's argmax was accepted: 7,612 of 20,000
  drafts through the API, and the chi-square test against the target's law gave p = 0."""
  model = testing.ToyAR(6, 8)
  params = model.init_params(jax.random.PRNGKey(0))
  rule = registry.get("fuzzy", threshold=0.0, divergence=divergence)
  out = speculative.generate(model, params, model, params, Prompt.from_lists([[1]] * 256),
                             jax.random.PRNGKey(3), rule=rule, gamma=3, max_new_tokens=6,
                             warp=Warp(1.0), eos_id=0)
  totals = out.stats.totals()
  assert totals["drafted"] > 0 and totals["accepted"] == 0, totals



def test_a_prompt_past_a_rotary_models_trained_context_is_warned_about(caplog):
  """Probe round 10: nothing bounds a rotary model's prompt (no position table); a 116k-token
  prompt for Qwen (trained for 32,768) was padded to 131,072 positions without a word."""
  import types
  from specjax.api import prompt_fit
  model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=64))
  with caplog.at_level("WARNING", logger=prompt_fit.__name__):
    prompt_fit.warn_past_context(model, "the target", 60, 4, "")
    assert not caplog.records
    prompt_fit.warn_past_context(model, "the target", 60, 5, "")
  assert "a prompt of 60 tokens and 5 new tokens run past the 64 positions the target was " \
      "trained for" in caplog.text and "truncate='left' with max_len=64" in caplog.text
