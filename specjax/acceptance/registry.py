"""Acceptance rules by name: `@register("exact")` on a Rule subclass, `get("exact", **hparams)`.

Built-in rule modules are imported lazily on the first lookup, so that a new family only has to
live in `specjax/acceptance/<module>.py` and be listed in `_BUILTIN_MODULES`.
"""

from __future__ import annotations

import dataclasses
import importlib


_RULES: dict[str, type] = {}


class UnknownRuleError(ValueError):
  """A rule name that no module registered; carries the known names."""

  def __init__(self, name: str, known: list[str]):
    super().__init__(f"unknown acceptance rule {name!r}; known rules: {', '.join(known)}")
    self.name, self.known = name, known
_BUILTIN_MODULES = ("exact", "lenient", "fuzzy", "adaptive", "vocab")
_loaded = False


def register(name: str):
  """Class decorator: make the Rule subclass available as `get(name, ...)`."""
  def wrap(cls):
    if name in _RULES and _RULES[name] is not cls:
      raise ValueError(f"acceptance rule {name!r} is registered twice "
                       f"({_RULES[name].__module__} and {cls.__module__})")
    _RULES[name] = cls
    cls.rule_name = name
    return cls
  return wrap


def _load_builtins() -> None:
  global _loaded
  if _loaded:
    return
  _loaded = True
  for module in _BUILTIN_MODULES:
    full = f"specjax.acceptance.{module}"
    try:
      importlib.import_module(full)
    except ModuleNotFoundError as err:
      if err.name != full:      # a real import error inside an existing module: surface it
        raise


def names() -> list[str]:
  _load_builtins()
  return sorted(_RULES)


def rule_class(name: str) -> type:
  """The Rule subclass registered as `name`."""
  _load_builtins()
  if name not in _RULES:
    raise UnknownRuleError(name, names())
  return _RULES[name]


def get(name: str, **hparams):
  """Build the rule registered as `name` with its hyperparameters (e.g. get("lenient", eps=0.1))."""
  cls = rule_class(name)
  fields = [f.name for f in dataclasses.fields(cls)]
  unknown = sorted(set(hparams) - set(fields))
  if unknown:
    raise ValueError(f"acceptance rule {name!r} has no hyperparameter {', '.join(unknown)}; "
                     f"its hyperparameters are: {', '.join(fields) or '(none)'}")
  return cls(**hparams)
