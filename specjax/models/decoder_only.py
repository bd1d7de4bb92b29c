"""What every decoder-only family shares behind the model contract: params from the module's
init, prefill and extend_entries. A family supplies `module` (a Flax module called as
module(tokens[B,T], k, v, lengths, select) -> (hidden, logits, new_k, new_v)) and `init_cache`."""

from __future__ import annotations

import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp

from specjax.models import ModelBase, Prompt, layers
from specjax.models import kv_cache as kvc

Params = Any


class DecoderOnly(ModelBase):
  """Mixin for the frozen wrappers of decoder-only families (GPT-2, Llama)."""

  @property
  def layout(self) -> str:
    return self.config.layout

  @property
  def quant(self) -> str:
    return self.config.quant

  @functools.partial(jax.jit, static_argnums=0)
  def init_params(self, rng: jax.Array) -> Params:
    """Plain nested dict laid out as the family's module docstring says (per-layer leaves
    [L, ...]; with scan_layers=False layers_0 ... without [L], the same values)."""
    cache = self.init_cache(1, 1)
    tokens = jnp.zeros((1, 1), jnp.int32)
    variables = layers.with_scan(self).module.init(rng, tokens, cache.k, cache.v, cache.lengths)
    return layers.to_layout(flax.core.unfreeze(variables["params"]), self.config.scan_layers)

  @functools.partial(jax.jit, static_argnums=0)
  def prefill(self, params: Params, prompt: Prompt, cache: kvc.KVCache):
    """Writes all P prompt entries of every row (pads included: they sit past lengths[b] and are
    masked, then overwritten), sets cache.lengths = prompt.lengths and returns
    (logits[B,V] f32, hidden[B,D]) at position lengths[b]-1."""
    kvc.check_capacity(prompt.tokens.shape[1], cache.capacity, "prompt")
    cache = cache.replace(lengths=jnp.zeros_like(cache.lengths))
    empty = cache.k[:, :, :, :0], cache.v[:, :, :, :0]     # nothing to attend to before the prompt
    hidden, logits, k, v = self.module.apply({"params": params}, prompt.tokens, *empty,
                                             cache.lengths, select=prompt.lengths - 1)
    cache = kvc.append(cache, k, v).replace(lengths=prompt.lengths.astype(jnp.int32))
    return logits, hidden, cache

  @functools.partial(jax.jit, static_argnums=0)
  def extend_entries(self, params: Params, tokens: jax.Array, cache: kvc.KVCache,
                     select: jax.Array | None = None):
    """tokens [B,T] at positions lengths[b]+t -> (logits[B,T,V] f32, hidden[B,T,D], (k, v)
    [L,B,T,H_cache,Dh]); the cache is read, not written. select [B]: logits and hidden of
    position select[b] only ([B,1,V], [B,1,D]). Capacity (lengths + T <= S) is the caller's."""
    kvc.check_capacity(tokens.shape[1], cache.capacity, "extend block")
    hidden, logits, k, v = self.module.apply({"params": params}, tokens, cache.k, cache.v,
                                             cache.lengths, select=select)
    if select is not None:
      hidden, logits = hidden[:, None], logits[:, None]
    return logits, hidden, (k, v)
