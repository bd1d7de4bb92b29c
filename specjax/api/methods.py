"""Decoding methods by name: autoregressive, speculative (any registered acceptance rule),
sprinter, slem, slrs.

A method is a frozen dataclass holding its loaded models, its DecodeSettings and what its rule
needs, used in two steps: `prepare(texts) -> Prompts` (host-side tokenization, once per batch) and
`generate(prompts, key) -> Generation` (the decoding itself; what the eval tools time).
`specjax.api.decoder` builds them from Python arguments, `specjax.app.methods` from a config.
Adding a method is one class here (or in its own module) and one `@register`.

Devices: a method built with a `mesh` (data x model) has its params placed on it by the
sharding rules table, and the jitted loops run over that mesh (decoding/sharded.py).
String-level methods run on one device.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import numpy as np

from specjax.api import prompt_fit, streaming
from specjax.api.drafters import LoadedHead
from specjax.api.errors import UsageError
from specjax.api.loading import LoadedModel
from specjax.data import tokenizer as tokenizer_lib
from specjax import drafting
from specjax.decoding import autoregressive, sharded, speculative, string_level
from specjax.drafting import NGram
from specjax.decoding.state import Generation, Reserve, position_limit
from specjax.models import prompting
from specjax.models.prompting import Prompt
from specjax import sampling
from specjax.sampling import Warp
from specjax.sprinter import loop as sprinter_loop

_METHODS: dict[str, type] = {}
_NONE = Reserve(per_token=0, fixed=0)      # a T5 prompt: in the encoder, not the cache


def register(*names: str):
  def wrap(cls):
    for name in names:
      _METHODS[name] = cls
    return cls
  return wrap


def names() -> list[str]:
  return sorted(_METHODS)


def method_class(name: str) -> type:
  return _METHODS[name]


MAX_SEED = 2**32 - 1
WARP_VALUES = ("temperature", "top_k", "top_p")   # settings that may hold one value per prompt
MIN_BUCKET = 16            # the narrowest prompt bucket (models/prompting.bucket)
TRUNCATE = ("", "left")


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
  """How a method decodes (the `decode` section of a config; keyword arguments in Python)."""
  gamma: int = 4                 # draft tokens per block
  max_new_tokens: int = 64
  # The warp: one value for every prompt, or a tuple with one per prompt of the call
  temperature: float | tuple[float, ...] = 1.0       # 0: greedy
  top_k: int | tuple[int, ...] = 0
  top_p: float | tuple[float, ...] = 1.0
  seed: int = 0
  max_len: int = 0               # cache size of both models (T5: and encoder); 0: just enough
  batch_size: int = 1
  lookbehind: int = 10           # string-level rules: tokens re-encoded behind a draft
  chat: bool = False             # prompts wrapped in the target tokenizer's chat template
  truncate: str = ""             # "": refuse a prompt the cache cannot hold; "left": keep its end
  stop: tuple[str, ...] | str = ()   # stop strings: a row ends where one appears (text cut before)
  stream: bool = True            # print text as it is generated (batch_size 1, one device)
  # > 0: a block's drafting ends after a draft whose top probability under the draft model is
  # below it (gamma stays the most per block; drafting/length.ConfidenceStop); 0: gamma always
  draft_confidence: float = 0.0

  def __post_init__(self):
    if isinstance(self.stop, str):
      object.__setattr__(self, "stop", (self.stop,))
    if any(not s for s in self.stop):
      raise ValueError(f"stop={self.stop!r}: a stop string must not be empty")
    at_least = dict(gamma=1, max_new_tokens=1, batch_size=1, max_len=0, lookbehind=0)
    for name, low in at_least.items():
      if getattr(self, name) < low:
        raise ValueError(f"{name}={getattr(self, name)} must be >= {low}")
    if not 0 <= self.seed <= MAX_SEED:
      raise ValueError(f"seed={self.seed} is out of range: use an integer in [0, {MAX_SEED}] "
                       f"(PRNG keys hold 32 bits; larger seeds would repeat smaller ones)")
    if self.truncate not in TRUNCATE:
      raise ValueError(f"truncate={self.truncate!r}: use '' (refuse prompts that do not fit) or "
                       f"'left' (keep the last tokens that fit)")
    Warp(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)   # refused now
    if not 0.0 <= self.draft_confidence <= 1.0:        # NaN fails too
      raise ValueError(f"draft_confidence={self.draft_confidence}: use a probability in (0, 1] "
                       f"(drafting stops after a draft the draft model gives less), or 0 (off)")

  @property
  def warp(self) -> Warp:
    return Warp(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

  def row_warp(self, b: int) -> Warp:
    """The warp of row b alone: its own values as single numbers."""
    return Warp(**{n: v[b] if isinstance(v, tuple) else v
                   for n in WARP_VALUES for v in [getattr(self, n)]})

  def rows(self, start: int, n: int, padded: int) -> "DecodeSettings":
    """These settings for prompts start..start+n of the call, in a batch of `padded` rows (the
    extra rows repeat the last prompt's values)."""
    def cut(values):
      if not isinstance(values, tuple):
        return values
      mine = values[start:start + n]
      return mine + mine[-1:] * (padded - n)
    return dataclasses.replace(self, **{n_: cut(getattr(self, n_)) for n_ in WARP_VALUES})


def placed(loaded: LoadedModel, mesh, target: bool, what: str) -> LoadedModel:
  """`loaded` with its params placed on `mesh` by the sharding rules table (None: as it is). A
  target must have heads that the mesh's model axis divides (sharding.HeadsError); a draft whose
  heads it does not divide keeps its attention replicated."""
  if mesh is None:
    return loaded
  if target:
    sharded.check_target(loaded.model, mesh, what)
  return dataclasses.replace(loaded, params=sharded.place_params(loaded.model, loaded.params,
                                                                 mesh))


@dataclasses.dataclass(frozen=True)
class Prompts:
  """One batch of prompts, encoded for every model of a method."""
  target: Prompt
  draft: Prompt | None = None


@dataclasses.dataclass(frozen=True)
class Method:
  """What every method shares: the target, the decode settings, prompts and outputs."""
  target: LoadedModel
  settings: DecodeSettings
  mesh: Any = None               # a ('data', 'model') Mesh the params live on; None: one device
  arg_prefix: str = "--config.decode."   # how messages name settings ("": Python arguments)
  name: ClassVar[str] = ""
  streams: ClassVar[bool] = False    # generate takes on_chunk (streaming, stop strings)

  def __post_init__(self):
    why = self.settings.draft_confidence and self.confidence_refusal()
    if why:
      raise UsageError(f"{self.arg_prefix}draft_confidence={self.settings.draft_confidence}: "
                       f"{why}; or set it to 0")

  def confidence_refusal(self) -> str:
    """Why this method cannot end drafting by the draft's confidence: "" where it can, and
    where it has no draft (like gamma, the setting then has nothing to do)."""
    if getattr(self, "draft", None) is None:
      return ""
    return (f"method {self.label} drafts in a loop of its own: draft_confidence applies to "
            f"speculative decoding with an acceptance rule (exact, greedy, ...)")

  @property
  def label(self) -> str:
    return self.name

  @property
  def eos_id(self) -> tuple[int, ...]:
    """Every id that ends a generation (Qwen: <|endoftext|> and <|im_end|>): the loop stops a
    row at any of them."""
    return prompting.eos_ids(self.target.tokenizer)

  @property
  def draft_model(self) -> LoadedModel | None:
    """The draft model (None: no draft, or a drafter without a model such as prompt lookup)."""
    draft = getattr(self, "draft", None)
    return draft if isinstance(draft, LoadedModel) else None

  def room(self, loaded: LoadedModel) -> prompt_fit.Room | None:
    """How long a prompt `loaded`'s cache can hold (None: no bound, a T5 encoder without
    decode.max_len)."""
    limit = self.cache_limit(loaded)
    if limit is None:
      return None
    room = self.reserve(loaded)
    return prompt_fit.Room(model=self.role(loaded), limit=limit[0], limit_from=limit[1],
                           max_new_tokens=self.settings.max_new_tokens, per_token=room.per_token,
                           fixed=room.fixed, fixed_from=room.what, prefix=self.arg_prefix)

  def cache_limit(self, loaded: LoadedModel) -> tuple[int, str] | None:
    """(positions, where the number comes from): decode.max_len, else the smallest position
    table of the method's decoder-only models (one cache size serves them all)."""
    if self.settings.max_len:
      return self.settings.max_len, f"{self.arg_prefix}max_len"
    if loaded.model.is_encoder_decoder:
      return None
    tables = [(n, m) for m in self.models() if (n := position_limit(m.model)) is not None]
    if not tables:
      return None
    n, owner = min(tables, key=lambda t: (t[0], t[1] is not loaded))   # a tie names its own
    return n, "its n_positions" if owner is loaded else f"{self.role(owner)}'s n_positions"

  def reserve(self, loaded: LoadedModel) -> Reserve:
    """Cache positions decoding takes after a prompt in `loaded`'s cache (the loop's own
    reserve); a T5 prompt lives in the encoder and takes none of them."""
    return _NONE if loaded.model.is_encoder_decoder else autoregressive.RESERVE

  def models(self) -> list[LoadedModel]:
    return [m for m in (self.target, self.draft_model) if m is not None]

  def role(self, loaded: LoadedModel) -> str:
    return "the target" if loaded is self.target else "the draft"

  def encode_text(self, loaded: LoadedModel, text: str) -> list[int]:
    """One text's ids for `loaded` as decoding feeds them (chat template included), unfitted."""
    text = formatted_text(self, text)
    return prompting.encode(loaded.tokenizer, text,
                            encoder_decoder=loaded.model.is_encoder_decoder)

  def encode(self, loaded: LoadedModel, texts, width: int = MIN_BUCKET) -> Prompt:
    """Texts (or id lists, taken as they are) -> a Prompt for one model, every row fitted to its
    cache (prompt_fit), padded to a bucket of at least `width` clipped to the cache's room."""
    encoder_decoder = loaded.model.is_encoder_decoder
    rows = self._rows(loaded, texts)
    room = self.room(loaded)
    rows = prompt_fit.fit(rows, texts, room, truncate=self.settings.truncate,
                          encoder_decoder=encoder_decoder, bos=prompting.has_bos(loaded.tokenizer))
    prompt = prompting.batch(rows, loaded.tokenizer.pad_id,
                             None if room is None else room.longest, minimum=width)
    if room is None:                                  # no position table: memory is the bound
      reserve, (batch, wide) = self.reserve(loaded), prompt.tokens.shape
      new = self.settings.max_new_tokens
      # A T5 decoder's cache holds at least the new tokens (its prompt is in the encoder).
      positions = ((0 if encoder_decoder else wide) + max(reserve.per_token, 1) * new
                   + reserve.fixed)
      prompt_fit.check_cache_memory(loaded.model, self.role(loaded), batch, positions,
                                    wide if encoder_decoder else 0, new, self.arg_prefix)
      prompt_fit.warn_past_context(loaded.model, self.role(loaded), max(map(len, rows)), new,
                                   self.arg_prefix)
    return prompt

  def _rows(self, loaded: LoadedModel, texts) -> list[list[int]]:
    encoder_decoder = loaded.model.is_encoder_decoder
    return [prompting.encode(loaded.tokenizer, t, encoder_decoder=encoder_decoder)
            if isinstance(t, str) else [int(i) for i in t] for t in texts]

  def widths(self, texts) -> tuple[int, ...]:
    """Per model (target, then draft), the bucket of the longest of `texts` (at most the cache's
    room): batches of one call padded to it share one compiled program, where their own
    buckets would compile one per prompt length."""
    out = []
    for loaded in self.models():
      room = self.room(loaded)
      longest = max(len(r) for r in self._rows(loaded, texts))
      out.append(prompting.bucket(longest if room is None else min(longest, max(room.longest, 1)),
                                  None if room is None else max(room.longest, 1)))
    return tuple(out)

  def prepare(self, texts, widths: tuple[int, ...] = ()) -> Prompts:
    """Texts -> every model's Prompt; widths: the least bucket per model (Method.widths)."""
    draft = self.draft_model
    target_w, draft_w = (tuple(widths) + (MIN_BUCKET, MIN_BUCKET))[:2]
    return Prompts(target=self.encode(self.target, texts, target_w),
                   draft=None if draft is None else self.encode(draft, texts, draft_w))

  def texts(self, gen: Generation) -> list[streaming.Finished]:
    """(generated ids, text, finish_reason) per row, each cut at its EOS and at the first of
    decode.stop."""
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
    return Autoregressive(target=self.target, settings=self.settings, mesh=self.mesh,
                          arg_prefix=self.arg_prefix)

  def generate(self, prompts: Prompts, key, on_chunk=None) -> Generation:
    """Decode one batch. on_chunk (methods with `streams`): called with the committed ids after
    the prefill and after every block (decoding/state.drive); it may end rows."""
    raise NotImplementedError


@register("autoregressive")
@dataclasses.dataclass(frozen=True)
class Autoregressive(Method):
  name: ClassVar[str] = "autoregressive"
  streams: ClassVar[bool] = True

  def generate(self, prompts: Prompts, key, on_chunk=None) -> Generation:
    s = self.settings
    return autoregressive.generate(
        self.target.model, self.target.params, prompts.target, key,
        max_new_tokens=s.max_new_tokens, warp=s.warp, eos_id=self.eos_id, max_len=self.max_len,
        mesh=self.mesh, on_chunk=on_chunk)


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel, what: str,
                          rule_flag: str = "rule") -> None:
  """Refuse a draft whose tokenizer gives other ids than the target's to a rule that reads draft
  ids as target ids (it would accept them and print the draft's ids in the target's vocabulary).
  What decides the ids is compared (tokenizer.same_vocabulary), not files or sizes."""
  if not tokenizer_lib.same_vocabulary(target.tokenizer, draft.tokenizer):
    raise UsageError(
        f"{what} reads the draft's ids as the target's, but the draft's tokenizer "
        f"({draft.tokenizer.path}) is not the target's ({target.tokenizer.path}): use a "
        f"cross-tokenizer rule ({rule_flag}=intersection, union, slem or slrs) or a draft "
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


@register("speculative")
@dataclasses.dataclass(frozen=True)
class Speculative(Method):
  """Draft-then-verify blocks in one jitted loop, with any registered acceptance rule. The draft
  is a model, prompt lookup (NGram: no model; the rules of NGram.refusal) or a draft head
  trained for the target (LoadedHead)."""
  draft: LoadedModel | NGram | LoadedHead = None
  rule: object = None
  name: ClassVar[str] = "speculative"
  streams: ClassVar[bool] = True

  @property
  def label(self) -> str:
    lookup = f" + {self.draft.name}" if isinstance(self.draft, (NGram, LoadedHead)) else ""
    return self.rule.rule_name + lookup

  def confidence_refusal(self) -> str:
    return ""

  def drafter(self, draft):
    """What the loop drafts with: `draft` (a model, a Drafter), its drafting also ended by the
    draft's confidence where settings.draft_confidence > 0 (drafting/length.ConfidenceStop
    around the rule's own policy). Prompt lookup proposes with probability 1: it never stops
    for it, and is returned as it is."""
    if not self.settings.draft_confidence or isinstance(draft, NGram):
      return draft
    policy = drafting.length.ConfidenceStop(float(self.settings.draft_confidence),
                                            inner=drafting.length.for_rule(self.rule))
    if isinstance(draft, drafting.Drafter):
      return dataclasses.replace(draft, length=policy)
    return drafting.ModelDrafter(draft_model=draft, length=policy)

  def reserve(self, loaded: LoadedModel) -> Reserve:
    if loaded.model.is_encoder_decoder:
      return _NONE
    drafter = drafting.as_drafter(loaded.model, self.rule) if loaded is self.draft else None
    return speculative.reserve(self.settings.gamma, drafter)

  def generate(self, prompts: Prompts, key, on_chunk=None) -> Generation:
    s = self.settings
    if isinstance(self.draft, NGram):
      draft, params = self.draft, None
    elif isinstance(self.draft, LoadedHead):          # the head reads the target's features
      draft, params = self.draft.drafter, self.draft.loop_params(self.target)
    else:
      draft, params = self.draft.model, self.draft.params
    return speculative.generate(
        self.target.model, self.target.params, self.drafter(draft), params, prompts.target, key,
        rule=self.rule, gamma=s.gamma, max_new_tokens=s.max_new_tokens, warp=s.warp,
        eos_id=self.eos_id, draft_prompt=prompts.draft, max_len=self.max_len, mesh=self.mesh,
        on_chunk=on_chunk)


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
  draft: LoadedModel = None
  verifier: object = None
  verifier_params: object = None
  threshold: float = 0.5
  gamma_max: int = 8
  name: ClassVar[str] = "sprinter"

  def reserve(self, loaded: LoadedModel) -> Reserve:
    if loaded.model.is_encoder_decoder:
      return _NONE
    return sprinter_loop.reserve(self.gamma_max, self.settings.max_new_tokens)

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

  def __post_init__(self):
    if isinstance(self.max_depth, bool) or not isinstance(self.max_depth, int) \
        or self.max_depth < 1:
      raise ValueError(f"max_depth={self.max_depth!r}: SLRS drafts at least one token before a "
                       f"target token is determined: use an integer >= 1")


@register("slem", "slrs")
@dataclasses.dataclass(frozen=True)
class StringLevel(Method):
  """SLEM / SLRS (Timor et al.): a host-driven loop over token lists, batch rows one by one."""
  draft: LoadedModel = None
  method: str = "slem"
  max_depth: int = 3

  @property
  def label(self) -> str:
    return self.method

  def reserve(self, loaded: LoadedModel) -> Reserve:
    return string_level.reserve(self.settings.gamma)

  def generate(self, prompts: Prompts, key, on_chunk=None) -> Generation:
    _no_streaming(self, on_chunk)
    s = self.settings
    rows = lambda p: [[int(t) for t in r[:n]] for r, n in zip(np.asarray(p.tokens),
                                                               np.asarray(p.lengths))]
    keys = sampling.as_row_keys(key, len(rows(prompts.target)))
    outs = [string_level.generate(
        self.target.model, self.target.params, self.target.tokenizer, self.draft.model,
        self.draft.params, self.draft.tokenizer, x_t, x_d, keys[b], method=self.method,
        gamma=s.gamma, max_new_tokens=s.max_new_tokens, warp=s.row_warp(b),
        lookbehind=s.lookbehind,
        max_depth=self.max_depth, eos_id=self.eos_id, max_len=self.max_len,
        prompt_width=int(prompts.target.tokens.shape[1]))
        for b, (x_t, x_d) in enumerate(zip(rows(prompts.target), rows(prompts.draft)))]
    tokens = np.zeros((len(outs), s.max_new_tokens), np.int32)
    for b, o in enumerate(outs):
      tokens[b, :len(o.tokens)] = o.tokens
    stats = jax.tree.map(lambda *xs: np.concatenate(xs), *[o.stats for o in outs])
    return Generation(tokens=tokens, stats=stats,
                      lengths=np.asarray([len(o.tokens) for o in outs], np.int32))

