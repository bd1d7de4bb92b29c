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
