"""Models and the model contract the decoding loop relies on (docs/design.md §3).

A model is a frozen, hashable dataclass (so it can be a static argument of `jax.jit`) with
what `Model` below types:

  vocab_size: int; is_encoder_decoder: bool; hidden_size: int; dtype
  n_positions, decoder_start_id, heads, layout, quant (what loading, the loops and sharding read)
  init_params(rng) -> params
  init_cache(batch, max_len, enc_len=0) -> KVCache
  prefill(params, prompt: Prompt, cache) -> (logits[B,V], hidden[B,D], cache)
  extend_entries(params, tokens[B,T], cache, select=None) -> (logits[B,T,V], hidden[B,T,D], (k, v))
  extend(params, tokens[B,T], cache, select=None) -> (logits[B,T,V], hidden[B,T,D], cache)

`extend_entries` reads the cache and returns the block's new keys and values [L,B,T,H,Dh] without
writing them; `extend` (ModelBase) is extend_entries followed by kv_cache.append. The split lets
a caller that branches (lax.switch over verify widths) keep the cache write outside the branches:
a cache passed through a branch that writes it is copied whole. `select` ([B] indices into T)
keeps one position per row ([B,1,V] logits): the draft's two-token feed needs only the last.

Decoder-only: `prefill` ingests the right-padded prompt and returns the next-token logits of each
row (taken at position lengths[b]-1); afterwards `cache.lengths == prompt.lengths`.
Encoder-decoder (T5): `prefill` encodes the prompt, stores cross-attention keys/values in the cache,
ingests the decoder start token and returns the logits of the first output token; afterwards
`cache.lengths == 1`. Logits are float32 whatever the parameter dtype.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from specjax.models import kv_cache, prompting
from specjax.models.prompting import Prompt  # noqa: F401  (the contract's input type)


@runtime_checkable
class Model(Protocol):
  """The model contract, typed: the loops, sharding and loading read these, never probe for
  them (ModelBase gives the families their values; a toy model states its own)."""
  vocab_size: int
  is_encoder_decoder: bool
  hidden_size: int
  n_positions: int | None        # a learned position table's size; None: RoPE / relative, no bound
  decoder_start_id: int          # an encoder-decoder's first decoder input (0 for decoder-only)
  heads: tuple[int, int] | None  # (query, key/value) heads a mesh splits; None: no attention
  layout: str                    # dense kernels "in_out" or "out_in" (models/dense_layout.py)
  quant: str                     # "" or "int8" dense layers (models/quant.py)

  @property
  def dtype(self) -> Any: ...
  def init_params(self, rng: jax.Array) -> Any: ...
  def init_cache(self, batch: int, max_len: int, enc_len: int = 0) -> kv_cache.KVCache: ...
  def prefill(self, params, prompt: Prompt, cache: kv_cache.KVCache): ...
  def extend_entries(self, params, tokens: jax.Array, cache: kv_cache.KVCache, select=None): ...
  def extend(self, params, tokens: jax.Array, cache: kv_cache.KVCache, select=None): ...


class ModelBase:
  """Properties shared by the frozen model wrappers; `config` has vocab_size, d_model, dtype and
  num_heads. The defaults below are a family's without the feature (no position table, no
  decoder start, one KV head per query head, [in, out] float kernels)."""

  n_positions: int | None = None
  decoder_start_id: int = 0
  layout: str = "in_out"
  quant: str = ""

  @property
  def heads(self) -> tuple[int, int]:
    return self.config.num_heads, self.config.num_heads

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def hidden_size(self) -> int:
    return self.config.d_model

  @property
  def dtype(self):
    return jnp.dtype(self.config.dtype)

  @functools.partial(jax.jit, static_argnums=0)
  def extend(self, params, tokens: jax.Array, cache: kv_cache.KVCache,
             select: jax.Array | None = None):
    """tokens [B,T] at positions lengths[b]+t -> (logits[B,T,V] f32, hidden[B,T,D], cache with
    the T new entries written and lengths + T). select [B]: only position select[b]'s logits
    and hidden ([B,1,V], [B,1,D]), skipping the LM head elsewhere."""
    logits, hidden, (k, v) = self.extend_entries(params, tokens, cache, select)
    return logits, hidden, kv_cache.append(cache, k, v)


def score(model, params, prompt: Prompt, targets: jax.Array):
  """Teacher-forced logits through the decoding path: prefill, then one extend over targets[:, :-1].

  Returns (logits[B,L,V], hidden[B,L,D]) where position t predicts targets[:, t] from the prompt and
  targets[:, :t]. Used by training and scoring so that they share the model code with decoding.
  """
  batch, length = targets.shape
  cache = model.init_cache(batch, prompting.prefix_len(model, prompt) + length,
                           prompting.enc_len(model, prompt))
  first_logits, first_hidden, cache = model.prefill(params, prompt, cache)
  if length == 1:
    return first_logits[:, None], first_hidden[:, None]
  rest_logits, rest_hidden, _ = model.extend(params, targets[:, :-1], cache)
  logits = jnp.concatenate([first_logits[:, None], rest_logits], axis=1)      # [B, L, V]
  hidden = jnp.concatenate([first_hidden[:, None], rest_hidden], axis=1)      # [B, L, D]
  return logits, hidden
