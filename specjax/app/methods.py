"""Decoding methods by name: autoregressive, speculative (any registered rule), sprinter, slem, slrs.

A method is a frozen dataclass built from a config by its own `from_config` and used in two steps:
`prepare(texts) -> Prompts` (host-side tokenization, once per batch) and
`generate(prompts, key) -> Generation` (the decoding itself; what the eval tools time).
Adding a method is one class here (or in its own module) and one `@register`.

`rule.name` picks the method: a method name (sprinter, slem, slrs) runs that method; any other
name is an acceptance rule of speculative decoding; without a draft checkpoint the target
decodes alone.

Devices: the `mesh` section (data x model; 1 x 1, the default, is one device) places every
model's params by the sharding rules table when the method is built, and the jitted loops run
over that mesh (decoding/sharded.py); `distributed.enabled` joins the other processes first.
String-level methods run on one device.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import numpy as np

from specjax import sharding
from specjax.acceptance import registry, vocab
from specjax.app import builders, prompt_fit, resolve, streaming
from specjax.app.config import ConfigError
from specjax.data import tokenizer as tokenizer_lib
from specjax.decoding import autoregressive, sharded, speculative, string_level
from specjax.decoding.state import Generation
from specjax.models import prompting
from specjax.models.prompting import Prompt
from specjax.sprinter import loop as sprinter_loop
from specjax.sprinter import verifier as sprinter_verifier

_METHODS: dict[str, type] = {}


def register(*names: str):
  def wrap(cls):
    for name in names:
      _METHODS[name] = cls
    return cls
  return wrap


def names() -> list[str]:
  return sorted(_METHODS)


def method_name(config, draft_role: str = "draft") -> str:
  """The method a config asks for (see the module docstring)."""
  rule = builders.section(config, "rule").get("name", "")
  if not (builders.section(config, draft_role).get("checkpoint") and rule):
    return "autoregressive"
  return rule if rule in _METHODS else "speculative"


@dataclasses.dataclass(frozen=True)
class MeshSettings:
  """The `mesh` section of decoding: a ('data', 'model') mesh; 1 x 1 decodes on one device."""
  data: int = 1                  # batch rows split over this many devices (-1: all the rest)
  model: int = 1                 # heads (KV heads when they divide), mlp and vocab split this way


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
  """The `distributed` section: jax.distributed.initialize before anything runs (multi-host)."""
  enabled: bool = False
  coordinator: str = ""          # host:port of process 0; "" where JAX finds it (TPU pods)
  num_processes: int = 0         # 0: found by JAX
  process_id: int = -1           # -1: found by JAX


def mesh_from_config(config):
  """The decoding mesh of the `mesh` section (None: one device), after jax.distributed joins
  the other processes when `distributed.enabled` (before anything runs on a device)."""
  dist = builders.typed(DistributedSettings, builders.section(config, "distributed"),
                        "distributed")
  if dist.enabled:
    sharding.initialize_distributed(dist.coordinator or None, dist.num_processes or None,
                                    dist.process_id if dist.process_id >= 0 else None)
  spec = builders.typed(MeshSettings, builders.section(config, "mesh"), "mesh")
  if (spec.data, spec.model) == (1, 1):
    return None
  mesh = sharding.make_mesh(spec.data, spec.model)
  return None if mesh.devices.size == 1 else mesh


def load_placed(config, role: str, mesh, target: bool) -> resolve.LoadedModel:
  """A model section loaded, its params placed on the mesh by the rules table. The target must
  have heads that the mesh's model axis divides (sharding.HeadsError); a draft whose heads it
  does not divide keeps its attention replicated."""
  loaded = resolve.load(builders.model_spec(config, role))
  if mesh is None:
    return loaded
  if target:
    sharded.check_target(loaded.model, mesh, f"the {role} model")
  return dataclasses.replace(loaded, params=sharded.place_params(loaded.model, loaded.params,
                                                                 mesh))


def build(config, draft_role: str = "draft"):
  """The configured method; `draft_role` picks another draft section (eval: `draft_raw`). A
  model alone: `Autoregressive.from_config(config, target_role=ROLE)`."""
  return _METHODS[method_name(config, draft_role)].from_config(config, draft_role=draft_role)


@dataclasses.dataclass(frozen=True)
class Prompts:
  """One batch of prompts, encoded for every model of a method."""
  target: Prompt
  draft: Prompt | None = None


@dataclasses.dataclass(frozen=True)
class Method:
  """What every method shares: the target, the decode settings, prompts and outputs."""
  target: resolve.LoadedModel
  settings: builders.DecodeSettings
  mesh: Any = None               # a ('data', 'model') Mesh the params live on; None: one device
  name: ClassVar[str] = ""
  streams: ClassVar[bool] = False    # generate takes on_chunk (streaming, stop strings)

  @property
  def label(self) -> str:
    return self.name

  @property
  def eos_id(self) -> tuple[int, ...]:
    """Every id that ends a generation (Qwen: <|endoftext|> and <|im_end|>): the loop stops a
    row at any of them."""
    return prompting.eos_ids(self.target.tokenizer)

  @property
  def draft_model(self) -> resolve.LoadedModel | None:
    return getattr(self, "draft", None)

  def room(self, loaded: resolve.LoadedModel) -> prompt_fit.Room | None:
    """How long a prompt `loaded`'s cache can hold (None: no bound, a T5 encoder without
    decode.max_len)."""
    limit = self.cache_limit(loaded)
    if limit is None:
      return None
    per_token, fixed, fixed_from = self.reserve(loaded)
    return prompt_fit.Room(model=self.role(loaded), limit=limit[0], limit_from=limit[1],
                           max_new_tokens=self.settings.max_new_tokens, per_token=per_token,
                           fixed=fixed, fixed_from=fixed_from)

  def cache_limit(self, loaded: resolve.LoadedModel) -> tuple[int, str] | None:
    """(positions, where the number comes from): decode.max_len, else the smallest position
    table of the method's decoder-only models (one cache size serves them all)."""
    if self.settings.max_len:
      return self.settings.max_len, "--config.decode.max_len"
    if loaded.model.is_encoder_decoder:
      return None
    tables = [(n, m) for m in self.models() if (n := _positions(m.model)) is not None]
    if not tables:
      return None
    n, owner = min(tables, key=lambda t: (t[0], t[1] is not loaded))   # a tie names its own
    return n, "its n_positions" if owner is loaded else f"{self.role(owner)}'s n_positions"

  def reserve(self, loaded: resolve.LoadedModel) -> tuple[int, int, str]:
    """Cache positions decoding takes after a prompt in `loaded`'s cache: (per new token,
    fixed, what the fixed ones are); a T5 prompt lives in the encoder and takes none of them."""
    return (0, 0, "") if loaded.model.is_encoder_decoder else (1, 0, "")

  def models(self) -> list[resolve.LoadedModel]:
    return [m for m in (self.target, self.draft_model) if m is not None]

  def role(self, loaded: resolve.LoadedModel) -> str:
    return "the target" if loaded is self.target else "the draft"

  def encode_text(self, loaded: resolve.LoadedModel, text: str) -> list[int]:
    """One text's ids for `loaded` as decoding feeds them (chat template included), unfitted."""
    text = formatted_text(self, text)
    return prompting.encode(loaded.tokenizer, text,
                            encoder_decoder=loaded.model.is_encoder_decoder)

  def encode(self, loaded: resolve.LoadedModel, texts) -> Prompt:
    """Texts -> a bucketed Prompt for one model, every row fitted to its cache (prompt_fit);
    the bucket is clipped to the room left in the cache."""
    encoder_decoder = loaded.model.is_encoder_decoder
    rows = [prompting.encode(loaded.tokenizer, t, encoder_decoder=encoder_decoder) for t in texts]
    room = self.room(loaded)
    rows = prompt_fit.fit(rows, texts, room, truncate=self.settings.truncate,
                          encoder_decoder=encoder_decoder, bos=prompting.has_bos(loaded.tokenizer))
    return prompting.batch(rows, loaded.tokenizer.pad_id, None if room is None else room.longest)

  def prepare(self, texts) -> Prompts:
    draft = self.draft_model
    return Prompts(target=self.encode(self.target, texts),
                   draft=None if draft is None else self.encode(draft, texts))

  def texts(self, gen: Generation) -> list[tuple[list[int], str]]:
    """(generated ids, text) per row, each cut at its EOS and at the first of decode.stop."""
    tok, stop = self.target.tokenizer, self.settings.stop
    return [streaming.final_text(tok, row[:n], stop)
            for row, n in zip(np.asarray(gen.tokens), np.asarray(gen.lengths))]

  @property
  def max_len(self) -> int | None:
    return self.settings.max_len or None

  def with_settings(self, **changes):
    """The same method and models with other decode settings (gamma, max_new_tokens, ...)."""
    return dataclasses.replace(self, settings=dataclasses.replace(self.settings, **changes))

  def target_only(self) -> "Autoregressive":
    """Autoregressive decoding with this method's target and settings (the speed baseline)."""
    return Autoregressive(target=self.target, settings=self.settings, mesh=self.mesh)

  def generate(self, prompts: Prompts, key, on_chunk=None) -> Generation:
    """Decode one batch. on_chunk (methods with `streams`): called with the committed ids after
    the prefill and after every block (decoding/state.drive); it may end rows."""
    raise NotImplementedError


@register("autoregressive")
@dataclasses.dataclass(frozen=True)
class Autoregressive(Method):
  name: ClassVar[str] = "autoregressive"
  streams: ClassVar[bool] = True

  @classmethod
  def from_config(cls, config, target_role="target", draft_role="draft"):
    del draft_role
    mesh = mesh_from_config(config)
    return cls(target=load_placed(config, target_role, mesh, target=True),
               settings=builders.decode_settings(config), mesh=mesh)

  def generate(self, prompts: Prompts, key, on_chunk=None) -> Generation:
    s = self.settings
    return autoregressive.generate(
        self.target.model, self.target.params, prompts.target, key,
        max_new_tokens=s.max_new_tokens, warp=s.warp, eos_id=self.eos_id, max_len=self.max_len,
        mesh=self.mesh, on_chunk=on_chunk)


def check_same_vocabulary(target: resolve.LoadedModel, draft: resolve.LoadedModel,
                          what: str) -> None:
  """Refuse a draft whose tokenizer gives other ids than the target's to a rule that reads draft
  ids as target ids (it would accept them and print the draft's ids in the target's vocabulary).
  What decides the ids is compared (tokenizer.same_vocabulary), not files or sizes."""
  if not tokenizer_lib.same_vocabulary(target.tokenizer, draft.tokenizer):
    raise ConfigError(
        f"{what} reads the draft's ids as the target's, but the draft's tokenizer "
        f"({draft.tokenizer.path}) is not the target's ({target.tokenizer.path}): use a "
        f"cross-tokenizer rule (--config.rule.name=intersection, union, slem or slrs) or a draft "
        f"with the target's tokenizer")


def formatted_text(method: Method, text: str) -> str:
  """With decode.chat, the text as one user turn in the target's chat template."""
  if not method.settings.chat:
    return text
  return method.target.tokenizer.apply_chat_template(text)


def _no_streaming(method: Method, on_chunk) -> None:
  if on_chunk is not None:
    raise ValueError(f"method {method.name} has a loop of its own: it does not stream (its text "
                     f"and stop strings are applied when it ends)")


def _positions(model) -> int | None:
  """A decoder-only model's position table (None: rotary or relative positions, no bound)."""
  return None if model.is_encoder_decoder else getattr(getattr(model, "config", None),
                                                       "n_positions", None)


def _load_pair(config, target_role: str, draft_role: str, mesh=None):
  return (load_placed(config, target_role, mesh, target=True),
          load_placed(config, draft_role, mesh, target=False))


@register("speculative")
@dataclasses.dataclass(frozen=True)
class Speculative(Method):
  """Draft-then-verify blocks in one jitted loop, with any registered acceptance rule."""
  draft: resolve.LoadedModel = None
  rule: object = None
  name: ClassVar[str] = "speculative"
  streams: ClassVar[bool] = True

  @property
  def label(self) -> str:
    return self.rule.rule_name

  @classmethod
  def from_config(cls, config, target_role="target", draft_role="draft"):
    mesh = mesh_from_config(config)
    target, draft = _load_pair(config, target_role, draft_role, mesh)
    name = builders.section(config, "rule").get("name", "")
    try:
      needs_map = not registry.rule_class(name).needs_same_vocab
    except registry.UnknownRuleError as err:
      raise ConfigError(f"unknown acceptance rule {name!r} (--config.rule.name): acceptance "
                        f"rules are {', '.join(err.known)}; decoding methods are "
                        f"{', '.join(n for n in names() if n != 'speculative')}") from None
    fixed = {}
    if not needs_map:
      check_same_vocabulary(target, draft, f"--config.rule.name={name}")
    if needs_map:     # a draft with another tokenizer: the rule maps ids through a VocabMap
      fixed["vocab"] = vocab.build(target.tokenizer, draft.tokenizer,
                                   target_width=target.model.vocab_size,
                                   draft_width=draft.model.vocab_size)
    return cls(target=target, settings=builders.decode_settings(config), mesh=mesh, draft=draft,
               rule=builders.rule(config, **fixed))

  def reserve(self, loaded: resolve.LoadedModel) -> tuple[int, int, str]:
    """New tokens (a draft on another tokenizer: up to draft_image_width draft tokens each) and
    one verify block of gamma (decoding/speculative.py sizes the caches so)."""
    if loaded.model.is_encoder_decoder:
      return 0, 0, ""
    per_token = self.rule.draft_image_width if loaded is self.draft else 1
    return per_token, self.settings.gamma, f"gamma {self.settings.gamma}"

  def generate(self, prompts: Prompts, key, on_chunk=None) -> Generation:
    s = self.settings
    return speculative.generate(
        self.target.model, self.target.params, self.draft.model, self.draft.params,
        prompts.target, key, rule=self.rule, gamma=s.gamma, max_new_tokens=s.max_new_tokens,
        warp=s.warp, eos_id=self.eos_id, draft_prompt=prompts.draft, max_len=self.max_len,
        mesh=self.mesh, on_chunk=on_chunk)


@dataclasses.dataclass(frozen=True)
class SprinterSettings:
  """The `rule` section of method sprinter."""
  verifier: str = ""         # a train.verifier workdir
  threshold: float = -1.0    # -1: the value saved with the verifier
  gamma_max: int = -1        # -1: the value saved with the verifier

  def __post_init__(self):
    check_sprinter(self.threshold, self.gamma_max, saved_ok=True)


def check_sprinter(threshold: float, gamma_max: int, saved_ok: bool = False) -> None:
  """A verifier score threshold in [0, 1] and gamma_max >= 0 (saved_ok: -1, use the saved one)."""
  keep = " (or -1: the value saved with the verifier)" if saved_ok else ""
  if not (0 <= threshold <= 1 or (saved_ok and threshold == -1)):
    raise ValueError(f"threshold={threshold}: a verifier score threshold must be in [0, 1]{keep}")
  if not (gamma_max >= 0 or (saved_ok and gamma_max == -1)):
    raise ValueError(f"gamma_max={gamma_max}: consecutive verifier accepts must be >= 0{keep}")


@register("sprinter")
@dataclasses.dataclass(frozen=True)
class Sprinter(Method):
  """SPRINTER: a learned verifier accepts draft tokens; the target runs only on rejection."""
  draft: resolve.LoadedModel = None
  verifier: object = None
  verifier_params: object = None
  threshold: float = 0.5
  gamma_max: int = 8
  name: ClassVar[str] = "sprinter"

  @classmethod
  def from_config(cls, config, target_role="target", draft_role="draft"):
    rule = {k: v for k, v in builders.section(config, "rule").items() if k != "name"}
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
    mesh = mesh_from_config(config)
    target, draft = _load_pair(config, target_role, draft_role, mesh)
    check_same_vocabulary(target, draft, "method sprinter")
    return cls(target=target, settings=builders.decode_settings(config), mesh=mesh, draft=draft,
               verifier=verifier, verifier_params=params, threshold=threshold,
               gamma_max=gamma_max)

  def reserve(self, loaded: resolve.LoadedModel) -> tuple[int, int, str]:
    """New tokens and one target chunk of up to gamma_max + 1 (sprinter/loop.py)."""
    if loaded.model.is_encoder_decoder:
      return 0, 0, ""
    chunk = min(self.gamma_max, self.settings.max_new_tokens - 1) + 1
    return 1, chunk, f"a target chunk of gamma_max + 1 = {chunk}"

  def generate(self, prompts: Prompts, key, on_chunk=None) -> Generation:
    _no_streaming(self, on_chunk)
    s = self.settings
    return sprinter_loop.generate(
        self.target.model, self.target.params, self.draft.model, self.draft.params,
        self.verifier, self.verifier_params, prompts.target, key, threshold=self.threshold,
        gamma_max=self.gamma_max, max_new_tokens=s.max_new_tokens, warp=s.warp,
        eos_id=self.eos_id, max_len=self.max_len, mesh=self.mesh)


@dataclasses.dataclass(frozen=True)
class StringLevelSettings:
  """The `rule` section of methods slem / slrs."""
  max_depth: int = 3         # SLRS: most draft tokens before a target token is determined


@register("slem", "slrs")
@dataclasses.dataclass(frozen=True)
class StringLevel(Method):
  """SLEM / SLRS (Timor et al.): a host-driven loop over token lists, batch rows one by one."""
  draft: resolve.LoadedModel = None
  method: str = "slem"
  max_depth: int = 3

  @property
  def label(self) -> str:
    return self.method

  @classmethod
  def from_config(cls, config, target_role="target", draft_role="draft"):
    rule = dict(builders.section(config, "rule"))
    method = rule.pop("name")
    hp = builders.typed(StringLevelSettings, rule, "rule")
    if mesh_from_config(config) is not None:
      raise ConfigError(f"method {method} is host-driven and runs on one device: set "
                        f"--config.mesh.data=1 --config.mesh.model=1")
    target, draft = _load_pair(config, target_role, draft_role)
    return cls(target=target, settings=builders.decode_settings(config), draft=draft,
               method=method, max_depth=hp.max_depth)

  def reserve(self, loaded: resolve.LoadedModel) -> tuple[int, int, str]:
    """New tokens and a block of gamma + 1 (string_level.py grows its caches past this where the
    position table allows)."""
    return 1, self.settings.gamma + 1, f"gamma {self.settings.gamma} + 1"

  def generate(self, prompts: Prompts, key, on_chunk=None) -> Generation:
    _no_streaming(self, on_chunk)
    s = self.settings
    rows = lambda p: [[int(t) for t in r[:n]] for r, n in zip(np.asarray(p.tokens),
                                                               np.asarray(p.lengths))]
    keys = jax.vmap(lambda b: jax.random.fold_in(key, b))(np.arange(len(rows(prompts.target))))
    outs = [string_level.generate(
        self.target.model, self.target.params, self.target.tokenizer, self.draft.model,
        self.draft.params, self.draft.tokenizer, x_t, x_d, keys[b], method=self.method,
        gamma=s.gamma, max_new_tokens=s.max_new_tokens, warp=s.warp, lookbehind=s.lookbehind,
        max_depth=self.max_depth, eos_id=self.eos_id, max_len=self.max_len)
        for b, (x_t, x_d) in enumerate(zip(rows(prompts.target), rows(prompts.draft)))]
    tokens = np.zeros((len(outs), s.max_new_tokens), np.int32)
    for b, o in enumerate(outs):
      tokens[b, :len(o.tokens)] = o.tokens
    stats = jax.tree.map(lambda *xs: np.concatenate(xs), *[o.stats for o in outs])
    return Generation(tokens=tokens, stats=stats,
                      lengths=np.asarray([len(o.tokens) for o in outs], np.int32))

