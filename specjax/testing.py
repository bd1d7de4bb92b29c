"""Tiny models and toy distributions shared by the tests (and handy for experiments).

ToyAR is a table model that follows the full model contract (prefill / extend / KVCache with
rollback) and whose whole-sequence law can be enumerated exactly with `enumerate_law`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from specjax.acceptance import base, exact
from specjax.models import Prompt
from specjax.models import kv_cache


# How far apart the same float32 model's values may be in its scanned and unrolled layouts: XLA
# fuses a scan body and straight-line layers into different reductions (a few float32 ulps on CPU:
# 1.3e-6 at logits of magnitude 3 since the attention's softmax spans its segments without a
# concatenation; up to ~2e-6 on an H200).
def layout_ulp() -> float:
  return 2e-6 if jax.default_backend() == "cpu" else 1e-5


@dataclasses.dataclass(frozen=True)
class ToyAR:
  """Next-token logits = params["table"][min(pos, P-1), token at pos]: a position-dependent bigram.

  pos is the absolute stream position of the input token, read from the cache lengths, so a wrong
  rollback changes the law. The cache stores the token ids (in k), as a real model stores keys.
  """
  vocab_size: int
  num_positions: int
  hidden_size: int = 1
  is_encoder_decoder: bool = dataclasses.field(default=False, init=False)
  # The rest of the model contract (models.Model): no position table bound, no attention heads.
  n_positions: ClassVar[None] = None
  decoder_start_id: ClassVar[int] = 0
  heads: ClassVar[None] = None
  layout: ClassVar[str] = "in_out"
  quant: ClassVar[str] = ""

  @property
  def dtype(self):
    return jnp.float32

  def init_params(self, rng: jax.Array, scale: float = 2.0) -> dict:
    shape = (self.num_positions, self.vocab_size, self.vocab_size)
    return {"table": scale * jax.random.normal(rng, shape, jnp.float32)}

  def init_cache(self, batch: int, max_len: int, enc_len: int = 0) -> kv_cache.KVCache:
    del enc_len
    return kv_cache.init_cache(layers=1, batch=batch, max_len=max_len, heads=1, head_dim=1)

  def _logits(self, params, tokens, positions):
    pos = jnp.minimum(positions, self.num_positions - 1)
    logits = params["table"][pos, tokens]                                 # [B, T, V]
    hidden = tokens[..., None].astype(jnp.float32)                        # [B, T, 1]
    return logits.astype(jnp.float32), hidden

  def _write(self, cache, tokens, start):
    ids = tokens.astype(jnp.float32)[None, :, :, None, None]              # [1, B, T, 1, 1]
    k = jax.vmap(kv_cache.write_layer, in_axes=(0, 0, None))(cache.k, ids, start)
    return cache.replace(k=k, lengths=start + tokens.shape[1])

  def prefill(self, params, prompt: Prompt, cache):
    kv_cache.check_capacity(prompt.tokens.shape[1], cache.capacity, "prompt")
    cache = self._write(cache, prompt.tokens, jnp.zeros_like(cache.lengths))
    last = (prompt.lengths - 1)[:, None]
    token = jnp.take_along_axis(prompt.tokens, last, axis=1)
    logits, hidden = self._logits(params, token, last)
    return logits[:, 0], hidden[:, 0], cache.replace(lengths=prompt.lengths.astype(jnp.int32))

  def extend_entries(self, params, tokens, cache, select=None):
    positions = kv_cache.positions(cache.lengths, tokens.shape[1])
    ids = tokens.astype(jnp.float32)[None, :, :, None, None]              # [1, B, T, 1, 1]
    if select is not None:
      tokens = jnp.take_along_axis(tokens, select[:, None], axis=1)
      positions = jnp.take_along_axis(positions, select[:, None], axis=1)
    logits, hidden = self._logits(params, tokens, positions)
    return logits, hidden, (ids, jnp.zeros_like(ids))

  def extend(self, params, tokens, cache, select=None):
    logits, hidden, (k, v) = self.extend_entries(params, tokens, cache, select)
    return logits, hidden, kv_cache.append(cache, k, v)

  def stored_tokens(self, cache, row: int) -> list[int]:
    """The token ids row `row` of the cache holds (its valid entries)."""
    n = int(cache.lengths[row])
    return [int(t) for t in np.asarray(cache.k[0, row, 0, :n, 0])]


def enumerate_law(model: ToyAR, params, prompt: list[int], *, max_new_tokens: int, warp,
                  eos_id: int | None) -> dict[tuple[int, ...], float]:
  """Exact probability of every whole output sequence (ending at EOS or at max_new_tokens)."""
  probs = np.exp(np.asarray(warp.log_probs(params["table"]), np.float64))  # [P, V, V]
  probs /= probs.sum(-1, keepdims=True)
  law: dict[tuple[int, ...], float] = {}
  stack = [((), 1.0)]
  while stack:
    seq, mass = stack.pop()
    prev = seq[-1] if seq else prompt[-1]
    pos = min(len(prompt) - 1 + len(seq), model.num_positions - 1)
    for tok, pr in enumerate(probs[pos, prev]):
      if pr == 0:
        continue
      new = seq + (tok,)
      if tok == eos_id or len(new) == max_new_tokens:
        law[new] = law.get(new, 0.0) + mass * pr
      else:
        stack.append((new, mass * pr))
  return law


def enumerate_model_law(model, params, prompt: list[int], *, max_new_tokens: int,
                        warp) -> dict[tuple[int, ...], float]:
  """Exact probability of every sequence of max_new_tokens tokens (no EOS) a model of the model
  contract decodes after `prompt`, from its own prefill logits (one pass per prefix: for a
  vocabulary of a few ids and a few tokens)."""
  law, stack = {}, [((), 1.0)]
  while stack:
    seq, mass = stack.pop()
    tokens = list(prompt) + list(seq)
    row = Prompt.from_lists([tokens])
    logits, _, _ = model.prefill(params, row, model.init_cache(1, row.tokens.shape[1]))
    probs = np.exp(np.asarray(warp.log_probs(logits[0]), np.float64))
    probs /= probs.sum()
    for tok, pr in enumerate(probs):
      new = seq + (tok,)
      if len(new) == max_new_tokens:
        law[new] = law.get(new, 0.0) + mass * pr
      else:
        stack.append((new, mass * pr))
  return law


def draft_table(rng: jax.Array, target_table: jax.Array, kind: str) -> jax.Array:
  """A draft logit table for a target table: "good" (close), "poor" (mostly unrelated)."""
  noise = jax.random.normal(rng, target_table.shape)
  if kind == "good":
    return target_table + 0.4 * noise
  if kind == "poor":
    return 0.3 * target_table + 2.0 * noise
  raise ValueError(f"unknown draft kind {kind!r}: use 'good' or 'poor' (disjoint: disjoint_tables)")


def disjoint_tables(rng: jax.Array, vocab: int, positions: int) -> tuple[jax.Array, jax.Array]:
  """(target, draft) tables whose supports are disjoint at every (position, token) context."""
  k1, k2, k3 = jax.random.split(rng, 3)
  shape = (positions, vocab, vocab)
  order = jnp.argsort(jax.random.uniform(k1, shape), axis=-1)
  in_target = order < vocab // 2                                         # half the ids each
  target = jnp.where(in_target, 2.0 * jax.random.normal(k2, shape), -jnp.inf)
  draft = jnp.where(in_target, -jnp.inf, 2.0 * jax.random.normal(k3, shape))
  return target, draft


def constant_table(logits, vocab: int, positions: int = 1) -> jax.Array:
  """A table whose next-token logits ignore the context: context-independent p or q."""
  logits = jnp.asarray(logits, jnp.float32)
  return jnp.broadcast_to(logits, (positions, vocab, vocab))


def sequence_counts(tokens, lengths) -> dict[tuple[int, ...], int]:
  """Histogram of whole generated sequences from a Generation's tokens/lengths."""
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  counts: dict[tuple[int, ...], int] = {}
  for n in np.unique(lengths):
    rows = tokens[lengths == n, :n]
    uniq, cnt = np.unique(rows, axis=0, return_counts=True)
    for seq, c in zip(uniq, cnt):
      key = tuple(int(t) for t in seq)
      counts[key] = counts.get(key, 0) + int(c)
  return counts


def chi_square_pvalue(law: dict, counts: dict, min_expected: float = 5.0) -> float:
  """Goodness of fit of observed whole-sequence counts to an enumerated law (small cells pooled).

  A sequence outside the law's support gives p = 0.
  """
  from scipy import stats  # test-only dependency
  if any(seq not in law for seq in counts):
    return 0.0
  total = sum(counts.values())
  expected = np.array([law[s] * total for s in law])
  observed = np.array([counts.get(s, 0) for s in law], np.float64)
  big = expected >= min_expected
  exp_cells = list(expected[big]) + ([expected[~big].sum()] if (~big).any() else [])
  obs_cells = list(observed[big]) + ([observed[~big].sum()] if (~big).any() else [])
  exp_cells, obs_cells = np.array(exp_cells), np.array(obs_cells)
  exp_cells *= obs_cells.sum() / exp_cells.sum()
  return float(stats.chisquare(obs_cells, exp_cells).pvalue)


def tiny_decoder(seed: int = 0, vocab_size: int = 48, d_model: int = 32, num_layers: int = 2,
                 num_heads: int = 4, d_ff: int = 64, n_positions: int = 128, eos_id: int = 1):
  """(model, params) of a random GPT-2-style decoder small enough for CPU tests."""
  from specjax.models.decoder import Decoder, DecoderConfig
  cfg = DecoderConfig(vocab_size=vocab_size, n_positions=n_positions, d_model=d_model,
                      num_layers=num_layers, num_heads=num_heads, d_ff=d_ff, bos_token_id=eos_id,
                      eos_token_id=eos_id, pad_token_id=0)
  model = Decoder(cfg)
  return model, _spread(model.init_params(jax.random.PRNGKey(seed)))


def tiny_t5(seed: int = 0, vocab_size: int = 48, d_model: int = 32, num_layers: int = 2,
            num_heads: int = 4, d_ff: int = 64, **overrides):
  """(model, params) of a random T5 small enough for CPU tests."""
  from specjax.models.t5 import T5, T5Config
  names = {f.name for f in dataclasses.fields(T5Config)}
  wanted = dict(vocab_size=vocab_size, d_model=d_model, num_layers=num_layers,
                num_decoder_layers=num_layers, num_heads=num_heads, d_ff=d_ff,
                d_kv=d_model // num_heads,
                **overrides)
  model = T5(T5Config(**{k: v for k, v in wanted.items() if k in names}))
  return model, _spread(model.init_params(jax.random.PRNGKey(seed)))


def _spread(params, factor: float = 4.0):
  """Scale the embedding / output tables so random logits are well separated (no argmax ties);
  an int8 head's integers stay, its scale is scaled."""
  def scale(path, x):
    name = "/".join(str(getattr(p, "key", p)) for p in path)
    table = ("embedding" in name or "lm_head" in name) and not jnp.issubdtype(x.dtype, jnp.integer)
    return x * factor if table else x
  return jax.tree_util.tree_map_with_path(scale, params)


__all__ = ["ToyAR", "enumerate_law", "draft_table", "disjoint_tables", "constant_table",
           "sequence_counts", "chi_square_pvalue", "tiny_decoder", "tiny_t5"]


def check_extend_variants(model, params, tokens, cache, select) -> None:
  """The model contract's extend variants agree with a plain extend over tokens [B,T]:
  `select` [B] gives position select[b]'s logits and hidden, and extend_entries returns the
  entries extend writes (at lengths[b] .. lengths[b]+T-1; entries are [L,B,T,H,Dh], the cache
  [L,B,H,S,Dh])."""
  logits, hidden, written = model.extend(params, tokens, cache)
  rows = np.arange(tokens.shape[0])
  one_logits, one_hidden, one_cache = model.extend(params, tokens, cache, select)
  np.testing.assert_allclose(one_logits[:, 0], np.asarray(logits)[rows, select], atol=1e-5)
  np.testing.assert_allclose(one_hidden[:, 0], np.asarray(hidden)[rows, select], atol=1e-5)
  np.testing.assert_array_equal(one_cache.k, written.k)
  _, _, (k, v) = model.extend_entries(params, tokens, cache)
  for b, start in enumerate(np.asarray(cache.lengths)):
    span = slice(start, start + tokens.shape[1])
    np.testing.assert_array_equal(np.swapaxes(k[:, b], 1, 2), written.k[:, b, :, span])
    np.testing.assert_array_equal(np.swapaxes(v[:, b], 1, 2), written.v[:, b, :, span])


@dataclasses.dataclass(frozen=True)
class ResampleFromP(exact.Exact):
  """A broken exact rule, for the law tests' power: after a rejection it resamples from p
  instead of norm(max(0, p - q)), so the rejected proposal can be drawn again."""

  def verify(self, draft_tokens, draft_len, q_logp, p_logp, keys, rule_state):
    n, nxt = base.rejection_verify(draft_tokens, draft_len, q_logp, p_logp, keys,
                                   lambda log_p: log_p, residual=False)
    return n, nxt, rule_state


def assert_greedy_sd_is_greedy(target, target_params, draft, draft_params, *, gamma: int = 3,
                               max_new_tokens: int = 12) -> None:
  """Greedy speculative decoding of two prompts ([1, 2, 3] and [4]) equals the target's own
  greedy decoding, token for token (AssertionError otherwise)."""
  from specjax.decoding import autoregressive, speculative
  from specjax.sampling import Warp
  prompt, key, greedy = Prompt.from_lists([[1, 2, 3], [4]]), jax.random.PRNGKey(0), Warp(0.0)
  alone = autoregressive.generate(target, target_params, prompt, key,
                                  max_new_tokens=max_new_tokens, warp=greedy, eos_id=None)
  sd = speculative.generate(target, target_params, draft, draft_params, prompt, key,
                            rule="greedy", gamma=gamma, max_new_tokens=max_new_tokens,
                            warp=greedy, eos_id=None)
  np.testing.assert_array_equal(sd.tokens, alone.tokens)


def with_devices(devices: int) -> str:
  """XLA_FLAGS for a child process on `devices` simulated CPU devices: this process's flags (the
  test suite's compile settings among them) plus the device count."""
  import os
  return " ".join(filter(None, (os.environ.get("XLA_FLAGS", ""),
                                f"--xla_force_host_platform_device_count={devices}")))


def assert_prints_on_devices(code: str, expected: str, devices: int = 8, timeout: int = 300):
  """Runs the Python `code` in a fresh process on `devices` simulated CPU devices and asserts
  that it exits 0 and prints `expected` (AssertionError with its stderr's tail otherwise)."""
  import os
  import subprocess
  import sys
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": with_devices(devices)}
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=timeout)
  assert proc.returncode == 0 and expected in proc.stdout, proc.stderr[-3000:]
