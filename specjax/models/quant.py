"""int8 weights: the dense layers of a decoder-only model stored as int8 with a float32 scale per
output channel. On the CPU they are multiplied as int8 x int8 -> int32 with activations quantized
per row on the fly (W8A8, symmetric, round to nearest); on accelerators weight-only (W8A16: the
kernel converted to the activations' dtype inside the product, the scale applied to its output).

Why weight-only on accelerators: a batch-1 step reads every weight once either way, so both read
a byte per weight, and only W8A8 adds rounding; XLA fuses the conversion into the product there.
On an H200 (jax 0.11.2) XLA:GPU's s8 x s8 -> s32 product also returned twice the product, which
weight-only never asks for. Which is faster than bfloat16 weights on a given accelerator is
eval.bench's --quant int8 rows; quant="auto" keeps the model dtype there until measured.

Why W8A8 on the CPU: a decoding step is a matrix-vector product that reads every
weight once, so its time is the weights' bytes; int8 reads a quarter of float32's. A kernel
stored [out, in] is multiplied by specjax's own CPU kernel (models/cpu_kernels.py: int8 x int8
-> int32, streaming each weight row once for every activation row, at about float32's bytes per
second). One stored [in, out], or any where that kernel cannot be built, goes through XLA:CPU's
int8 x int8 -> int32 product, which runs two or more rows through its integer kernels, while a
float32 x dequantized-int8 product or a one-row int8 product falls back to a slow loop (about
15x float32's time); so activations are quantized, and a one-row product is padded to two rows
there. Both give the same int32 sums.

What is quantized: every Dense kernel of the transformer layers (attention q/k/v/out, the MLP)
and the output layer (a tied head gets an int8 copy of the embedding table, [D, V], or [V, D]
with layout out_in: at a quarter of float32's bytes it is read once per step where the float
table was). The embedding table
stays in the model dtype for the input lookup, which reads one row per token.

Speculative decoding is exact relative to the quantized W8A8 target because the int8 model is one
function of its input across pass widths: its integer products are exact in any order, and the
rest runs width-invariant (transformer.Arch.width_invariant: attention and the norms' statistics
one position at a time), so a verify pass gives each position the bits a one-position step
gives. Without that, the last-bit differences of a batched float part (~1e-7) turn, once
activations are rounded to int8, into a whole quantisation step now and then, and greedy SD left
the int8 target's own tokens at a near-tie (tests/test_quant.py, docs/results.md).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import cpu_kernels, dense_layout, hf_tensors
from specjax.models.hf_tensors import tree_set

QUANTS = ("", "int8")      # "": the model dtype's dense layers
_QMAX = 127.0
AUTO = "auto"              # a loader's choice per machine: `choose`
CHOICES = QUANTS + (AUTO,)  # what a loader or a config section accepts


def choose(backend: str, quantizable: bool) -> tuple[str, str]:
  """quant="auto" -> (the quant to load with, why): AUTO where int8 is measured against float
  weights for the model's shapes (models/layout_choice.py with int8=True: the CPU backend and a
  family with int8 layers), else "" (the model dtype). Example: ("cpu", True) -> ("auto", ...);
  ("gpu", True) -> ("", "int8 on gpu is weight-only and not measured at load ...")."""
  if not quantizable:
    return "", "this family has no int8 layers"
  if backend != "cpu":
    return "", (f"int8 on {backend} is weight-only and not measured at load: eval.bench "
                f"--quant int8 compares it with the model dtype")
  return AUTO, "measured against float weights on this CPU"


def rounds_activations(backend: str | None = None) -> bool:
  """Whether int8 layers on `backend` (None: jax's default) quantize their activations too
  (W8A8: the CPU) or multiply by the int8 weights alone (W8A16: accelerators). Module doc."""
  return (backend or jax.default_backend()) == "cpu"


class Int8Dense(nn.Module):
  """nn.Dense over an int8 kernel [in, out] (layout "in_out") or [out, in] ("out_in") with a
  float32 `scale` [out] (and an optional bias in the activation dtype): x [..., in] -> [..., out]
  in `dtype`. `precision` applies to the weight-only product (accelerators); the CPU's integer
  product is exact."""
  features: int
  use_bias: bool = True
  dtype: Any = jnp.float32
  precision: Any = None
  layout: str = dense_layout.IN_OUT

  @nn.compact
  def __call__(self, x):
    transposed = self.layout == dense_layout.OUT_IN
    shape = (self.features, x.shape[-1]) if transposed else (x.shape[-1], self.features)
    kernel = self.param("kernel", nn.initializers.zeros, shape, jnp.int8)
    scale = self.param("scale", nn.initializers.ones, (self.features,), jnp.float32)
    y = int8_matmul(x, kernel, scale, precision=self.precision,
                    transposed=transposed).astype(self.dtype)
    if self.use_bias:
      y = y + self.param("bias", nn.initializers.zeros, (self.features,), jnp.dtype(self.dtype))
    return y


def dense(features: int, *, quant: str, dtype, precision, name: str, use_bias: bool = True,
          kernel_init=nn.initializers.lecun_normal(), layout: str = "in_out") -> nn.Module:
  """The dense layer of a model whose config says `quant` ("": float weights in `dtype`; "int8"),
  its kernel stored as `layout` says: "in_out", nn.Dense's [in, out], or "out_in", [out, in], the
  same product (models/dense_layout.py)."""
  if quant == "int8":
    return Int8Dense(features, use_bias=use_bias, dtype=dtype, precision=precision,
                     layout=layout, name=name)
  cls = dense_layout.OutInDense if layout == dense_layout.OUT_IN else nn.Dense
  return cls(features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, precision=precision,
             kernel_init=kernel_init, name=name)


def int8_logits(hidden: jax.Array, vocab_size: int, subset=None, precision=None,
                layout: str = dense_layout.IN_OUT) -> jax.Array:
  """Inside a model's compact __call__: the int8 output layer `lm_head` (kernel [D, V], or
  [D, K] over a models/sub_vocab.SubVocab `subset`; [V, D] / [K, D] with layout "out_in") ->
  float32 logits [..., V]."""
  rows = vocab_size if subset is None else subset.size
  logits = Int8Dense(rows, use_bias=False, precision=precision, layout=layout,
                     name="lm_head")(hidden)
  return logits if subset is None else subset.expand(logits)


def int8_matmul(x: jax.Array, kernel: jax.Array, scale: jax.Array, precision=None,
                w8a8: bool | None = None, transposed: bool = False) -> jax.Array:
  """x [..., K] (float) times kernel [K, N] int8 ([N, K] when `transposed`) with scale [N] ->
  float32 [..., N]. W8A8 (w8a8 None: rounds_activations(), the CPU): each row of x quantized
  with its own absmax scale, the product accumulated in int32. Weight-only: the kernel converted
  to x's dtype (int8 values are exact in bfloat16) inside a product at `precision` accumulated
  in float32, times the scale."""
  if kernel.dtype != jnp.int8:
    raise TypeError(f"an int8 layer's kernel {kernel.shape} is {kernel.dtype}: int8 models take "
                    f"the params quant.quantize_params or an int8 load gives")
  contract = 1 if transposed else 0
  if not (rounds_activations() if w8a8 is None else w8a8):
    y = jax.lax.dot_general(x, kernel.astype(x.dtype), (((x.ndim - 1,), (contract,)), ((), ())),
                            precision=precision, preferred_element_type=jnp.float32)
    return y * scale
  lead, width = x.shape[:-1], x.shape[-1]
  rows = x.reshape(-1, width).astype(jnp.float32)                       # [M, K]
  amax = jnp.max(jnp.abs(rows), axis=-1, keepdims=True)                 # [M, 1]
  row_scale = jnp.where(amax > 0, amax / _QMAX, 1.0)
  q = jnp.round(rows / row_scale).astype(jnp.int8)
  acc = _integer_product(q, kernel, transposed)                         # [M, N] int32
  y = acc.astype(jnp.float32) * row_scale * scale
  return y.reshape(*lead, scale.shape[-1])


def _integer_product(q: jax.Array, kernel: jax.Array, transposed: bool) -> jax.Array:
  """q [M, K] int8 times an int8 kernel ([K, N], or [N, K] when `transposed`) -> int32 [M, N]:
  specjax's CPU kernel for an [out, in] kernel where it is built (models/cpu_kernels.py), else
  XLA's product. The same integers either way."""
  if transposed and jax.default_backend() == "cpu" and cpu_kernels.status().active:
    return cpu_kernels.int8_dot(q, kernel)
  m = q.shape[0]
  if m == 1:                       # a one-row int8 product is XLA:CPU's slow path (docstring)
    q = jnp.concatenate([q, q], axis=0)
  # Integer products are exact at any precision: DEFAULT keeps the ambient default (e.g. a
  # session's "highest") from choosing another algorithm for them.
  acc = jax.lax.dot_general(q, kernel, (((1,), (1 if transposed else 0,)), ((), ())),
                            precision=jax.lax.Precision.DEFAULT,
                            preferred_element_type=jnp.int32)           # [M, N]
  return acc[:m]


@functools.partial(jax.jit, static_argnames="transposed")
def quantize_kernel(kernel: jax.Array, transposed: bool = False) -> tuple[jax.Array, jax.Array]:
  """kernel [..., in, out] float ([..., out, in] when `transposed`) -> (int8 of the same shape,
  float32 scale [..., out]): symmetric, per output channel (per layer too when stacked)."""
  w = kernel.astype(jnp.float32)
  axis = -1 if transposed else -2                                  # the input axis
  amax = jnp.max(jnp.abs(w), axis=axis)
  scale = jnp.where(amax > 0, amax / _QMAX, 1.0)
  q = jnp.clip(jnp.round(w / jnp.expand_dims(scale, axis)), -_QMAX, _QMAX).astype(jnp.int8)
  return q, scale


def put(params: dict, path: tuple[str, ...], value: jax.Array, quant: str,
        layout: str = dense_layout.IN_OUT) -> None:
  """A loader's tree_set(params, path, value) that quantizes as it goes: with quant "int8" a
  Dense kernel (a leaf named `kernel` anywhere, the untied output layer's included; given in the
  model's `layout`) is stored as its int8 kernel with its float32 `scale` beside it, so the
  float model is never held whole (the host holds one float leaf extra at a time); other leaves,
  and every leaf with quant "", as given. Finish with `with_head`."""
  if quant == "int8" and path[-1] == "kernel":
    kernel, scale = quantize_kernel(value, transposed=dense_layout.transposes(path, layout, quant))
    tree_set(params, path, kernel)
    tree_set(params, (*path[:-1], "scale"), scale)
  else:
    tree_set(params, path, value)


def put_layers(params: dict, path: tuple[str, ...], read_layer, num_layers: int, dtype,
               quant: str, layout: str = dense_layout.IN_OUT) -> None:
  """`put` for a stacked leaf [L, ...] read a layer at a time (read_layer(i): layer i's array in
  the model's orientation): with quant "int8" a kernel is cast to `dtype` and quantized layer by
  layer into an int8 stack [L, in, out] with its scales [L, out], so the float stack (the MLP's,
  the largest leaf of a deep model) is never held; other leaves are stacked in `dtype`
  (hf_tensors.stack_layers). The bits are those of `put` on the float stack; `layout` as
  there."""
  if quant != "int8" or path[-1] != "kernel":
    tree_set(params, path, hf_tensors.stack_layers(read_layer, num_layers, dtype))
    return
  kernels = scales = None
  for i in range(num_layers):
    kernel, scale = quantize_kernel(hf_tensors.to_device(read_layer(i), dtype),
                                    transposed=dense_layout.transposes(path, layout))
    if kernels is None:
      kernels = np.empty((num_layers, *kernel.shape), np.int8)                # [L, in, out]
      scales = np.empty((num_layers, *scale.shape), np.float32)              # [L, out]
    kernels[i], scales[i] = kernel, scale
  tree_set(params, path, jax.device_put(kernels))
  tree_set(params, (*path[:-1], "scale"), jax.device_put(scales))


def with_head(params: dict, quant: str, tied: bool, layout: str = dense_layout.IN_OUT) -> dict:
  """The params a loader built with `put`, with a tied int8 model's output layer added: `lm_head`
  (kernel [D, V] int8, scale [V]; [V, D] in layout "out_in") quantized from the embedding table,
  which stays for the input lookup. Unchanged for quant "" or an untied head (`put` quantized
  it)."""
  if quant == "int8" and tied:
    table = params["token_embed"]["embedding"]                                   # [V, D]
    if dense_layout.transposes(("lm_head", "kernel"), layout, quant):
      kernel, scale = quantize_kernel(table, transposed=True)                    # [V, D]
    else:
      kernel, scale = _quantize_transposed(table)                                # [D, V]
    params["lm_head"] = {"kernel": kernel, "scale": scale}
  return params


def quantize_params(params: dict, tied: bool, layout: str = dense_layout.IN_OUT) -> dict:
  """The params of a float decoder-only model (its kernels in `layout`) -> those of its int8 twin
  (config quant="int8", the same layout), in place, as a loader with `put` and `with_head` builds
  them (each float kernel dropped as soon as it is converted)."""
  for path in _kernel_paths(params):
    parent = params
    for key in path[:-1]:
      parent = parent[key]
    kernel = parent.pop("kernel")
    if path[0] == "lm_head" and dense_layout.transposes(path, layout, "int8"):
      kernel = kernel.T                              # a float head is [D, V] in either layout
    put(params, path, kernel, "int8", layout)
  return with_head(params, "int8", tied, layout)


def _kernel_paths(tree: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
  paths = []
  for key, sub in tree.items():
    if isinstance(sub, dict):
      paths += _kernel_paths(sub, (*prefix, key))
    elif key == "kernel":
      paths.append((*prefix, key))
  return paths


@jax.jit
def _quantize_transposed(table: jax.Array) -> tuple[jax.Array, jax.Array]:
  return quantize_kernel(table.T)

