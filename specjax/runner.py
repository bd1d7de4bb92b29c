"""Config -> models -> decoding -> a JSON-ready report. Shared by the decode CLI and the eval tools."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from specjax import loading
from specjax.acceptance import registry
from specjax.decoding import autoregressive, sequential, speculative
from specjax.models import Prompt
from specjax.sampling import Warp

STAT_FIELDS = ("blocks", "drafted", "accepted", "verified", "emitted", "target_passes",
               "draft_passes") + sequential.EXTRA_FIELDS


@dataclasses.dataclass(frozen=True)
class Decoder:
  """Everything needed to decode one batch: loaded models, the rule, the sampling warp."""
  target: loading.LoadedModel
  draft: loading.LoadedModel | None
  rule: object | None
  warp: Warp
  gamma: int
  max_new_tokens: int
  max_len: int = 0

  @property
  def eos_id(self) -> int:
    return int(self.target.tokenizer.eos_id)

  @property
  def rule_name(self) -> str:
    return getattr(self.rule, "rule_name", "") or getattr(self.rule, "name", "") or "none"

  def room(self, loaded: loading.LoadedModel) -> int | None:
    """Cache positions left for a prompt: max_len (or the model's position table) minus the
    generated tokens and the verify block. None: unbounded (T5 prompts live in the encoder)."""
    if loaded.model.is_encoder_decoder:
      return None
    limit = self.max_len or getattr(getattr(loaded.model, "config", None), "n_positions", None)
    return None if limit is None else limit - self.max_new_tokens - self.gamma - 1

  def encode(self, texts: list[str]) -> tuple[Prompt, Prompt | None]:
    """(target prompt, draft prompt or None) for a batch of texts."""
    prompt = encode_prompts(self.target, texts, self.room(self.target))
    if self.draft is None:
      return prompt, None
    return prompt, encode_prompts(self.draft, texts, self.room(self.draft))

  def generate(self, prompt: Prompt, key, draft_prompt: Prompt | None = None):
    max_len = self.max_len or None
    if self.draft is None:
      return autoregressive.generate(
          self.target.model, self.target.params, prompt, key, max_new_tokens=self.max_new_tokens,
          warp=self.warp, eos_id=self.eos_id, max_len=max_len)
    if isinstance(self.rule, StringLevel):
      return string_level_generate(self, prompt, key)
    if isinstance(self.rule, sequential.Sprinter):       # SPRINTER has its own loop
      return sequential.generate_with_rule(
          self.rule, self.target.model, self.target.params, self.draft.model, self.draft.params,
          prompt, key, max_new_tokens=self.max_new_tokens, warp=self.warp, eos_id=self.eos_id,
          max_len=max_len)
    return speculative.generate(
        self.target.model, self.target.params, self.draft.model, self.draft.params, prompt, key,
        rule=self.rule, gamma=self.gamma, max_new_tokens=self.max_new_tokens, warp=self.warp,
        eos_id=self.eos_id, draft_prompt=draft_prompt, max_len=max_len)


def build(config, use_draft: bool | None = None, draft_section: str = "draft") -> Decoder:
  """use_draft=None: speculative iff the config names a draft checkpoint and a rule."""
  d = config.decode
  if use_draft is None:
    use_draft = bool(config.get(draft_section) and config[draft_section].get("checkpoint")
                     and config.get("rule") and config.rule.get("name"))
  target = loading.load(config.target, "target")
  draft = loading.load(config[draft_section], draft_section) if use_draft else None
  rule = make_rule(config, target, draft) if use_draft else None
  warp = Warp(temperature=float(d.temperature), top_k=int(d.top_k), top_p=float(d.top_p))
  return Decoder(target=target, draft=draft, rule=rule, warp=warp, gamma=int(d.gamma),
                 max_new_tokens=int(d.max_new_tokens), max_len=int(d.get("max_len", 0) or 0))


@dataclasses.dataclass(frozen=True)
class StringLevel:
  """`--config.rule.name=slem|slrs`: the host-driven string-level loop (batch rows one by one)."""
  method: str
  max_depth: int = 3
  lookbehind: int = 10

  @property
  def name(self) -> str:
    return self.method


def make_rule(config, target: loading.LoadedModel, draft: loading.LoadedModel):
  """The configured rule; cross-vocabulary rules get the VocabMap of the two tokenizers."""
  name = config.rule.name
  hparams = {k: v for k, v in config.rule.items() if k != "name"}
  if name in ("slem", "slrs"):
    return StringLevel(name, int(hparams.get("max_depth", 3)),
                       int(config.decode.get("lookbehind", 10)))
  if name in ("intersection", "union"):
    from specjax.acceptance import vocab
    hparams["vocab"] = vocab.build(target.tokenizer, draft.tokenizer,
                                   target_width=target.model.vocab_size,
                                   draft_width=draft.model.vocab_size)
  return registry.get(name, **hparams)


def string_level_generate(dec: "Decoder", prompt: Prompt, key):
  """Rows of `prompt` through specjax.decoding.string_level, gathered like a batched Generation."""
  from specjax.decoding import string_level
  from specjax.decoding.state import Generation, SpecStats
  keys = jax.vmap(lambda b: jax.random.fold_in(key, b))(np.arange(prompt.tokens.shape[0]))
  tok = dec.target.tokenizer
  outs = []
  for b, (row, n) in enumerate(zip(np.asarray(prompt.tokens), np.asarray(prompt.lengths))):
    ids = [int(t) for t in row[:n] if t != tok.bos_id]
    outs.append(string_level.generate(
        dec.target.model, dec.target.params, tok, dec.draft.model, dec.draft.params,
        dec.draft.tokenizer, tok.decode(ids), keys[b], method=dec.rule.method, gamma=dec.gamma,
        max_new_tokens=dec.max_new_tokens, warp=dec.warp, lookbehind=dec.rule.lookbehind,
        max_depth=dec.rule.max_depth, eos_id=dec.eos_id, max_len=dec.max_len or None))
  tokens = np.zeros((len(outs), dec.max_new_tokens), np.int32)
  for b, o in enumerate(outs):
    tokens[b, :len(o.tokens)] = o.tokens
  stats = jax.tree.map(lambda *xs: np.concatenate(xs), *[o.stats for o in outs])
  return Generation(tokens=tokens, lengths=np.asarray([len(o.tokens) for o in outs], np.int32),
                    stats=stats)


def bucket(n: int, minimum: int = 16) -> int:
  """Pad prompt widths to powers of two so that new prompts rarely recompile."""
  width = minimum
  while width < n:
    width *= 2
  return width


def encode_prompts(loaded: loading.LoadedModel, texts: list[str], room: int | None = None) -> Prompt:
  """Tokenize (T5: + EOS; decoder-only: BOS +) and right-pad to a bucket, clipped to `room`
  (the cache positions left for the prompt) when the prompt itself fits there."""
  tok, model = loaded.tokenizer, loaded.model
  rows = []
  for text in texts:
    ids = list(tok.encode(text))
    if model.is_encoder_decoder:
      ids = ids + [tok.eos_id]                       # T5 inputs end with EOS
    elif tok.bos_id is not None and tok.bos_id >= 0:
      ids = [tok.bos_id] + ids
    rows.append(ids)
  longest = max(len(r) for r in rows)
  width = bucket(longest)
  if room is not None and longest <= room:
    width = min(width, room)
  return Prompt.from_lists(rows, pad_to=width, pad_id=tok.pad_id)


def decode_rows(loaded: loading.LoadedModel, tokens, lengths) -> list[tuple[list[int], str]]:
  out = []
  for row, n in zip(np.asarray(tokens), np.asarray(lengths)):
    ids = [int(t) for t in row[:n]]
    text_ids = ids[:-1] if ids and ids[-1] == loaded.tokenizer.eos_id else ids
    out.append((ids, loaded.tokenizer.decode(text_ids)))
  return out


def stats_rows(stats, batch: int) -> list[dict]:
  if stats is None:
    return [{} for _ in range(batch)]
  arrays = {f: np.asarray(getattr(stats, f)) for f in STAT_FIELDS if hasattr(stats, f)}
  return [{f: int(a[i]) for f, a in arrays.items()} for i in range(batch)]


def aggregate(rows: list[dict]) -> dict:
  total = {f: sum(r.get(f, 0) for r in rows) for f in STAT_FIELDS if any(f in r for r in rows)}
  if total.get("verified"):
    total["acceptance_rate"] = total["accepted"] / total["verified"]
  if total.get("blocks"):
    total["block_efficiency"] = total["emitted"] / total["blocks"]
  return total


def run(config, prompts: list[str]) -> dict:
  dec = build(config)
  batch_size = int(config.decode.get("batch_size", 1)) or 1
  key = jax.random.PRNGKey(int(config.decode.seed))
  results = []
  for start in range(0, len(prompts), batch_size):
    texts = prompts[start:start + batch_size]
    prompt, draft_prompt = dec.encode(texts)
    gen = dec.generate(prompt, jax.random.fold_in(key, start), draft_prompt)
    decoded = decode_rows(dec.target, gen.tokens, gen.lengths)
    for text, (ids, out), st in zip(texts, decoded, stats_rows(gen.stats, len(texts))):
      results.append({"prompt": text, "text": out, "tokens": ids, "stats": st})
  mode = "speculative" if dec.draft is not None else "autoregressive"
  return {"settings": {"mode": mode, **config.to_dict()}, "results": results,
          "stats": aggregate([r["stats"] for r in results])}


def summary_line(stats: dict, wall_s: float) -> str:
  emitted = stats.get("emitted", 0)
  parts = [f"{emitted} tokens in {wall_s:.2f}s (incl. compile)"]
  if "acceptance_rate" in stats:
    parts.append(f"alpha {stats['acceptance_rate']:.3f}")
  if "block_efficiency" in stats:
    parts.append(f"tau {stats['block_efficiency']:.2f}")
  for f in ("blocks", "target_passes", "draft_passes"):
    if f in stats:
      parts.append(f"{f} {stats[f]}")
  return "stats: " + ", ".join(parts)


def eval_source(config):
  """The config's task source (validation prompts and references for the eval tools)."""
  from specjax.data.source import SourceConfig, make_source
  d = config.data
  fields = {k: int(d[k]) for k in ("lm_prompt_len", "max_target_len", "max_prompt_len") if k in d}
  return make_source(d.task, d.tokenizer, SourceConfig(batch_size=1, **fields))


def eval_examples(config, n: int, split: str = "validation") -> list[tuple[str, str]]:
  return eval_source(config).eval_examples(split, n)


def eval_prompts(config, n: int) -> list[str]:
  if config.get("data"):
    return [p for p, _ in eval_examples(config, n)]
  return list(config.get("prompts", []))[:n]


def build_single(config, section: str) -> Decoder:
  """Autoregressive decoding with the model of `section` alone (e.g. draft-only quality)."""
  d = config.decode
  warp = Warp(temperature=float(d.temperature), top_k=int(d.top_k), top_p=float(d.top_p))
  return Decoder(target=loading.load(config[section], section), draft=None, rule=None, warp=warp,
                 gamma=int(d.gamma), max_new_tokens=int(d.max_new_tokens),
                 max_len=int(d.get("max_len", 0) or 0))


def generate_texts(dec: Decoder, prompts: list[str], key, batch_size: int = 16):
  """Decode `prompts` in batches; returns (texts, per-row stats dicts)."""
  texts, stats = [], []
  for start in range(0, len(prompts), batch_size):
    chunk = prompts[start:start + batch_size]
    chunk = chunk + [chunk[-1]] * (batch_size - len(chunk))          # one shape: pad the batch
    prompt, draft_prompt = dec.encode(chunk)
    gen = dec.generate(prompt, jax.random.fold_in(key, start), draft_prompt)
    n = min(batch_size, len(prompts) - start)
    texts += [t for _, t in decode_rows(dec.target, gen.tokens, gen.lengths)][:n]
    stats += stats_rows(gen.stats, batch_size)[:n]
  return texts, stats


def enable_compilation_cache() -> None:
  """Persist compiled programs under the specjax cache so that a second run starts fast."""
  from specjax.data.cache import cache_dir
  jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "jax-compile"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
