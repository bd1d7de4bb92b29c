"""Load `configs/*.py` files (`get_config(arg=None) -> ConfigDict`) and apply `--config.a.b=v` overrides.

A bare name (`tiny.py`, `tiny`) resolves in ./configs, then in the configs/ folder beside the
installed package; `NAME.py:ARG` passes ARG to get_config. Overrides are typed by the value they
replace; only the `rule` section accepts new keys (each rule has its own hyperparameters, which the
rule registry validates).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import ml_collections

OPEN_SECTIONS = ("rule",)


class ConfigError(ValueError):
  pass


def resolve_path(name: str) -> Path:
  candidates = [Path(name)]
  if not name.endswith(".py"):
    candidates.append(Path(name + ".py"))
  for base in (Path.cwd() / "configs", Path(__file__).resolve().parent.parent / "configs"):
    candidates += [base / c.name for c in list(candidates[:2])]
  for c in candidates:
    if c.is_file():
      return c
  known = sorted(p.name for p in (Path(__file__).resolve().parent.parent / "configs").glob("*.py"))
  raise ConfigError(f"config '{name}' not found (looked in ./ and configs/). Known configs: "
                    f"{', '.join(known) or 'none'}.")


def load_config(name: str, overrides: list[str] | tuple[str, ...] = ()) -> ml_collections.ConfigDict:
  file_part, _, arg = name.partition(":")
  path = resolve_path(file_part)
  spec = importlib.util.spec_from_file_location(f"specjax_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"{path} defines no get_config()")
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
      raise ConfigError(f"unknown config section '{p}' in override '{item}'")
    node = node[p]
  if leaf not in node and not (parents and parents[0] in OPEN_SECTIONS):
    raise ConfigError(f"unknown config field '{key}' (override '{item}'); known fields here: "
                      f"{', '.join(sorted(node.keys()))}")
  old = node[leaf] if leaf in node else None
  node[leaf] = _typed(raw, old)


def _typed(raw: str, old):
  if isinstance(old, bool):
    if raw.lower() in ("true", "1", "yes"):
      return True
    if raw.lower() in ("false", "0", "no"):
      return False
    raise ConfigError(f"expected true/false, got '{raw}'")
  if isinstance(old, str):
    return raw
  try:
    value = ast.literal_eval(raw)
  except (ValueError, SyntaxError):
    return raw
  if isinstance(old, float) and isinstance(value, int):
    return float(value)
  if isinstance(old, int) and isinstance(value, float) and not value.is_integer():
    raise ConfigError(f"expected an integer, got '{raw}'")
  return int(value) if isinstance(old, int) and isinstance(value, float) else value
