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
machine and setting; each config's shapes are kept beside the answers, so that reading one does
not trace the model. Other backends get "in_out" without measuring: the flip was seen on XLA:CPU,
and the GPU and TPU results (docs/results.md) were measured in Flax's layout.

With `int8=True` (a loader's quant="auto") int8 weights in either layout are two more
candidates, measured the same way through the model's own int8 product (models/quant.int8_matmul:
W8A8; [in, out] on XLA's integer product, a one-row product padded to two, [out, in] on
specjax's CPU kernel where it builds, models/cpu_kernels.py), and the output layer is measured too
(int8 quantizes it, [D, V] or [V, D] as the candidate stores its layers; its first HEAD_ROWS
vocabulary rows, scaled to the vocabulary): per-model costs are the
layers' (a layer's products times the layer count) plus the head's. The cheaper int8 layout is
chosen only when it is more than MARGIN below the better float layout's cost: it is an
approximation of the float model, and whether it pays depends on the CPU (VNNI), the width (a
target's verify pass, a draft's or a target-alone run's one-row steps) and the shape
(docs/results.md: on one AVX-512 machine int8 wins for a verify pass and loses for a one-row
step).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import statistics
import time
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax.models import cpu_kernels, dense_layout, layers, quant

log = logging.getLogger(__name__)

MARGIN = 0.05          # out_in must be this much cheaper (fraction of in_out's cost)
REPEATS = 7            # timed calls per product, after one compiling call
_MAX_SHAPES = 3        # a layer's largest distinct kernel shapes that are measured
_SPREAD_BYTES = 64 << 20   # at least this many weight bytes per product: past the caches
_MAX_COPIES = 8
DEFAULT_ROWS = (1, 5)  # when the loader does not know gamma: a step and gamma = 4's verify
INT8 = "int8"          # int8 weights [in, out], a candidate with int8=True (models/quant.py)
INT8_OUT_IN = "int8_out_in"   # int8 weights [out, in], the other int8 candidate
INT8_LAYOUTS = {INT8: dense_layout.IN_OUT, INT8_OUT_IN: dense_layout.OUT_IN}
HEAD_ROWS = 16384      # the output layer's vocabulary rows that are timed (then scaled to V)


@dataclasses.dataclass(frozen=True)
class Choice:
  """The layout picked, why ("measured", "cached" or the backend's default), the weighted costs
  in seconds of the candidates (empty when not measured: a layer's largest products, or with
  int8 candidates the whole model's products), and the quant picked ("" or "int8": only where
  int8 was a candidate)."""
  layout: str
  reason: str
  costs: dict = dataclasses.field(default_factory=dict)
  quant: str = ""

  def describe(self) -> str:
    picked = f"{self.quant} weights {self.layout}" if self.quant else self.layout
    if not self.costs:
      return f"{picked} ({self.reason})"
    ms = ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in sorted(self.costs.items()))
    what = ("the model's products at those widths" if INT8 in self.costs
            else "a layer's largest products")
    return f"{picked} ({self.reason}: {ms}, {what} summed)"


def _described(model, entries: dict, cache_file: Path | None):
  """(dense_shapes, _head) of `model`, kept in the cache under a digest of its config: tracing
  the model's init for its abstract params is most of a cached choice's time, and a config
  always gives the same shapes. A config with a sub-vocabulary head (arrays) is not kept."""
  config = dataclasses.replace(model.config, scan_layers=True, layout=dense_layout.IN_OUT)
  if config.head_subset is not None:
    return dense_shapes(model), _head(model)
  key = f"config-{_digest([type(model).__name__, dataclasses.asdict(config)])}"
  kept = entries.get(key)
  if isinstance(kept, dict) and "shapes" in kept and "head" in kept:
    return tuple(tuple(s) for s in kept["shapes"]), tuple(kept["head"])
  params = _abstract_params(model)
  shapes, head = dense_shapes(model, params), _head(model, params)
  if cache_file is not None:
    _write(cache_file, key, dict(shapes=[list(s) for s in shapes], head=list(head)))
  return shapes, head


def dense_shapes(model, params=None) -> tuple[tuple[int, int, int], ...]:
  """A decoder-only model's layer kernel shapes as (in, out, count per layer), the _MAX_SHAPES
  largest by in * out, from the abstract params of its stacked, [in, out] twin (nothing is
  allocated; `params`: those abstract params when the caller has them)."""
  shapes = _abstract_params(model) if params is None else params
  counts = Counter()
  for path, leaf in jax.tree_util.tree_flatten_with_path(shapes[layers.STACKED])[0]:
    if getattr(path[-1], "key", None) == "kernel":
      counts[tuple(leaf.shape[1:])] += 1                               # [L, in, out] -> (in, out)
  largest = sorted(counts, key=lambda s: s[0] * s[1], reverse=True)[:_MAX_SHAPES]
  return tuple((k, n, counts[(k, n)]) for k, n in largest)


def _abstract_params(model):
  """The abstract params (nothing allocated) of `model`'s stacked, [in, out] twin."""
  twin = dense_layout.with_layout(layers.with_scan(model), dense_layout.IN_OUT)
  return jax.eval_shape(twin.init_params, jax.random.PRNGKey(0))


def choose(model, rows=DEFAULT_ROWS, *, cache_file: Path | None, backend: str | None = None,
           int8: bool = False, layout: str | None = None) -> Choice:
  """The layout for `model` (a decoder-only model with a `layout` field) at widths `rows` (a
  repeated width counts as often as it appears): the backend default off the CPU, else the
  cached answer or a measurement (module docstring), stored in `cache_file` (None: not stored).
  int8: int8 weights are a candidate too (Choice.quant says whether they won); layout: the
  float layout when it is fixed (None: both are measured)."""
  backend = backend or jax.default_backend()
  if backend != "cpu":
    return Choice(layout or dense_layout.IN_OUT,
                  f"the {backend} backend's default, not measured")
  cfg = model.config
  entries = _read(cache_file)
  shapes, head = _described(model, entries, cache_file)
  rows = tuple(sorted(int(m) for m in rows))
  floats = (layout,) if layout else dense_layout.LAYOUTS
  head = head if int8 else None
  key = _key(shapes, rows, cfg.dtype, cfg.precision, floats, head)
  cached = entries.get(key)
  if cached is not None and cached.get("layout") in floats:
    return Choice(cached["layout"], f"cached in {cache_file}", cached.get("costs", {}),
                  cached.get("quant", ""))
  costs = {f: _cost(shapes, rows, f, cfg.dtype, cfg.precision) for f in floats}
  int8s = [f for f, stored in INT8_LAYOUTS.items() if stored in floats] if int8 else []
  if int8:
    costs = _model_costs(costs, shapes, rows, head, cfg, int8s)
  best = decide(costs) if len(floats) == 2 else floats[0]
  choice = Choice(best, f"measured at rows {', '.join(map(str, rows))}", costs)
  if int8:
    fastest = min(int8s, key=costs.get)
    if costs[fastest] < (1.0 - MARGIN) * costs[best]:
      choice = dataclasses.replace(choice, layout=INT8_LAYOUTS[fastest], quant=INT8)
  if cache_file is not None:
    _write(cache_file, key, dict(layout=choice.layout, quant=choice.quant, costs=costs,
                                 rows=list(rows), shapes=[list(s) for s in shapes],
                                 dtype=cfg.dtype))
  return choice


def _head(model, params=None) -> tuple[int, int, int, bool]:
  """(layers, D, V, tied) of a decoder-only model, from its abstract params (`params`, else
  traced here)."""
  shapes = _abstract_params(model) if params is None else params
  num_layers = jax.tree_util.tree_leaves(shapes[layers.STACKED])[0].shape[0]
  vocab, width = shapes["token_embed"]["embedding"].shape
  return num_layers, width, vocab, "lm_head" not in shapes


def _model_costs(layer_costs: dict, shapes, rows, head, cfg, int8s) -> dict:
  """A step's products per candidate: the float layouts' layer costs and those of the int8
  candidates `int8s` (timed here), times the layer count, plus the output layer's in float (as
  stored: a tied table [V, D], an untied kernel [D, V]) or in int8 (in the candidate's layout)."""
  num_layers, width, vocab, tied = head
  costs = dict(layer_costs, **{f: _cost(shapes, rows, f, cfg.dtype, cfg.precision)
                               for f in int8s})
  cols = min(vocab, HEAD_ROWS)
  head_cost = lambda fmt: vocab / cols * _cost(((width, cols, 1),), rows, fmt, cfg.dtype,
                                               cfg.precision)
  float_head = head_cost(dense_layout.OUT_IN if tied else dense_layout.IN_OUT)
  # an int8 output layer is stored as its layers are: [D, V], or [V, D] with out_in
  return {f: num_layers * c + (head_cost(f) if f in INT8_LAYOUTS else float_head)
          for f, c in costs.items()}


def decide(costs: dict[str, float]) -> str:
  """out_in when its cost is more than MARGIN below in_out's, else in_out (e.g. {in_out: 1.0,
  out_in: 0.96} -> in_out; {in_out: 1.0, out_in: 0.94} -> out_in)."""
  if costs[dense_layout.OUT_IN] < (1.0 - MARGIN) * costs[dense_layout.IN_OUT]:
    return dense_layout.OUT_IN
  return dense_layout.IN_OUT


def _cost(shapes, rows, fmt: str, dtype: str, precision: str) -> float:
  """Sum over shapes (in, out, count) and widths M (each as often as `rows` holds it) of count x
  the median seconds of one [M, in] x kernel product in `fmt` (a layout or INT8); each width
  timed once."""
  widths = Counter(rows)
  total = 0.0
  for k, n, count in shapes:
    times = _times((k, n), tuple(widths), fmt, dtype, precision)
    total += count * sum(widths[m] * t for m, t in zip(widths, times))
  return total


def _times(shape, rows, fmt: str, dtype: str, precision: str) -> list[float]:
  if fmt in INT8_LAYOUTS:
    return time_int8_products(shape, rows, INT8_LAYOUTS[fmt])
  return time_products(shape, rows, fmt, dtype, precision)


def time_products(shape: tuple[int, int], rows: tuple[int, ...], layout: str, dtype: str,
                  precision: str) -> list[float]:
  """Median seconds of [M, in] x one kernel of `shape` (in, out) stored in `layout`, for each M
  in `rows`, over copies that together exceed the caches (module docstring). The weights are
  filled, not drawn: a float product's time does not depend on the values, and drawing 100 MB
  of normals cost more than the timing."""
  k, n = shape
  dt = jnp.dtype(dtype)
  stored = (k, n) if layout == dense_layout.IN_OUT else (n, k)
  contract = 0 if layout == dense_layout.IN_OUT else 1
  weights = [jnp.full(stored, 0.01 * (i + 1), dt) for i in range(_copies(k * n * dt.itemsize))]
  product = lambda x, w: jax.lax.dot_general(x, w, (((1,), (contract,)), ((), ())),
                                             precision=precision)
  return _median_seconds(product, weights, k, rows, dt)


def time_int8_products(shape: tuple[int, int], rows: tuple[int, ...],
                       layout: str = dense_layout.IN_OUT) -> list[float]:
  """time_products for an int8 kernel of `shape` (in, out) stored in `layout` with its scale,
  multiplied as an int8 model multiplies (quant.int8_matmul: float32 activations quantized per
  row)."""
  k, n = shape
  transposed = layout == dense_layout.OUT_IN
  scale = jnp.full((n,), 0.01, jnp.float32)
  weights = [jnp.full((n, k) if transposed else (k, n), i + 1, jnp.int8)
             for i in range(_copies(k * n))]
  product = lambda x, w: quant.int8_matmul(x, w, scale, transposed=transposed)
  return _median_seconds(product, weights, k, rows, jnp.dtype(jnp.float32))


def _copies(nbytes: int) -> int:
  return max(1, min(_MAX_COPIES, -(-_SPREAD_BYTES // nbytes)))


def _median_seconds(product, weights, k: int, rows, dt) -> list[float]:
  """Per M in rows: the median seconds of product([M, k] ones, w), one call per weight copy."""
  products = jax.jit(lambda x, weights: [product(x, w) for w in weights])
  out = []
  for m in rows:
    x = jnp.ones((m, k), dt)
    jax.block_until_ready(products(x, weights))                     # compile, touch the pages
    times = []
    for _ in range(REPEATS):
      start = time.perf_counter()
      jax.block_until_ready(products(x, weights))
      times.append(time.perf_counter() - start)
    out.append(statistics.median(times) / len(weights))
  return out


def _key(shapes, rows, dtype: str, precision: str, floats=dense_layout.LAYOUTS,
         head=None) -> str:
  settings = dict(cpu=cpu_kernels.cpu_flags(), cores=os.cpu_count(), jaxlib=_jaxlib_version(),
                  xla_flags=os.environ.get("XLA_FLAGS", ""), shapes=[list(s) for s in shapes],
                  rows=list(rows), dtype=dtype, precision=precision)
  if tuple(floats) != dense_layout.LAYOUTS or head is not None:   # older keys stay valid
    settings.update(floats=list(floats), head=list(head) if head else None)
  if head is not None:                          # int8 candidates: both layouts since version 2
    settings.update(int8_candidates=sorted(INT8_LAYOUTS))
    if cpu_kernels.status().active:             # [out, in] int8 runs on specjax's kernel
      settings.update(int8_kernel=cpu_kernels.status().describe())
  return _digest(settings)


def _digest(obj) -> str:
  """16 hex digits of sha256 over `obj` as sorted JSON (repr for what JSON cannot hold)."""
  blob = json.dumps(obj, sort_keys=True, default=repr).encode()
  return hashlib.sha256(blob).hexdigest()[:16]


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
