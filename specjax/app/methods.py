"""Configs -> decoding methods (specjax.api.methods): the `rule`, `decode`, `mesh` and
`distributed` sections read and checked, with errors naming the flags that set them.

`rule.name` picks the method: a method name (sprinter, slem, slrs) runs that method; any other
name is an acceptance rule of speculative decoding (no `rule` section: exact); without a draft
checkpoint, or with `rule.name=''`, the target decodes alone.

Devices: the `mesh` section (data x model; 1 x 1, the default, is one device) places every
model's params by the sharding rules table when the method is built, and the jitted loops run
over that mesh (decoding/sharded.py); `distributed.enabled` joins the other processes first.
String-level methods run on one device.
"""

from __future__ import annotations

import dataclasses
import logging

from specjax import sharding
from specjax.acceptance import registry
from specjax.api import methods as api_methods
from specjax.api import rules as api_rules
from specjax.api.drafters import check_head_dir, draft_head, early_exit, sub_vocab
from specjax.api.errors import UsageError
from specjax.api.loading import LoadedModel
from specjax.api.methods import (Autoregressive, DecodeSettings, Method, Prompts,  # noqa: F401
                                 Speculative, Sprinter, SprinterSettings, StringLevel,
                                 StringLevelSettings, check_same_vocabulary, check_sprinter,
                                 formatted_text, names)
from specjax.app import builders, resolve
from specjax.app.config import ConfigError
from specjax.drafting import NGram
from specjax.sprinter import verifier as sprinter_verifier

log = logging.getLogger(__name__)


def method_name(config, draft_role: str = "draft") -> str:
  """The method a config asks for (see the module docstring): a config with a draft and no
  `rule` section decodes with exact SD, as specjax.generate does with rule=None."""
  rule = builders.rule_section(config).get("name", "")
  draft = builders.section(config, draft_role)
  if not ((draft.get("checkpoint") or draft.get("method") in ("ngram", "early_exit", "head"))
          and rule):
    return "autoregressive"
  return rule if rule in api_methods.names() else "speculative"


@dataclasses.dataclass(frozen=True)
class MeshSettings:
  """The `mesh` section of decoding: a ('data', 'model') mesh; 1 x 1 decodes on one device."""
  data: int = 1                  # batch rows split over this many devices (-1: all the rest)
  model: int = 1                 # heads (KV heads when they divide), mlp and vocab split this way


def mesh_from_config(config):
  """The decoding mesh of the `mesh` section (None: one device), after jax.distributed joins
  the other processes when `distributed.enabled` (before anything runs on a device)."""
  builders.join_processes(config)
  spec = builders.typed(MeshSettings, builders.section(config, "mesh"), "mesh")
  if (spec.data, spec.model) == (1, 1):
    return None
  mesh = sharding.make_mesh(spec.data, spec.model)
  return None if mesh.devices.size == 1 else mesh


def load_placed(config, role: str, mesh, target: bool, alone: bool = False) -> LoadedModel:
  """A model section loaded, its params placed on the mesh by the rules table. The target must
  have heads that the mesh's model axis divides (sharding.HeadsError); a draft whose heads it
  does not divide keeps its attention replicated. The weight format ("auto" layout and quant) is
  chosen for the widths the model runs at: a target's step and verify pass (1, gamma + 1), or
  its one-position steps when it decodes `alone`; a draft's block, one pass over the last two
  committed tokens then gamma - 1 steps (decoding/speculative.py)."""
  gamma = builders.decode_settings(config).gamma
  rows = (1,) if alone else (1, gamma + 1) if target else (2,) + (1,) * max(gamma - 1, 1)
  return api_methods.placed(resolve.load(builders.model_spec(config, role), rows), mesh, target,
                            f"the {role} model")


def check_decodable(config) -> None:
  """A config whose target section has no `checkpoint` field describes a model to train
  (distill_tiny.py: a Markov language without a tokenizer): refused, naming configs to decode
  with, before advice about flags that section does not have."""
  target = config.get("target") if hasattr(config, "get") else None
  if target is not None and "checkpoint" not in target:
    raise ConfigError("this config's target section has no checkpoint field: it describes a "
                      "model to train (train.pretrain / train.distill), not one to decode; "
                      "decode with a config that names checkpoints (tiny.py, qwen_coder.py, or "
                      "one of your own)")


def build(config, draft_role: str = "draft") -> Method:
  """The configured method; `draft_role` picks another draft section (eval: `draft_raw`). A
  model alone: `autoregressive(config, target_role=ROLE)`."""
  check_decodable(config)
  return _BUILDERS[_builder_name(method_name(config, draft_role))](config, draft_role=draft_role)


def _load_pair(config, target_role: str, draft_role: str, mesh=None):
  # Both checkpoints are fetched and converted before either is loaded, so that a conversion's
  # temporaries never sit beside the loaded target (the first run's peak memory).
  for role in (target_role, draft_role):
    resolve.checkpoint_dir(builders.model_spec(config, role))
  return (load_placed(config, target_role, mesh, target=True),
          _draft_head(config, draft_role, load_placed(config, draft_role, mesh, target=False),
                      mesh))


def _draft_head(config, role: str, draft: LoadedModel, mesh) -> LoadedModel:
  """The draft with its head cut to `vocab_top_k` ids when the section asks (0: as it is)."""
  k = drafter_settings(config, role).vocab_top_k
  if not k or _keeps_every_id(k, draft.model.vocab_size, role):
    return draft
  try:
    draft = sub_vocab(draft, k, flag=f"--config.{role}.vocab_top_k")
  except UsageError as err:
    raise ConfigError(str(err)) from None
  return api_methods.placed(draft, mesh, False, f"the {role} model")


def _keeps_every_id(k: int, vocab: int, role: str) -> bool:
  """Whether a config's vocab_top_k covers the whole vocabulary (a config's default K on a
  smaller model): the full head, said in the log."""
  if isinstance(k, int) and k >= vocab:
    log.info("--config.%s.vocab_top_k=%d covers all %d ids of the %s: its full head", role, k,
             vocab, role)
    return True
  return False


def autoregressive(config, target_role: str = "target", draft_role: str = "draft"):
  """The target (or the model of section `target_role`) decoding alone."""
  del draft_role
  mesh = mesh_from_config(config)
  return Autoregressive(target=load_placed(config, target_role, mesh, target=True, alone=True),
                        settings=builders.decode_settings(config), mesh=mesh)


@dataclasses.dataclass(frozen=True)
class DrafterSettings:
  """The drafter fields of a draft section (configs/common.draft)."""
  method: str = "model"          # model | ngram (prompt lookup) | early_exit (the target's layers)
  #                                | head (a draft head trained on the target: checkpoint = its
  #                                  train.distill --config.distill.student=head workdir)
  ngram_max: int = 3
  ngram_min: int = 1
  exit_layer: int = 0            # early_exit: the target's first exit_layer layers draft
  vocab_top_k: int = 0           # > 0: the draft's head scores only its K most frequent ids


def drafter_settings(config, role: str = "draft") -> DrafterSettings:
  values = {k: v for k, v in builders.section(config, role).items() if k in builders.DRAFTER_KEYS}
  spec = builders.typed(DrafterSettings, values, role)
  if spec.method not in DRAFTERS:
    raise ConfigError(f"--config.{role}.method={spec.method!r}: use model (the checkpoint "
                      f"drafts), ngram (prompt lookup), early_exit (the target's first "
                      f"--config.{role}.exit_layer layers) or head (a draft head: "
                      f"--config.{role}.checkpoint=its train.distill workdir)")
  default = DrafterSettings()
  for field, method in _READ_BY.items():
    if spec.method != method and getattr(spec, field) != getattr(default, field):
      raise ConfigError(f"--config.{role}.{field}={getattr(spec, field)!r} is a setting of "
                        f"--config.{role}.method={method}, and this section drafts with "
                        f"{spec.method}: drop it or set the method")
  return spec


DRAFTERS = ("model", "ngram", "early_exit", "head")
_READ_BY = {"ngram_max": "ngram", "ngram_min": "ngram", "exit_layer": "early_exit"}
# The draft section's fields that each drafter without a draft model of its own reads (the
# others, the model's checkpoint, quant, dtype, ..., it never reads).
DRAFTER_READS = {"ngram": ("method", "ngram_max", "ngram_min"),
                 "early_exit": ("method", "exit_layer", "vocab_top_k"),
                 "head": ("method", "checkpoint", "vocab_top_k")}


def _model_drafts(config, role: str, method: str) -> None:
  """ConfigError when the draft section asks for a drafter other than a model: `method` (slem,
  slrs, sprinter) drafts with a draft model of its own."""
  drafter_method = drafter_settings(config, role).method
  if drafter_method != "model":
    raise ConfigError(f"--config.{role}.method={drafter_method} cannot serve method {method} "
                      f"(--config.rule.name), which drafts with a draft model "
                      f"(--config.{role}.checkpoint): use --config.{role}.method=model, or an "
                      f"acceptance rule such as exact with {drafter_method}")


def drafter(config, role: str = "draft") -> NGram | None:
  """Prompt lookup when the draft section says method=ngram; None: a model drafts."""
  spec = drafter_settings(config, role)
  if spec.method != "ngram":
    return None
  try:
    return NGram(ngram_max=spec.ngram_max, ngram_min=spec.ngram_min)
  except ValueError as err:
    raise ConfigError(f"{err} (--config.{role}.ngram_min, --config.{role}.ngram_max)") from None


def speculative(config, draft_role: str = "draft") -> Speculative:
  """Speculative decoding with the registered acceptance rule of `rule.name`."""
  mesh = mesh_from_config(config)
  name = builders.rule_section(config).get("name", "")
  try:
    cls = registry.rule_class(name)
  except registry.UnknownRuleError as err:
    raise ConfigError(f"unknown acceptance rule {name!r} (--config.rule.name): acceptance "
                      f"rules are {', '.join(err.known)}; decoding methods are "
                      f"{', '.join(n for n in names() if n != 'speculative')}") from None
  try:                              # before any model is loaded
    api_rules.check_one_value_each(cls, builders.rule_section(config), "--config.rule.")
  except UsageError as err:
    raise ConfigError(str(err)) from None
  lookup = drafter(config, draft_role)
  if lookup is not None:
    if drafter_settings(config, draft_role).vocab_top_k:
      raise ConfigError(f"--config.{draft_role}.vocab_top_k: prompt lookup has no draft head to "
                        f"cut; set --config.{draft_role}.vocab_top_k=0 or draft with a model "
                        f"(--config.{draft_role}.method)")
    refusal = lookup.refusal(cls)
    if refusal:
      raise ConfigError(f"{refusal} (--config.rule.name; --config.{draft_role}.method=ngram)")
    return Speculative(target=load_placed(config, "target", mesh, target=True),
                       settings=builders.decode_settings(config), mesh=mesh, draft=lookup,
                       rule=builders.rule(config))
  if drafter_settings(config, draft_role).method == "head":
    return _head_method(config, draft_role, mesh, cls)
  if drafter_settings(config, draft_role).method == "early_exit":
    target = load_placed(config, "target", mesh, target=True)
    exit_layer = drafter_settings(config, draft_role).exit_layer
    try:
      draft = early_exit(target, exit_layer, f"--config.{draft_role}.exit_layer")
    except UsageError as err:
      raise ConfigError(str(err)) from None
    draft = _draft_head(config, draft_role, draft, mesh)
    draft = api_methods.placed(draft, mesh, False, "the early-exit draft")
  else:
    target, draft = _load_pair(config, "target", draft_role, mesh)
  try:
    fixed = api_rules.fixed_args(name, target, draft, rule_flag="--config.rule.name")
  except UsageError as err:
    raise ConfigError(str(err)) from None
  return Speculative(target=target, settings=builders.decode_settings(config), mesh=mesh,
                     draft=draft, rule=builders.rule(config, **fixed))


def _head_method(config, role: str, mesh, rule_cls) -> Speculative:
  """The target with the draft head saved in the draft section's checkpoint (a workdir)."""
  flag = f"--config.{role}.checkpoint"
  path = builders.section(config, role).get("checkpoint", "")
  if not path:
    raise ConfigError(f"--config.{role}.method=head needs {flag}=WORKDIR: the workdir of "
                      f"`python -m train.distill --config.distill.student=head`")
  try:
    check_head_dir(path, flag)                      # before the target loads
  except UsageError as err:
    raise ConfigError(str(err)) from None
  target = load_placed(config, "target", mesh, target=True)
  k = drafter_settings(config, role).vocab_top_k
  try:
    head = draft_head(target, path, flag)
    if k and not _keeps_every_id(k, target.model.vocab_size, role):
      head = sub_vocab(head, k, flag=f"--config.{role}.vocab_top_k", target=target)
  except UsageError as err:
    raise ConfigError(str(err)) from None
  refusal = head.drafter.refusal(rule_cls)
  if refusal:
    raise ConfigError(f"{refusal} (--config.rule.name; --config.{role}.method=head)")
  return Speculative(target=target, settings=builders.decode_settings(config), mesh=mesh,
                     draft=head, rule=builders.rule(config))


def variant(base: Speculative, config) -> Speculative | StringLevel:
  """The method `config`'s rule section names (an acceptance rule with what it needs from the two
  models, or slem / slrs) on the models `base` already holds, so that a sweep loads them once."""
  rule = dict(builders.rule_section(config))
  name = rule.pop("name", "")
  if name in ("slem", "slrs"):
    hp = builders.typed(StringLevelSettings, rule, "rule")
    return StringLevel(target=base.target, settings=base.settings, draft=base.draft, method=name,
                       max_depth=hp.max_depth)
  try:
    fixed = api_rules.fixed_args(name, base.target, base.draft, rule_flag="--config.rule.name")
  except UsageError as err:
    raise ConfigError(str(err)) from None
  return dataclasses.replace(base, rule=builders.rule(config, **fixed))


def check_verifier_draft(meta: dict, draft: str, workdir: str, draft_role: str) -> None:
  """A verifier scores its draft's hidden states: one trained on another draft is refused (a
  verifier saved before train.verifier recorded its models is taken as it is)."""
  trained = meta.get("models", {}).get("draft")
  if trained is not None and trained != draft:
    raise ConfigError(f"the verifier in {workdir} was trained on the hidden states of the draft "
                      f"{trained}, and this run's draft is {draft}: set "
                      f"--config.{draft_role}.checkpoint to that draft, or train a verifier for "
                      f"this one (python -m train.verifier)")


def sprinter(config, draft_role: str = "draft") -> Sprinter:
  """SPRINTER with the verifier of `rule.verifier` (a train.verifier workdir)."""
  rule = {k: v for k, v in builders.rule_section(config).items() if k != "name"}
  hp = builders.typed(SprinterSettings, rule, "rule")
  if not hp.verifier:
    raise ConfigError("method sprinter needs --config.rule.verifier=WORKDIR (a train.verifier "
                      "run)")
  verifier, params, meta = sprinter_verifier.load(hp.verifier)
  threshold, gamma_max = sprinter_verifier.decode_settings(meta, hp.threshold, hp.gamma_max)
  try:
    check_sprinter(threshold, gamma_max)
  except ValueError as err:
    raise ConfigError(f"the verifier in {hp.verifier} was saved with {err}") from None
  _model_drafts(config, draft_role, "sprinter")
  check_verifier_draft(meta, builders.model_name(config, draft_role), hp.verifier, draft_role)
  mesh = mesh_from_config(config)
  target, draft = _load_pair(config, "target", draft_role, mesh)
  try:
    check_same_vocabulary(target, draft, "method sprinter", "--config.rule.name")
  except UsageError as err:
    raise ConfigError(str(err)) from None
  return Sprinter(target=target, settings=builders.decode_settings(config), mesh=mesh,
                  draft=draft, verifier=verifier, verifier_params=params, threshold=threshold,
                  gamma_max=gamma_max)


def string_level(config, draft_role: str = "draft") -> StringLevel:
  """SLEM / SLRS (one device)."""
  rule = dict(builders.rule_section(config))
  method = rule.pop("name")
  hp = builders.typed(StringLevelSettings, rule, "rule")
  if mesh_from_config(config) is not None:
    raise ConfigError(f"method {method} is host-driven and runs on one device: set "
                      f"--config.mesh.data=1 --config.mesh.model=1")
  _model_drafts(config, draft_role, method)
  target, draft = _load_pair(config, "target", draft_role)
  return StringLevel(target=target, settings=builders.decode_settings(config), draft=draft,
                     method=method, max_depth=hp.max_depth)


_BUILDERS = {"autoregressive": autoregressive, "speculative": speculative, "sprinter": sprinter,
             "string_level": string_level}


def _builder_name(method: str) -> str:
  return "string_level" if method in ("slem", "slrs") else method
