"""One decoding run as `specjax.decode` does it, timed phase by phase: the child process of
`eval.startup` (run it through that tool; it reads when its parent spawned it from the
environment).

    python -m eval.startup_probe --config tiny.py --prompt "def f(x):" --out probe.json

Phases, in seconds since the parent spawned the process (SPECJAX_STARTUP_T0, time.time()):
python (interpreter up, this module running), imports (jax, then specjax's app layer), config
(cli.setup + load_config), load (methods.build: tokenizers and weights), encode (prepare) and
generate (the first call: tracing, lowering, compile or persistent-cache fetch, then decoding).
Programs: per jitted function, its trace, lowering and compile seconds (jax.monitoring events;
a cache hit's compile is the fetch). Peak host memory is ru_maxrss; peak anonymous memory
(RssAnon: memory-mapped weight files do not count) is sampled every 10 ms, up to the end of
loading and overall, beside the weights' bytes and their largest tensor, so that the loader's
bound (weights + largest tensor + 0.5 GB) can be read off a row.
"""

from __future__ import annotations

import os
import time

T0 = float(os.environ.get("SPECJAX_STARTUP_T0", time.time()))
PYTHON_UP = time.time() - T0

# ruff: noqa: E402  (the clock above starts before anything heavy is imported)
import argparse
import collections
import json
import resource
import sys
import threading

from specjax.api.timing import union_seconds

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/core/compile/backend_compile_duration": "compile_s"}
CACHE_EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "cache_requests",
                "/jax/compilation_cache/cache_hits": "cache_hits",
                "/jax/compilation_cache/cache_misses": "cache_misses"}


class Clock:
  """Phase end times since spawn, and the durations between them."""

  def __init__(self):
    self.marks = {"python": PYTHON_UP}
    self.phases = {"python": PYTHON_UP}

  def mark(self, phase: str) -> None:
    now = time.time() - T0
    self.phases[phase] = now - max(self.marks.values())
    self.marks[phase] = now


class Programs:
  """jax.monitoring listeners: seconds per program and phase, time spans of tracing (nested
  jits trace inside their caller: the union of spans counts each second once), cache events."""

  def __init__(self, monitoring):
    self.per_program = collections.defaultdict(lambda: collections.defaultdict(float))
    self.spans = collections.defaultdict(list)
    self.counts = collections.Counter()
    monitoring.register_event_duration_secs_listener(self.on_duration)
    monitoring.register_event_time_span_listener(self.on_span)
    monitoring.register_event_listener(self.on_event)

  def on_duration(self, event, seconds, **kw):
    if event in EVENTS:
      self.per_program[kw.get("fun_name", "?")][EVENTS[event]] += seconds
    elif event == "/jax/compilation_cache/cache_retrieval_time_sec":
      self.counts["cache_fetch_ms"] += int(1e3 * seconds)

  def on_span(self, event, start, end, **kw):
    if event in EVENTS:
      self.spans[EVENTS[event]].append((start, end))

  def on_event(self, event, **kw):
    if event in CACHE_EVENTS:
      self.counts[CACHE_EVENTS[event]] += 1

  def summary(self) -> dict:
    totals = {name: union_seconds(spans) for name, spans in self.spans.items()}
    programs = {name: {k: round(v, 4) for k, v in d.items()}
                for name, d in self.per_program.items()}
    return {"totals": totals, "programs": programs, **self.counts}


class AnonPeak:
  """Peak RssAnon in MiB, sampled every 10 ms by a daemon thread; `take()` returns the peak since
  the previous take (None where /proc/self/status is missing: not Linux)."""

  def __init__(self):
    self.peak = self.now()
    if self.peak is not None:
      threading.Thread(target=self._sample, daemon=True).start()

  @staticmethod
  def now() -> float | None:
    try:
      with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("RssAnon"))
    except (OSError, StopIteration):
      return None

  def _sample(self):
    while True:
      self.peak = max(self.peak, self.now())
      time.sleep(0.01)

  def take(self) -> float | None:
    peak, self.peak = self.peak, self.now()
    return None if peak is None else max(peak, self.peak)


def weights(method) -> dict:
  """MiB of the params of the method's models (target, and a draft model if any), and of their
  largest tensor."""
  import jax
  leaves = [leaf for model in (method.target, getattr(method, "draft", None))
            if hasattr(model, "params") for leaf in jax.tree_util.tree_leaves(model.params)]
  sizes = [leaf.nbytes / 2**20 for leaf in leaves]
  return {"weights_mb": sum(sizes), "largest_mb": max(sizes, default=0.0)}


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m eval.startup_probe", description=__doc__)
  p.add_argument("--config", default="tiny.py")
  p.add_argument("--prompt", default="def f(x):")
  p.add_argument("--out", required=True)
  return p.parse_known_args(argv)


def run(args, overrides) -> dict:
  clock = Clock()
  anon = AnonPeak()
  import jax
  from jax import monitoring
  clock.mark("import_jax")
  from specjax.app import cli, config, methods
  clock.mark("import_specjax")
  programs = Programs(monitoring)
  cli.setup()
  cfg = config.load_config(args.config, overrides)
  clock.mark("config")
  method = methods.build(cfg)
  clock.mark("load")
  load_anon = anon.take()
  prompts = method.prepare([args.prompt])
  clock.mark("encode")
  gen = jax.block_until_ready(method.generate(prompts, jax.random.PRNGKey(0)))
  clock.mark("generate")
  jax.block_until_ready(method.generate(prompts, jax.random.PRNGKey(0)))
  clock.mark("decode")               # the same call compiled: what decoding alone takes
  return {"phases": clock.phases, "marks": clock.marks, "tokens": int(gen.lengths[0]),
          "method": method.name, "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
          / 1024, "load_anon_mb": load_anon, "anon_mb": max(load_anon or 0, anon.take() or 0)
          if load_anon is not None else None, **weights(method),
          "jax": programs.summary(), "modules": len(sys.modules)}


def main(argv=None) -> int:
  args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
  report = run(args, overrides)
  with open(args.out, "w") as f:
    json.dump(report, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
