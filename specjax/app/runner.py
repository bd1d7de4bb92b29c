"""Config + prompts -> decoded texts and statistics: what `specjax.decode` and the eval tools run."""

from __future__ import annotations

import logging

import jax
import numpy as np

from specjax.app import builders, methods, resolve
from specjax.decoding.state import STAT_FIELDS as SPEC_FIELDS
from specjax.sprinter.loop import EXTRA_FIELDS

log = logging.getLogger(__name__)

STAT_FIELDS = SPEC_FIELDS + EXTRA_FIELDS


def stats_rows(stats, batch: int) -> list[dict]:
  """Per-row statistics dicts of a Generation's stats (every field the method reports)."""
  if stats is None:
    return [{} for _ in range(batch)]
  arrays = {f: np.asarray(getattr(stats, f)) for f in STAT_FIELDS if hasattr(stats, f)}
  return [{f: int(a[i]) for f, a in arrays.items()} for i in range(batch)]


def aggregate(rows: list[dict]) -> dict:
  """Summed counters plus acceptance_rate (alpha) and block_efficiency (tau)."""
  total = {f: sum(r.get(f, 0) for r in rows) for f in STAT_FIELDS if any(f in r for r in rows)}
  if total.get("verified"):
    total["acceptance_rate"] = total["accepted"] / total["verified"]
  if total.get("blocks"):
    total["block_efficiency"] = total["emitted"] / total["blocks"]
  return total


def generate_texts(method: methods.Method, prompts: list[str], key, batch_size: int = 16,
                   pad_batches: bool = True):
  """Decode `prompts` (in the chat template with decode.chat) in batches; returns [(prompt,
  generated ids, text, per-row stats)], each prompt as given.
  pad_batches: the last batch is filled with repeats of its last prompt, so that every batch
  has one shape (the eval tools); rows past the prompts are dropped."""
  texts = formatted(method, prompts)
  out = []
  log.info("decoding %d prompt(s) with %s (the first batch of each shape compiles first) ...",
           len(prompts), method.label)
  for start in range(0, len(prompts), batch_size):
    chunk = texts[start:start + batch_size]
    n = len(chunk)
    if pad_batches:
      chunk = chunk + [chunk[-1]] * (batch_size - n)
    gen = method.generate(method.prepare(chunk), jax.random.fold_in(key, start))
    rows = zip(prompts[start:start + n], method.texts(gen), stats_rows(gen.stats, len(chunk)))
    out += [(p, ids, text, st) for p, (ids, text), st in rows]
  return out


def formatted(method: methods.Method, prompts: list[str]) -> list[str]:
  """With decode.chat, every prompt as one user turn in the target's chat template (the draft
  reads the same text, so both models see the same tokens)."""
  if not method.settings.chat:
    return list(prompts)
  return [method.target.tokenizer.apply_chat_template(p) for p in prompts]


def run(config, prompts: list[str]) -> dict:
  """`specjax.decode`'s report: per prompt its text, ids and statistics; totals; settings (with
  the devices decoding ran on). Every process of a multi-host run gets the same report."""
  settings = builders.decode_settings(config)      # refused before any model is built
  method = methods.build(config)
  key = jax.random.PRNGKey(settings.seed)
  rows = generate_texts(method, prompts, key, settings.batch_size, pad_batches=False)
  results = [{"prompt": p, "text": text, "tokens": ids, "stats": st} for p, ids, text, st in rows]
  return {"settings": {"mode": method.name, "label": method.label,
                       "devices": devices(method.mesh), **config.to_dict()},
          "results": results, "stats": aggregate([r["stats"] for r in results])}


def devices(mesh) -> dict:
  """Where a method decodes: mesh data x model, devices and processes (1 x 1: one device)."""
  shape = dict(mesh.shape) if mesh is not None else {"data": 1, "model": 1}
  return {"mesh": f"{shape['data']}x{shape['model']}", "data": shape["data"],
          "model": shape["model"], "devices": 1 if mesh is None else int(mesh.devices.size),
          "processes": jax.process_count()}


def reports() -> bool:
  """Whether this process prints and writes results: process 0 (every process computes them)."""
  return jax.process_index() == 0


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


def eval_prompts(config, n: int) -> list[str]:
  """The first n validation prompts of the config's task, else its example prompts."""
  if builders.section(config, "data").get("task"):
    return [p for p, _ in resolve.eval_source(config).eval_examples("validation", n)]
  return list(config.get("prompts", []))[:n]
