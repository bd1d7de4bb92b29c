"""Per-layer params in two layouts, and running a model's layers in either.

Stacked (`scan_layers=True`, the default and what HF import builds): every per-layer leaf sits
under one `layers` subtree with a leading [L] axis and the layers run under `nn.scan`, so the
compiled program holds one layer whatever the depth. Unstacked (`scan_layers=False`):
`layers_0` ... `layers_{L-1}` subtrees hold the same leaves without [L] and a Python loop runs
them, so compile time grows with depth, but XLA:CPU reads each layer's float weights where they
lie (from a stack it copies them out first: ~3x a small model's batch-1 decode step). Quantized
layers on specjax's CPU kernels read a stack in place (models/layer_view.py), so they scan
without the copies (`scan_layers`' "auto"). T5 has two
stacks, `encoder/layers` and `decoder/layers`; `unstack` / `stack` convert any of them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

STACKED = "layers"
_UNSTACKED = re.compile(r"layers_(\d+)")
LAYOUTS = ("auto", "scan", "unrolled")


def layer_name(i: int) -> str:
  """The param subtree (and module name) of layer i in the unstacked layout."""
  return f"{STACKED}_{i}"


def scan_layers(layout: str, backend: str | None = None, in_place: bool = False) -> bool:
  """A layout choice -> the models' `scan_layers`. "auto": scanned on TPU (compile time
  independent of depth), and on the CPU where specjax's kernels read every layer's quantized
  weights and cache in place (`in_place`: quant.reads_in_place; the scan passes them the whole
  stacks and the layer's index, models/layer_view.py); unrolled elsewhere on the CPU and on GPU,
  where XLA copies a scanned layer's weights out of the stack before its products (on an H200,
  1.2 ms of a 1.5B model's 3.8 ms step; unrolled, the step is 2.6 ms, and compiling takes 3-4x
  longer: docs/results.md)."""
  if layout not in LAYOUTS:
    raise ValueError(f"layers '{layout}' is not one of {LAYOUTS}.")
  if layout == "auto":
    backend = backend or jax.default_backend()
    return backend == "tpu" or (backend == "cpu" and in_place)
  return layout == "scan"


# ---------------------------------------------------------------------------------------------
# Converting params.


@jax.jit
def _split_on_device(x: jax.Array) -> tuple[jax.Array, ...]:
  """[L, ...] -> L arrays [...], in one dispatch (one compile per leaf shape)."""
  return tuple(x[i] for i in range(x.shape[0]))


def _on_one_cpu(x) -> bool:
  return (isinstance(x, np.ndarray) or isinstance(x, jax.Array)
          and not isinstance(x, jax.core.Tracer) and len(x.devices()) == 1
          and next(iter(x.devices())).platform == "cpu")


def _split(x: jax.Array) -> tuple[jax.Array, ...]:
  """[L, ...] -> L arrays [...]. On one CPU device the slices are numpy views of the same
  memory, each copied once and compiling nothing (the jitted split compiled once per leaf shape:
  7.8 s of a 24 + 24-layer T5's cold start)."""
  if not _on_one_cpu(x):
    return _split_on_device(x)
  host = np.asarray(x)
  return tuple(jnp.array(host[i]) for i in range(host.shape[0]))


def _split_stack(stacked: Mapping, free_stacked: bool) -> dict:
  """One `layers` subtree ([L, ...] leaves) -> {layers_i: the same tree without [L]}."""
  leaves, treedef = jax.tree_util.tree_flatten(stacked)
  per_leaf = []
  for leaf in leaves:
    per_leaf.append(_split(leaf))
    if free_stacked and isinstance(leaf, jax.Array):
      leaf.delete()
  num_layers = len(per_leaf[0])
  return {layer_name(i): jax.tree_util.tree_unflatten(treedef, [parts[i] for parts in per_leaf])
          for i in range(num_layers)}


def unstack(params: Mapping, *, free_stacked: bool = False) -> dict:
  """Every `layers` subtree (top level, or T5's encoder/ and decoder/) -> layers_0 ..
  layers_{L-1}; other leaves are kept as they are, unstacked params returned unchanged.
  free_stacked: delete each stacked leaf once split, so that converting a freshly loaded model
  holds one leaf more than the model, not two models (outside jit only; the caller must not use
  the stacked params again)."""
  out = {}
  for key, value in params.items():
    if key == STACKED and isinstance(value, Mapping):
      out.update(_split_stack(value, free_stacked))
    elif isinstance(value, Mapping):
      out[key] = unstack(value, free_stacked=free_stacked)
    else:
      out[key] = value
  return out


def stack(params: Mapping) -> dict:
  """The inverse of `unstack`: layers_0 .. layers_{L-1} subtrees -> one `layers` subtree with
  [L, ...] leaves; stacked params returned unchanged."""
  out, layers = {}, {}
  for key, value in params.items():
    match = _UNSTACKED.fullmatch(key)
    if match:
      layers[int(match.group(1))] = value
    elif isinstance(value, Mapping):
      out[key] = stack(value)
    else:
      out[key] = value
  if layers:
    if sorted(layers) != list(range(len(layers))):
      raise ValueError(f"unstacked layers {sorted(layers)} are not layers_0 .. layers_"
                       f"{len(layers) - 1}.")
    ordered = [layers[i] for i in range(len(layers))]
    out[STACKED] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *ordered)   # [L, ...]
  return out


def to_layout(params: Mapping, scan: bool, *, free_stacked: bool = False) -> dict:
  """params in the layout a model with `scan_layers=scan` applies (either layout accepted)."""
  return stack(params) if scan else unstack(params, free_stacked=free_stacked)


def first_layers(params: Mapping, k: int) -> dict:
  """A decoder-only model's params keeping layers 0 .. k-1 (either layout) and every other leaf
  (embedding, final norm, head): an early-exit copy of the model. The unrolled layout shares the
  kept layers' arrays; a stack is sliced (a copy of k / L of the layer weights)."""
  out = {}
  for key, value in params.items():
    match = _UNSTACKED.fullmatch(key)
    if key == STACKED and isinstance(value, Mapping):
      out[key] = jax.tree_util.tree_map(lambda x: x[:k], value)
    elif match is None or int(match.group(1)) < k:
      out[key] = value
  return out


def with_scan(model, scan: bool = True):
  """The same model with `config.scan_layers = scan` (e.g. the stacked twin that import and
  init build params with before converting them)."""
  return dataclasses.replace(model, config=dataclasses.replace(model.config, scan_layers=scan))


# ---------------------------------------------------------------------------------------------
# Running the layers.


def run(layers, in_axes: Sequence, carry, *args, method: str = "__call__", take=None):
  """Calls `layers` like an `nn.scan` module: a scanned module directly; the unstacked layout (a
  sequence of layer modules) in a Python loop that gives layer i take(leaf, i) of every leaf of
  an argument whose in_axes entry is 0 (take None: the slice leaf[i]; nn.broadcast arguments
  whole), threads the carry and stacks the per-layer outputs [L, ...], as scan does. Returns
  (carry, outputs)."""
  if not isinstance(layers, Sequence):
    return getattr(layers, method)(carry, *args)
  if any(axis is not nn.broadcast and axis != 0 for axis in in_axes):
    raise ValueError(f"in_axes {in_axes}: only 0 and nn.broadcast are supported.")
  outputs = []
  for i, layer in enumerate(layers):
    pick = (lambda a: a[i]) if take is None else (lambda a: take(a, i))
    sliced = [arg if axis is nn.broadcast else jax.tree_util.tree_map(pick, arg)
              for arg, axis in zip(args, in_axes)]
    carry, out = getattr(layer, method)(carry, *sliced)
    outputs.append(out)
  return carry, jax.tree_util.tree_map(lambda *outs: jnp.stack(outs), *outputs)
