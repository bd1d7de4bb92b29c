"""The roofline of a decoding step for eval.bench: what a step must read and compute, and the
device's peaks (datasheets, or given)."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

# device_kind prefix -> (memory bandwidth TB/s, dense bf16 TFLOP/s), the vendors' datasheets.
PEAKS = {
    "TPU v4": (1.2, 275.0), "TPU v5 lite": (0.819, 197.0), "TPU v5e": (0.819, 197.0),
    "TPU v5p": (2.765, 459.0), "TPU v5": (2.765, 459.0), "TPU v6 lite": (1.64, 918.0),
    "TPU v6e": (1.64, 918.0), "NVIDIA A100": (2.039, 312.0), "NVIDIA H100": (3.35, 989.0),
    "NVIDIA H200": (4.8, 989.0),
}


def peaks(device_kind: str, override: str = "") -> tuple[float, float] | None:
  """(bytes/s, FLOP/s) of the device: --peak 'TBps,TFLOPs' or the datasheet table (None: not
  known, e.g. a CPU)."""
  if override:
    bw, fl = (float(x) for x in override.split(","))
    return bw * 1e12, fl * 1e12
  for prefix, (bw, fl) in sorted(PEAKS.items(), key=lambda kv: -len(kv[0])):
    if device_kind.startswith(prefix):
      return bw * 1e12, fl * 1e12
  return None


def _leaves(tree, skip: tuple[str, ...] = ()):
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    names = [getattr(k, "key", str(k)) for k in path]
    if not any(s in names for s in skip):
      yield names, leaf


def step_cost(model, params, batch: int, positions: float) -> dict:
  """What one decoding step of `batch` rows at `positions` cached entries must move and compute:
  the weights it reads (an untied embedding table is gathered, B rows; T5's encoder is not run),
  the filled KV cache, and 2 FLOPs per weight per row (matmuls) plus attention's 4 per cached
  entry per head dim."""
  cfg = model.config
  skip = ("encoder",)
  weights = matmul = 0
  # A tied table is the output layer too, unless an int8 model keeps its own copy (lm_head).
  tied = getattr(cfg, "tie_word_embeddings", False) and "lm_head" not in params
  for names, leaf in _leaves(params, skip):
    size, nbytes = int(np.prod(leaf.shape)), int(leaf.size * leaf.dtype.itemsize)
    embedding = "embedding" in names
    if embedding and not tied:
      nbytes, size = nbytes * batch // max(leaf.shape[0], 1), 0
    weights += nbytes
    if leaf.ndim >= 2:
      matmul += size
  layers = getattr(cfg, "num_decoder_layers", None) or cfg.num_layers
  heads, kv_heads = model.heads
  head_dim = getattr(cfg, "head_dim", None) or cfg.d_kv
  itemsize = jnp.dtype(cfg.dtype).itemsize
  cache = 2 * layers * kv_heads * head_dim * positions * batch * itemsize
  attention = 4 * layers * heads * head_dim * positions * batch
  return dict(weight_bytes=weights, cache_bytes=cache, flops=2 * matmul * batch + attention)


def floor_s(cost: dict, peak: tuple[float, float] | None) -> float | None:
  if peak is None:
    return None
  return max((cost["weight_bytes"] + cost["cache_bytes"]) / peak[0], cost["flops"] / peak[1])


if __name__ == "__main__":         # a library module: say which tool to run, not exit 0
  sys.exit("eval.roofline is a library, not a tool: python -m eval.bench reports each step against the roofline")
