"""Config loading, overrides, and the decode CLI's error path without weights."""

import os
import re
import subprocess
import sys

import pytest

from specjax.app import builders
from specjax.app.config import ConfigError, load_config, shipped

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
    ("--config.decode.gamma=2.5", "expects an integer"),
    ("--config.decode.gamma=abc", "expects a number"),
    ("--config.decode.greedy=true", "unknown config field"),
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


def test_shipped_configs_load_from_any_directory(tmp_path):
  """Configs live in the package: a plain import finds them wherever the user stands."""
  assert {"tiny.py", "t5_xl_small.py", "distill_lm1b.py"} <= set(shipped())
  code = ("from specjax.app.config import load_config; "
          "print(load_config('tiny.py').decode.gamma, load_config('distill_lm1b').train.steps)")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.split() == ["4", "300000"]


def test_a_config_file_by_path(tmp_path):
  path = tmp_path / "mine.py"
  path.write_text("import ml_collections\n"
                  "def get_config(arg=None):\n"
                  "  return ml_collections.ConfigDict(dict(decode=dict(gamma=int(arg or 2))))\n")
  assert load_config(str(path)).decode.gamma == 2
  assert load_config(f"{path}:9").decode.gamma == 9


@pytest.mark.parametrize("section, values, message", [
    ("decode", {"gamma": "abc"}, "decode.gamma='abc' is not a whole number"),
    ("decode", {"gama": 3}, "unknown field.*gama.*known fields: batch_size"),
    ("decode", {"temperature": "hot"}, "decode.temperature='hot' is not a number"),
    ("rule", {"name": "lenient", "eps": "x"}, "rule.eps='x' is not a number"),
    ("rule", {"name": "lenient", "epsilon": 0.1}, "unknown field.*epsilon.*known fields: eps"),
    ("target", {"checkpoint": "x", "d_model": 3}, "need arch=decoder or arch=t5"),
])
def test_builders_refuse_unknown_keys_and_mistyped_values(section, values, message):
  import ml_collections
  config = ml_collections.ConfigDict({section: values})
  build = {"decode": builders.decode_settings, "rule": builders.rule,
           "target": lambda c: builders.model_spec(c, "target")}[section]
  with pytest.raises(ConfigError, match=message):
    build(config)


def test_builders_type_values_by_annotation():
  import ml_collections
  config = ml_collections.ConfigDict(dict(
      decode=dict(gamma=5.0, temperature=0, top_p="0.9"),
      rule=dict(name="fuzzy", threshold=[0.1, 0.2], divergence="js")))
  settings = builders.decode_settings(config)
  assert (settings.gamma, settings.temperature, settings.top_p) == (5, 0.0, 0.9)
  assert isinstance(settings.gamma, int) and isinstance(settings.temperature, float)
  assert builders.rule(config).threshold == (0.1, 0.2)
  spec = builders.model_spec(ml_collections.ConfigDict(dict(
      draft=dict(arch="decoder", d_model=32, num_layers=1, init_from=""))), "draft")
  assert spec.arch == "decoder" and dict(spec.fields) == {"d_model": 32, "num_layers": 1}


@pytest.mark.parametrize("override,message", [
    ("--config.decode.stop=5", "--config.decode.stop=5 does not fit the field, which holds a tuple"),
    ("--config.prompts=5", "which holds a list: write it in that form"),
    ("--config.rule=exact", "--config.rule is a section: set its fields"),
    ("--config.decode=5", "--config.decode is a section"),
])
def test_an_override_of_a_list_or_a_section_is_refused_with_the_form(override, message):
  with pytest.raises(ConfigError, match=re.escape(message)):
    load_config("tiny.py", [override])


def test_a_string_for_a_number_or_tuple_field_names_the_field():
  from specjax.app import builders
  with pytest.raises(ConfigError, match=r"--config.rule.threshold='abc' is not a"):
    builders.coerce("abc", float | tuple[float, ...], "rule.threshold")
  assert builders.coerce([0.5, 1], float | tuple[float, ...], "rule.threshold") == (0.5, 1.0)
