"""Where a compiled call's device time goes: one call under jax.profiler, its device kernels
summed by name, and how busy the device was between the first kernel and the last.

    summary = trace.profile(fn, steps=127)   # fn() runs once, already compiled

`busy_pct` under 100 means gaps between kernels (launches, host syncs, a while loop's condition
read back on the host); `kernels_per_step` counts launches per decoding step; `top` lists the
kernels that took the most time. Backends without a device plane (XLA:CPU) give None.
"""

from __future__ import annotations

import collections
import pathlib
import tempfile

import jax
from jax.profiler import ProfileData


def profile(fn, steps: int, top: int = 12) -> dict | None:
  """fn() (compiled already) run once under the profiler -> the summary of its device kernels
  (None where the backend records no device plane)."""
  jax.block_until_ready(fn())            # compiled (or fetched) outside the trace
  with tempfile.TemporaryDirectory(prefix="specjax-trace-") as tmp:
    with jax.profiler.trace(tmp):
      jax.block_until_ready(fn())
    files = sorted(pathlib.Path(tmp).rglob("*.xplane.pb"))
    if not files:
      return None
    return summarize(kernels(ProfileData.from_file(str(files[-1]))), steps, top)


def kernels(data) -> list[tuple[str, float, float]]:
  """(name, start_ns, duration_ns) of every event on a device plane's streams."""
  out = []
  for plane in data.planes:
    if not plane.name.startswith("/device:"):
      continue
    for line in plane.lines:
      if line.name.startswith("Stream"):
        out += [(e.name, e.start_ns, e.duration_ns) for e in line.events]
  return out


def summarize(events: list[tuple[str, float, float]], steps: int, top: int = 12) -> dict | None:
  """Kernel count and time, the span from the first start to the last end, the busy share of
  that span (overlapping kernels merged) and the `top` kernels by total time."""
  if not events:
    return None
  events = sorted(events, key=lambda e: e[1])
  span = max(s + d for _, s, d in events) - events[0][1]
  busy, end = 0.0, events[0][1]
  for _, s, d in events:
    busy += max(0.0, s + d - max(s, end))
    end = max(end, s + d)
  by_name = collections.defaultdict(lambda: [0, 0.0])
  for name, _, d in events:
    by_name[name][0] += 1
    by_name[name][1] += d
  ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
  return dict(kernels=len(events), kernels_per_step=len(events) / max(steps, 1),
              kernel_ms=sum(d for _, _, d in events) / 1e6, span_ms=span / 1e6,
              busy_pct=100 * busy / span if span else 100.0,
              top=[dict(name=name[:90], count=c, ms=t / 1e6) for name, (c, t) in ranked])
