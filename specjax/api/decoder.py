"""The Python front door: `SpeculativeDecoder` (one object, built once, called many times) and
`generate` (one call). Both take loaded models (`specjax.load`), so a notebook decodes two
checkpoints in three lines:

    target, draft = specjax.load("pypi:qwen-coder/target"), specjax.load("pypi:qwen-coder/draft")
    out = specjax.generate(target, ["def fib(n):"], draft=draft, temperature=0)
    out.texts, out.tokens, out.stats

Every rule is reachable by name: the acceptance rules of speculative decoding (exact, greedy,
lenient, fuzzy, adaptive, intersection, union, ...) and the methods with a loop of their own
(sprinter, slem, slrs). The command-line tools decode through `batches` below, so text goes to
tokens one way everywhere.

Randomness: prompt i of a call draws with fold_in(PRNGKey(seed), i), so results do not depend on
batch_size, and row b of a batch equals that prompt decoded alone with the same key.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
from pathlib import Path
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.acceptance.base import Rule
from specjax.api import rules, streaming
from specjax.api.drafters import LoadedHead
from specjax.api.errors import UsageError, check_types
from specjax.api.loading import LoadedModel
from specjax.api.methods import (Autoregressive, DecodeSettings, Method, Speculative, Sprinter,
                                 StringLevel, check_same_vocabulary, check_sprinter,
                                 formatted_text, placed)
from specjax.api.results import Result, Row, aggregate, stats_rows
from specjax import drafting
from specjax.drafting import NGram
from specjax.sprinter import verifier as sprinter_verifier

STRING_LEVEL = ("slem", "slrs")
METHOD_RULES = ("sprinter",) + STRING_LEVEL       # rules that are methods with their own loop
DEFAULT_BATCH = 8
log = logging.getLogger(__name__)

Prompts = Sequence[str] | Sequence[Sequence[int]]
Stream = Callable[[int, str], None]


class SpeculativeDecoder:
  """A target, an optional draft and a rule, ready to decode many times.

  target, draft: LoadedModel (specjax.load); draft may also be prompt lookup, "ngram" or
  specjax.NGram(ngram_max=3, ngram_min=1): no model, drafts copied from the prompt and the
  output (rules exact, greedy, lenient, hf_greedy_draft), or a draft head trained for the
  target, specjax.draft_head(target, WORKDIR) (any same-vocabulary rule). rule: a rule name or an acceptance rule object
  (None: "exact" with a draft; the target alone without one). gamma: draft tokens per block
  (None: 4; a number without a draft is refused, as it would change nothing).
  draft_confidence > 0: a block's drafting ends after a draft whose top probability under the
  draft is below it, so gamma is the most per block (Hugging Face's
  assistant_confidence_threshold; the real pair: gamma 7, 0.7); 0: gamma drafts every block.
  mesh: a ('data', 'model') jax.sharding.Mesh to place the params on and decode over (None: one
  device). max_len: cache positions of every model (0: just enough for each batch).
  rule_args: the rule's hyperparameters (lenient: eps; fuzzy: threshold, divergence; sprinter:
  verifier (a train.verifier workdir), threshold, gamma_max; slrs: max_depth; ...).

  The compiled programs live in jax's caches, keyed by shapes and static settings: a second
  call with the same settings and prompt buckets compiles nothing (docs/api.md lists what
  recompiles). Raises UsageError (and the loaders' errors) before anything is compiled."""

  def __init__(self, target: LoadedModel, draft: LoadedModel | NGram | str | None = None, *,
               rule: str | Rule | None = None, gamma: int | None = None, mesh=None,
               max_len: int = 0, draft_confidence: float = 0.0, **rule_args):
    _check_model(target, "target")
    draft = NGram() if draft == "ngram" else draft
    if draft is not None and not isinstance(draft, (NGram, LoadedHead)):
      _check_model(draft, "draft")
    if mesh is not None and (not isinstance(mesh, jax.sharding.Mesh)
                             or set(mesh.axis_names) != {"data", "model"}):
      raise UsageError(f"mesh={mesh!r}: pass a jax.sharding.Mesh with axes ('data', 'model') "
                       f"(specjax.sharding.make_mesh(data, model)), or None for one device")
    _check_draft_args(draft, gamma=gamma, draft_confidence=draft_confidence)
    _refuse_transformers_names(rule_args, rule, "SpeculativeDecoder()")
    base = _settings(gamma=4 if gamma is None else gamma, max_len=max_len)
    method = _method(target, draft, rule, rule_args, base, mesh)
    self.method = dataclasses.replace(method, arg_prefix="", settings=_replace(
        method.settings, draft_confidence=draft_confidence))

  @property
  def name(self) -> str:
    """The rule or method decoding runs with ("autoregressive" without a draft)."""
    return self.method.label

  def generate(self, prompts: Prompts, *, max_new_tokens: int = 64,
               temperature: float | Sequence[float] = 1.0, top_k: int | Sequence[int] = 0,
               top_p: float | Sequence[float] = 1.0, seed: int = 0, batch_size: int | None = None,
               chat: bool = False, stop: str | Sequence[str] = (), stream: Stream | None = None,
               truncate: str = "", **unknown) -> Result:
    """Decode `prompts` (strings, or lists of token ids fed as they are, BOS included where the
    model wants one) -> Result (texts, generated ids and stats, in prompt order).

    max_new_tokens: generated tokens per prompt at most (rows end earlier at an end-of-sequence
    id of the target's tokenizer or at a stop string). temperature 0 is greedy; top_k 0 and
    top_p 1 are off. Each of the three is one value, or a list with one per prompt (rows may
    mix greedy and sampling). max_new_tokens and top_k compile per power-of-two bucket (20 and
    30 share a program, as do top_k 3 and 4); temperature and top_p never recompile. seed:
    prompt i draws with fold_in(PRNGKey(seed), i). batch_size: prompts decoded together (None:
    up to 8). chat: wrap each text as one user turn in the target's chat template. stop: strings
    that end a row (the text is cut before the first).
    stream(i, text): called with prompt i's new text as it is committed (methods with a loop of
    their own: once, when the row is done). truncate: "" refuses a prompt the cache cannot
    hold, "left" keeps its last tokens. Any other keyword is refused (UsageError), naming the
    argument that does its job (transformers' do_sample, max_length, ...)."""
    _refuse_transformers_names(unknown, None, ".generate()")
    for name in unknown:
      near = difflib.get_close_matches(name, _DECODE_ARGS, n=1)
      raise UsageError(f".generate() has no argument {name!r}" + (
          f": did you mean {near[0]!r}?" if near else f" (it takes {', '.join(_DECODE_ARGS)})"))
    _check_stream(stream)
    rows = _check_prompts(prompts, self.method, chat)
    warp = _warp_values(len(rows), temperature=temperature, top_k=top_k, top_p=top_p)
    method = self.method.with_settings(**_settings_changes(
        max_new_tokens=max_new_tokens, **warp,
        seed=seed, chat=chat, stop=stop, truncate=truncate, stream=stream is not None,
        batch_size=min(len(rows), DEFAULT_BATCH) if batch_size is None else batch_size))
    rows = [formatted_text(method, p) for p in rows] if chat else rows
    out = [row for _, done in batches(method, rows, jax.random.PRNGKey(seed), stream=stream)
           for row in done]
    return Result(texts=[r.text for r in out], tokens=[r.ids for r in out],
                  stats=aggregate([r.stats for r in out]), row_stats=[r.stats for r in out],
                  finish_reasons=[r.finish_reason for r in out])


def generate(target: LoadedModel, prompts: Prompts, *,
             draft: LoadedModel | NGram | str | None = None, rule: str | Rule | None = None,
             gamma: int | None = None, mesh=None, max_len: int = 0,
             draft_confidence: float = 0.0, **kwargs) -> Result:
  """One call: SpeculativeDecoder(target, draft, rule=rule, gamma=gamma, mesh=mesh,
  max_len=max_len, draft_confidence=draft_confidence, **rule_args).generate(prompts,
  **decode_args), where kwargs holds both
  (the decode arguments of SpeculativeDecoder.generate; every other name is a rule argument).
  Build a SpeculativeDecoder yourself to decode several times with one set of models."""
  decode_args = {k: kwargs.pop(k) for k in list(kwargs) if k in _DECODE_ARGS}
  _refuse_transformers_names(kwargs, rule, "generate()")
  for name in set(kwargs) - _rule_arg_names(rule):
    near = difflib.get_close_matches(name, _DECODE_ARGS + _DECODER_ARGS, n=1)
    if near:
      raise UsageError(f"generate() has no argument {name!r}: did you mean {near[0]!r}? (other "
                       f"names are the rule's hyperparameters)")
  decoder = SpeculativeDecoder(target, draft, rule=rule, gamma=gamma, mesh=mesh,
                               max_len=max_len, draft_confidence=draft_confidence, **kwargs)
  return decoder.generate(prompts, **decode_args)


# transformers generate's names that specjax spells otherwise, or does not do (docs/api.md):
# without this they read as a rule's hyperparameters ("do_sample (a rule's argument) needs a
# draft"), or as a bare TypeError from SpeculativeDecoder.generate.
TRANSFORMERS_NAMES = {
    "do_sample": "temperature=0 decodes greedily, temperature > 0 samples",
    "max_length": "max_new_tokens=N counts the new tokens (max_length counted the prompt too)",
    "num_beams": "specjax decodes one sequence per prompt: no beam search",
    "num_return_sequences": "repeat the prompt in the list (each row draws its own sample)",
    "repetition_penalty": "no logits processors beyond temperature, top_k and top_p",
    "no_repeat_ngram_size": "no logits processors beyond temperature, top_k and top_p",
    "eos_token_id": "every end id of the target's tokenizer ends a row; stop=[...] adds strings",
    "stop_strings": "stop=[...]",
    "streamer": "stream=lambda i, text: ...",
    "assistant_model": "draft=specjax.load(...)",
    "prompt_lookup_num_tokens": "draft='ngram', gamma=K",
    "num_assistant_tokens": "gamma=K",
    "assistant_confidence_threshold": "draft_confidence=C",
    "input_ids": "pass the id lists as prompts",
    "generation_config": "pass its values as arguments",
}


def _refuse_transformers_names(kwargs: dict, rule, where: str) -> None:
  """UsageError for a transformers generate argument that is not the rule's own, naming what
  does its job here."""
  for name in sorted(set(kwargs) & set(TRANSFORMERS_NAMES) - _rule_arg_names(rule)):
    raise UsageError(f"{where} has no argument {name!r} (transformers generate's): "
                     f"{TRANSFORMERS_NAMES[name]} (docs/api.md, \"transformers' names\")")


def _rule_arg_names(rule) -> set[str]:
  """The arguments the rule named `rule` takes (never mistaken for a misspelt decode argument:
  slrs's max_depth is not max_len); empty for a rule object or an unknown name."""
  if not isinstance(rule, str):
    return set()
  if rule in ("slem", "slrs"):
    return {"max_depth", "lookbehind"}
  if rule == "sprinter":
    return {"verifier", "threshold", "gamma_max"}
  try:
    return set(rules.hyperparameters(rules.rule_class(rule)))
  except UsageError:
    return set()


def _check_draft_args(draft, **values) -> None:
  """Drafting's arguments without a draft would change nothing: a UsageError naming the first
  one set (gamma not None, draft_confidence not 0)."""
  what = {"gamma": "sets the draft tokens per block",
          "draft_confidence": "ends drafting by the draft's confidence"}
  for name, value in values.items():
    if draft is None and value not in (None, 0):
      raise UsageError(f"{name}={value!r} {what[name]}, and there is no draft: pass "
                       f"draft=... or drop it")


def _check_stream(stream) -> None:
  """A stream callback is None or callable as stream(i, text); else a UsageError now, not a
  TypeError after the first block has compiled and run."""
  if stream is None:
    return
  if not callable(stream):
    raise UsageError(f"stream={stream!r}: pass a function stream(i, text), or None")
  try:
    signature = inspect.signature(stream)
  except (TypeError, ValueError):        # a builtin without a signature: called as it is
    return
  try:
    signature.bind(0, "")
  except TypeError as err:
    raise UsageError(f"stream={getattr(stream, '__qualname__', stream)!r} cannot be called as "
                     f"stream(i, text), with the prompt's index and its new text ({err}): give "
                     f"it those two arguments") from None


_DECODE_ARGS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "batch_size", "chat",
                "stop", "stream", "truncate")
_DECODER_ARGS = ("draft", "rule", "gamma", "mesh", "max_len", "draft_confidence")


def batches(method: Method, prompts: list, key: jax.Array, *, stream: Stream | None = None,
            pad_batches: bool = False,
            first: int = 0) -> Iterator[tuple[int, list[Row]]]:
  """Decode `prompts` (texts, or id lists) in batches of method.settings.batch_size, lazily:
  yields (index of the batch's first prompt, [Row(generated ids, text, stats, finish_reason)]
  per prompt) as each batch finishes. Prompt i draws with fold_in(key, i). Every batch is padded to the bucket of
  the call's longest prompt, so that a call compiles one program per batch size.
  stream(i, text): prompt i's new text as it is committed (streaming methods on one device),
  the rest when its batch ends. pad_batches: the last batch is filled with repeats of its last
  prompt, so that every batch has one shape (the eval tools); the repeats are dropped.
  first: start at prompt `first` (a resumed run: the results are those of a run from 0)."""
  size = method.settings.batch_size
  widths = method.widths(prompts)           # one bucket per model for the whole call
  rule = getattr(method, "rule", None)
  if getattr(rule, "rule_name", "") == "greedy" and not method.settings.warp.greedy:
    log.warning("rule greedy decodes greedily (the target's argmax): temperature %s, top_k and "
                "top_p do not apply; use rule exact to sample", method.settings.temperature)
  for start in range(first, len(prompts), size):
    chunk = list(prompts[start:start + size])
    n = len(chunk)
    if pad_batches:
      chunk += [chunk[-1]] * (size - n)
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(start, start + len(chunk)))
    show = None if stream is None else (lambda b, text, s=start: stream(s + b, text))
    streamer = None
    if method.streams and method.mesh is None and (show or method.settings.stop):
      streamer = streaming.Streamer(method.target.tokenizer, len(chunk), method.settings.stop,
                                    show)
    mine = dataclasses.replace(method, settings=method.settings.rows(start, n, len(chunk)))
    gen = mine.generate(method.prepare(chunk, widths), keys, streamer)
    texts = method.texts(gen)[:n]
    if show is not None:
      for b, done in enumerate(texts):
        rest = done.text[streamer.rows[b].shown:] if streamer is not None else done.text
        if rest:
          show(b, rest)
    yield start, [Row(done.ids, done.text, st, done.finish_reason)
                  for done, st in zip(texts, stats_rows(gen.stats, n))]


# ------------------------------------------------------------------------------ construction

def _method(target, draft, rule, rule_args: dict, settings: DecodeSettings, mesh) -> Method:
  """The method for these models and rule, its params placed on `mesh`."""
  if draft is None:
    if rule is not None or rule_args:
      what = (f"rule={rule!r}" if rule is not None else
              f"{', '.join(sorted(rule_args))} (a rule's argument)")
      raise UsageError(f"{what} needs a draft: pass draft=specjax.load(...) (without one the "
                       f"target decodes alone)")
    return Autoregressive(target=placed(target, mesh, True, "the target"), settings=settings,
                          mesh=mesh)
  rule = "exact" if rule is None else rule
  target = placed(target, mesh, True, "the target")
  if isinstance(draft, (NGram, LoadedHead)):
    return _own_ids(target, draft, rule, rule_args, settings, mesh)
  if rule in STRING_LEVEL:
    return _string_level(target, draft, rule, rule_args, settings, mesh)
  draft = placed(draft, mesh, False, "the draft")
  if rule == "sprinter":
    return _sprinter(target, draft, rule_args, settings, mesh)
  return Speculative(target=target, settings=settings, mesh=mesh, draft=draft,
                     rule=rules.make(rule, rule_args, target, draft))


def _own_ids(target, draft: NGram | LoadedHead, rule, args: dict, settings,
             mesh) -> Speculative:
  """A drafter that proposes the target's own ids (prompt lookup, a draft head) verified by a
  same-vocabulary rule (prompt lookup: one that reads no draft distribution)."""
  drafter = draft if isinstance(draft, NGram) else draft.drafter
  if rule in METHOD_RULES:
    rules_ok = drafting.ONE_HOT_RULES if drafter.one_hot else "an acceptance rule"
    raise UsageError(f"rule={rule!r} is a method with a draft model of its own; "
                     f"{drafter.what or drafter.name} drafts for {rules_ok}")
  refusal = drafter.refusal(rules.rule_class(rule) if isinstance(rule, str) else rule)
  if refusal:
    raise UsageError(refusal)
  # The drafter proposes the target's own ids: the target stands for the draft's vocabulary.
  return Speculative(target=target, settings=settings, mesh=mesh, draft=draft,
                     rule=rules.make(rule, args, target, target))


def _string_level(target, draft, method: str, args: dict, settings, mesh) -> StringLevel:
  unknown = sorted(set(args) - {"max_depth", "lookbehind"})
  if unknown:
    raise UsageError(f"rule {method!r} takes no argument {', '.join(unknown)}; its arguments are "
                     f"max_depth (SLRS: draft tokens before a target token is determined) and "
                     f"lookbehind (tokens re-encoded behind a draft)")
  if mesh is not None:
    raise UsageError(f"rule {method!r} is host-driven and runs on one device: pass mesh=None")
  if "lookbehind" in args:
    settings = _replace(settings, lookbehind=args["lookbehind"])
  return StringLevel(target=target, settings=settings, draft=draft, method=method,
                     max_depth=_int_arg(args.get("max_depth", 3), "max_depth", 1))


def _check_verifier_draft(meta: dict, draft: LoadedModel, workdir) -> None:
  """A verifier scores its draft's hidden states: one trained on the draft of another checkpoint
  directory is refused (one saved without `draft_dir` is taken as it is)."""
  trained = meta.get("models", {}).get("draft_dir")
  if trained is not None and Path(trained).resolve() != Path(draft.path).resolve():
    raise UsageError(f"the verifier in {workdir} was trained on the hidden states of the draft "
                     f"in {trained}, and this draft was loaded from {draft.path}: pass "
                     f"draft=specjax.load(...) of that checkpoint, or train a verifier for this "
                     f"draft (python -m train.verifier)")


def _sprinter(target, draft, args: dict, settings, mesh) -> Sprinter:
  unknown = sorted(set(args) - {"verifier", "threshold", "gamma_max"})
  if unknown or "verifier" not in args:
    raise UsageError("rule 'sprinter' takes verifier (a train.verifier workdir, required), "
                     "threshold and gamma_max (default: the values saved with the verifier)"
                     + (f"; not {', '.join(unknown)}" if unknown else ""))
  check_same_vocabulary(target, draft, "rule='sprinter'")
  verifier, params, meta = sprinter_verifier.load(str(args["verifier"]))
  _check_verifier_draft(meta, draft, args["verifier"])
  threshold, gamma_max = sprinter_verifier.decode_settings(meta, args.get("threshold", -1.0),
                                                           args.get("gamma_max", -1))
  try:
    check_sprinter(threshold, gamma_max)
  except ValueError as err:
    raise UsageError(f"rule 'sprinter': {err}") from None
  return Sprinter(target=target, settings=settings, mesh=mesh, draft=draft, verifier=verifier,
                  verifier_params=params, threshold=threshold, gamma_max=gamma_max)


def _int_arg(value, name: str, low: int) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < low:
    raise UsageError(f"{name}={value!r}: use an integer >= {low}")
  return value


def _settings(**values) -> DecodeSettings:
  check_types(DecodeSettings, values)
  try:
    return DecodeSettings(**values)
  except (TypeError, ValueError) as err:
    raise UsageError(str(err)) from None


def _replace(settings: DecodeSettings, **changes) -> DecodeSettings:
  return _settings(**{**dataclasses.asdict(settings), **changes})


def _settings_changes(**changes) -> dict:
  """The changes, checked by DecodeSettings (a UsageError naming the bad one)."""
  stop = changes["stop"]
  stop = (stop,) if isinstance(stop, str) else stop
  if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
    raise UsageError(f"stop={changes['stop']!r}: pass a string or a list of strings")
  changes["stop"] = tuple(stop)
  _settings(**changes)
  return changes


def _warp_values(n: int, **values) -> dict:
  """temperature, top_k, top_p as DecodeSettings takes them: a number, or a tuple with one value
  per prompt (a list or array of exactly n)."""
  out = {}
  for name, value in values.items():
    if isinstance(value, (list, tuple, np.ndarray)):
      value = tuple(v.item() if isinstance(v, np.generic) else v for v in value)
      if len(value) != n:
        raise UsageError(f"{name} has {len(value)} values for {n} prompts: give one value, or "
                         f"exactly one per prompt")
    out[name] = value
  return out


def _check_model(model, role: str) -> None:
  if not isinstance(model, LoadedModel):
    raise UsageError(f"{role}={type(model).__name__}: pass a loaded model, "
                     f"specjax.load(NAME_OR_PATH)")


def _check_text(i: int, text: str) -> None:
  """UsageError naming a lone surrogate in prompt i (no tokenizer encodes one: text decoded from
  bytes that are not UTF-8, with errors='surrogateescape')."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as err:
    raise UsageError(f"prompt {i} is not valid text: character {err.start} is a lone surrogate "
                     f"(U+{ord(text[err.start]):04X}), which no tokenizer encodes; decode the "
                     f"prompt's bytes as UTF-8") from None


def _check_prompts(prompts, method: Method, chat: bool) -> list:
  """Prompts as a list of strings or of id lists (one kind), checked before any work."""
  if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or not prompts:
    raise UsageError(f"prompts={_short(prompts)}: pass a non-empty list of strings (or of "
                     f"token-id lists), e.g. ['def fib(n):']")
  if all(isinstance(p, str) for p in prompts):
    empty = [i for i, p in enumerate(prompts) if not p]
    if empty:
      raise UsageError(f"prompt {empty[0]} is empty: give text to continue")
    for i, text in enumerate(prompts):
      _check_text(i, text)
    return list(prompts)
  empty = [i for i, p in enumerate(prompts) if isinstance(p, (list, tuple)) and not len(p)]
  if empty:
    raise UsageError(f"prompt {empty[0]} is empty: give at least one token id")
  messages = lambda p: isinstance(p, (list, tuple)) and p and all(isinstance(m, dict) for m in p)
  if any(messages(p) for p in prompts):
    raise UsageError("a prompt is a list of chat messages: specjax takes each prompt as one "
                     "text, and chat=True makes it one user turn in the target's chat template "
                     "(with the template's default system turn). For a system prompt or several "
                     "turns, write the template's text yourself and pass it with chat=False")
  if not all(_is_ids(p) for p in prompts):
    raise UsageError("prompts must be all strings or all lists of token ids (ints >= 0), not "
                     "a mix or other types")
  if chat:
    raise UsageError("chat=True applies the chat template to text: pass text prompts")
  vocab = method.target.model.vocab_size
  bad = [(i, t) for i, p in enumerate(prompts) for t in p if t >= vocab]
  if bad:
    raise UsageError(f"prompt {bad[0][0]} holds id {bad[0][1]}, past the target's {vocab} "
                     f"embedding rows")
  draft = method.draft_model
  if draft is not None and draft.tokenizer is not method.target.tokenizer:
    if not _same_ids(method.target, draft):
      raise UsageError("the draft has another tokenizer: pass text prompts (each model encodes "
                       "them with its own tokenizer)")
  return [[int(t) for t in p] for p in prompts]


def _same_ids(target: LoadedModel, draft: LoadedModel) -> bool:
  try:
    check_same_vocabulary(target, draft, "")
  except UsageError:
    return False
  return True


def _is_ids(p) -> bool:
  if not isinstance(p, (list, tuple, np.ndarray)):
    return False
  ids = np.asarray(p)
  return ids.ndim == 1 and ids.size > 0 and ids.dtype.kind in "iu" and bool((ids >= 0).all())


def _short(value) -> str:
  text = repr(value)
  return text if len(text) <= 40 else text[:37] + "..."
