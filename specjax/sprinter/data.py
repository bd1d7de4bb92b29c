"""SPRINTER's training examples (docs/papers/sprinter.md §2): what the draft proposes, labelled by the target.

Each text prefix c is extended by a continuation of `cont_len` tokens taken from one of four
sources, one per prefix group: text, draft samples, target samples, or a per-token mix. Every
position i = 0..cont_len of every continuation is one example: prefix c + cont[:i], a candidate
x ~ q(.|prefix), the verifier's feature (reading A or B, see `specjax.sprinter.verifier`), and the
label 1[log q(x) - log p(x) <= log lambda]. One jitted scan per batch runs both models over the
continuation and records everything; the host then drops positions past an EOS or past the text.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling
from specjax.data.batch import Batch
from specjax.models import Prompt, prompting

GROUPS = ("text", "draft", "target", "mixed")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  lam: float = 1.2            # x is acceptable iff q(x)/p(x) <= lam
  cont_len: int = 20          # continuations of 0..cont_len tokens
  mix_prob: float = 0.5       # group "mixed": P(a continuation token comes from the target)
  features: str = "A"         # the verifier's reading: "A" (h_{t-1}) or "B" (h_t)

  def __post_init__(self):
    if not self.lam > 0.0:
      raise ValueError(f"lam must be > 0 (a token is acceptable iff q/p <= lam), got {self.lam}")
    if self.cont_len < 1:
      raise ValueError(f"cont_len must be >= 1, got {self.cont_len}")
    if not 0.0 <= self.mix_prob <= 1.0:
      raise ValueError(f"mix_prob is a probability: it must lie in [0, 1], got {self.mix_prob}")
    if self.features not in ("A", "B"):
      raise ValueError(f"features must be 'A' or 'B', got {self.features!r}")


@dataclasses.dataclass(frozen=True)
class _Rollout:
  """Static description of one jitted data-generation call (the jit cache key)."""
  target: Any
  draft: Any
  warp: sampling.Warp
  data: DataConfig
  max_len: int


def rollout(target, target_params, draft, draft_params, prompt: Prompt, text: jax.Array,
            group: jax.Array, key: jax.Array, *, warp: sampling.Warp, data: DataConfig) -> dict:
  """Examples of one batch of prefixes; every array is [B, cont_len+1, ...] (position i = prefix
  c + cont[:i]). text [B, cont_len]: the text continuation (group 0); group [B] in 0..3.

  Returns features [B,I,D], log_q / log_p (of the candidate x) [B,I], x [B,I], cont [B,L].
  """
  if target.vocab_size != draft.vocab_size:
    raise ValueError(f"draft vocab {draft.vocab_size} != target vocab {target.vocab_size}: the "
                     f"ratio label q(x)/p(x) needs one vocabulary")
  need = max(prompting.prefix_len(target, prompt), prompting.prefix_len(draft, prompt)) + data.cont_len + 1
  setup = _Rollout(target=target, draft=draft, warp=warp, data=data, max_len=need)
  return _rollout(setup, target_params, draft_params, prompt, text, group, key)


@functools.partial(jax.jit, static_argnums=0)
def _rollout(setup: _Rollout, tparams, dparams, prompt, text, group, key):
  target, draft, warp, data = setup.target, setup.draft, setup.warp, setup.data
  batch = prompt.tokens.shape[0]
  tcache = target.init_cache(batch, setup.max_len, prompting.enc_len(target, prompt))
  dcache = draft.init_cache(batch, setup.max_len, prompting.enc_len(draft, prompt))
  p_logits, _, tcache = target.prefill(tparams, prompt, tcache)
  q_logits, h, dcache = draft.prefill(dparams, prompt, dcache)
  rows = sampling.row_keys(key, batch)
  text = jnp.pad(text, ((0, 0), (0, 1)))                                # [B, L+1]

  def step(carry, i):
    p_logits, q_logits, h, tcache, dcache = carry
    keys = sampling.position_keys(rows, jnp.full((batch,), i))
    plp, qlp = warp.log_probs(p_logits), warp.log_probs(q_logits)        # [B, V]
    x = sampling.categorical(qlp, sampling.fold_rows(keys, 0))
    feat = h
    if data.features == "B":
      feat = draft.extend(dparams, x[:, None], dcache)[1][:, 0]         # cache discarded
    from_q = sampling.categorical(qlp, sampling.fold_rows(keys, 1))
    from_p = sampling.categorical(plp, sampling.fold_rows(keys, 2))
    coin = jax.vmap(lambda k: jax.random.uniform(k) < data.mix_prob)(sampling.fold_rows(keys, 3))
    cont = jnp.select([group == 0, group == 1, group == 2], [text[:, i], from_q, from_p],
                      jnp.where(coin, from_p, from_q))
    p_logits, _, tcache = target.extend(tparams, cont[:, None], tcache)
    q_logits, h2, dcache = draft.extend(dparams, cont[:, None], dcache)
    out = dict(features=feat.astype(jnp.float32), x=x, cont=cont,
               log_q=jnp.take_along_axis(qlp, x[:, None], 1)[:, 0],
               log_p=jnp.take_along_axis(plp, x[:, None], 1)[:, 0])
    return (p_logits[:, 0], q_logits[:, 0], h2[:, 0], tcache, dcache), out

  carry = (p_logits, q_logits, h, tcache, dcache)
  _, out = jax.lax.scan(step, carry, jnp.arange(data.cont_len + 1))
  out = jax.tree_util.tree_map(lambda a: jnp.swapaxes(a, 0, 1), out)   # [B, I, ...]
  out["cont"] = out["cont"][:, :-1]                                     # [B, L]
  return out


def valid_positions(cont: np.ndarray, group: np.ndarray, text_len: np.ndarray,
                    eos: int) -> np.ndarray:
  """[S, L+1] bool: prefix c + cont[:i] is an example iff cont[:i] holds no EOS and, for the text
  group, i <= the text's length. Example: cont [5, 1, 7], eos 1 -> [1, 1, 0, 0]."""
  cont, group = np.asarray(cont), np.asarray(group)
  seen_eos = np.cumsum(cont == eos, axis=1) > 0                         # [S, L]
  valid = np.concatenate([np.ones((len(cont), 1), bool), ~seen_eos], axis=1)
  pos = np.arange(cont.shape[1] + 1)[None, :]
  return valid & ((group[:, None] != 0) | (pos <= np.asarray(text_len)[:, None]))


def labels_from(log_q: np.ndarray, log_p: np.ndarray, lam: float) -> np.ndarray:
  """1[q(x)/p(x) <= lam] from log-probs (p(x) = 0 gives 0)."""
  return (np.asarray(log_q, np.float64) - np.asarray(log_p, np.float64)) <= math.log(lam)


def build_dataset(target, target_params, draft, draft_params, batches: Iterable[Batch],
                  key: jax.Array, *, warp: sampling.Warp, data: DataConfig,
                  eos: int) -> dict[str, np.ndarray]:
  """Examples from an iterable of Batch (prompt = prefix c, targets = text continuation).

  Sequence s of the whole run gets group s % 4, so the four groups have equal numbers of
  sequences. Returns flat arrays over examples: features [N, D], labels, log_ratio, group, seq,
  pos, x; and per sequence: `sequences` [S, P+L] (prompt then continuation), `prompt_len` [S].
  """
  parts, seqs, seq0 = [], [], 0
  for n, batch in enumerate(batches):
    rows = batch.targets.shape[0]
    text = _fit(np.asarray(batch.targets), data.cont_len)
    text_len = np.minimum(np.asarray(batch.mask).sum(1), data.cont_len)
    group = (seq0 + np.arange(rows)) % len(GROUPS)
    out = jax.device_get(rollout(target, target_params, draft, draft_params, batch.prompt,
                                 jnp.asarray(text), jnp.asarray(group), jax.random.fold_in(key, n),
                                 warp=warp, data=data))
    valid = valid_positions(out["cont"], group, text_len, eos)
    parts.append(_examples(out, valid, group, seq0))
    seqs.append((np.asarray(batch.prompt.tokens), np.asarray(batch.prompt.lengths), out["cont"]))
    seq0 += rows
  ds = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
  ds["log_ratio"] = ds.pop("log_q").astype(np.float64) - ds.pop("log_p")
  ds["labels"] = ds["log_ratio"] <= math.log(data.lam)
  ds["sequences"], ds["prompt_len"] = _stack_sequences(seqs)
  return ds


def _examples(out: dict, valid: np.ndarray, group: np.ndarray, seq0: int) -> dict:
  """The valid [B, I] positions of one rollout as flat per-example arrays."""
  rows, width = valid.shape
  seq_ids = np.broadcast_to((seq0 + np.arange(rows))[:, None], valid.shape)
  pos = np.broadcast_to(np.arange(width)[None, :], valid.shape)
  return dict(features=out["features"][valid], log_q=out["log_q"][valid],
              log_p=out["log_p"][valid], x=out["x"][valid],
              group=np.broadcast_to(group[:, None], valid.shape)[valid],
              seq=seq_ids[valid], pos=pos[valid])


def _fit(a: np.ndarray, width: int) -> np.ndarray:
  """Cut or zero-pad the columns of a [B, L] array to `width`."""
  if a.shape[1] >= width:
    return a[:, :width]
  return np.pad(a, ((0, 0), (0, width - a.shape[1])))


def _stack_sequences(seqs) -> tuple[np.ndarray, np.ndarray]:
  """Rows of (prompt [B, P], lengths [B], cont [B, L]) -> ([S, P_max+L] prompt then
  continuation, zero-padded; [S] prompt lengths)."""
  width = max(p.shape[1] for p, _, _ in seqs)
  rows, lens = [], []
  for prompt, lengths, cont in seqs:
    for b in range(len(lengths)):
      rows.append(np.concatenate([prompt[b, :lengths[b]], cont[b],
                                  np.zeros(width - lengths[b], np.int32)]))
      lens.append(lengths[b])
  return np.stack(rows).astype(np.int32), np.asarray(lens, np.int32)
