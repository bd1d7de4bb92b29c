"""The API's own error, and the type check of keyword arguments against a dataclass's fields:
a call that cannot be carried out as asked is refused before any work."""

from __future__ import annotations

import numbers
import types
import typing
from typing import Any, Mapping


class UsageError(ValueError):
  """An argument the API refuses (an unknown rule or argument, a draft no rule can use, prompts
  of the wrong type): the message names the argument and the fix."""


def check_types(cls: type, values: Mapping[str, Any], what: str = "") -> None:
  """Refuse a value that is not of its field's annotated type in `cls` (int, float, bool, str,
  tuples and unions of them; a float field takes an int, never a bool)."""
  hints = typing.get_type_hints(cls)
  for name, value in values.items():
    if name in hints and not _conforms(value, hints[name]):
      raise UsageError(f"{what}{name}={value!r} is not {_describe(hints[name])}")


def _conforms(value, hint) -> bool:
  origin = typing.get_origin(hint)
  if hint is Any:
    return True
  if origin in (typing.Union, types.UnionType):
    return any(_conforms(value, h) for h in typing.get_args(hint))
  if origin is tuple:
    args = typing.get_args(hint)
    if not isinstance(value, (tuple, list)):
      return False
    inner = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
    return len(inner) == len(value) and all(_conforms(v, h) for v, h in zip(value, inner))
  if hint is type(None):
    return value is None
  if hint is bool:
    return isinstance(value, bool)
  if hint is int:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
  if hint is float:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
  return not isinstance(hint, type) or isinstance(value, hint)


def _describe(hint) -> str:
  origin = typing.get_origin(hint)
  if origin in (typing.Union, types.UnionType):
    return " or ".join(_describe(h) for h in typing.get_args(hint))
  if origin is tuple:
    return f"a tuple of {_describe(typing.get_args(hint)[0])}"
  names = {int: "an integer", float: "a number", bool: "True or False", str: "a string"}
  return names.get(hint, f"a {getattr(hint, '__name__', hint)}")
