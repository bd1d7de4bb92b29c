"""Acceptance rules as the API takes them: a registered name with its hyperparameters, or a rule
object; what a rule needs from the two models (a cross-vocabulary map) is built here, and a
same-vocabulary rule with a draft on another tokenizer is refused, never switched."""

from __future__ import annotations

import dataclasses
import io
import logging

import numpy as np

from specjax.acceptance import registry, vocab
from specjax.acceptance.base import Rule
from specjax.api.errors import UsageError, check_types
from specjax.api.loading import LoadedModel
from specjax.api.methods import check_same_vocabulary
from specjax.data.cache import atomic_write_bytes, cache_dir, settings_key

log = logging.getLogger(__name__)

BUILT = ("vocab",)            # rule fields built from the models, never passed by the user
_VOCAB_MAPS: dict[tuple, vocab.VocabMap] = {}


def hyperparameters(cls: type) -> list[str]:
  """The fields of a rule class that a user sets (`eps` of lenient, `tau` of fuzzy, ...)."""
  return [f.name for f in dataclasses.fields(cls) if f.init and f.name not in BUILT]


def rule_class(name: str) -> type:
  """The acceptance rule registered as `name`, or a UsageError listing the known ones."""
  try:
    return registry.rule_class(name)
  except registry.UnknownRuleError as err:
    raise UsageError(f"unknown rule {name!r}: acceptance rules are {', '.join(err.known)}; "
                     f"decoding methods with a draft are sprinter, slem and slrs") from None


def make(rule: str | Rule, args: dict, target: LoadedModel, draft: LoadedModel) -> Rule:
  """A rule object for this target and draft: `rule` by name with `args` as its
  hyperparameters, or a rule object (then args must be empty); a cross-vocabulary rule gets the
  vocabulary map of the two tokenizers (built once per pair of tokenizers)."""
  if isinstance(rule, Rule):
    if args:
      raise UsageError(f"rule={rule!r} is a rule object: set its hyperparameters on it, not as "
                       f"arguments ({', '.join(sorted(args))})")
    cls, values = type(rule), {}
  else:
    cls = rule_class(rule)
    known = hyperparameters(cls)
    unknown = sorted(set(args) - set(known))
    if unknown:
      raise UsageError(f"rule {rule!r} takes no argument {', '.join(unknown)}; its "
                       f"hyperparameters are {', '.join(known) or '(none)'}")
    values = args
    check_types(cls, values, f"rule {rule!r}: ")
  fixed = fixed_args(cls.rule_name, target, draft)
  try:
    if isinstance(rule, Rule):
      made = dataclasses.replace(rule, **fixed) if fixed else rule
    else:
      made = cls(**values, **fixed)
  except (TypeError, ValueError) as err:
    prefix = f"rule {cls.rule_name!r}: "
    raise UsageError(("" if str(err).startswith(prefix) else prefix) + str(err)) from None
  check_one_value_each(type(made), {n: getattr(made, n) for n in made.traced})
  return made


def check_one_value_each(cls: type, values: dict, flag: str = "") -> None:
  """Refuse a traced hyperparameter given per row (fuzzy's threshold as a sequence): the rule's
  rows are a batch's, which batch_size and padding decide, not the prompts; a decoder's rule
  has one value of each (as vLLM's speculative config is one per engine). `flag` prefixes the
  field's name in the message ("--config.rule.")."""
  per_row = [n for n in cls.traced if isinstance(values.get(n), (list, tuple))]
  if per_row:
    name = per_row[0]
    raise UsageError(f"rule {cls.rule_name!r}: {flag}{name}={values[name]!r} gives one value per "
                     f"batch row; a decoder's rule takes one value: give one number (a sweep "
                     f"over values reuses the compiled loop)")


def fixed_args(name: str, target: LoadedModel, draft: LoadedModel,
               rule_flag: str = "rule") -> dict:
  """The rule's fields built from the two models: {} for same-vocabulary rules (after checking
  that the draft's tokenizer gives the target's ids), {"vocab": VocabMap} for the others."""
  if registry.rule_class(name).needs_same_vocab:
    check_same_vocabulary(target, draft, f"{rule_flag}={name}", rule_flag)
    return {}
  return {"vocab": vocab_map(target, draft)}


def vocab_map(target: LoadedModel, draft: LoadedModel) -> vocab.VocabMap:
  """The VocabMap between the two models' tokenizers and logits widths, built once per pair and
  kept in memory and under cache_dir() (keyed by what decides the ids: the tokenizers'
  fingerprints and the widths; building one for two real tokenizers takes seconds)."""
  key = (target.tokenizer.fingerprint, draft.tokenizer.fingerprint, target.model.vocab_size,
         draft.model.vocab_size)
  if key not in _VOCAB_MAPS:
    _VOCAB_MAPS[key] = _cached_map(target, draft, key)
  return _VOCAB_MAPS[key]


VOCAB_MAP_VERSION = 1       # bump when vocab.build's output changes
_MAP_FIELDS = ("d2t", "t2d", "images", "image_len")


def _cached_map(target: LoadedModel, draft: LoadedModel, key: tuple) -> vocab.VocabMap:
  path = cache_dir() / f"vocab-map-{settings_key({'v': VOCAB_MAP_VERSION, 'key': key})}.npz"
  sizes = dict(target_vocab=target.tokenizer.vocab_size, draft_vocab=draft.tokenizer.vocab_size)
  try:
    with np.load(path, allow_pickle=False) as f:
      vmap = vocab.VocabMap(**{k: f[k] for k in _MAP_FIELDS}, **sizes)
    log.info("%s (cached: %s)", vmap.report(), path)
    return vmap
  except (OSError, KeyError, ValueError):
    pass                                  # absent or damaged: build it again
  vmap = vocab.build(target.tokenizer, draft.tokenizer, target_width=target.model.vocab_size,
                     draft_width=draft.model.vocab_size)
  buffer = io.BytesIO()
  np.savez(buffer, **{k: getattr(vmap, k) for k in _MAP_FIELDS})
  atomic_write_bytes(path, buffer.getvalue())
  return vmap
