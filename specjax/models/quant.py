"""int8 (and int4, below) weights: the dense layers of a decoder-only model stored as int8 with a
float32 scale per output channel. On the CPU they are multiplied as int8 x int8 -> int32 with
activations quantized per row on the fly (W8A8, symmetric, round to nearest); on accelerators
weight-only (W8A16: the kernel converted to the activations' dtype inside the product, the scale
applied to its output).

Why weight-only on accelerators: a batch-1 step reads every weight once either way, so both read
a byte per weight, and only W8A8 adds rounding; XLA fuses the conversion into the product there.
On an H200 (jax 0.11.2) XLA:GPU's s8 x s8 -> s32 product also returned twice the product, which
weight-only never asks for. Which is faster than bfloat16 weights on a given accelerator is
eval.bench's --quant int8 rows; quant="auto" keeps the model dtype there until measured.

Why W8A8 on the CPU: a decoding step is a matrix-vector product that reads every
weight once, so its time is the weights' bytes; int8 reads a quarter of float32's. A kernel
stored [out, in] is multiplied by specjax's own CPU kernel (models/cpu_kernels.py: int8 x int8
-> int32, streaming the weights once for every activation row, at about float32's bytes per
second), and kept in that kernel's blocked layout (block_int8: 16 rows' entries interleaved four
at a time; the [out, in] shape, its entries reordered, so param trees and sharding rules are
unchanged), which lets a verify pass's 4-8 rows cost little more than one. One stored
[in, out], or any where that kernel cannot be built, goes through XLA:CPU's int8 x int8 -> int32
product, which runs two or more rows through its integer kernels, while a
float32 x dequantized-int8 product or a one-row int8 product falls back to a slow loop (about
15x float32's time); so activations are quantized, and a one-row product is padded to two rows
there. Both give the same int32 sums.

int4 ("int4", a draft's choice): per group of 64 inputs a float32 scale and 64 four-bit weights
(llama.cpp's Q4_0 rounding, pack_int4), packed two to a byte and stored [out, in] only. On the
CPU: W4A8 on specjax's kernel, each group's integer sum exact and the groups added in float32 in
one order, so the model is width-invariant like int8's. A draft step reads about half of int8's
bytes; the rounding costs acceptance only, since speculative decoding is exact relative to the
target whatever the draft. Elsewhere (accelerators, or no compiler) the weights are dequantized
inside each step.

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

from specjax.models import cpu_kernels, dense_layout, hf_tensors, layer_view
from specjax.models.hf_tensors import tree_set

QUANTS = ("", "int8", "int4")   # "": the model dtype's dense layers
_QMAX = 127.0
GROUP = 64                 # int4 weights per scale, along the input axis
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


def reads_in_place(quant: str, layout: str) -> bool:
  """Whether a model's `quant` layers stored in `layout` run on specjax's CPU kernels in this
  process (int4, and int8 stored [out, in], with the CPU's W8A8 and the kernels built), which
  then read a layer of a stacked [L, ...] leaf where it lies (models/layer_view.py), so that its
  layers run scanned at the unrolled layout's speed (models/layers.scan_layers). Not with more
  than one device: XLA does not partition a kernel's call, so a sharded stack passed whole
  would be gathered whole in every layer (one layer's slice is, otherwise)."""
  # The format first: a float model never builds the kernels (status() compiles them).
  kernel_format = quant == "int4" or (quant == "int8" and layout == dense_layout.OUT_IN)
  return (kernel_format and jax.default_backend() == "cpu" and jax.device_count() == 1
          and rounds_activations() and cpu_kernels.status().active)


class QuantDense(nn.Module):
  """nn.Dense over quantized weights (and an optional bias in the activation dtype): x [..., in]
  -> [..., out] in `dtype`. quant "int8": an int8 kernel [in, out] (layout "in_out") or [out, in]
  ("out_in") with a float32 `scale` [out]; "int4": int4 weights packed two to a byte, `kernel`
  uint8 [out, in / 2] (layout out_in only) with a float32 `scale` [out, in / GROUP]
  (pack_int4). `precision` applies to the weight-only product (accelerators); the CPU's integer
  products are exact."""
  features: int
  use_bias: bool = True
  dtype: Any = jnp.float32
  precision: Any = None
  layout: str = dense_layout.IN_OUT
  quant: str = "int8"

  @nn.compact
  def __call__(self, x):
    width = x.shape[-1]
    if self.quant == "int4" and width % GROUP:
      raise ValueError(f"int4 layers need input widths that are multiples of {GROUP}; "
                       f"{self.name} takes {width}: use quant int8 or '' for this model")
    if self.quant == "int4":
      kernel = self.param("kernel", nn.initializers.zeros, (self.features, width // 2), jnp.uint8)
      scale = self.param("scale", nn.initializers.ones, (self.features, width // GROUP),
                         jnp.float32)
      y = int4_matmul(x, kernel, scale, precision=self.precision)
    else:
      transposed = self.layout == dense_layout.OUT_IN
      shape = (self.features, width) if transposed else (width, self.features)
      kernel = self.param("kernel", nn.initializers.zeros, shape, jnp.int8)
      scale = self.param("scale", nn.initializers.ones, (self.features,), jnp.float32)
      y = int8_matmul(x, kernel, scale, precision=self.precision, transposed=transposed)
    y = y.astype(self.dtype)
    if self.use_bias:
      y = y + self.param("bias", nn.initializers.zeros, (self.features,), jnp.dtype(self.dtype))
    return y


def dense(features: int, *, quant: str, dtype, precision, name: str, use_bias: bool = True,
          kernel_init=nn.initializers.lecun_normal(), layout: str = "in_out") -> nn.Module:
  """The dense layer of a model whose config says `quant` ("": float weights in `dtype`; "int8";
  "int4"), its kernel stored as `layout` says: "in_out", nn.Dense's [in, out], or "out_in",
  [out, in], the same product (models/dense_layout.py)."""
  if quant:
    return QuantDense(features, use_bias=use_bias, dtype=dtype, precision=precision,
                      layout=layout, quant=quant, name=name)
  cls = dense_layout.OutInDense if layout == dense_layout.OUT_IN else nn.Dense
  return cls(features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, precision=precision,
             kernel_init=kernel_init, name=name)


def quantized_logits(hidden: jax.Array, vocab_size: int, quant: str, subset=None, precision=None,
                     layout: str = dense_layout.IN_OUT) -> jax.Array:
  """Inside a model's compact __call__: the quantized output layer `lm_head` (int8: kernel
  [D, V], or [D, K] over a models/sub_vocab.SubVocab `subset`, [V, D] / [K, D] with layout
  "out_in"; int4: [V, D / 2] / [K, D / 2]) -> float32 logits [..., V]."""
  rows = vocab_size if subset is None else subset.size
  logits = QuantDense(rows, use_bias=False, precision=precision, layout=layout, quant=quant,
                      name="lm_head")(hidden)
  return logits if subset is None else subset.expand(logits)


def int8_matmul(x: jax.Array, kernel: jax.Array, scale: jax.Array, precision=None,
                w8a8: bool | None = None, transposed: bool = False) -> jax.Array:
  """x [..., K] (float) times kernel [K, N] int8 ([N, K] when `transposed`; or a
  layer_view.LayerOf of a stack of them) with scale [N] -> float32 [..., N]. W8A8 (w8a8 None: rounds_activations(), the CPU): each row of x quantized
  with its own absmax scale, the product accumulated in int32. Weight-only: the kernel converted
  to x's dtype (int8 values are exact in bfloat16) inside a product at `precision` accumulated
  in float32, times the scale."""
  if kernel.dtype != jnp.int8:
    raise TypeError(f"an int8 layer's kernel {kernel.shape} is {kernel.dtype}: int8 models take "
                    f"the params quant.quantize_params or an int8 load gives")
  contract = 1 if transposed else 0
  if not (rounds_activations() if w8a8 is None else w8a8):
    y = jax.lax.dot_general(x, layer_view.read(kernel).astype(x.dtype),
                            (((x.ndim - 1,), (contract,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)
    return y * scale
  q, row_scale = _quantize_rows(x)                                      # [M, K], [M, 1]
  acc = _integer_product(q, kernel, transposed)                         # [M, N] int32
  y = acc.astype(jnp.float32) * row_scale * scale
  return y.reshape(*x.shape[:-1], scale.shape[-1])


def int4_matmul(x: jax.Array, packed: jax.Array, scale: jax.Array, precision=None,
                w4a8: bool | None = None) -> jax.Array:
  """x [..., K] (float) times an int4 layer (packed uint8 [N, K / 2], scale [N, K / GROUP]:
  pack_int4's, in block_int4's layout where blocked_layout(); or layer_view.LayerOf of their
  stacks) -> float32 [..., N]. W4A8 (w4a8 None: rounds_activations(), the CPU): each row
  of x quantized to int8 with its own absmax scale, each group's product summed exactly in int32
  and scaled, on specjax's CPU kernel (models/cpu_kernels.py). Elsewhere, and where that kernel
  is not built, the weights are dequantized inside the step and multiplied in float32 at
  `precision` (x's dtype on accelerators), the same numbers up to float32 rounding."""
  if packed.dtype != jnp.uint8 or scale.shape[-1] * GROUP != 2 * packed.shape[-1]:
    raise TypeError(f"an int4 layer takes packed uint8 [N, K / 2] and scales [N, K / {GROUP}] "
                    f"(quant.quantize_kernel(..., quant='int4')); got {packed.dtype} "
                    f"{packed.shape} and {scale.shape}")
  w4a8 = rounds_activations() if w4a8 is None else w4a8
  if w4a8:
    q, row_scale = _quantize_rows(x)                                    # [M, K], [M, 1]
    if kernel_products():
      y = cpu_kernels.int4_dot(q, packed, scale) * row_scale            # [M, N]
      return y.reshape(*x.shape[:-1], packed.shape[0])
    x = (q.astype(jnp.float32) * row_scale).reshape(x.shape)
  weights = dequantize_int4(layer_view.read(packed), layer_view.read(scale),
                            jnp.float32 if w4a8 else x.dtype)                    # [N, K]
  return jax.lax.dot_general(x, weights, (((x.ndim - 1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def _quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """x [..., K] -> (int8 [M, K], float32 scale [M, 1]): each row by its absmax, M = x's rows."""
  rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)                 # [M, K]
  amax = jnp.max(jnp.abs(rows), axis=-1, keepdims=True)                 # [M, 1]
  row_scale = jnp.where(amax > 0, amax / _QMAX, 1.0)
  return jnp.round(rows / row_scale).astype(jnp.int8), row_scale


def kernel_products() -> bool:
  """Whether int8 products of [out, in] kernels and int4 layers run on specjax's CPU kernel in
  this process: jax's default backend is the CPU and the kernel is built (any instruction set)."""
  return jax.default_backend() == "cpu" and cpu_kernels.status().active


def blocked_layout() -> bool:
  """Whether [out, in] int8 kernels and int4 layers are kept in specjax's CPU kernel's blocked
  layout in this process (block_int8, block_int4): where that kernel multiplies them (jax's
  default backend is the CPU, the kernel is built) and reads that layout (its AVX-512 VNNI
  build: cpu_kernels.reads_blocked). quantize_kernel blocks them then, and the products expect
  it."""
  return jax.default_backend() == "cpu" and cpu_kernels.reads_blocked()


BLOCK = 16     # weight rows per block of the blocked layout (cpu_kernels.cc)


def _block(x: jax.Array, width: int) -> jax.Array:
  """x [..., N, C] -> the same shape, its entries reordered in blocks of 16 rows: per block,
  [C // width, 16, width] (each row's entries `width` at a time, the 16 rows side by side)
  then [16, C % width]; the last N % 16 rows as they are."""
  *lead, n, c = x.shape
  full, cw = n // BLOCK * BLOCK, c // width * width
  head = x[..., :full, :].reshape(*lead, n // BLOCK, BLOCK, c)
  chunks = head[..., :cw].reshape(*lead, n // BLOCK, BLOCK, cw // width, width)
  chunks = jnp.swapaxes(chunks, -3, -2).reshape(*lead, n // BLOCK, BLOCK * cw)
  rest = head[..., cw:].reshape(*lead, n // BLOCK, BLOCK * (c - cw))
  blocks = jnp.concatenate([chunks, rest], axis=-1).reshape(*lead, full, c)
  return jnp.concatenate([blocks, x[..., full:, :]], axis=-2)


def _unblock(x: jax.Array, width: int) -> jax.Array:
  """_block's inverse."""
  *lead, n, c = x.shape
  full, cw = n // BLOCK * BLOCK, c // width * width
  flat = x[..., :full, :].reshape(*lead, n // BLOCK, BLOCK * c)
  chunks = flat[..., :BLOCK * cw].reshape(*lead, n // BLOCK, cw // width, BLOCK, width)
  chunks = jnp.swapaxes(chunks, -3, -2).reshape(*lead, n // BLOCK, BLOCK, cw)
  rest = flat[..., BLOCK * cw:].reshape(*lead, n // BLOCK, BLOCK, c - cw)
  rows = jnp.concatenate([chunks, rest], axis=-1).reshape(*lead, full, c)
  return jnp.concatenate([rows, x[..., full:, :]], axis=-2)


def block_int8(kernel: jax.Array) -> jax.Array:
  """An int8 kernel [..., N, K] ([out, in]) -> the same entries in cpu_kernels.cc's blocked
  layout, the same shape: per block of 16 rows, [K // 4, 16, 4] (each row's entries four at a
  time, the 16 rows side by side) then [16, K % 4]; the last N % 16 rows as they are. The
  kernel reads 16 rows' next four entries with one load and needs no sum across a row."""
  return _block(kernel, 4)


def unblock_int8(blocked: jax.Array) -> jax.Array:
  """block_int8's inverse: the blocked layout [..., N, K] -> the plain [out, in] kernel."""
  return _unblock(blocked, 4)


def block_int4(packed: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """pack_int4's (packed [..., N, K / 2], scale [..., N, K / GROUP]) -> the same in
  cpu_kernels.cc's blocked layout: the packed bytes blocked as int8 weights are (four bytes of
  16 rows to a 64-byte vector: 8 weights of each row, a group's low and high halves), the
  scales one at a time ([K / GROUP, 16] a block)."""
  return _block(packed, 4), _block(scale, 1)


def take_rows(leaf: jax.Array, ids) -> jax.Array:
  """Rows `ids` of an [out, in] leaf as stored (a sub-vocabulary head cut from an output layer:
  an int8 kernel, an int4 layer's packed kernel or scales, or a float leaf): through the plain
  layout and back where they are blocked (blocked_layout)."""
  ids = jnp.asarray(ids)
  if leaf.ndim != 2 or not blocked_layout():
    return jnp.take(leaf, ids, axis=0)
  return _take_blocked(leaf, ids, 4 if leaf.dtype in (jnp.int8, jnp.uint8) else 1)


@functools.partial(jax.jit, static_argnums=2)
def _take_blocked(leaf: jax.Array, ids: jax.Array, width: int) -> jax.Array:
  # one compiled program (a load's: op by op, its reorderings took most of a second)
  return _block(jnp.take(_unblock(leaf, width), ids, axis=0), width)


def _integer_product(q: jax.Array, kernel: jax.Array, transposed: bool) -> jax.Array:
  """q [M, K] int8 times an int8 kernel ([K, N], or [N, K] when `transposed`: in block_int8's
  layout where blocked_layout()) -> int32 [M, N]: specjax's CPU kernel for an [out, in] kernel
  where it is built (models/cpu_kernels.py), else XLA's product. The same integers either way."""
  if transposed and kernel_products():
    return cpu_kernels.int8_dot(q, kernel)
  kernel = layer_view.read(kernel)
  m = q.shape[0]
  if m == 1:                       # a one-row int8 product is XLA:CPU's slow path (docstring)
    q = jnp.concatenate([q, q], axis=0)
  # Integer products are exact at any precision: DEFAULT keeps the ambient default (e.g. a
  # session's "highest") from choosing another algorithm for them.
  acc = jax.lax.dot_general(q, kernel, (((1,), (1 if transposed else 0,)), ((), ())),
                            precision=jax.lax.Precision.DEFAULT,
                            preferred_element_type=jnp.int32)           # [M, N]
  return acc[:m]


@functools.partial(jax.jit, static_argnames=("transposed", "quant"))
def quantize_kernel(kernel: jax.Array, transposed: bool = False,
                    quant: str = "int8") -> tuple[jax.Array, jax.Array]:
  """kernel [..., in, out] float ([..., out, in] when `transposed`) -> (quantized kernel, float32
  scale). int8: the kernel's shape in int8 and scale [..., out], symmetric, per output channel
  (per layer too when stacked); [out, in] in block_int8's layout where blocked_layout(). int4
  (`transposed` only): pack_int4's uint8 [..., out, in / 2] and scale [..., out, in / GROUP]."""
  if quant == "int4":
    if not transposed:
      raise ValueError("int4 layers are stored [out, in] (layout out_in)")
    return block_int4(*pack_int4(kernel)) if blocked_layout() else pack_int4(kernel)
  w = kernel.astype(jnp.float32)
  axis = -1 if transposed else -2                                  # the input axis
  amax = jnp.max(jnp.abs(w), axis=axis)
  scale = jnp.where(amax > 0, amax / _QMAX, 1.0)
  q = jnp.clip(jnp.round(w / jnp.expand_dims(scale, axis)), -_QMAX, _QMAX).astype(jnp.int8)
  return (block_int8(q) if transposed and blocked_layout() else q), scale


def pack_int4(kernel: jax.Array) -> tuple[jax.Array, jax.Array]:
  """kernel [..., out, in] float (in a multiple of GROUP) -> (packed uint8 [..., out, in / 2],
  float32 scale [..., out, in / GROUP]). Per group of GROUP inputs, llama.cpp's Q4_0 rounding:
  the entry of largest magnitude m gives the scale m / -8, so that it becomes -8 exactly, and
  the others round to the nearest of -8 .. 7. Group g's 64 values lie in 32 bytes: byte j holds
  w[64 g + j] + 8 in its low nibble and w[64 g + 32 + j] + 8 in its high one (the layout
  cpu_kernels.cc's AVX2 and plain builds read; block_int4 reorders it for the VNNI build)."""
  *lead, out, width = kernel.shape
  if width % GROUP:
    raise ValueError(f"int4 weights need input widths that are multiples of {GROUP}; a kernel "
                     f"[{out}, {width}] has {width}: load this model with quant int8 or ''")
  w = kernel.astype(jnp.float32).reshape(*lead, out, width // GROUP, GROUP)
  at = jnp.argmax(jnp.abs(w), axis=-1, keepdims=True)
  peak = jnp.take_along_axis(w, at, axis=-1)                          # [..., out, G, 1]
  scale = jnp.where(peak != 0, peak / -8.0, 1.0)
  q = jnp.clip(jnp.round(w / scale), -8, 7).astype(jnp.int32) + 8    # [..., out, G, 64] 0..15
  half = GROUP // 2
  packed = (q[..., :half] | (q[..., half:] << 4)).astype(jnp.uint8)   # [..., out, G, 32]
  return packed.reshape(*lead, out, width // 2), scale[..., 0]


def dequantize_int4(packed: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
  """pack_int4's (packed [..., out, in / 2], scale [..., out, in / GROUP]) -> the weights it
  stands for, [..., out, in] in `dtype`."""
  *lead, out, half_width = packed.shape
  p = packed.reshape(*lead, out, -1, GROUP // 2)                     # [..., out, G, 32]
  q = jnp.concatenate([p & 15, p >> 4], axis=-1).astype(jnp.float32) - 8.0
  return (q * scale[..., None]).reshape(*lead, out, 2 * half_width).astype(dtype)


def float_shapes(shapes, quant: str):
  """A model's param shapes (jax.eval_shape of its init) -> the shapes of the float tensors its
  leaves are made from, as a converter checks a checkpoint's: an int4 kernel [..., out, in / 2]
  comes from [..., out, in]; every other leaf (int8 kernels included) has its float shape."""
  def one(path, leaf):
    if quant == "int4" and getattr(path[-1], "key", None) == "kernel":
      return jax.ShapeDtypeStruct((*leaf.shape[:-1], 2 * leaf.shape[-1]), jnp.float32)
    return leaf
  return jax.tree_util.tree_map_with_path(one, shapes)


def put(params: dict, path: tuple[str, ...], value: jax.Array, quant: str,
        layout: str = dense_layout.IN_OUT) -> None:
  """A loader's tree_set(params, path, value) that quantizes as it goes: with quant "int8" a
  Dense kernel (a leaf named `kernel` anywhere, the untied output layer's included; given in the
  model's `layout`) is stored as its int8 kernel with its float32 `scale` beside it, so the
  float model is never held whole (the host holds one float leaf extra at a time); other leaves,
  and every leaf with quant "", as given. Finish with `with_head`."""
  if quant and path[-1] == "kernel":
    kernel, scale = quantize_kernel(value, dense_layout.transposes(path, layout, quant), quant)
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
  if not quant or path[-1] != "kernel":
    tree_set(params, path, hf_tensors.stack_layers(read_layer, num_layers, dtype))
    return
  kernels = scales = None
  for i in range(num_layers):
    kernel, scale = quantize_kernel(hf_tensors.to_device(read_layer(i), dtype),
                                    dense_layout.transposes(path, layout, quant), quant)
    if kernels is None:
      kernels = np.empty((num_layers, *kernel.shape), kernel.dtype)           # [L, in, out]
      scales = np.empty((num_layers, *scale.shape), np.float32)              # [L, out]
    kernels[i], scales[i] = kernel, scale
  tree_set(params, path, jax.device_put(kernels))
  tree_set(params, (*path[:-1], "scale"), jax.device_put(scales))


def with_head(params: dict, quant: str, tied: bool, layout: str = dense_layout.IN_OUT) -> dict:
  """The params a loader built with `put`, with a tied int8 model's output layer added: `lm_head`
  (kernel [D, V] int8, scale [V]; [V, D] in layout "out_in") quantized from the embedding table,
  which stays for the input lookup. Unchanged for quant "" or an untied head (`put` quantized
  it)."""
  if quant and tied:
    table = params["token_embed"]["embedding"]                                   # [V, D]
    if dense_layout.transposes(("lm_head", "kernel"), layout, quant):
      kernel, scale = quantize_kernel(table, True, quant)               # [V, D] (int4 [V, D/2])
    else:
      kernel, scale = _quantize_transposed(table)                                # [D, V]
    params["lm_head"] = {"kernel": kernel, "scale": scale}
  return params


def quantize_params(params: dict, tied: bool, layout: str = dense_layout.IN_OUT,
                    quant: str = "int8") -> dict:
  """The params of a float decoder-only model (its kernels in `layout`) -> those of its `quant`
  twin (config quant="int8" or "int4", the same layout), in place, as a loader with `put` and
  `with_head` builds them (each float kernel dropped as soon as it is converted)."""
  for path in _kernel_paths(params):
    parent = params
    for key in path[:-1]:
      parent = parent[key]
    kernel = parent.pop("kernel")
    if path[0] == "lm_head" and dense_layout.transposes(path, layout, quant):
      kernel = kernel.T                              # a float head is [D, V] in either layout
    put(params, path, kernel, quant, layout)
  return with_head(params, quant, tied, layout)


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

