"""Drafts with another tokenizer: vocabulary maps and the `union` / `intersection` (TLI) rules
(Timor et al., ICML'25, Alg 1 and Alg 4) inside the jitted speculative loop.

The draft runs in its own vocabulary. `q_log_probs` maps its logits into target ids with a
scatter-add (two draft strings that normalise to one target string both count), drafts are target
ids, and the model drafter (drafting/model.py) feeds committed target tokens back to the draft
through the same map: the token's single draft id (t2d) or, when it has none, its draft encoding
from a fixed-width padded table [V_T, W]. Verification is the standard one on (p, q mapped), so
the output law is the target's.

Hashability (rules are static jit arguments): the id arrays live in a `VocabMap`, a dataclass with
eq=False, so it hashes and compares by identity. Reuse one VocabMap object for repeated calls (the
jit cache is keyed by it); its arrays become constants of the compiled loop.
"""

from __future__ import annotations

import logging
import dataclasses
import functools
import re
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling
from specjax.acceptance import base
from specjax.acceptance.registry import register

log = logging.getLogger(__name__)

_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
DEFAULT_MIN_OVERLAP = 0.05      # refuse a map covering less than 5% of the target vocabulary


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
  """GPT-2 byte-level BPE: the inverse of its bytes -> printable unicode table (Ġ is space)."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
      list(range(ord("®"), ord("ÿ") + 1))
  cs, n = list(bs), 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return {chr(c): b for b, c in zip(bs, cs)}


def _is_byte_level(tok) -> bool:
  hf = getattr(tok, "tok", None)
  pre = getattr(getattr(hf, "backend_tokenizer", None), "pre_tokenizer", None)
  return "ByteLevel" in repr(pre)


def token_bytes(tok, i: int, byte_level: bool | None = None) -> bytes | None:
  """The normalised string of token i as bytes: '▁'/'Ġ' -> ' ', '<0xNN>' -> the byte; None for
  the tokenizer's special tokens (pad, bos, unk, eos: eos is paired explicitly)."""
  special = {getattr(tok, n, None) for n in ("pad_id", "bos_id", "unk_id", "eos_id")}
  if i in special:
    return None
  piece = tok.id_to_piece(i)
  if piece is None:
    return None
  m = _BYTE.match(piece)
  if m:
    return bytes([int(m.group(1), 16)])
  if byte_level is None:
    byte_level = _is_byte_level(tok)
  table = _byte_level_decoder()
  if byte_level and all(c in table for c in piece):
    return bytes(table[c] for c in piece)
  return piece.replace("▁", " ").replace("Ġ", " ").encode("utf-8")


def _strings(tok) -> list[bytes | None]:
  byte_level = _is_byte_level(tok)
  return [token_bytes(tok, i, byte_level) for i in range(tok.vocab_size)]


def _canonical(tok, strings: list[bytes | None]) -> dict[bytes, int]:
  """string -> one id: a regular piece over a byte-fallback piece ('a' over '<0x61>': the one the
  tokenizer itself produces), then the smallest id."""
  out: dict[bytes, int] = {}
  for i, s in enumerate(strings):
    if s is not None and not _BYTE.match(tok.id_to_piece(i) or ""):
      out.setdefault(s, i)
  for i, s in enumerate(strings):
    if s is not None:
      out.setdefault(s, i)
  return out


@dataclasses.dataclass(frozen=True, eq=False)
class VocabMap:
  """Id maps between a target and a draft vocabulary (eq/hash by identity: see module doc).

  d2t [V_D] / t2d [V_T]: int32, -1 where the token's normalised string is absent from the other
  vocabulary (EOS is paired explicitly). inter_d [K]: every draft id with a target image (the
  pruned head's rows); inter_t [K] = d2t[inter_d] (may repeat: scatter-add). images [V_T, W],
  image_len [V_T]: each target id's draft encoding (t2d when it exists), padded with 0.
  """
  d2t: np.ndarray
  t2d: np.ndarray
  images: np.ndarray
  image_len: np.ndarray
  target_vocab: int     # target tokenizer size (before padding to the model width)
  draft_vocab: int

  @property
  def inter_d(self) -> np.ndarray:
    return np.nonzero(self.d2t >= 0)[0].astype(np.int32)

  @property
  def inter_t(self) -> np.ndarray:
    return self.d2t[self.inter_d]

  @property
  def overlap(self) -> int:
    """Target ids reachable from the draft (distinct strings in T ∩ D)."""
    return int(np.sum(self.t2d[:self.target_vocab] >= 0))

  @property
  def share(self) -> float:
    return self.overlap / self.target_vocab

  def report(self) -> str:
    return (f"vocabulary overlap: {self.overlap} of {self.target_vocab} target tokens "
            f"({100 * self.share:.1f}%) also in the draft's {self.draft_vocab}; draft encodings "
            f"of target tokens use up to {self.images.shape[1]} draft tokens")

  def check(self, min_share: float, rule_name: str) -> None:
    if self.share < min_share:
      raise ValueError(
          f"{self.report()}: below the minimum {100 * min_share:.1f}% for rule {rule_name!r}, "
          f"whose drafts can only be accepted inside the overlap. Use a draft whose tokenizer "
          f"shares more tokens with the target, a string-level method (slem/slrs), or lower "
          f"min_overlap")


def build(target_tok, draft_tok, *, target_width: int | None = None,
          draft_width: int | None = None, max_image_len: int = 8,
          verbose: bool = True) -> VocabMap:
  """VocabMap from two tokenizers (the `Tokenizer` interface of specjax.data.tokenizer).

  target_width / draft_width: the models' logits widths (>= the tokenizer sizes; extra ids map to
  -1). max_image_len: longer draft encodings of a target token are truncated (this only changes
  the draft's context, hence acceptance, never the output law).
  """
  v_t, v_d = target_tok.vocab_size, draft_tok.vocab_size
  w_t, w_d = target_width or v_t, draft_width or v_d
  if w_t < v_t or w_d < v_d:
    raise ValueError(f"model widths ({w_t}, {w_d}) are smaller than the tokenizers' vocabularies "
                     f"({v_t}, {v_d}): the config pairs a model with the wrong tokenizer")
  t_str, d_str = _strings(target_tok), _strings(draft_tok)
  t_canon, d_canon = _canonical(target_tok, t_str), _canonical(draft_tok, d_str)
  d2t = np.full(w_d, -1, np.int32)
  t2d = np.full(w_t, -1, np.int32)
  for i, s in enumerate(d_str):
    if s is not None and s in t_canon:
      d2t[i] = t_canon[s]
  for i, s in enumerate(t_str):
    if s is not None and s in d_canon:
      t2d[i] = d_canon[s]
  if target_tok.eos_id is not None and draft_tok.eos_id is not None:
    d2t[draft_tok.eos_id], t2d[target_tok.eos_id] = target_tok.eos_id, draft_tok.eos_id
  images, image_len = _image_table(target_tok, draft_tok, t2d, w_t, max_image_len)
  vmap = VocabMap(d2t=d2t, t2d=t2d, images=images, image_len=image_len, target_vocab=v_t,
                  draft_vocab=v_d)
  if verbose:
    log.info("%s", vmap.report())
  return vmap


def _image_table(target_tok, draft_tok, t2d, width: int, max_len: int):
  """[V_T, W] draft encodings of every target id: [t2d[t]] when it exists, else the draft's
  encoding of the token's text (unk, or 0, when it has no text of its own)."""
  fallback = draft_tok.unk_id if getattr(draft_tok, "unk_id", None) is not None else 0
  rows = []
  for t in range(width):
    if t2d[t] >= 0:
      rows.append([int(t2d[t])])
      continue
    text = target_tok.decode([t]) if t < target_tok.vocab_size else ""
    ids = list(draft_tok.encode(text))[:max_len] if text else []
    rows.append(ids or [fallback])
  w = max(len(r) for r in rows)
  images = np.zeros((width, w), np.int32)
  lens = np.array([len(r) for r in rows], np.int32)
  for t, r in enumerate(rows):
    images[t, :len(r)] = r
  return images, lens


def _pad_check(q_logp: jax.Array, p_logp: jax.Array, name: str) -> None:
  if q_logp.shape[-1] != p_logp.shape[-1]:
    raise ValueError(f"rule {name!r}: q over {q_logp.shape[-1]} target ids but the target has "
                     f"{p_logp.shape[-1]} logits: build the VocabMap with target_width="
                     f"target.vocab_size and draft_width=draft.vocab_size")


@dataclasses.dataclass(frozen=True)
class _CrossVocab(base.Rule):
  """Shared machinery: q over target ids from a draft's own vocabulary (the VocabMap, which the
  model drafter also uses to feed committed tokens back, drafting/model.py)."""
  vocab: VocabMap = None
  min_overlap: float = DEFAULT_MIN_OVERLAP
  needs_same_vocab: ClassVar[bool] = False

  def __post_init__(self):
    if not 0 <= self.min_overlap <= 1:
      raise ValueError(f"rule {self.rule_name!r}: min_overlap (a share of the target vocabulary) "
                       f"must be in [0, 1], got {self.min_overlap}")
    if not isinstance(self.vocab, VocabMap):
      raise ValueError(f"rule {self.rule_name!r} needs vocab=VocabMap (build it with "
                       f"specjax.acceptance.vocab.build(target_tokenizer, draft_tokenizer))")
    self.vocab.check(self.min_overlap, self.rule_name)

  def _scatter(self, q_draft: jax.Array, rows: np.ndarray) -> jax.Array:
    """Draft probabilities [..., K] over draft ids `rows` -> log q over target ids [..., V_T]."""
    targets = jnp.asarray(self.vocab.d2t[rows])
    shape = q_draft.shape[:-1] + (self.vocab.t2d.shape[0],)
    q_t = jnp.zeros(shape, jnp.float32).at[..., targets].add(q_draft)
    return jnp.where(q_t > 0, jnp.log(jnp.where(q_t > 0, q_t, 1.0)), -jnp.inf)


@register("intersection")
@dataclasses.dataclass(frozen=True)
class Intersection(_CrossVocab):
  """TLI (Alg 4): the draft's head pruned to T ∩ D (logits[..., inter_d]), warped there, so q̃ is
  q renormalised on the overlap; scatter-added into target ids; standard SD verification.
  Acceptance sum_I min(p, q̃) >= union's sum_I min(p, q) (Thm 4.1).

  Fallback (Alg 4, "if sum_I q = 0, take one AR step"): where the draft gives no shared token a
  finite logit, q̃ is empty (all -inf over target ids). The proposal there is an arbitrary id
  with q̃ = 0, which verify rejects with probability 1 (base.ratio_accept), and the token is drawn
  from norm((p - 0)+) = p: that position is decoded by the target alone.
  """

  def q_log_probs(self, q_logits, warp):
    """Draft logits [..., V_D] -> log q̃ over target ids [..., V_T]; all -inf where q̃ is empty.

    Example: inter_d = [0, 1, 4], logits at those rows [-inf, -inf, -inf] -> every entry -inf
    (the warp alone would give NaN, or a one-hot on row 0 at temperature 0)."""
    shared = q_logits[..., jnp.asarray(self.vocab.inter_d)]                # [..., K]
    has_mass = jnp.any(shared > -jnp.inf, axis=-1, keepdims=True)         # [..., 1]
    q_i = jnp.where(has_mass, jnp.exp(warp.log_probs(shared)), 0.0)       # [..., K]
    return self._scatter(q_i, self.vocab.inter_d)

  def verify(self, draft_tokens, draft_len, q_logp, p_logp, keys, rule_state):
    _pad_check(q_logp, p_logp, "intersection")
    n, nxt = base.rejection_verify(draft_tokens, draft_len, q_logp, p_logp, keys, lambda x: x)
    return n, nxt, rule_state


@register("union")
@dataclasses.dataclass(frozen=True)
class Union(_CrossVocab):
  """Alg 1: the draft samples its full warped q; mass on draft-only tokens becomes the sentinel
  id V_T (always rejected, fed to the target clipped, never committed); q' = q on the overlap,
  not renormalised, is used for the ratio and the residual norm((p - q')+)."""

  def q_log_probs(self, q_logits, warp):
    q = jnp.exp(warp.log_probs(q_logits))                                 # [..., V_D]
    rows = self.vocab.inter_d
    return self._scatter(q[..., jnp.asarray(rows)], rows)

  def propose(self, q_logp, keys):
    outside = jnp.log(jnp.maximum(1.0 - jnp.sum(jnp.exp(q_logp), -1, keepdims=True), 0.0))
    return sampling.categorical(jnp.concatenate([q_logp, outside], axis=-1), keys)

  def verify(self, draft_tokens, draft_len, q_logp, p_logp, keys, rule_state):
    _pad_check(q_logp, p_logp, "union")
    num, vocab = draft_tokens.shape[1], q_logp.shape[-1]
    uniforms, sample_keys = base.verify_streams(keys, num)
    inside = draft_tokens < vocab
    tok = jnp.minimum(draft_tokens, vocab - 1)
    accept = base.ratio_accept(uniforms, base.take_tokens(p_logp[:, :num], tok),
                               base.take_tokens(q_logp, tok))
    n = base.prefix_accepted(inside & accept, draft_len)
    p_n, q_n = base.take_position(p_logp, n), base.take_position(q_logp, n)
    fix = jnp.where((n < draft_len)[:, None], base.residual_log_probs(p_n, q_n), p_n)
    return n, sampling.categorical(fix, sample_keys), rule_state
