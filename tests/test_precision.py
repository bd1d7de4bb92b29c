"""Matmul precision: every dot of the models carries the config's `precision` ("highest" for
float32 weights, so float32 stays float32 on TF32 GPUs; "default" for bfloat16 ones, whose
products are exact either way), and it is a specjax setting that config.json does not carry."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from specjax import testing
from specjax.models import Prompt, decoder, hf_import, t5

BUILDERS = {"gpt2": testing.tiny_decoder, "t5": testing.tiny_t5}


def _dot_precisions(fn, *args) -> list:
  """The precision of every dot_general in fn's jaxpr, scan bodies and inner jits included."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        found.append(eqn.params["precision"])
      for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          if isinstance(sub, jax.extend.core.ClosedJaxpr):
            walk(sub.jaxpr)
          elif isinstance(sub, jax.extend.core.Jaxpr):
            walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


@pytest.mark.parametrize("family", list(BUILDERS))
@pytest.mark.parametrize("precision", ["highest", "default"])
def test_every_matmul_runs_at_the_config_precision(family, precision):
  model, params = BUILDERS[family]()
  model = dataclasses.replace(model, config=dataclasses.replace(model.config,
                                                                precision=precision))
  prompt = Prompt.from_lists([[3, 4, 5], [6, 7]])
  cache = model.init_cache(2, 8, enc_len=3)
  _, _, filled = model.prefill(params, prompt, cache)
  tokens = np.array([[8, 9], [10, 11]], np.int32)
  found = (_dot_precisions(model.prefill, params, prompt, cache)
           + _dot_precisions(model.extend, params, tokens, filled))
  want = (jax.lax.Precision(precision),) * 2
  assert len(found) >= 12 and set(found) == {want}, set(found)


def test_precision_is_checked_and_not_written_to_config_json(tmp_path):
  for config in (decoder.DecoderConfig, t5.T5Config):
    with pytest.raises(ValueError, match=r"precision 'fast' is not supported; use one of "
                                         r"\('default', 'high', 'highest'\)"):
      config(precision="fast")
  model, params = testing.tiny_decoder()
  fast = dataclasses.replace(model, config=dataclasses.replace(model.config, precision="default"))
  hf_import.save_model(fast, params, str(tmp_path))
  assert "precision" not in json.loads((tmp_path / "config.json").read_text())
  assert hf_import.load_model(str(tmp_path))[0] == model                  # "highest" by default
  loaded, loaded_params = hf_import.load_model(str(tmp_path), precision="default")
  assert loaded == fast
  jax.tree_util.tree_map(np.testing.assert_array_equal, loaded_params, params)


def test_a_checkpoint_loaded_in_bfloat16_runs_at_precision_default(tmp_path):
  """hf_import.default_precision: float32 weights keep "highest"; 16-bit weights get "default"
  (XLA:GPU runs their products as GEMMs there, as reductions at "highest"). Asked for, either
  precision is kept."""
  model, params = testing.tiny_decoder()
  hf_import.save_model(model, params, str(tmp_path))
  assert hf_import.load_model(str(tmp_path))[0].config.precision == "highest"
  half = hf_import.load_model(str(tmp_path), dtype="bfloat16")[0].config
  assert (half.dtype, half.precision) == ("bfloat16", "default")
  asked = hf_import.load_model(str(tmp_path), dtype="bfloat16", precision="highest")[0].config
  assert asked.precision == "highest"
