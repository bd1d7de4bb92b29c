"""What a verify pass costs on this backend, one matrix multiply at a time: [M, K] x weights for
M = 1 (a decoding step) and M = 2..8 (a verify pass over gamma + 1 positions), in float32,
bfloat16, int8 (models/quant.py's W8A8 product) and int4 (W4A8, [N, K] only), with the weights
stored [K, N] (Flax's layout) or [N, K] (PyTorch's).

    python -m eval.matmul                                  # Qwen2.5-1.5B's MLP matrix, 1536 x 8960
    python -m eval.matmul --k 896 --n 4864 --rows 1,2,5 --output_json matmul.json
    python -m eval.matmul --dtypes float32,int8 --copies 16  # weights read from memory, not cache

Speculative decoding pays when a pass over M positions costs about what a one-position pass
costs (the memory-bound regime of accelerators at small batch). `ratio` is each time over the
M = 1 time of the same dtype and layout; `vs_best_1` is over the fastest M = 1 time of all
(what a target-only loop would use). Jitted, compiled apart, median of --repeats calls.

With --copies 1 the one matrix stays in the CPU's caches between calls (a 1536 x 8960 int8
matrix is 14 MB; some server CPUs have 100+ MB of last-level cache), which a model's step, whose
weights are read once each, never sees: --copies N calls N distinct copies in turn.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from eval import flags
from specjax.app import cli, outputs
from specjax.models import quant

LAYOUTS = {"KN": (((1,), (0,)), ((), ())), "NK": (((1,), (1,)), ((), ()))}
QUANTIZED = ("int8", "int4")


def parse_args(argv):
  p = cli.parser("python -m eval.matmul", __doc__)
  p.add_argument("--k", type=int, default=1536, help="input features")
  p.add_argument("--n", type=int, default=8960, help="output features")
  p.add_argument("--rows", default="1,2,3,5,8", help="comma-separated M values")
  p.add_argument("--dtypes", default="float32,bfloat16")
  p.add_argument("--repeats", type=int, default=30)
  p.add_argument("--copies", type=int, default=1,
                 help="distinct copies of the weights, called in turn: with enough of them "
                      "(their bytes past the CPU's last cache) each call reads its weights from "
                      "memory, as a model's step does; 1 times one matrix again and again")
  p.add_argument("--output_json")
  return cli.parse(p, argv)


def time_call(fn, x, copies: list[tuple], repeats: int) -> float:
  """Median seconds of fn(x, *args), args taking each of `copies` in turn, after a first
  (compiling) call with each."""
  for args in copies:
    jax.block_until_ready(fn(x, *args))
  times = []
  for i in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(x, *copies[i % len(copies)]))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def measure(k: int, n: int, rows: list[int], dtypes: list[str], repeats: int,
            copies: int = 1) -> list[dict]:
  weights = np.random.default_rng(0).standard_normal((k, n), np.float32)
  records = []
  for dtype in dtypes:
    for layout, dims in LAYOUTS.items():
      if dtype == "int4" and layout == "KN":
        continue                                         # int4 layers are stored [N, K] only
      fn, w, args = _product(dtype, weights if layout == "KN" else weights.T, dims,
                             transposed=layout == "NK")
      stored = [args] + [tuple(jnp.array(a, copy=True) for a in args) for _ in range(copies - 1)]
      for m in rows:
        x = jnp.ones((m, k), jnp.float32 if dtype in QUANTIZED else dtype)
        ms = 1e3 * time_call(fn, x, stored, repeats=max(repeats, copies))
        records.append(dict(dtype=dtype, layout=layout, rows=m, k=k, n=n, ms=ms, copies=copies,
                            weight_gb_per_s=sum(a.nbytes for a in args) / ms / 1e6,
                            gflop_per_s=2 * m * k * n / ms / 1e6))
      del stored                # freed before the next dtype's copies are made
  best_1 = min(r["ms"] for r in records if r["rows"] == 1)
  for r in records:
    one = next(o["ms"] for o in records
               if (o["dtype"], o["layout"], o["rows"]) == (r["dtype"], r["layout"], 1))
    r.update(ratio=r["ms"] / one, vs_best_1=r["ms"] / best_1)
  return records


def _product(dtype: str, weights: np.ndarray, dims, transposed: bool = False):
  """(jitted fn(x, *args), the weights as stored, args): a float product of `dtype`, int8
  weights (stored [N, K] when `transposed`) with activations quantized per row
  (models/quant.int8_matmul: W8A8), or int4 weights, [N, K] (quant.int4_matmul: W4A8)."""
  if dtype == "int4":
    packed, scale = quant.quantize_kernel(jnp.asarray(weights), True, "int4")
    return jax.jit(quant.int4_matmul), packed, (packed, scale)
  if dtype == "int8":
    kernel, scale = quant.quantize_kernel(jnp.asarray(weights), transposed=transposed)
    product = functools.partial(quant.int8_matmul, transposed=transposed)
    return jax.jit(product), kernel, (kernel, scale)
  w = jnp.asarray(weights, dtype)
  return jax.jit(lambda x, w: jax.lax.dot_general(x, w, dims,
                                                  preferred_element_type=jnp.float32)), w, (w,)


def check_memory(k: int, n: int, copies: int, dtypes: list[str]) -> None:
  """Refuse --copies whose weights (held at once, for one dtype and layout at a time) need more
  than 80% of the memory available now: a typo of a copy count swapped or was killed, silently."""
  each = k * n * max(np.dtype(d).itemsize if d not in QUANTIZED else 1 for d in dtypes)
  need, have = each * (copies + 1), _available_bytes()
  if have is not None and need > 0.8 * have:
    most = max(int(0.8 * have // each) - 1, 1)
    raise ValueError(f"--copies {copies} holds {copies} copies of the {k} x {n} weights at once "
                     f"({need / 1e9:.1f} GB), and {have / 1e9:.1f} GB of memory is available: use "
                     f"--copies {most} or less")


def _available_bytes() -> int | None:
  """MemAvailable of /proc/meminfo (None where there is none)."""
  try:
    with open("/proc/meminfo") as f:
      line = next(line for line in f if line.startswith("MemAvailable:"))
    return int(line.split()[1]) * 1024
  except (OSError, StopIteration, ValueError, IndexError):
    return None


def table(records: list[dict]) -> str:
  lines = ["| dtype | layout | M | ms | ratio | vs_best_1 | weight GB/s | GFLOP/s |",
           "|---|---|---|---|---|---|---|---|"]
  lines += [f"| {r['dtype']} | {r['layout']} | {r['rows']} | {r['ms']:.2f} | {r['ratio']:.2f} | "
            f"{r['vs_best_1']:.2f} | {r['weight_gb_per_s']:.1f} | {r['gflop_per_s']:.1f} |"
            for r in records]
  return "\n".join(lines)


def main(argv=None) -> int:
  args, overrides = parse_args(argv)

  def go():
    if overrides:
      raise ValueError(f"eval.matmul takes no --config overrides (got {overrides[0]})")
    flags.check_counts(k=args.k, n=args.n, repeats=args.repeats, copies=args.copies)
    rows = flags.parse_gammas(args.rows, "--rows")
    rows = rows if 1 in rows else [1] + rows            # the ratios are over M = 1
    output = flags.output_file(args.output_json, "--output_json")
    cli.setup()
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in ("float32", "bfloat16", "float16") + QUANTIZED]
    if unknown or not dtypes:
      raise ValueError(f"--dtypes: use float32, bfloat16, float16, int8 or int4 (got "
                       f"{args.dtypes!r})")
    if "int4" in dtypes and args.k % quant.GROUP:
      raise ValueError(f"--dtypes int4 groups the inputs by {quant.GROUP}: use a --k that is a "
                       f"multiple of {quant.GROUP} (got {args.k}), or drop int4")
    check_memory(args.k, args.n, args.copies, dtypes)
    records = measure(args.k, args.n, rows, dtypes, args.repeats, args.copies)
    print(table(records), flush=True)
    if output:
      outputs.write_json(output, {"device": jax.devices()[0].device_kind, "records": records})

  return cli.run("eval.matmul", go)


if __name__ == "__main__":
  sys.exit(main())
