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
import os
import stat
import traceback
from pathlib import Path

import ml_collections

OPEN_SECTIONS = ("rule",)
# Words a numeric field also takes, whatever its config's default (decode.gamma=4 in tiny.py).
WORDS = {"decode.gamma": ("auto",)}
PACKAGE = "specjax.configs"
NOT_CONFIGS = ("__init__", "common")


class ConfigError(ValueError):
  """A config that cannot be loaded or a value that does not fit its field."""


def shipped() -> list[str]:
  """Names of the configs shipped in specjax.configs."""
  files = importlib.resources.files(PACKAGE).iterdir()
  return sorted(f.name for f in files
                if f.name.endswith(".py") and f.name.removesuffix(".py") not in NOT_CONFIGS)


def config_file(name: str) -> Path | None:
  """The file a --config names (`NAME.py:ARG` included): a path, else a shipped config's file;
  None when it is neither."""
  path = Path(name.partition(":")[0]).expanduser()
  for candidate in (path, path.with_name(path.name + ".py")):
    if candidate.is_file():
      return candidate
  stem = path.name.removesuffix(".py")
  if path.parent == Path(".") and f"{stem}.py" in shipped():
    return Path(str(importlib.resources.files(PACKAGE) / f"{stem}.py"))
  return None


def _module(name: str):
  """The config module: a file path, else a module of specjax.configs. An error in the file's
  code is a ConfigError naming the file and the line."""
  file = config_file(name)
  if file is None:
    raise ConfigError(f"config '{name}' is neither a file nor a shipped config. Shipped configs: "
                      f"{', '.join(shipped())}.")
  try:
    if file.parent == Path(str(importlib.resources.files(PACKAGE))):
      return importlib.import_module(f"{PACKAGE}.{file.stem}")
    spec = importlib.util.spec_from_file_location(f"specjax_config_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
  except ConfigError:
    raise
  except Exception as err:        # whatever the file's code raises, SyntaxError included
    raise code_error(err, file, "fix the config file") from None


def code_error(err: BaseException, file: Path, fix: str) -> ConfigError:
  """An exception raised by a config file's code -> one line: the file, the line of the file
  that raised it (a syntax error's own line), the error and `fix`."""
  if isinstance(err, SyntaxError):
    line, text, what = err.lineno, (err.text or "").strip(), f"SyntaxError: {err.msg}"
  else:
    frames = [f for f in traceback.extract_tb(err.__traceback__) if _same(f.filename, file)]
    line, text = (frames[-1].lineno, frames[-1].line) if frames else (None, "")
    what = f"{type(err).__name__}: {err}"
  where = f"{file}, line {line}" + (f" ({text})" if text else "") if line else str(file)
  return ConfigError(f"config {where}: {what}: {fix}")


def _same(a: str, b: Path) -> bool:
  try:
    return Path(a).resolve() == b.resolve()
  except OSError:
    return False


def load_config(name: str, overrides=()) -> ml_collections.ConfigDict:
  """The ConfigDict of `get_config()` (`get_config(ARG)` for `NAME.py:ARG`), then the
  overrides; a config that fails or returns something else is a ConfigError naming the file."""
  file_part, _, arg = name.partition(":")
  module = _module(file_part)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"config '{file_part}' defines no get_config()")
  file = config_file(file_part)
  try:
    config = module.get_config(arg) if arg else module.get_config()
  except ConfigError:
    raise
  except Exception as err:
    raise code_error(err, file, "fix the config's get_config()") from None
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f"config {file}: get_config() returned {type(config).__name__}, not an "
                      f"ml_collections.ConfigDict: return ml_collections.ConfigDict(...)")
  config.unlock()
  for item in overrides:
    apply_override(config, item)
  return config


# The fields, in any section, that name files or directories a run reads.
INPUT_FIELDS = ("checkpoint", "init_from", "tokenizer", "verifier")


def input_paths(name: str, config) -> dict[str, str]:
  """The files and directories a run reads, by the flag that names them: the --config file
  `name` and every existing local path among the sections' checkpoint, init_from, tokenizer and
  verifier fields (what outputs.check_not_input compares an output with)."""
  file = config_file(name) if name else None
  out = {"--config": str(file)} if file else {}
  sections = [(k, v) for k, v in config.items() if hasattr(v, "get")] \
      if hasattr(config, "items") else []
  for section, values in sections:
    for field in INPUT_FIELDS:
      value = values.get(field)
      local = _local_input(value) if isinstance(value, str) and value else None
      if local is not None:
        out[f"--config.{section}.{field}"] = str(local)
  return out


def check_input_file(path: Path, flag: str, what: str) -> None:
  """Refuse a device or a socket given for an input file (/dev/zero was read forever, a
  terminal waits on a person), naming `flag` and `what` to give; a pipe (/dev/stdin from a
  shell) is read as a file. A missing path is left to the reader's own message."""
  try:
    mode = os.stat(path).st_mode
  except OSError:
    return
  if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISSOCK(mode):
    kind = "a socket" if stat.S_ISSOCK(mode) else "a device"
    raise ConfigError(f"{flag} {path} is {kind}, not a file: give {what}")


def _local_input(value: str) -> Path | None:
  """The existing local path that a field's value names, found without fetching or building
  anything: a path as it is; a hub id (ORG/NAME) already in the local Hugging Face cache, its
  snapshot directory. Pair names (builtin:, pypi:) live in specjax's cache, which
  outputs.check_not_input refuses as a whole."""
  path = Path(value).expanduser()
  if path.exists():
    return path
  if ":" in value or value.count("/") != 1 or value.startswith((".", "/", "~")):
    return None
  from specjax.models import hf_import
  try:
    return hf_import.resolve_checkpoint(value)
  except Exception:         # not cached (or no huggingface_hub): nothing of it to overwrite
    return None


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
  if hasattr(old, "keys"):
    raise ConfigError(f"--config.{key} is a section: set its fields, --config.{key}.FIELD=VALUE "
                      f"(fields: {', '.join(sorted(old.keys()))})")
  if raw in WORDS.get(key, ()):
    with node.ignore_type():
      node[leaf] = raw
    return
  value = _typed(raw, old, key)
  if isinstance(old, (list, tuple)) and isinstance(value, str):
    value = (value,)             # one text for a list of texts (decode.stop=TEXT)
  try:
    node[leaf] = value
  except (TypeError, ValueError) as err:
    form = "['TEXT', ...]" if isinstance(old, (list, tuple)) else repr(old)[:40]
    raise ConfigError(f"--config.{key}={raw} does not fit the field, which holds a "
                      f"{type(old).__name__}: write it in that form, e.g. "
                      f"--config.{key}=\"{form}\"") from err


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
      words = "".join(f" or {w}" for w in WORDS.get(key, ()))
      raise ConfigError(f"--config.{key} expects a number{words}, got '{raw}'") from None
  if isinstance(old, float) and isinstance(value, int):
    return float(value)
  if isinstance(old, int) and isinstance(value, float) and not value.is_integer():
    raise ConfigError(f"--config.{key} expects an integer, got '{raw}'")
  return int(value) if isinstance(old, int) and isinstance(value, float) else value
