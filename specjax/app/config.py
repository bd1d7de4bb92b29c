"""Load a config (`get_config(arg=None) -> ConfigDict`) and apply `--config.a.b=v` overrides.

`tiny.py` (or `tiny`) names a config shipped in `specjax.configs`, found after any install; a path
to a file of the same form works too (`./my_config.py`). `NAME.py:ARG` passes ARG to get_config.
Overrides take the type of the value they replace; only the `rule` section accepts new keys
(each rule has its own hyperparameters, which `builders` checks against the rule's fields).
"""

from __future__ import annotations

import ast
import importlib
import importlib.resources
import importlib.util
from pathlib import Path

import ml_collections

OPEN_SECTIONS = ("rule",)
PACKAGE = "specjax.configs"
NOT_CONFIGS = ("__init__", "common")


class ConfigError(ValueError):
  """A config that cannot be loaded or a value that does not fit its field."""


def shipped() -> list[str]:
  """Names of the configs shipped in specjax.configs."""
  files = importlib.resources.files(PACKAGE).iterdir()
  return sorted(f.name for f in files
                if f.name.endswith(".py") and f.name.removesuffix(".py") not in NOT_CONFIGS)


def _module(name: str):
  """The config module: a file path, else a module of specjax.configs."""
  path = Path(name).expanduser()
  for candidate in (path, path.with_name(path.name + ".py")):
    if candidate.is_file():
      spec = importlib.util.spec_from_file_location(f"specjax_config_{candidate.stem}", candidate)
      module = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)
      return module
  stem = path.name.removesuffix(".py")
  if path.parent == Path(".") and f"{stem}.py" in shipped():
    return importlib.import_module(f"{PACKAGE}.{stem}")
  raise ConfigError(f"config '{name}' is neither a file nor a shipped config. Shipped configs: "
                    f"{', '.join(shipped())}.")


def load_config(name: str, overrides=()) -> ml_collections.ConfigDict:
  file_part, _, arg = name.partition(":")
  module = _module(file_part)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"config '{file_part}' defines no get_config()")
  config = module.get_config(arg) if arg else module.get_config()
  config.unlock()
  for item in overrides:
    apply_override(config, item)
  return config


def apply_override(config: ml_collections.ConfigDict, item: str) -> None:
  """`--config.decode.gamma=5` or `decode.gamma=5`; values typed like the field they replace."""
  key, sep, raw = item.removeprefix("--").removeprefix("config.").partition("=")
  if not sep:
    raise ConfigError(f"override '{item}' needs the form --config.section.field=value")
  *parents, leaf = key.split(".")
  node = config
  for p in parents:
    if p not in node:
      raise ConfigError(f"unknown config section '{p}' in override '{item}'; sections: "
                        f"{', '.join(sorted(node.keys()))}")
    node = node[p]
  if leaf not in node and not (parents and parents[0] in OPEN_SECTIONS):
    raise ConfigError(f"unknown config field '{key}' (override '{item}'); known fields here: "
                      f"{', '.join(sorted(node.keys()))}")
  old = node[leaf] if leaf in node else None
  node[leaf] = _typed(raw, old, key)


def _typed(raw: str, old, key: str):
  if isinstance(old, bool):
    if raw.lower() in ("true", "1", "yes"):
      return True
    if raw.lower() in ("false", "0", "no"):
      return False
    raise ConfigError(f"--config.{key} expects true or false, got '{raw}'")
  if isinstance(old, str):
    return raw
  try:
    value = ast.literal_eval(raw)
  except (ValueError, SyntaxError):
    if not isinstance(old, (int, float)):
      return raw                 # a new rule hyperparameter: the rule's field types it
    try:
      value = float(raw)         # inf, nan
    except ValueError:
      raise ConfigError(f"--config.{key} expects a number, got '{raw}'") from None
  if isinstance(old, float) and isinstance(value, int):
    return float(value)
  if isinstance(old, int) and isinstance(value, float) and not value.is_integer():
    raise ConfigError(f"--config.{key} expects an integer, got '{raw}'")
  return int(value) if isinstance(old, int) and isinstance(value, float) else value
