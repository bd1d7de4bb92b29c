"""Config + prompts -> decoded texts and statistics: what `specjax.decode` and the eval tools run."""

from __future__ import annotations

import logging
import time
from typing import Callable

import jax

from specjax.app import builders, methods, resolve
from specjax.api import decoder, timing
from specjax.api.results import aggregate, stats_rows  # noqa: F401  (for the eval tools)
from specjax.app.config import ConfigError

log = logging.getLogger(__name__)

class Interrupted(KeyboardInterrupt):
  """Ctrl-C during a generation: `rows` are the prompts finished before it (the batch in flight
  is dropped)."""

  def __init__(self, rows: list):
    super().__init__()
    self.rows = rows


def generate_texts(method: methods.Method, prompts: list[str], key, batch_size: int = 16,
                   pad_batches: bool = True, show: Callable[[str], None] | None = None,
                   done: list | None = None, on_batch: Callable[[list], None] | None = None):
  """Decode `prompts` (in the chat template with decode.chat) in batches through the API's
  decoder.batches (prompt i draws with fold_in(key, i)); returns [(prompt, generated ids, text,
  per-row stats, finish_reason)], each prompt as given, each text cut at its EOS and at the
  first of decode.stop, finish_reason "stop" (EOS or a stop string) or "length".
  pad_batches: the last batch is filled with repeats of its last prompt, so that every batch
  has one shape (the eval tools); rows past the prompts are dropped.
  show: each prompt's header and text go to show(str) as soon as its batch is done, or as it is
  generated (streaming: batches of one row, a method that streams, one device).
  done: the rows of prompts[:len(done)], finished by an earlier run (decoding starts after
  them); on_batch(rows) is called with every row finished so far after each batch.
  Ctrl-C raises Interrupted with the prompts finished before it."""
  if method.settings.batch_size != batch_size:
    method = method.with_settings(batch_size=batch_size)
  log.info("decoding %d prompt(s) with %s (the first batch of each shape compiles first) ...",
           len(prompts), method.label)
  live = show is not None and batch_size == 1 and method.streams and method.mesh is None
  stream = (lambda _, text: show(text)) if live else None
  out = list(done or [])
  pending = decoder.batches(method, formatted(method, prompts), key, stream=stream,
                            pad_batches=pad_batches, first=len(out))
  try:           # Ctrl-C anywhere in a batch: decoding, printing or saving the rows so far
    for start in range(len(out), len(prompts), batch_size):
      if live:
        show(f"> {prompts[start]}\n")
      _, rows = next(pending)
      for p, row in zip(prompts[start:start + batch_size], rows):
        if show is not None:
          show("\n\n" if live else f"> {p}\n{row.text}\n\n")
        out.append((p, *row))
      if on_batch is not None:
        on_batch(out)
  except KeyboardInterrupt:
    raise Interrupted(out) from None
  return out


def formatted(method: methods.Method, prompts: list[str]) -> list[str]:
  """With decode.chat, every prompt as one user turn in the target's chat template (the draft
  reads the same text, so both models see the same tokens)."""
  return [methods.formatted_text(method, p) for p in prompts]


# What only speculative decoding reads: with the target alone these change nothing.
DRAFT_ONLY = ("rule.", "draft.", "decode.gamma=", "decode.lookbehind=")
# How a user turns speculative decoding off (an empty value): never refused.
TURNS_OFF = ("draft.checkpoint=", "rule.name=")


def check_compare(config) -> None:
  """Refuse --compare where the target decodes alone: there is nothing to compare it with (the
  flag was ignored without a word)."""
  if methods.method_name(config) == "autoregressive":
    raise ConfigError("--compare decodes the prompts with the target alone too, and this run "
                      "decodes with the target alone: give a draft (--config.draft.checkpoint="
                      "PATH) and a rule, or drop --compare")


def check_overrides_apply(config, overrides) -> None:
  """Refuse the user's own overrides that the configured method would ignore (rule.*, draft.*,
  decode.gamma, decode.lookbehind when the target decodes alone): a run that silently drops
  --config.rule.name=lenient reports target-only results as if they were lenient ones. The
  config's own values are never refused (tiny.py's rule is there for when a draft is given).
  With a drafter that has no model of its own (ngram, early_exit, head), the user's draft.*
  settings that it never reads (the draft model's checkpoint, quant, dtype, ...) are refused."""
  # The last override of a key is the one that counts (an earlier --config.draft.checkpoint=PATH
  # emptied by a later --config.draft.checkpoint= is the user turning the draft off).
  methods.check_decodable(config)
  last = {o.partition("=")[0]: o for o in (o.removeprefix("--").removeprefix("config.")
                                           for o in overrides)}
  if methods.method_name(config) != "autoregressive":
    _check_drafter_reads(config, last)
    return
  ignored = [f"--config.{o}" for o in last.values()
             if o.startswith(DRAFT_ONLY) and o not in TURNS_OFF]
  if not ignored:
    return
  have = "has" if len(ignored) == 1 else "have"
  if builders.section(config, "draft").get("checkpoint"):
    why, fix = "with --config.rule.name=''", "name a rule (--config.rule.name=exact)"
  else:
    why, fix = "without a draft", "give one (--config.draft.checkpoint=PATH)"
  raise ConfigError(f"{', '.join(ignored)} {have} no effect {why}: the target decodes alone. "
                    f"For speculative decoding {fix}; to decode with the target alone, drop "
                    f"{'it' if len(ignored) == 1 else 'them'}")


def _check_drafter_reads(config, last: dict) -> None:
  drafter = methods.drafter_settings(config).method
  reads = methods.DRAFTER_READS.get(drafter)
  if reads is None:                 # a draft model: every field of its section counts
    return
  ignored = [f"--config.{o}" for key, o in last.items()
             if key.startswith("draft.") and key.removeprefix("draft.") not in reads]
  if ignored:
    raise ConfigError(f"{', '.join(ignored)}: --config.draft.method={drafter} reads only "
                      f"{', '.join(f'draft.{r}' for r in reads)} of the draft section, so "
                      f"{'this has' if len(ignored) == 1 else 'these have'} no effect: drop "
                      f"{'it' if len(ignored) == 1 else 'them'}, or draft with a model "
                      f"(--config.draft.method=model)")


def run(config, prompts: list[str], show: Callable[[str], None] | None = None,
        compare: bool = False, progress=None) -> dict:
  """`specjax.decode`'s report: per prompt its text, ids and statistics; totals; settings (with
  the devices decoding ran on, and the prompts decoded); `timing` (seconds: load, compile,
  decode, ms per token). show: stream the text (generate_texts). compare: also decode the
  prompts with the target alone (`compare`: its texts' timing and the speedup). Every process of
  a multi-host run gets the same report. progress: an app.progress.Progress that the finished
  prompts are saved to after each batch and resumed from (one process only)."""
  settings = builders.decode_settings(config)      # refused before any model is built
  clock, start = timing.clock(), time.perf_counter()
  compiled = clock.seconds()
  method = methods.build(config)
  load_s = time.perf_counter() - start - (clock.seconds() - compiled)
  if progress is not None and jax.process_count() > 1:
    log.info("multi-host run: no progress file; a killed run starts over")
    progress = None
  report = decode_timed(method, prompts, jax.random.PRNGKey(settings.seed), show, progress)
  report["timing"]["load_s"] = load_s
  report["settings"] = {"mode": method.name, "label": method.label,
                        "devices": devices(method.mesh), **config.to_dict(),
                        "prompts": list(prompts), "resolved": resolved(settings)}
  if compare and method.name != "autoregressive" and "partial" not in report:
    alone = decode_timed(method.target_only(), prompts, jax.random.PRNGKey(settings.seed))
    report["compare"] = {"target_alone": alone["timing"],
                         "speedup": speedup(alone["timing"], report["timing"]),
                         "same_tokens": [r["tokens"] for r in alone["results"]]
                         == [r["tokens"] for r in report["results"]]}
  return report


def resolved(settings) -> dict:
  """What decode.gamma "auto" became on this machine (a report records it: sampled draws and a
  resumed run depend on it), and the draft_confidence that goes with it."""
  return {"gamma": settings.gamma, "draft_confidence": settings.draft_confidence}


def decode_timed(method: methods.Method, prompts: list[str], key,
                 show: Callable[[str], None] | None = None, progress=None) -> dict:
  """results, aggregated stats and timing (compile_s: tracing, lowering, compiling or fetching
  compiled programs; decode_s: the rest of the generation; tokens and ms/token: of the prompts
  decoded by this call, not those `progress` resumed) of one method on the prompts."""
  resumed = [(r["prompt"], r["tokens"], r["text"], r["stats"], r.get("finish_reason"))
             for r in progress.rows()] \
      if progress is not None else []
  on_batch = None if progress is None else (lambda rows: progress.save(_results(rows)))
  clock = timing.clock()
  compiled, start = clock.seconds(), time.perf_counter()
  partial = False
  try:
    rows = generate_texts(method, prompts, key, method.settings.batch_size, pad_batches=False,
                          show=show, done=resumed, on_batch=on_batch)
  except Interrupted as stop:
    rows, partial = stop.rows, True
  wall, compile_s = time.perf_counter() - start, clock.seconds() - compiled
  results = _results(rows)
  stats = aggregate([r["stats"] for r in results])
  tokens = sum(len(r["tokens"]) for r in results[len(resumed):])
  decode_s = max(wall - compile_s, 0.0)
  done = {"partial": {"prompts_done": len(rows), "prompts": len(prompts)}} if partial else {}
  if resumed:
    done["resumed"] = len(resumed)
  return {"results": results, "stats": stats, **done,
          "timing": {"compile_s": compile_s, "decode_s": decode_s, "tokens": tokens,
                     "ms_per_token": 1e3 * decode_s / tokens if tokens else None}}


def _results(rows: list) -> list[dict]:
  return [{"prompt": p, "text": text, "tokens": ids, "stats": st, "finish_reason": why}
          for p, ids, text, st, why in rows]


def speedup(alone: dict, spec: dict) -> float | None:
  """ms/token of the target alone over ms/token of speculative decoding."""
  if not (alone.get("ms_per_token") and spec.get("ms_per_token")):
    return None
  return alone["ms_per_token"] / spec["ms_per_token"]


def devices(mesh) -> dict:
  """Where a method decodes: mesh data x model, devices and processes (1 x 1: one device)."""
  shape = dict(mesh.shape) if mesh is not None else {"data": 1, "model": 1}
  return {"mesh": f"{shape['data']}x{shape['model']}", "data": shape["data"],
          "model": shape["model"], "devices": 1 if mesh is None else int(mesh.devices.size),
          "processes": jax.process_count()}


def reports() -> bool:
  """Whether this process prints and writes results: process 0 (every process computes them)."""
  return jax.process_index() == 0


def summary_line(stats: dict, times: dict, before_s: float) -> str:
  """`stats: N tokens, decode S s (M ms/token), alpha, tau, ...; start-up B s (load L s, compile
  C s)`: decoding apart from everything before it (times: decode_timed's timing + load_s;
  before_s: the seconds from the start to the first decoded block, compilation included)."""
  ms, tokens = times.get("ms_per_token"), times.get("tokens", 0)
  past = (f" ({stats['emitted']} decoded: blocks ran past a stop string)"
          if stats.get("emitted", tokens) > tokens else "")
  parts = [f"{tokens} tokens{past}, decode {times['decode_s']:.2f}s"
           + (f" ({ms:.1f} ms/token)" if ms else "")]
  if stats.get("acceptance_rate") is not None:
    parts.append(f"alpha {stats['acceptance_rate']:.3f}")
  if "block_efficiency" in stats:
    parts.append(f"tau {stats['block_efficiency']:.2f}")
  for f in ("blocks", "target_passes", "draft_passes"):
    if f in stats:
      parts.append(f"{f} {stats[f]}")
  return (f"stats: {', '.join(parts)}; start-up {before_s:.1f}s (load {times.get('load_s', 0):.1f}s, "
          f"compile {times['compile_s']:.1f}s)")


def compare_line(report: dict) -> str:
  """`compare: target alone M ms/token, speculative S ms/token: speedup X; the same tokens` (decode
  phase only; "other tokens" where the two differ, as sampling draws them)."""
  alone, spec = report["compare"]["target_alone"], report["timing"]
  ratio = report["compare"]["speedup"]
  fmt = lambda t: f"{t['ms_per_token']:.1f} ms/token" if t.get("ms_per_token") else "n/a"
  if not ratio:
    return f"compare: target alone {fmt(alone)}"
  same = "the same tokens" if report["compare"].get("same_tokens") else "other tokens"
  return (f"compare: target alone {fmt(alone)}, {report['settings']['label']} {fmt(spec)}: "
          f"speedup {ratio:.2f}x; {same}")


def eval_prompts(config, n: int) -> list[str]:
  """The first n validation prompts of the config's task, else its example prompts."""
  if builders.section(config, "data").get("task"):
    return [p for p, _ in resolve.eval_source(config).eval_examples("validation", n)]
  return list(config.get("prompts", []))[:n]
