"""The storage layout of a decoder-only model's float dense kernels: [in, out] ("in_out", Flax's
nn.Dense and specjax's default) or [out, in] ("out_in", PyTorch's and Hugging Face's Linear).

Both compute the same product, written as one `dot_general` contracting x's last dim with the
kernel's input dim, but XLA:CPU runs them at different speeds, and which one is faster flips
between CPUs and between row counts: on a 2-core AVX2 machine [M, 1536] x [1536, 8960] costs
2.1 / 3.1 / 3.6x one row at M = 2 / 3 / 5 stored [in, out] and 1.6 / 1.6 / 1.7x stored
[out, in]; on a 2-core AVX-512 machine the order is reversed. So the layout is a load-time
setting of each model (models/layout_choice.py measures it on CPU), not a property of the
checkpoint: the params are the same leaves (`kernel`) transposed.

What the layout covers: every float Dense kernel of the transformer layers (attention
query/key/value/out, the MLP). Not covered:
  - the LM head: a tied head multiplies by the embedding table [V, D], which is [out, in]
    already and is shared with the input lookup; an untied head ([D, V] `lm_head/kernel`) is one
    product per step next to seven per layer, and the drafters that cut it (early exit,
    sub-vocabulary heads: models/sub_vocab.py) read it as [D, V]. It keeps its layout.
int8 kernels (models/quant.py) take the layout too, the output layer's included ([V, D] with
out_in), and their integer product's speed depends on it more than float32's: [out, in] int8
runs on specjax's own CPU kernel (models/cpu_kernels.py), [in, out] on XLA's product
(layout_choice measures both).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

IN_OUT, OUT_IN = "in_out", "out_in"
LAYOUTS = (IN_OUT, OUT_IN)


def check(layout: str, quant: str = "") -> None:
  """Refuse a layout that is not one of LAYOUTS, or one that `quant` cannot take: int8 kernels
  take either, int4 ones are stored [out, in] only (models/quant.py)."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout '{layout}' is not supported; use one of {LAYOUTS} ([in, out]: "
                     f"Flax's, or [out, in]: PyTorch's).")
  if quant == "int4" and layout != OUT_IN:
    raise ValueError(f"int4 layers are stored [out, in]: layout '{layout}' cannot hold them; use "
                     f"layout '{OUT_IN}' (or 'auto', which picks it for int4)")


class OutInDense(nn.Module):
  """nn.Dense with its kernel stored [out, in]: x [..., in] -> [..., out] in `dtype`, the same
  product (one dot_general contracting x's last dim with the kernel's dim 1) and bias. The kernel
  is initialised as kernel_init draws an [in, out] kernel, transposed, so that one seed gives the
  same model in either layout."""
  features: int
  use_bias: bool = True
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Any = nn.initializers.lecun_normal()
  bias_init: Any = nn.initializers.zeros

  @nn.compact
  def __call__(self, x):
    init = lambda key, shape, dtype: self.kernel_init(key, shape[::-1], dtype).T
    kernel = self.param("kernel", init, (self.features, x.shape[-1]), self.param_dtype)
    bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias else None)
    x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
    y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (1,)), ((), ())),
                            precision=self.precision)                        # [..., out]
    return y if bias is None else y + bias


def transposes(path: tuple[str, ...], layout: str, quant: str = "") -> bool:
  """Whether the param at `path` is a Dense kernel that `layout` stores [out, in]: a transformer
  layer's kernel, and a quantized model's (`quant` "int8" or "int4") output layer, [V, D], which
  specjax's CPU kernels read a vocabulary row at a time (models/cpu_kernels.py); a float LM head
  keeps [D, V] (module docstring)."""
  if layout != OUT_IN or path[-1] != "kernel":
    return False
  return path[0] != "lm_head" or bool(quant)


def with_layout(model, layout: str):
  """The same decoder-only model with `config.layout = layout` (checked)."""
  check(layout, model.quant)
  return dataclasses.replace(model, config=dataclasses.replace(model.config, layout=layout))
