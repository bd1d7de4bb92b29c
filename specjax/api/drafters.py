"""Drafters built from the target itself (no second checkpoint): early exit, the target's first
layers with its final norm and head (LayerSkip's self-speculation; transformers'
`assistant_early_exit`). Prompt lookup, the drafter without a model, is decoding/ngram.NGram."""

from __future__ import annotations

import dataclasses

from specjax.api.errors import UsageError
from specjax.api.loading import LoadedModel
from specjax.models import layers as layers_lib


def early_exit(target: LoadedModel, exit_layer: int, flag: str = "exit_layer") -> LoadedModel:
  """The target's first `exit_layer` layers (1 .. layers - 1) with its embedding, final norm and
  head, as a draft model with the target's tokenizer and its own cache. A model that was not
  trained to exit early (LayerSkip was) predicts poorly from a middle layer: expect a low
  acceptance rate. `flag` names the setting in errors."""
  model = target.model
  if model.is_encoder_decoder:
    raise UsageError(f"{flag}: early exit drafts with a decoder-only target's first layers; "
                     f"{type(model).__name__} is an encoder-decoder: give a draft checkpoint")
  layers = model.config.num_layers
  if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or \
      not 1 <= exit_layer <= layers - 1:
    raise UsageError(f"{flag}={exit_layer!r}: the target has {layers} layers: choose a whole "
                     f"number from 1 to {layers - 1}")
  draft = dataclasses.replace(model, config=dataclasses.replace(model.config,
                                                                num_layers=exit_layer))
  return LoadedModel(model=draft, params=layers_lib.first_layers(target.params, exit_layer),
                     tokenizer=target.tokenizer, path=target.path)
