"""The LM head's product: hidden states times a vocabulary-sized kernel, as float32 logits.

XLA:CPU multiplies 16-bit floats as float32: it converts both operands first. For the head that
conversion is a float32 copy of the largest tensor of the model (0.9 GB for Qwen2.5's 151,936 x
1536 table), written and read again at every step: it puts a bfloat16 decode over its memory
bound, and the product costs 10x the float32 one. On CPU a 16-bit head is therefore multiplied
a block of vocabulary rows at a time, in a loop (one block's float32 copy is live, small enough
to stay in the last-level cache, and the program does not grow with the vocabulary); decoding
loops with 16-bit floats compile without loop-invariant code motion
(decoding.state.CPU_16BIT_LOOP_OPTIONS), so the conversion is not hoisted out of that loop.
Each logit is the same dot over the same D, so the logits are the same. Accelerators multiply
16-bit floats natively and keep the one product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Vocabulary rows per block: a float32 block of 12 MiB at D = 1536.
BLOCK_ROWS = 2048


def logits(hidden: jax.Array, kernel: jax.Array, vocab_axis: int, precision=None) -> jax.Array:
  """hidden [..., D] x kernel ([V, D] with vocab_axis=0, a tied embedding table; [D, V] with
  vocab_axis=1, a Dense kernel) -> float32 logits [..., V]. Blocked over V (BLOCK_ROWS rows) on
  CPU for 16-bit kernels (module doc), one product otherwise."""
  spec = "...d,vd->...v" if vocab_axis == 0 else "...d,dv->...v"
  on_cpu_16bit = jax.default_backend() == "cpu" and jnp.dtype(kernel.dtype).itemsize == 2
  # On CPU the conversion is written out: it is what XLA:CPU does anyway, and a product left
  # 16-bit x 16-bit -> float32 inside a decoding loop of two or more rows reaches a dot runtime
  # that refuses it ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32").
  cast = (lambda x: x.astype(jnp.float32)) if on_cpu_16bit else (lambda x: x)
  product = lambda w: jnp.einsum(spec, cast(hidden), cast(w), precision=precision,
                                 preferred_element_type=jnp.float32)
  vocab, rows = kernel.shape[vocab_axis], BLOCK_ROWS
  if not on_cpu_16bit or vocab <= rows:
    return product(kernel)
  blocks = vocab // rows

  def block(i, out):                                    # out [..., blocks * rows]
    w = jax.lax.dynamic_slice_in_dim(kernel, i * rows, rows, axis=vocab_axis)
    return jax.lax.dynamic_update_slice_in_dim(out, product(w), i * rows, axis=-1)

  out = jax.lax.fori_loop(0, blocks, block,
                          jnp.zeros(hidden.shape[:-1] + (blocks * rows,), jnp.float32))
  if blocks * rows == vocab:
    return out
  tail = jax.lax.slice_in_dim(kernel, blocks * rows, vocab, axis=vocab_axis)
  return jnp.concatenate([out, product(tail)], axis=-1)
