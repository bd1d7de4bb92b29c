"""Where a run's seconds go: JAX's tracing, lowering and compilation (or fetching compiled
programs from the persistent cache), told apart from the decoding itself.

`CompileClock` listens to jax.monitoring's events for as long as the process lives; its
`seconds()` is the union of the compile spans so far (a nested jit traces inside its caller, so
spans overlap and summing them would count a second twice). The backend-compile span also covers
fetching a program from the persistent cache (jax's compile_or_get_cached runs inside it), so a
fetch is counted once, in its span. A runner reads it before and after a generation: what the
generation took beyond it is decoding.
"""

from __future__ import annotations

import threading

_SPAN_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                "/jax/core/compile/jaxpr_to_mlir_module_duration",
                "/jax/core/compile/backend_compile_duration")


def union_seconds(spans: list[tuple[float, float]]) -> float:
  """Length of the union of [start, end] intervals: [(0, 2), (1, 3), (5, 6)] -> 4."""
  total, reach = 0.0, float("-inf")
  for start, end in sorted(spans):
    if end > reach:
      total += end - max(start, reach)
      reach = end
  return total


class CompileClock:
  """Seconds of compilation seen since the clock was made (one per process: `clock()`)."""

  def __init__(self):
    from jax import monitoring
    self._spans: list[tuple[float, float]] = []
    self._lock = threading.Lock()
    monitoring.register_event_time_span_listener(self._on_span)

  def _on_span(self, event, start, end, **_):
    if event in _SPAN_EVENTS:
      with self._lock:
        self._spans.append((start, end))

  def seconds(self) -> float:
    with self._lock:
      return union_seconds(self._spans)


_CLOCK: CompileClock | None = None


def clock() -> CompileClock:
  """The process's CompileClock (listening from the first call on)."""
  global _CLOCK
  if _CLOCK is None:
    _CLOCK = CompileClock()
  return _CLOCK


_BACKEND_COMPILE = _SPAN_EVENTS[2]
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


class CompileLog:
  """Says on `log` what XLA is compiling while it compiles: a compile still running after
  `after` seconds is announced ("compiling jit(_chunk_jit) (or fetching it from the compile
  cache) ..."), and its end with its time ("compiled ... in 20.1s", or "fetched ... from the
  compile cache" where the persistent cache held it), so that a first run's 10-30 s of
  compilation shows as a phase with its time rather than as silence. Compiles shorter than
  `after` say nothing."""

  def __init__(self, log, after: float = 2.0):
    from jax import monitoring
    self._log, self._after = log, after
    self._running: dict[int, tuple[float, threading.Timer]] = {}   # thread -> (start, timer)
    self._fetched: set[int] = set()                                # threads that hit the cache
    self._lock = threading.Lock()
    monitoring.register_scalar_listener(self._on_start)
    monitoring.register_event_listener(self._on_event)
    monitoring.register_event_time_span_listener(self._on_end)

  def close(self) -> None:
    """Stops listening (pending announcements are cancelled)."""
    from jax import monitoring
    monitoring.unregister_scalar_listener(self._on_start)
    monitoring.unregister_event_listener(self._on_event)
    monitoring.unregister_event_time_span_listener(self._on_end)
    with self._lock:
      for _, timer in self._running.values():
        timer.cancel()
      self._running.clear()

  def _on_start(self, event, start, fun_name="?", **_):
    if event != _BACKEND_COMPILE:
      return
    timer = threading.Timer(self._after, self._log.info,
                            ("compiling %s (or fetching it from the compile cache) ...",
                             fun_name))
    timer.daemon = True
    with self._lock:
      self._running[threading.get_ident()] = (start, timer)
      self._fetched.discard(threading.get_ident())
    timer.start()

  def _on_event(self, event, **_):
    if event == _CACHE_HIT:
      with self._lock:
        self._fetched.add(threading.get_ident())

  def _on_end(self, event, start, end, fun_name="?", **_):
    if event != _BACKEND_COMPILE:
      return
    me = threading.get_ident()
    with self._lock:
      _, timer = self._running.pop(me, (None, None))
      fetched = me in self._fetched
      self._fetched.discard(me)
    if timer is not None:
      timer.cancel()
    if end - start < self._after:
      return
    if fetched:
      self._log.info("fetched %s from the compile cache in %.1fs", fun_name, end - start)
    else:
      self._log.info("compiled %s in %.1fs", fun_name, end - start)


_LOG: CompileLog | None = None


def log_compiles(log, after: float = 2.0) -> CompileLog:
  """The process's CompileLog on `log` (made on the first call; later calls return it)."""
  global _LOG
  if _LOG is None:
    _LOG = CompileLog(log, after)
  return _LOG
