"""Defects found by the eighth probe round and the items earlier rounds left alone, each with the
behaviour it had: a device read forever as a prompt or problems file, a tiny temperature that
warped to +inf log-probs, a stream that showed text the final text cut at a stop string."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from eval import problems as problem_file
from specjax import decode
from specjax.app.config import ConfigError


@pytest.mark.parametrize("read", [
    lambda path: decode.read_prompt_file(path),
    lambda path: problem_file.load_problems(Path(path)),
])
def test_a_device_is_refused_as_an_input_file(read):
  """--problems /dev/zero read lines forever (memory without bound)."""
  with pytest.raises(ConfigError, match=r"/dev/zero is a device, not a file: give a"):
    read("/dev/zero")


@pytest.mark.parametrize("temperature", [1e-10, 1e-30, 1e-45])
def test_a_tiny_temperature_warps_to_the_argmax_without_inf_or_nan(temperature):
  """Probe round 8: jitted, logits / 1e-10 gave +inf log-probs (XLA fused the division), so
  exact SD with prompt lookup accepted every draft token and its residual sampled id 0; at
  1e-38 the target alone left its greedy tokens."""
  import jax
  import numpy as np
  from specjax.sampling import Warp
  logits = np.random.RandomState(0).randn(2, 5, 400).astype(np.float32) * 10
  for warp in (Warp(temperature), Warp((temperature, 0.7))):
    lp = np.asarray(jax.jit(lambda x, w: w.log_probs(x))(logits, warp))
    assert not np.isnan(lp).any() and (lp <= 0).all()
    np.testing.assert_array_equal(lp[0].argmax(-1), logits[0].argmax(-1))
    assert (lp[0].max(-1) == 0).all()                       # all the mass on the argmax


class _Bytes:
  """A byte-level tokenizer: id = one UTF-8 byte; half a character decodes to U+FFFD."""
  eos_ids, eos_id = (999,), 999
  decode = staticmethod(lambda ids: bytes(ids).decode("utf-8", "replace"))


@pytest.mark.parametrize("stop, text", [(("\n🦜",), "Answer: 42"), (("🦜",), "Answer: 42\n"),
                                        (("x", "2\n🦜"), "Answer: 4")])
def test_the_stream_never_shows_text_that_the_final_text_cuts(stop, text):
  """Probe round 8: with stop "\\n🦜", "42\\n" + half the parrot streamed the newline, which the
  final text cut away (the U+FFFD was held back, the stop string's start before it was not)."""
  from specjax.api import streaming
  ids = list("Answer: 42\n🦜 next".encode())
  shown = []
  streamer = streaming.Streamer(_Bytes(), 1, stop, lambda row, text: shown.append(text))
  for k in range(1, len(ids) + 1):
    if streamer(np.asarray([ids[:k]]), np.asarray([k]))[0]:
      break
  assert "".join(shown) == streaming.final_text(_Bytes(), ids[:k], stop)[1] == text


def test_matmul_refuses_copies_past_the_memory_available(monkeypatch, capsys):
  """--copies 100000000 allocated in silence until it was killed; 400 of the default matrix
  need 22 GB."""
  from eval import matmul
  monkeypatch.setattr(matmul, "_available_bytes", lambda: 24 * 10**9)
  monkeypatch.setattr(matmul, "measure", lambda *a: pytest.fail("measured"))
  assert matmul.main(["--copies", "400"]) == 2
  assert ("--copies 400 holds 400 copies of the 1536 x 8960 weights at once (22.1 GB), and "
          "24.0 GB of memory is available: use --copies 347 or less") in capsys.readouterr().err
  matmul.check_memory(1536, 8960, 347, ["float32"])


@pytest.mark.parametrize("module", ["trace", "roofline", "flags", "shapes", "timing", "problems",
                                    "llamacpp"])
def test_a_library_module_run_as_a_tool_says_which_tool_to_run(module):
  """`python -m eval.trace` and `python -m eval.roofline ANYTHING` did nothing and exited 0."""
  import subprocess
  import sys
  done = subprocess.run([sys.executable, "-m", f"eval.{module}", "x"], capture_output=True,
                        text=True, env={"JAX_PLATFORMS": "cpu", "PATH": ""})
  assert done.returncode == 1 and f"eval.{module} is a library, not a tool: python -m eval." \
      in done.stderr, done.stderr


def test_training_messages_name_the_flags_that_mend_them(tmp_path):
  """lambda1 2 said 'mixture lambda1 must lie in [0, 1]', prompt_len 0 printed a MarkovSource
  repr, a target_len past the positions advised decoding's remedies, and a decode report cut
  short was 'not JSON' at line 1 column 2."""
  import json
  import types
  from specjax.app import builders, fit
  from specjax.data import tasks
  with pytest.raises(ConfigError, match=r"--config.distill: lambda1 must be in \[0, 1\]"):
    builders.train_config({"distill": {"lambda1": 2.0}, "train": {"steps": 1}})
  spec = builders.DataSpec(prompt_len=0, target_len=16)
  with pytest.raises(ConfigError, match=r"--config.data.prompt_len=0: a training example needs "
                     r"at least 1 prompt token"):
    fit.open_source(spec, 2)
  model = types.SimpleNamespace(is_encoder_decoder=False, n_positions=32)
  with pytest.raises(ConfigError, match=r"--config.data.prompt_len=8 \+ --config.data.target_len"
                     r"=100 = 108 positions, and the student reads at most 32"):
    fit.check_data_lengths(builders.DataSpec(prompt_len=8, target_len=100), [("student", model)])
  report = json.dumps({"results": [{"prompt": "a" * 50, "text": "b" * 50}] * 5}, indent=2)
  (tmp_path / "cut.json").write_text(report[:300])
  with pytest.raises(tasks.TaskFileError, match=r"is not JSON \(Unterminated string starting "
                     r"at: line 9"):
    tasks.get_task(f"file:{tmp_path / 'cut.json'}").examples("train")


def test_gamma_auto_is_recorded_as_it_resolved_and_a_partial_of_another_is_refused(
    tmp_path, monkeypatch):
  """The report said "gamma": "auto" (7, 4 or 3 by the machine), and a .partial begun on one
  machine resumed on another with another gamma; "autox" was 'expects a number'."""
  from specjax.app import builders, config, progress, runner
  monkeypatch.setattr(builders, "auto_blocks", lambda quant: (7, 0.7))
  cfg = config.load_config("tiny.py", ["--config.decode.gamma=auto"])
  settings = builders.decode_settings(cfg)
  assert runner.resolved(settings) == {"gamma": 7, "draft_confidence": 0.7}
  here = {**cfg.to_dict(), "prompts": ["a"], "resolved": runner.resolved(settings)}
  progress.Progress(tmp_path / "out.json", here).save([])
  there = dict(here, resolved={"gamma": 4, "draft_confidence": 0.8})
  with pytest.raises(progress.ProgressError, match="differs in resolved.draft_confidence, "
                     "resolved.gamma"):
    progress.Progress(tmp_path / "out.json", there).rows()
  with pytest.raises(ConfigError, match="--config.decode.gamma expects a number or auto, got "
                     "'autox'"):
    config.load_config("tiny.py", ["--config.decode.gamma=autox"])


@pytest.mark.parametrize("top_p", [1e-9, 1e-45, 5e-324])
def test_a_tiny_top_p_keeps_the_top_token(top_p):
  """Probe round 8: a top_p under float32's smallest normal kept nothing, so every token (the
  cutoff index -1) was kept and the text was sampled from the whole distribution."""
  import jax
  from specjax.sampling import Warp
  logits = np.random.RandomState(1).randn(3, 400).astype(np.float32) * 3
  for warp in (Warp(1.0, top_p=top_p), Warp(1.0, top_p=(top_p, 1.0, top_p))):
    lp = np.asarray(jax.jit(lambda x, w: w.log_probs(x))(logits, warp))
    assert (np.isfinite(lp[0]).sum(), lp[0].argmax()) == (1, logits[0].argmax())
