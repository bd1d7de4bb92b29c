"""One layer of a stacked array [L, ...], not sliced out: what specjax's CPU kernels read in place.

XLA copies a slice of an array before it passes it to a custom call, so a layer loop that gave
each layer `w[i]` copied every layer's weights (and its slice of the KV cache) before each
product: a decoding step then read its weights twice and wrote them once. A `LayerOf` carries
the whole stack and the layer's index instead; the kernels (models/cpu_kernels.py) take both
and read the layer where it lies. Everything else reads it with `read`, the slice itself.

A LayerOf lives only inside a traced layer (it is not a pytree and never crosses a jax
transform); it has the layer's `shape`, `dtype` and `ndim`, so Flax's param shape check passes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LayerOf:
  """Layer `index` (int32 scalar) of `stack` [L, ...]."""
  stack: jax.Array
  index: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.stack.shape[1:])

  @property
  def dtype(self):
    return self.stack.dtype

  @property
  def ndim(self) -> int:
    return self.stack.ndim - 1


def read(x):
  """A LayerOf -> its layer as an array (a slice); an array as it is."""
  if isinstance(x, LayerOf):
    return jax.lax.dynamic_index_in_dim(x.stack, x.index, axis=0, keepdims=False)
  return x


def stack_and_index(x) -> tuple[jax.Array, jax.Array]:
  """A LayerOf -> (its stack [L, ...], its index); an array [...] -> ([1, ...], 0), a stack of
  one layer (a free reshape)."""
  if isinstance(x, LayerOf):
    return x.stack, jnp.asarray(x.index, jnp.int32)
  return x[None], jnp.zeros((), jnp.int32)


def in_place(tree, index: jax.Array):
  """A layer's params from the stacked tree ([L, ...] leaves): quantized weights (int8 and int4
  `kernel`s, an int4 layer's group scales beside its uint8 kernel) as LayerOf, read in place by
  the kernels; every other leaf (norms, biases, per-channel scales) sliced."""
  def one(node):
    if not isinstance(node, Mapping):
      return read(LayerOf(node, index))
    packed = getattr(node.get("kernel"), "dtype", None) == jnp.uint8
    return {key: (LayerOf(value, index) if _quantized(key, value, packed) else one(value))
            for key, value in node.items()}
  return one(tree)


def _quantized(key: str, value, packed: bool) -> bool:
  if isinstance(value, Mapping):
    return False
  return (key == "kernel" and value.dtype in (jnp.int8, jnp.uint8)) or (key == "scale" and packed)
