"""layout="auto": which dense-kernel layout (models/dense_layout.py) a decoder-only model gets on
this machine, measured once and remembered.

On the CPU backend the model's own largest dense shapes (a layer's distinct [in, out] kernel
shapes, the three largest, each weighted by how many kernels of the layer have it) are multiplied
by [M, in] activations at the widths the model runs at (`rows`, a width repeated as often as it
runs: a draft's block at gamma 4 is one M = 2 pass over the last two committed tokens and three
M = 1 steps, (1, 1, 1, 2); a target's M = 1 step and M = gamma + 1 verify, (1, 5)) in both
layouts: jitted, compiled apart, median of REPEATS calls, with enough copies of each weight that
they do not fit in the caches (a decoding step reads its weights from memory). "out_in" is
chosen only when its weighted cost (sum over shapes and widths of count x median time) is more
than MARGIN below "in_out"'s: near a tie Flax's layout stays. The answer is
kept in a JSON file (`cache_file`, given by the caller) keyed by the CPU's flags and core count,
the jaxlib version, XLA_FLAGS, the shapes, widths, dtype and precision, so it is measured once per
machine and setting. Other backends get "in_out" without measuring: the flip was seen on XLA:CPU,
and the GPU and TPU results (docs/results.md) were measured in Flax's layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax.models import dense_layout, layers

log = logging.getLogger(__name__)

MARGIN = 0.05          # out_in must be this much cheaper (fraction of in_out's cost)
REPEATS = 7            # timed calls per product, after one compiling call
_MAX_SHAPES = 3        # a layer's largest distinct kernel shapes that are measured
_SPREAD_BYTES = 64 << 20   # at least this many weight bytes per product: past the caches
_MAX_COPIES = 8
DEFAULT_ROWS = (1, 5)  # when the loader does not know gamma: a step and gamma = 4's verify


@dataclasses.dataclass(frozen=True)
class Choice:
  """The layout picked, why ("measured", "cached" or the backend's default), and the weighted
  costs in seconds of both layouts (empty when not measured)."""
  layout: str
  reason: str
  costs: dict = dataclasses.field(default_factory=dict)

  def describe(self) -> str:
    if not self.costs:
      return f"{self.layout} ({self.reason})"
    ms = ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in sorted(self.costs.items()))
    return f"{self.layout} ({self.reason}: {ms}, a layer's largest products summed)"


def dense_shapes(model) -> tuple[tuple[int, int, int], ...]:
  """A decoder-only model's layer kernel shapes as (in, out, count per layer), the _MAX_SHAPES
  largest by in * out, from the abstract params of its stacked, [in, out] twin (nothing is
  allocated)."""
  twin = dense_layout.with_layout(layers.with_scan(model), dense_layout.IN_OUT)
  shapes = jax.eval_shape(twin.init_params, jax.random.PRNGKey(0))
  counts = Counter()
  for path, leaf in jax.tree_util.tree_flatten_with_path(shapes[layers.STACKED])[0]:
    if getattr(path[-1], "key", None) == "kernel":
      counts[tuple(leaf.shape[1:])] += 1                               # [L, in, out] -> (in, out)
  largest = sorted(counts, key=lambda s: s[0] * s[1], reverse=True)[:_MAX_SHAPES]
  return tuple((k, n, counts[(k, n)]) for k, n in largest)


def choose(model, rows=DEFAULT_ROWS, *, cache_file: Path | None,
           backend: str | None = None) -> Choice:
  """The layout for `model` (a decoder-only model with a `layout` field) at widths `rows` (a
  repeated width counts as often as it appears): the backend default off the CPU, else the
  cached answer or a measurement (module docstring), stored in `cache_file` (None: not stored)."""
  backend = backend or jax.default_backend()
  if backend != "cpu":
    return Choice(dense_layout.IN_OUT, f"the {backend} backend's default, not measured")
  cfg = model.config
  shapes, rows = dense_shapes(model), tuple(sorted(int(m) for m in rows))
  key = _key(shapes, rows, cfg.dtype, cfg.precision)
  cached = _read(cache_file).get(key)
  if cached is not None and cached.get("layout") in dense_layout.LAYOUTS:
    return Choice(cached["layout"], f"cached in {cache_file}", cached.get("costs", {}))
  costs = {layout: _cost(shapes, rows, layout, cfg.dtype, cfg.precision)
           for layout in dense_layout.LAYOUTS}
  choice = Choice(decide(costs), f"measured at rows {', '.join(map(str, rows))}", costs)
  if cache_file is not None:
    _write(cache_file, key, dict(layout=choice.layout, costs=costs, rows=list(rows),
                                 shapes=[list(s) for s in shapes], dtype=cfg.dtype))
  return choice


def decide(costs: dict[str, float]) -> str:
  """out_in when its cost is more than MARGIN below in_out's, else in_out (e.g. {in_out: 1.0,
  out_in: 0.96} -> in_out; {in_out: 1.0, out_in: 0.94} -> out_in)."""
  if costs[dense_layout.OUT_IN] < (1.0 - MARGIN) * costs[dense_layout.IN_OUT]:
    return dense_layout.OUT_IN
  return dense_layout.IN_OUT


def _cost(shapes, rows, layout: str, dtype: str, precision: str) -> float:
  """Sum over shapes (in, out, count) and widths M (each as often as `rows` holds it) of count x
  the median seconds of one [M, in] x kernel product in `layout`; each width timed once."""
  widths = Counter(rows)
  total = 0.0
  for k, n, count in shapes:
    times = time_products((k, n), tuple(widths), layout, dtype, precision)
    total += count * sum(widths[m] * t for m, t in zip(widths, times))
  return total


def time_products(shape: tuple[int, int], rows: tuple[int, ...], layout: str, dtype: str,
                  precision: str) -> list[float]:
  """Median seconds of [M, in] x one kernel of `shape` (in, out) stored in `layout`, for each M
  in `rows`, over copies that together exceed the caches (module docstring). The weights are
  filled, not drawn: a float product's time does not depend on the values, and drawing 100 MB
  of normals cost more than the timing."""
  k, n = shape
  dt = jnp.dtype(dtype)
  copies = max(1, min(_MAX_COPIES, -(-_SPREAD_BYTES // (k * n * dt.itemsize))))
  stored = (k, n) if layout == dense_layout.IN_OUT else (n, k)
  contract = 0 if layout == dense_layout.IN_OUT else 1
  weights = [jnp.full(stored, 0.01 * (i + 1), dt) for i in range(copies)]

  @jax.jit
  def products(x, weights):
    return [jax.lax.dot_general(x, w, (((1,), (contract,)), ((), ())), precision=precision)
            for w in weights]

  out = []
  for m in rows:
    x = jnp.ones((m, k), dt)
    jax.block_until_ready(products(x, weights))                     # compile, touch the pages
    times = []
    for _ in range(REPEATS):
      start = time.perf_counter()
      jax.block_until_ready(products(x, weights))
      times.append(time.perf_counter() - start)
    out.append(statistics.median(times) / copies)
  return out


def _key(shapes, rows, dtype: str, precision: str) -> str:
  settings = dict(cpu=cpu_flags(), cores=os.cpu_count(), jaxlib=_jaxlib_version(),
                  xla_flags=os.environ.get("XLA_FLAGS", ""), shapes=[list(s) for s in shapes],
                  rows=list(rows), dtype=dtype, precision=precision)
  blob = json.dumps(settings, sort_keys=True).encode()
  return hashlib.sha256(blob).hexdigest()[:16]


def cpu_flags() -> str:
  """The CPU's feature flags (the first `flags` line of /proc/cpuinfo; elsewhere the processor
  name): which kernels XLA:CPU runs depends on them (AVX2, AVX-512, AMX)."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("flags"):
          return " ".join(sorted(line.partition(":")[2].split()))
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _jaxlib_version() -> str:
  import jaxlib
  return getattr(jaxlib, "__version__", jax.__version__)


def _read(cache_file: Path | None) -> dict:
  """The cache's entries ({} when absent or unreadable: measuring again is the only cost)."""
  if cache_file is None:
    return {}
  try:
    entries = json.loads(Path(cache_file).read_text(encoding="utf-8"))
  except (OSError, ValueError):
    return {}
  return entries if isinstance(entries, dict) else {}


def _write(cache_file: Path, key: str, entry: dict) -> None:
  """Adds one entry, written to a temporary file and renamed (a reader never sees half a file;
  two processes measuring at once may drop one entry, measured again next time)."""
  path = Path(cache_file)
  entries = _read(path)
  entries[key] = entry
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)
  except OSError as err:
    log.warning("could not keep the dense-layout choice in %s (%s): it is measured again next "
                "run", path, err)
