"""String-level speculative decoding for a draft with another tokenizer (Timor et al., ICML'25):
SLEM (Alg 2, string-level exact match) and SLRS (Alg 3, string-level rejection sampling).

A host-driven loop around jitted model calls. The host keeps both token streams (x_T, x_D) as
Python lists and does the tokenizer work (decode drafts to text, re-encode over a look-behind
window, align, §2 of docs/papers/hetero_vocab.md); a `Backend` runs the models and keeps their KV
caches in step with the streams (rollback to the common prefix, then one padded extend). Only small
integer arrays cross between host and device for SLEM; SLRS also fetches probability rows.

SLEM: the draft proposes gamma tokens; their text, re-encoded by the target tokenizer, gives m
candidates; one target pass samples y_j ~ p(.|x_T, t_<j) at every position with the key of its
absolute output position (the autoregressive key), and the longest prefix with t_j == y_j plus
y_{n+1} is emitted. Every emitted token is the target's own sample, so the output equals
autoregressive decoding with the same key (greedy at temperature 0).

SLRS: the draft runs until eta (first target token determined, or max_depth draft tokens); the
proposal is t = first target token of the drafted text; psi(t), the probability that this stopped
process proposes t, is summed exactly over the trie of draft-token paths (one draft forward per
internal node, batched per level). Accept with min(1, p(t)/psi(t)), else sample the residual
norm((p - psi)+) by rejection from p. The trie costs ~2^(|t|-1) nodes, so SLRS suits short-token
(byte-level) drafts; it emits one token per target pass (analysis, not speed).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling
from specjax.decoding.state import (DRAFT, TARGET, Reserve, SpecStats, check_finite,
                                    new_tokens_bucket, stop_ids)
from specjax.models import kv_cache, prompting

MAX_CANDIDATES = 31          # a verify pass covers at most this many candidates (bucket 32)
STAT_KEYS = ("blocks", "drafted", "accepted", "verified", "emitted", "target_passes",
             "draft_passes")


# ---------------------------------------------------------------------------- alignment (host)

@dataclasses.dataclass(frozen=True)
class Alignment:
  """Result of align(old, new): new[start:] continues old[:len(old) - disc]; the first `disc`
  tokens of it (repl) overwrite old's tail, the rest (fresh) extends it."""
  start: int
  disc: int
  repl: list
  fresh: list


def align(old: Sequence[int], new: Sequence[int]) -> Alignment | None:
  """Longest diagonal run of new[r+i] == old[c+i] (ties: first in row-major order).

  Example: old [1, 2, 3], new [2, 3, 4, 5]: run (r=0, c=1, L=2) -> start 2, disc 0, fresh [4, 5].
  old [1, 2, 3], new [2, 9, 4]: run (0, 1, 1) -> start 1, disc 1, repl [9], fresh [4].
  No equal tokens -> None.
  """
  best = (0, 0, 0)
  for r in range(len(new)):
    for c in range(len(old)):
      n = 0
      while r + n < len(new) and c + n < len(old) and new[r + n] == old[c + n]:
        n += 1
      if n > best[2]:
        best = (r, c, n)
  r, c, n = best
  if n == 0:
    return None
  start, disc = r + n, len(old) - (c + n)
  return Alignment(start=start, disc=disc, repl=list(new[start:start + disc]),
                   fresh=list(new[start + disc:]))


def convert(ids: Sequence[int], src, dst) -> list[int]:
  """Re-tokenize: dst.encode(src.decode(ids)) (decode drops special tokens)."""
  return list(dst.encode(src.decode(list(ids))))


def draft_to_target(draft_seq: Sequence[int], n_before: int, x_t: Sequence[int], draft_tok,
                    target_tok, lookbehind: int = 10) -> list[int]:
  """Target candidates for the drafts draft_seq[n_before:]: re-encode a window that starts
  `lookbehind` known tokens earlier (never a fragment alone: non-injective tokenizers), then keep
  what follows the part aligned with x_T's tail."""
  window = convert(draft_seq[max(0, n_before - lookbehind):], draft_tok, target_tok)
  a = align(list(x_t[-len(window):]) if window else [], window)
  return window if a is None else a.fresh


def resync_draft(x_d: Sequence[int], x_t: Sequence[int], n_t_prev: int, target_tok, draft_tok,
                 prompt_d: int, prompt_t: int, lookbehind: int = 10) -> list[int]:
  """The draft stream after the target stream grew past n_t_prev: x_d (which may still hold this
  round's drafts) with its tail overwritten by the aligned re-encoding of x_T's new tokens plus a
  look-behind. If the result does not spell the target's text (alignment fooled by repeats), the
  draft prompt plus the draft's encoding of the whole generated text is used instead."""
  window = convert(x_t[max(prompt_t, n_t_prev - lookbehind):], target_tok, draft_tok)
  a = align(list(x_d[-len(window):]) if window else [], window)
  new = list(x_d) + window if a is None else list(x_d[:len(x_d) - a.disc]) + a.repl + a.fresh
  full = list(x_d[:prompt_d]) + convert(x_t[prompt_t:], target_tok, draft_tok)
  if draft_tok.decode(new[prompt_d:]) == draft_tok.decode(full[prompt_d:]):
    return new
  return full


# ------------------------------------------------------------------------------ the backend

class Backend(Protocol):
  """Model calls of the string-level loop; streams are whole token lists (prompt included)."""

  def draft_propose(self, x_d: list[int], k: int, g: int) -> list[int]:
    """k draft tokens sampled after x_d (g: generated target tokens so far, for keys)."""

  def target_sample(self, x_t: list[int], cands: list[int], g: int) -> list[int]:
    """y_1..y_{m+1}: y_j ~ p(.|x_t, cands[:j-1]), drawn with the key of output position g+j-1."""

  def draft_logprobs(self, x_d: list[int], paths: list[list[int]]) -> np.ndarray:
    """[len(paths), V_D] warped log q(.|x_d ++ path) (SLRS)."""

  def target_logprobs(self, x_t: list[int]) -> np.ndarray:
    """[V_T] warped log p(.|x_t) (SLRS)."""


def _common(a: Sequence[int], b: Sequence[int]) -> int:
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


@functools.partial(jax.jit, static_argnums=0)
def _feed(model, params, cache, feed, start, count):
  """Write feed [1, W] at `start`, keep `count` entries; logits [W, V] of every fed position,
  and whether they hold NaN / +inf."""
  cache = kv_cache.rollback(cache, jnp.reshape(start, (1,)))
  logits, _, cache = model.extend(params, feed, cache)
  return (logits[0], kv_cache.rollback(cache, jnp.reshape(start + count, (1,))),
          sampling.nonfinite_rows(logits)[0])


@jax.jit
def _sample_positions(warp, logits, first, row_key, g):
  """y_j from logits[first + j] with key fold_in(row_key, g + j): the autoregressive keys."""
  idx = jnp.minimum(first + jnp.arange(logits.shape[0]), logits.shape[0] - 1)
  keys = jax.vmap(lambda t: jax.random.fold_in(row_key, t))((g + jnp.arange(logits.shape[0]))
                                                            .astype(jnp.uint32))
  return warp.sample(logits[idx], keys)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _draft_steps(model, warp, k, params, cache, last_logits, key):
  """Sample d_1 from last_logits, then k-1 more draft steps; d_k is sampled but not fed.
  Returns (tokens [k], cache, whether a step's logits held NaN / +inf)."""
  keys = jax.vmap(lambda s: jax.random.fold_in(key, s))(jnp.arange(k, dtype=jnp.uint32))
  tokens = jnp.zeros((k,), jnp.int32).at[0].set(warp.sample(last_logits[None], keys[:1])[0])

  def body(j, carry):
    tokens, cache, bad = carry
    logits, _, cache = model.extend(params, tokens[j - 1].reshape(1, 1), cache)
    bad = bad | sampling.nonfinite_rows(logits)[0]
    return tokens.at[j].set(warp.sample(logits[:, 0], keys[j][None])[0]), cache, bad

  return jax.lax.fori_loop(1, k, body, (tokens, cache, jnp.bool_(False)))


@functools.partial(jax.jit, static_argnums=0)
def _tree_logprobs(model, warp, params, cache, feed, count):
  """One row of the cache tiled over N paths: feed [N, W] -> warped log-probs [N, V] at count-1."""
  n = feed.shape[0]
  tile = lambda x: jnp.repeat(x, n, axis=1) if x.ndim >= 2 else jnp.repeat(x, n, axis=0)
  cache = jax.tree_util.tree_map(tile, cache)
  logits, _, _ = model.extend(params, feed, cache)
  last = jnp.take_along_axis(logits, (count - 1)[:, None, None], axis=1)[:, 0]
  return warp.log_probs(last), jnp.any(sampling.nonfinite_rows(last))


@dataclasses.dataclass
class ModelBackend:
  """Decoder-only target and draft with KV caches synced to the host streams (batch 1)."""
  target: object
  target_params: object
  draft: object
  draft_params: object
  warp: sampling.Warp
  key: jax.Array
  max_len: int
  prompt_width: int = 0       # > 0: the target's prompt is prefilled at this padded width

  def __post_init__(self):
    for m in (self.target, self.draft):
      if m.is_encoder_decoder:
        raise ValueError("string-level SD supports decoder-only models (the target text is a "
                         "continuation of the prompt); use a decoder-only target and draft")
    self.row_key = jax.random.fold_in(self.key, 0)           # row 0, as autoregressive decoding
    self.draft_key = jax.random.fold_in(self.key, 0x5EED)    # an independent stream for drafts
    self.t_cache = self.target.init_cache(1, self.max_len)
    self.d_cache = self.draft.init_cache(1, self.max_len)
    self.t_seen: list[int] = []
    self.d_seen: list[int] = []
    self.nonfinite = jnp.int32(0)     # TARGET | DRAFT bits, kept on the device until `check`

  def _flag(self, bit: int, bad) -> None:
    self.nonfinite = self.nonfinite | jnp.where(bad, bit, 0).astype(jnp.int32)

  def stats_flags(self) -> jax.Array:
    """[1] the non-finite bits as SpecStats.nonfinite holds them."""
    return jnp.reshape(self.nonfinite, (1,))

  def check(self) -> None:
    """NonFiniteLogitsError if a model's logits held NaN / inf (a host read)."""
    stats = SpecStats(**{k: jnp.zeros((1,), jnp.int32) for k in STAT_KEYS},
                      nonfinite=self.stats_flags())
    check_finite(StringGeneration(tokens=None, text="", stats=stats), self.target, self.draft)

  def _sync(self, which: str, stream: list[int], extra: list[int] = ()):
    """Rewind `which` to its common prefix with stream (feeding at least stream's last token),
    feed the rest plus extra; return (logits [W, V] of the fed positions, index of stream[-1])."""
    model, params = (self.target, self.target_params) if which == "t" else \
        (self.draft, self.draft_params)
    seen, cache = (self.t_seen, self.t_cache) if which == "t" else (self.d_seen, self.d_cache)
    if which == "t" and not seen and self.prompt_width:
      return self._prefill_target(stream, extra)
    c = min(_common(seen, stream), len(stream) - 1)
    fed = list(stream[c:]) + list(extra)
    width = prompting.bucket(len(fed), minimum=8)
    kv_cache.check_capacity(c + width, self.max_len, "string-level stream + padded block "
                            "(pass a larger max_len)")
    feed = jnp.asarray([fed + [0] * (width - len(fed))], jnp.int32)
    logits, cache, bad = _feed(model, params, cache, feed, jnp.int32(c), jnp.int32(len(fed)))
    self._flag(TARGET if which == "t" else DRAFT, bad)
    if which == "t":
      self.t_cache, self.t_seen = cache, list(stream) + list(extra)
    else:
      self.d_cache, self.d_seen = cache, list(stream) + list(extra)
    return logits, len(stream) - 1 - c

  def _prefill_target(self, stream: list[int], extra: list[int]):
    """`_sync` of the target's first call: the prompt through `prefill` at the width that
    autoregressive decoding gives it, then `extra` fed after it. A model whose passes depend on
    their width (models.transformer.Arch.width_invariant covers every pass but a prefill) then
    holds the prompt's cache entries and logits bit for bit as autoregressive decoding does."""
    width = max(self.prompt_width, len(stream))
    kv_cache.check_capacity(width, self.max_len, "string-level prompt")
    prompt = prompting.Prompt.from_lists([stream], width, 0)
    first, _, cache = self.target.prefill(self.target_params, prompt, self.t_cache)   # [1, V]
    self._flag(TARGET, sampling.nonfinite_rows(first)[0])
    self.t_cache, self.t_seen = cache, list(stream)
    if not extra:
      return first, 0
    fed = list(extra)
    width = prompting.bucket(len(fed), minimum=8)
    kv_cache.check_capacity(len(stream) + width, self.max_len, "string-level stream + padded "
                            "block (pass a larger max_len)")
    feed = jnp.asarray([fed + [0] * (width - len(fed))], jnp.int32)
    logits, cache, bad = _feed(self.target, self.target_params, cache, feed,
                               jnp.int32(len(stream)), jnp.int32(len(fed)))
    self._flag(TARGET, bad)
    self.t_cache, self.t_seen = cache, list(stream) + fed
    return jnp.concatenate([first, logits]), 0

  def draft_propose(self, x_d, k, g):
    logits, last = self._sync("d", x_d)
    kv_cache.check_capacity(len(x_d) + k, self.max_len, "draft stream + gamma")
    key = jax.random.fold_in(self.draft_key, g)
    tokens, cache, bad = _draft_steps(self.draft, self.warp, k, self.draft_params, self.d_cache,
                                      logits[last], key)
    self._flag(DRAFT, bad)
    tokens = [int(t) for t in np.asarray(tokens)]
    self.d_cache, self.d_seen = cache, self.d_seen + tokens[:-1]
    return tokens

  def target_sample(self, x_t, cands, g):
    logits, first = self._sync("t", x_t, cands)
    ys = _sample_positions(self.warp, logits, jnp.int32(first), self.row_key, jnp.int32(g))
    return [int(y) for y in np.asarray(ys)[:len(cands) + 1]]

  def target_logprobs(self, x_t):
    logits, last = self._sync("t", x_t)
    self.check()                  # SLRS samples on the host: NaN would fail there, unnamed
    return np.asarray(self.warp.log_probs(logits[last]), np.float64)

  def draft_logprobs(self, x_d, paths):
    self._sync("d", x_d[:-1]) if len(x_d) > 1 else None
    rows = [[x_d[-1]] + list(p) for p in paths]
    n = prompting.bucket(len(rows), minimum=1)
    width = prompting.bucket(max(map(len, rows)), minimum=1)
    kv_cache.check_capacity(len(x_d) - 1 + width, self.max_len, "SLRS trie path")
    feed = np.zeros((n, width), np.int32)
    count = np.ones((n,), np.int32)
    for i, r in enumerate(rows):
      feed[i, :len(r)], count[i] = r, len(r)
    cache = kv_cache.rollback(self.d_cache, jnp.full((1,), len(x_d) - 1, jnp.int32))
    out, bad = _tree_logprobs(self.draft, self.warp, self.draft_params, cache,
                              jnp.asarray(feed), jnp.asarray(count))
    self._flag(DRAFT, bad)
    self.check()
    return np.asarray(out, np.float64)[:len(paths)]


# ---------------------------------------------------------------------------- the algorithms

@dataclasses.dataclass
class Streams:
  """Host state of one generation: both token streams, their prompt lengths, the output."""
  x_t: list[int]
  x_d: list[int]
  prompt_t: int
  prompt_d: int
  out: list[int] = dataclasses.field(default_factory=list)
  stats: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(STAT_KEYS, 0))

  def emit(self, tokens: list[int], max_new: int, eos: tuple[int, ...]) -> bool:
    """Append tokens (cut at a stop id / max_new) to x_T and the output; True when generation
    ends."""
    done = False
    stop = next((i for i, t in enumerate(tokens) if t in eos), None)
    if stop is not None:
      tokens, done = tokens[:stop + 1], True
    tokens = tokens[:max_new - len(self.out)]
    self.out += tokens
    self.x_t += tokens
    self.stats["emitted"] += len(tokens)
    return done or len(self.out) >= max_new


def slem_round(backend: Backend, s: Streams, target_tok, draft_tok, *, gamma: int, max_new: int,
               eos_id: tuple[int, ...], lookbehind: int = 10) -> bool:
  """One SLEM iteration (Alg 2); returns True when the generation is finished."""
  g, n_d, n_t = len(s.out), len(s.x_d), len(s.x_t)
  drafts = backend.draft_propose(s.x_d, gamma, g)
  dseq = s.x_d + drafts
  cands = draft_to_target(dseq, n_d, s.x_t, draft_tok, target_tok, lookbehind)[:MAX_CANDIDATES]
  ys = backend.target_sample(s.x_t, cands, g)
  n = 0
  while n < len(cands) and cands[n] == ys[n]:
    n += 1
  st = s.stats
  st["blocks"] += 1
  st["target_passes"] += 1
  st["draft_passes"] += gamma
  st["drafted"] += len(cands)
  st["accepted"] += n
  st["verified"] += min(n + 1, len(cands))
  done = s.emit(cands[:n] + [ys[n]], max_new, eos_id)
  s.x_d = resync_draft(dseq, s.x_t, n_t, target_tok, draft_tok, s.prompt_d, s.prompt_t,
                       lookbehind)
  return done


@dataclasses.dataclass(frozen=True)
class Proposer:
  """SLRS's stopped drafting process, as pure functions of a draft path: eta and T(text)_1."""
  target_tok: object
  draft_tok: object
  max_depth: int = 3

  @functools.cached_property
  def _prefixes(self) -> frozenset:
    """Proper prefixes of target token texts: a drafted text among them may still grow into a
    longer first target token (its first token is not determined yet)."""
    out = set()
    for t in range(self.target_tok.vocab_size):
      text = self.target_tok.decode([t])
      out.update(text[:i] for i in range(len(text)))
    return frozenset(out)

  @functools.cached_property
  def draft_texts(self) -> list[str]:
    return [self.draft_tok.decode([d]) for d in range(self.draft_tok.vocab_size)]

  def stops(self, path: Sequence[int], text: str) -> bool:
    return (len(path) >= self.max_depth or path[-1] == self.draft_tok.eos_id
            or text not in self._prefixes)

  def first_token(self, path: Sequence[int]) -> int:
    """The proposal of a stopped path: the first target token of its text (target EOS for a
    draft EOS with no text before it, -1 when the text has no token: always rejected)."""
    eos = self.draft_tok.eos_id
    body = list(path[:path.index(eos)]) if eos in path else list(path)
    ids = self.target_tok.encode(self.draft_tok.decode(body))
    if ids:
      return int(ids[0])
    return int(self.target_tok.eos_id) if eos in path else -1


def psi(backend: Backend, x_d: list[int], prop: Proposer, t: int | None = None, *,
        prune: bool = True) -> dict[int, float]:
  """psi: the probability that the stopped drafting process from x_d proposes each target token,
  summed over the trie of draft paths (one draft forward per internal node, batched per level).

  t given and prune: only paths whose text is compatible with t's text (one is a prefix of the
  other) are expanded, which is exact when the target tokenizer does not normalise text (T(s)_1
  is then a prefix of s); prune=False enumerates every path (any tokenizer).
  Returns {target id: psi}; with t=None it covers every proposal and sums to 1.
  """
  texts = prop.draft_texts
  want = None if t is None or not prune else prop.target_tok.decode([t])
  out: dict[int, float] = {}
  frontier = [((), "", 0.0)]
  while frontier:
    rows = backend.draft_logprobs(x_d, [list(p) for p, _, _ in frontier])
    nxt = []
    for (path, text, logq), row in zip(frontier, rows):
      for d in np.nonzero(np.isfinite(row))[0]:
        child, ctext = path + (int(d),), text + texts[d]
        if want is not None and not (ctext.startswith(want) or want.startswith(ctext)):
          continue
        lq = logq + float(row[d])
        if prop.stops(child, ctext):
          tok = prop.first_token(child)
          if t is None or tok == t:
            out[tok] = out.get(tok, 0.0) + float(np.exp(lq))
        else:
          nxt.append((child, ctext, lq))
    frontier = nxt
  return out


def _sample_path(backend: Backend, x_d: list[int], prop: Proposer, rng) -> tuple[list[int], int]:
  path, text = [], ""
  while True:
    row = np.exp(backend.draft_logprobs(x_d, [path])[0])
    d = int(rng.choice(len(row), p=row / row.sum()))
    path.append(d)
    text += prop.draft_texts[d]
    if prop.stops(path, text):
      return path, len(path)


def slrs_step(backend: Backend, s: Streams, prop: Proposer, rng, *, max_new: int,
              eos_id: tuple[int, ...], lookbehind: int = 10, prune: bool = True,
              max_trials: int = 10_000) -> bool:
  """One SLRS iteration (Alg 3): one emitted target token; True when the generation ends."""
  path, passes = _sample_path(backend, s.x_d, prop, rng)
  t = prop.first_token(path)
  p = np.exp(backend.target_logprobs(s.x_t))
  p /= p.sum()
  cache: dict[int, float] = {}

  def psi_at(tok: int) -> float:
    if tok not in cache:
      cache[tok] = psi(backend, s.x_d, prop, tok, prune=prune).get(tok, 0.0)
    return cache[tok]

  accepted = t >= 0 and rng.uniform() < min(1.0, p[t] / max(psi_at(t), 1e-300))
  y = t
  for _ in range(0 if accepted else max_trials):     # residual norm((p - psi)+) by rejection
    y = int(rng.choice(len(p), p=p))
    if rng.uniform() < max(0.0, 1.0 - psi_at(y) / p[y]):
      break
  st = s.stats
  for k, v in (("blocks", 1), ("target_passes", 1), ("draft_passes", passes), ("drafted", 1),
               ("verified", 1), ("accepted", int(accepted))):
    st[k] += v
  n_t = len(s.x_t)
  done = s.emit([y], max_new, eos_id)
  s.x_d = resync_draft(s.x_d, s.x_t, n_t, prop.target_tok, prop.draft_tok, s.prompt_d,
                       s.prompt_t, lookbehind)
  return done


# ------------------------------------------------------------------------------ entry point

@dataclasses.dataclass(frozen=True)
class StringGeneration:
  tokens: np.ndarray      # [N] generated target ids (EOS included)
  text: str               # target_tok.decode(tokens)
  stats: SpecStats        # [1] per field, as the jitted loops report


def run(backend: Backend, target_tok, draft_tok, x_t: list[int], x_d: list[int], *,
        method: str, gamma: int, max_new_tokens: int, eos_id: int | None, lookbehind: int = 10,
        max_depth: int = 3, rng=None, on_round: Callable[[Streams], None] | None = None
        ) -> Streams:
  """The host loop on any Backend (models or test tables)."""
  if method not in ("slem", "slrs"):
    raise ValueError(f"method must be 'slem' or 'slrs', got {method!r}")
  eos_id = stop_ids(eos_id)
  s = Streams(x_t=list(x_t), x_d=list(x_d), prompt_t=len(x_t), prompt_d=len(x_d))
  prop = Proposer(target_tok, draft_tok, max_depth) if method == "slrs" else None
  done = False
  while not done:
    if prop is None:
      done = slem_round(backend, s, target_tok, draft_tok, gamma=gamma, max_new=max_new_tokens,
                        eos_id=eos_id, lookbehind=lookbehind)
    else:
      done = slrs_step(backend, s, prop, rng, max_new=max_new_tokens, eos_id=eos_id,
                       lookbehind=lookbehind)
    if on_round is not None:
      on_round(s)
  return s


def reserve(gamma: int) -> Reserve:
  """What a prompt must leave room for: new tokens and a block of gamma + 1 (the loop grows its
  caches past this where the position tables allow)."""
  return Reserve(per_token=1, fixed=gamma + 1, what=f"gamma {gamma} + 1")


def default_capacity(models, prompt_len: int, max_new_tokens: int, gamma: int) -> int:
  """Both caches' size when the caller gives none: room for a draft stream about 3x the
  target's, cut to the models' position tables. Sized for the buckets of the prompt and of
  max_new_tokens, so that the values of one bucket share the compiled programs (whose caches have
  this size). Example: a 10-token prompt, 9 or 12 new tokens, gamma 3 -> 16 + 3 * 16 + 3 + 32."""
  limits = [m.n_positions for m in models]
  want = (prompting.bucket(prompt_len, minimum=16) + 3 * new_tokens_bucket(max_new_tokens)
          + gamma + 32)
  return min([want] + [n for n in limits if n])


def generate(target, target_params, target_tok, draft, draft_params, draft_tok, x_t: list[int],
             x_d: list[int], key: jax.Array, *, method: str = "slem", gamma: int = 4,
             max_new_tokens: int = 32,
             warp: sampling.Warp = sampling.Warp(), lookbehind: int = 10, max_depth: int = 3,
             eos_id: int | Sequence[int] | None, max_len: int | None = None,
             prompt_width: int = 0) -> StringGeneration:
  """SLEM or SLRS generation of up to max_new_tokens target tokens after one prompt (batch 1),
  given as the target's and the draft's token lists (`models.prompting.encode` of the text).

  eos_id: the stop ids (one id, several, or None: none; state.stop_ids). SLEM draws every
  emitted token with the autoregressive key of its position, so it equals
  autoregressive.generate with the same key (greedy at temperature 0). SLRS (max_depth: the drafting lookahead) uses a host RNG seeded from
  key. max_len: both KV caches' size (default: generous for this prompt and max_new_tokens).
  prompt_width > 0: the target prefills x_t padded to this width, as autoregressive decoding of
  the same Prompt does, so that a width-dependent prefill gives both the same bits (0: x_t is
  fed like any other block).
  Raises NonFiniteLogitsError if either model's logits held NaN / inf.
  """
  if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
    raise ValueError(f"gamma (draft tokens per round) must be an integer >= 1, got {gamma!r}")
  eos_id = stop_ids(eos_id)
  x_t, x_d = [int(t) for t in x_t], [int(t) for t in x_d]
  max_len = max_len or default_capacity((target, draft), max(len(x_t), len(x_d)),
                                         max_new_tokens, gamma)
  backend = ModelBackend(target, target_params, draft, draft_params, warp, key, max_len,
                         prompt_width)
  seed = int(jax.random.randint(jax.random.fold_in(key, 0x51), (), 0, 2**31 - 1))
  s = run(backend, target_tok, draft_tok, x_t, x_d, method=method, gamma=gamma,
          max_new_tokens=max_new_tokens, eos_id=eos_id, lookbehind=lookbehind,
          max_depth=max_depth, rng=np.random.default_rng(seed))
  backend.check()
  stats = SpecStats(**{k: jnp.asarray([v], jnp.int32) for k, v in s.stats.items()},
                    nonfinite=backend.stats_flags())
  return StringGeneration(tokens=np.asarray(s.out, np.int32), text=target_tok.decode(s.out),
                          stats=stats)
