"""What a training run reports: metrics.jsonl and its console lines (`MetricsLog`,
`format_record`), and the steps between two records (`Interval`): their metrics stay on the device
until a record is written, then come over in one transfer, with the interval's honest wall time.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from specjax.data.cache import atomic_write_bytes
from specjax.distill import data as data_lib
from specjax.distill import throughput

log = logging.getLogger(__name__)


class MetricsLog:
  """metrics.jsonl (one JSON per logged step), and each record to `show` (default: the log);
  process 0 only. The app layer passes a progress display as `show`."""

  def __init__(self, workdir: Path, show: Callable[[dict], None] | None = None):
    self.active = jax.process_index() == 0
    self.path = Path(workdir) / "metrics.jsonl"
    self.show = show or (lambda record: log.info("%s", format_record(record)))

  def write(self, step: int, metrics: dict) -> None:
    if not self.active:
      return
    record = {"step": int(step), **{k: _scalar(v) for k, v in metrics.items()}}
    self._append(record)
    self.show(record)

  def resume(self, step: int) -> None:
    """A run resuming from the checkpoint of `step`: the records of later steps (logged before
    the previous run stopped, and about to be trained again) and any half-written last line are
    dropped, and {"event": "resume", "step": step} marks the place. Step 0: a run killed before
    its first checkpoint starts again, and its records are all dropped ("restart")."""
    if not self.active or (step == 0 and not self.path.exists()):
      return
    kept = []
    if self.path.exists():
      for line in self.path.read_text().splitlines():
        try:
          record = json.loads(line)
        except json.JSONDecodeError:          # the last line of a killed run
          continue
        if step > 0 and record.get("step", 0) <= step:
          kept.append(line + "\n")
    atomic_write_bytes(self.path, "".join(kept).encode())
    self._append({"event": "resume" if step else "restart", "step": int(step)})

  def _append(self, record: dict) -> None:
    with self.path.open("a") as f:            # one short line per append: written whole
      f.write(json.dumps(record, allow_nan=False) + "\n")


FIRST_FIELDS = ("step", "loss", "source")


def format_record(record: dict) -> str:
  """One console line: step, loss and source first, then the rest in the record's order."""
  keys = [k for k in FIRST_FIELDS if k in record] + [k for k in record if k not in FIRST_FIELDS]
  return " ".join(f"{k}={record[k]:.4g}" if isinstance(record[k], float) else f"{k}={record[k]}"
                  for k in keys)


def count_text(n: float) -> str:
  """12345678 -> '12.3M' (parameter counts in log lines)."""
  for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
    if n >= scale:
      return f"{n / scale:.3g}{unit}"
  return f"{n:.0f}"


def _scalar(v):
  """A JSON value: strings kept, ints and bools plain, floats plain or None when not finite
  (strict JSON has no NaN)."""
  if isinstance(v, str):
    return v
  v = np.asarray(v)
  if v.dtype.kind in "iub":
    return v.item()
  return float(v) if np.isfinite(v) else None


class Interval:
  """The steps since the last record. Their metrics stay on the device (reading one would make
  the host wait for that step) until `record` reads them all in one transfer.

  Timing is honest without a wait per step: `seconds` is the interval's wall time (each step's
  phases as the host saw them, mostly dispatch, plus the waits for the device's backlog before a
  read), so seconds per step and tokens/s are exact over the interval. The phase split is that of
  a synchronised step (`add(..., split=True)`: the step before a record, which waits for each
  phase), applied to the interval's time."""

  def __init__(self, window: throughput.Window, flops: throughput.FlopModel):
    self.window, self.flops = window, flops
    self.steps: list[tuple[int, dict, str, tuple]] = []
    self.seconds = 0.0
    self.split: dict[str, float] = {}

  def add(self, done: int, metrics: dict, source: str, shape: tuple, seconds: dict,
          split: bool) -> None:
    """Step `done`: its metrics (device arrays), its batch's source, its (rows, prompt, target)
    shape and seconds per phase (real ones when `split`; any other key counts as waiting)."""
    self.steps.append((done, metrics, source, shape))
    self.wait(sum(seconds.values()))
    if split:
      self.split = {phase: seconds.get(phase, 0.0) for phase in throughput.PHASES}

  def wait(self, seconds: float) -> None:
    self.seconds += seconds

  def metrics_of(self, done: int) -> dict:
    """Step `done`'s metrics on the host and its source ({} when it is not in the interval)."""
    for d, metrics, source, _ in self.steps:
      if d == done:
        return {**jax.device_get(metrics), "source": source}
    return {}

  def record(self) -> tuple[dict, dict]:
    """(the last step's metrics on the host, the interval's throughput fields:
    throughput.Window.summary); then a new interval begins."""
    values = jax.device_get([metrics for _, metrics, _, _ in self.steps])
    per_step = self.seconds / max(len(self.steps), 1)
    total = sum(self.split.values()) or 1.0
    seconds = {phase: per_step * s / total for phase, s in self.split.items()}
    for (_, _, source, shape), step_values in zip(self.steps, values):
      sampled_by = None if source == data_lib.FIXED else source
      self.window.add(int(step_values["tokens"]), self.flops.step_flops(*shape, sampled_by),
                      seconds)
    self.steps, self.seconds = [], 0.0
    return values[-1], self.window.summary()
