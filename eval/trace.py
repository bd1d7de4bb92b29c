"""Where a compiled call's device time goes: one call under jax.profiler, its device kernels
summed by name, and how busy the device was between the first kernel and the last.

    summary = trace.profile(fn, steps=127)   # fn() runs once, already compiled

`busy_pct` under 100 means gaps between kernels (launches, host syncs, a while loop's condition
read back on the host); `kernels_per_step` counts launches per decoding step; `top` lists the
kernels that took the most time.

XLA:CPU has no device plane: its ops are recorded on the host's runtime threads only when the
process starts with `XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true` (each thunk then runs
inside a TraceMe); those events count as the kernels, their names with the HLO numbering cut
(`ynn_fusion.56` -> `ynn_fusion`), and ops on the runtime's threads overlap. Without the flag (or on
a backend that records neither) the summary is None.
"""

from __future__ import annotations

import collections
import pathlib
import re
import sys
import tempfile

import jax
from jax.profiler import ProfileData


def profile(fn, steps: int, top: int = 12) -> dict | None:
  """fn() (compiled already) run once under the profiler -> the summary of its device kernels,
  or of XLA:CPU's ops where they are recorded (module doc); None where neither is."""
  jax.block_until_ready(fn())            # compiled (or fetched) outside the trace
  with tempfile.TemporaryDirectory(prefix="specjax-trace-") as tmp:
    with jax.profiler.trace(tmp):
      jax.block_until_ready(fn())
    files = sorted(pathlib.Path(tmp).rglob("*.xplane.pb"))
    if not files:
      return None
    return summarize(kernels(ProfileData.from_file(str(files[-1]))), steps, top)


# XLA:CPU's threads where its thunks run: the client's (a program's first ops, or all of a small
# one) and the intra-op pool's.
CPU_THREADS = ("tf_XLAPjRtCpuClient", "tf_XLAEigen")
# Spans on those threads that are the runtime's own, not an op (some enclose the ops).
_NOT_OPS = re.compile(r"^(ThunkExecutor|SlinkyThreadPool|ThreadpoolListener|end: )")


def kernels(data) -> list[tuple[str, float, float]]:
  """(name, start_ns, duration_ns) of every event on a device plane's streams; where there is
  none, of every XLA:CPU op on the host's runtime threads (module doc), numbering cut."""
  out = []
  for plane in data.planes:
    if plane.name.startswith("/device:"):
      for line in plane.lines:
        if line.name.startswith("Stream"):
          out += [(e.name, e.start_ns, e.duration_ns) for e in line.events]
  return out or cpu_ops(data)


def cpu_ops(data) -> list[tuple[str, float, float]]:
  """(name, start_ns, duration_ns) of the XLA:CPU ops recorded on the host plane's runtime
  threads (`ynn_fusion.56` -> `ynn_fusion`); [] where XLA:CPU recorded none."""
  out = []
  for plane in data.planes:
    for line in plane.lines:
      if line.name.startswith(CPU_THREADS):
        out += [(re.sub(r"\.\d+$", "", e.name), e.start_ns, e.duration_ns)
                for e in line.events if not _NOT_OPS.match(e.name)]
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
  return dict(steps=steps, kernels=len(events), kernels_per_step=len(events) / max(steps, 1),
              kernel_ms=sum(d for _, _, d in events) / 1e6, span_ms=span / 1e6,
              busy_pct=100 * busy / span if span else 100.0,
              top=[dict(name=name[:90], count=c, ms=t / 1e6) for name, (c, t) in ranked])


if __name__ == "__main__":         # a library module: say which tool to run, not exit 0
  sys.exit("eval.trace is a library, not a tool: python -m eval.bench --profile and python -m eval.latency --profile show its profiles")
