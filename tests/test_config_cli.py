"""Config loading, overrides, and the decode CLI's error path without weights."""

import os
import subprocess
import sys

import pytest

from specjax.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bare_name_and_typed_overrides():
  c = load_config("t5_xl_small.py", ["--config.decode.gamma=7", "--config.decode.temperature=1",
                                     "--config.target.checkpoint=/tmp/x", "--config.rule.epsilon=0.1"])
  assert c.decode.gamma == 7 and isinstance(c.decode.gamma, int)
  assert c.decode.temperature == 1.0 and isinstance(c.decode.temperature, float)
  assert c.target.checkpoint == "/tmp/x"
  assert c.rule.epsilon == 0.1  # rule sections accept new hyperparameters


@pytest.mark.parametrize("override, message", [
    ("--config.decode.gama=3", "unknown config field 'decode.gama'"),
    ("--config.nope.x=3", "unknown config section 'nope'"),
    ("--config.decode.gamma=2.5", "expected an integer"),
    ("--config.decode.gamma", "needs the form"),
])
def test_bad_overrides(override, message):
  with pytest.raises(ConfigError, match=message):
    load_config("t5_xl_small", [override])


def test_unknown_config_lists_known():
  with pytest.raises(ConfigError, match="t5_xl_small.py"):
    load_config("no_such_config.py")


def test_decode_without_weights_explains_and_exits_nonzero(tmp_path):
  env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), JAX_PLATFORMS="cpu")
  env.pop("SPECJAX_DEBUG", None)
  proc = subprocess.run(
      [sys.executable, "-m", "specjax.decode", "--config", "t5_xl_small.py",
       "--prompt", "summarize: a cat sat on a mat"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0
  assert "Traceback" not in proc.stderr
  assert "google/t5-v1_1-xl" in proc.stderr
  assert "--config.target.checkpoint=DIR" in proc.stderr
  assert len(proc.stderr.strip().splitlines()) <= 6
