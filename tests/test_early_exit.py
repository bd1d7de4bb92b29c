"""Early exit (api/drafters.py): the target's first layers and head draft for it."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import specjax
from specjax import testing
from specjax.api.loading import LoadedModel
from specjax.app.config import ConfigError, load_config
from specjax.app.methods import speculative
from specjax.models import layers


def _target(scan: bool) -> LoadedModel:
  model, params = testing.tiny_decoder(seed=2, vocab_size=16, num_layers=4)
  model = layers.with_scan(model, scan)
  return LoadedModel(model=model, params=layers.to_layout(params, scan), tokenizer=None,
                     path=None)


@pytest.mark.parametrize("scan", [True, False])
def test_the_draft_is_the_targets_first_layers(scan):
  target = _target(scan)
  draft = specjax.early_exit(target, 2)
  assert draft.model.config.num_layers == 2 and draft.tokenizer is target.tokenizer
  kept = layers.unstack(draft.params)
  whole = layers.unstack(target.params)
  assert sorted(k for k in kept if k.startswith("layers_")) == ["layers_0", "layers_1"]
  jax.tree.map(np.testing.assert_array_equal, kept["layers_1"], whole["layers_1"])
  testing.assert_greedy_sd_is_greedy(target.model, target.params, draft.model, draft.params)


@pytest.mark.parametrize("exit_layer", [0, 4, 2.0, True])
def test_an_exit_layer_outside_the_target_is_refused_with_the_range(exit_layer):
  with pytest.raises(specjax.UsageError, match="the target has 4 layers: choose a whole number "
                                               "from 1 to 3"):
    specjax.early_exit(_target(True), exit_layer)


def test_a_t5_target_is_refused():
  model, params = testing.tiny_t5()
  with pytest.raises(specjax.UsageError, match="encoder-decoder"):
    specjax.early_exit(LoadedModel(model, params, None, None), 1)


def test_the_config_names_the_flag(monkeypatch):
  from specjax.app import methods
  monkeypatch.setattr(methods, "load_placed", lambda *a, **k: _target(False))
  config = load_config("tiny.py", ["--config.draft.method=early_exit",
                                   "--config.draft.exit_layer=9"])
  with pytest.raises(ConfigError, match="--config.draft.exit_layer=9: the target has 4 layers"):
    speculative(config)
  config = load_config("tiny.py", ["--config.draft.method=nope"])
  with pytest.raises(ConfigError, match="use model .* ngram .* early_exit .* or head"):
    speculative(config)


@pytest.mark.parametrize("flags, message", [
    (["--config.draft.exit_layer=4"], "exit_layer=4 is a setting of --config.draft.method="
                                      "early_exit, and this section drafts with model"),
    (["--config.draft.method=early_exit", "--config.draft.exit_layer=2",
      "--config.draft.ngram_max=5"], "ngram_max=5 is a setting of --config.draft.method=ngram"),
    (["--config.draft.method=ngram", "--config.rule.name=slem"],
     "method=ngram cannot serve method slem"),
    (["--config.draft.method=head", "--config.rule.name=slrs"],
     "method=head cannot serve method slrs"),
    (["--config.draft.method=early_exit", "--config.draft.exit_layer=2",
      "--config.rule.name=sprinter", "--config.rule.verifier=V"],
     "method=early_exit cannot serve method sprinter"),
    (["--config.draft.method=head"], "draft.checkpoint='builtin:tiny/draft.*' names a model; a "
                                     "draft head is loaded from the workdir"),
    (["--config.draft.method=head", "--config.draft.checkpoint=/nonexistent/head"],
     "'/nonexistent/head' does not exist: pass the workdir of a draft head run")])
def test_drafter_settings_the_method_does_not_read_are_refused(monkeypatch, flags, message):
  """A drafter field for another method, or a drafter for a method that drafts with a model
  of its own (slem, slrs, sprinter), is refused before any model loads (it was ignored)."""
  from specjax.app import methods
  monkeypatch.setattr(methods, "load_placed", lambda *a, **k: pytest.fail("loaded a model"))
  monkeypatch.setattr(methods.resolve, "checkpoint_dir", lambda *a: pytest.fail("fetched"))
  monkeypatch.setattr(methods.sprinter_verifier, "load", lambda path: (None, None, {}))
  monkeypatch.setattr(methods.sprinter_verifier, "decode_settings", lambda meta, t, g: (0.5, 4))
  with pytest.raises(ConfigError, match=message):
    methods.build(load_config("tiny.py", flags))


@pytest.mark.parametrize("make", [specjax.early_exit, lambda m, k: specjax.sub_vocab(m, k)])
def test_a_name_instead_of_a_loaded_model_is_refused(make):
  with pytest.raises(specjax.UsageError, match=r"=str: pass a loaded model, specjax.load"):
    make("builtin:tiny/target", 2)
