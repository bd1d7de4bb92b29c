"""Probe round 6: the embedded pair's smoke builds kept apart from full ones, ..."""

from __future__ import annotations

import pytest

from specjax.app.config import ConfigError


def test_a_smoke_build_of_the_embedded_pair_is_kept_apart_from_the_full_one(tmp_path,
                                                                            monkeypatch):
  """A 2-step build (SPECJAX_ZOO_STEP_SCALE=0) was stored where the full pair goes, and a later
  run without the variable decoded with its untrained models without a word."""
  from specjax.app import zoo
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  monkeypatch.delenv("SPECJAX_ZOO_STEP_SCALE", raising=False)
  assert zoo.pair_dir("tiny") == tmp_path / "zoo" / "tiny"
  monkeypatch.setenv("SPECJAX_ZOO_STEP_SCALE", "0")
  assert zoo.pair_dir("tiny") == tmp_path / "zoo" / "tiny-steps0"
  monkeypatch.setenv("SPECJAX_ZOO_STEP_SCALE", "0.25")
  assert zoo.pair_dir("tiny") == tmp_path / "zoo" / "tiny-steps0.25"
  assert zoo.recipe("tiny").steps.target == 150
  for bad in ("banana", "-1", "nan", "inf", ""):
    monkeypatch.setenv("SPECJAX_ZOO_STEP_SCALE", bad)
    with pytest.raises(ConfigError, match=f"SPECJAX_ZOO_STEP_SCALE='{bad}': the embedded pairs' "
                                          f"training steps are multiplied by it; give a number"):
      zoo.pair_dir("tiny")
