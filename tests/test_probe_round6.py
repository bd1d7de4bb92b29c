"""Probe round 6: the embedded pair's smoke builds kept apart from full ones, alpha when nothing
was verified, draft_confidence=0 with gamma auto, one stop text and types named in words. (This
round's other cases sit with their subjects: test_exactness and test_cross_family for a draft of
another width, test_load_errors for quantized checkpoints and damaged tokenizer files,
test_gguf_import, test_param_cache, test_decode_inputs, test_api and test_cpu_kernels.)"""

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


def test_a_run_that_drafted_but_verified_nothing_reports_alpha_as_none():
  """Result.stats lacked acceptance_rate when nothing was verified (max_new_tokens=1, or a stop
  string in the first block): docs/api.md's first example raised KeyError. The target alone has
  no alpha; the stats line prints none for either."""
  from specjax.api.results import aggregate
  from specjax.app import runner
  drafted = aggregate([{"blocks": 1, "drafted": 4, "accepted": 0, "verified": 0, "emitted": 1,
                        "target_passes": 1, "draft_passes": 5}])
  alone = aggregate([{"blocks": 1, "drafted": 0, "accepted": 0, "verified": 0, "emitted": 1,
                      "target_passes": 1, "draft_passes": 0}])
  assert drafted["acceptance_rate"] is None and "acceptance_rate" not in alone
  assert aggregate([{"accepted": 3, "verified": 4, "drafted": 4}])["acceptance_rate"] == 0.75
  line = runner.summary_line(drafted, {"decode_s": 1.0, "tokens": 1, "compile_s": 0.1}, 0.5)
  assert "alpha" not in line and "tau 1.00" in line


@pytest.mark.parametrize("flags, confidence", [
    (["--config.decode.gamma=auto", "--config.decode.draft_confidence=0"], 0.0),   # was 0.7
    (["--config.decode.gamma=auto", "--config.decode.draft_confidence=0.5"], 0.5),
    (["--config.decode.gamma=auto"], None),                                       # auto's own
    (["--config.decode.gamma=5"], 0.0),
    (["--config.decode.draft_confidence=0.6"], 0.6),
])
def test_a_draft_confidence_set_with_gamma_auto_is_kept_even_zero(flags, confidence):
  from specjax.app import builders
  from specjax.app.config import load_config
  settings = builders.decode_settings(load_config("tiny.py", flags))
  want = builders.auto_blocks("")[1] if confidence is None else confidence
  assert settings.draft_confidence == want


def test_one_stop_text_and_types_in_words():
  """--config.decode.stop=abc was refused ("holds a tuple"), while --config.decode.stop="[5]" was
  told the field takes `tuple[str, ...] | str`; max_depth=abc "is not a int"."""
  from specjax.app import builders
  from specjax.app.config import load_config
  assert builders.decode_settings(load_config("tiny.py", ["--config.decode.stop=abc"])).stop \
      == ("abc",)
  with pytest.raises(ConfigError, match=r"decode.stop=\(5,\) is not a list of texts or a text$"):
    builders.decode_settings(load_config("tiny.py", ["--config.decode.stop=[5]"]))
  assert builders._name(int) == "a whole number" and builders._name(float | None) == "a number"


def test_a_coordinator_that_nothing_answers_at_is_named_within_the_join_timeout(monkeypatch,
                                                                                 caplog):
  """Probe round 7: a process > 0 whose coordinator is absent waited 300 s in silence and was
  then aborted by JAX (a C++ stack); a bad address too."""
  import socket
  import time
  from specjax import sharding
  monkeypatch.setattr(sharding, "JOIN_TIMEOUT_S", 2)
  with socket.socket() as free:
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]                       # closed again: nothing listens there
  start = time.monotonic()
  with pytest.raises(sharding.DistributedSetupError, match=f"nothing answered at "
                     f"127.0.0.1:{port} .*start process 0 there first"):
    sharding._reach(f"127.0.0.1:{port}", 2, 1)
  assert time.monotonic() - start < 10
  with pytest.raises(sharding.DistributedSetupError, match="nothing answered at nohost:abc"):
    sharding._reach("nohost:abc", 2, 1)
  done = sharding.threading.Event()
  monkeypatch.setattr(done, "wait", lambda s: done.is_set() or done.set())
  with caplog.at_level("WARNING", logger="specjax.sharding"):
    sharding._still_waiting(done, "h:1", 2)
  assert "still waiting after" in caplog.text and "for the 2 processes of h:1" in caplog.text


def test_a_negative_process_id_is_refused_not_taken_as_unset():
  """Probe round 7: distributed.process_id=-3 was reported as "process_id (not set)"."""
  from specjax.app import builders
  from specjax.app.config import load_config
  config = load_config("distill_tiny.py", ["--config.distributed.enabled=true",
                                           "--config.distributed.process_id=-3"])
  with pytest.raises(ConfigError, match=r"--config.distributed: num_processes=0, process_id=-3: "
                                        r"use num_processes >= 1 and process_id 0 \.\."):
    builders.join_processes(config)
