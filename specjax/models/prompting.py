"""One prompt convention for decoding, evaluation and training data.

Text -> ids: a decoder-only model reads [BOS] + text (when the tokenizer has a BOS); an
encoder-decoder (T5) reads text + [EOS] in its encoder. Ids -> text: a generated row is cut at its
length and at its first EOS (any of the tokenizer's EOS ids), and the EOS itself is not decoded.
Rows are right-padded to a bucket (a power of two, at least `minimum`, at most `cap`) so that a
jitted function sees few prompt shapes. How many cache entries a prompt stream takes, and how wide
the encoder input is, also depend on the family; `prefix_len` and `enc_len` say it in one place.

Example (decoder-only, BOS 3, EOS 1): "ab" -> ids [7, 8] -> prompt row [3, 7, 8], bucket 16 ->
tokens [3, 7, 8, 0, ..., 0] (16 wide), length 3. Generated [9, 1, 0] with length 2 -> text of [9].
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass(kw_only=True)
class Prompt:
  """A batch of model inputs: decoder-only prompts, or encoder inputs for T5."""
  tokens: jax.Array    # [B, P] int32, right-padded
  lengths: jax.Array   # [B] int32, >= 1

  @classmethod
  def from_lists(cls, rows: list[list[int]], pad_to: int | None = None,
                 pad_id: int = 0) -> "Prompt":
    if any(len(r) == 0 for r in rows):
      raise ValueError("empty prompt: every prompt needs at least one token")
    tokens, lengths = pad_rows(rows, pad_to or max(len(r) for r in rows), pad_id)
    return cls(tokens=jnp.asarray(tokens), lengths=jnp.asarray(lengths))


def has_bos(tokenizer) -> bool:
  """Whether a decoder-only model's input starts with the tokenizer's BOS: it has one, and its
  own encoding adds it (`add_bos`, False for Qwen and GPT-2 tokenizers; SentencePiece: True)."""
  bos = getattr(tokenizer, "bos_id", None)
  return bos is not None and bos >= 0 and getattr(tokenizer, "add_bos", True)


def eos_ids(tokenizer) -> tuple[int, ...]:
  """Every id that ends a generation: `tokenizer.eos_ids` when it has several, else (eos_id,)."""
  ids = getattr(tokenizer, "eos_ids", None)
  return tuple(int(i) for i in ids) if ids else (int(tokenizer.eos_id),)


def encode(tokenizer, text: str, *, encoder_decoder: bool, cap: int | None = None) -> list[int]:
  """The model input of one text: [BOS] + ids (decoder-only), ids + [EOS] (encoder-decoder);
  cut to `cap` tokens, keeping the BOS (decoder-only) or the final EOS (encoder-decoder)."""
  return with_markers(tokenizer, list(tokenizer.encode(text)), encoder_decoder=encoder_decoder,
                      cap=cap)


def with_markers(tokenizer, ids: list[int], *, encoder_decoder: bool,
                 cap: int | None = None) -> list[int]:
  """`encode` for ids that are already tokenized."""
  if encoder_decoder:
    body = ids if cap is None else ids[:cap - 1]
    return body + [int(tokenizer.eos_id)]
  row = ([int(tokenizer.bos_id)] if has_bos(tokenizer) else []) + ids
  return row if cap is None else row[:cap]


def strip_bos(tokenizer, ids: Sequence[int]) -> list[int]:
  """A decoder-only prompt row without its BOS: the text part (what a string-level loop re-reads)."""
  ids = [int(t) for t in ids]
  return ids[1:] if ids and has_bos(tokenizer) and ids[0] == tokenizer.bos_id else ids


def bucket(n: int, cap: int | None = None, minimum: int = 16) -> int:
  """Padded width for a longest row of n tokens: the next power of two >= minimum, at most cap.

  Example: bucket(37) -> 64; bucket(37, cap=48) -> 48; bucket(3) -> 16.
  """
  if cap is not None and n > cap:
    raise ValueError(f"a row of {n} tokens exceeds the cap {cap}; truncate before bucketing")
  width = max(minimum, 1 << max(n - 1, 0).bit_length())
  return width if cap is None else min(cap, width)


def pad_rows(rows: Sequence[Sequence[int]], width: int,
             pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-pad rows to [len(rows), width]; returns (tokens int32, lengths int32)."""
  tokens = np.full((len(rows), width), pad_id, np.int32)
  for i, row in enumerate(rows):
    tokens[i, :len(row)] = row
  return tokens, np.asarray([len(r) for r in rows], np.int32)


def batch(rows: Sequence[Sequence[int]], pad_id: int, cap: int | None = None,
          minimum: int = 16) -> Prompt:
  """Id rows -> a bucketed, right-padded Prompt (rows must already fit `cap`)."""
  if any(len(r) == 0 for r in rows):
    raise ValueError("empty prompt: every prompt needs at least one token")
  return Prompt.from_lists(rows, bucket(max(len(r) for r in rows), cap, minimum), pad_id)


def decode(tokenizer, ids: Sequence[int], length: int | None = None) -> str:
  """Text of one generated row: cut at `length` and at its first EOS (not decoded)."""
  row = [int(t) for t in ids][:length]
  ends = set(eos_ids(tokenizer))
  cut = next((i for i, t in enumerate(row) if t in ends), len(row))
  return tokenizer.decode(row[:cut])


def prefix_len(model, prompt: Prompt) -> int:
  """Cache entries the prompt stream may occupy: the padded prompt, or T5's decoder start token."""
  return 1 if model.is_encoder_decoder else int(prompt.tokens.shape[1])


def enc_len(model, prompt: Prompt) -> int:
  """Encoder positions of the cache: the padded prompt for encoder-decoders, else 0."""
  return int(prompt.tokens.shape[1]) if model.is_encoder_decoder else 0


def stream_anchor(model, prompt: Prompt) -> jax.Array:
  """[B] the last token of each row's prompt stream (decoder-only: last prompt token; T5: start)."""
  if model.is_encoder_decoder:
    return jnp.full(prompt.lengths.shape, model.decoder_start_id, jnp.int32)
  last = (prompt.lengths - 1)[:, None]
  return jnp.take_along_axis(prompt.tokens, last, axis=1)[:, 0].astype(jnp.int32)
