"""Where each distillation batch comes from: Algorithm A.2 of DistillSpec (distillspec.md §3.2).

Per step, drawn once per batch (so every batch is homogeneous):
  u1 < lambda1            -> the fixed dataset batch (inputs and ground-truth outputs)
  else u2 < lambda2       -> dataset inputs, outputs sampled by the student (current params)
  else                    -> dataset inputs, outputs sampled by the teacher
The draw depends only on (seed, step), so a resumed run and every host of a pod pick the same
source. Generated outputs come from `specjax.decoding.autoregressive.generate`, the jitted sampler
used by decoding, at `temperature` (default 1, "paramount" per §C.1.3). Sampled tokens are
constants for the loss: gradients never flow through the sampling (no REINFORCE term).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.data.batch import Batch

FIXED, STUDENT, TEACHER = "fixed", "student", "teacher"
SOURCES = (FIXED, STUDENT, TEACHER)


@dataclasses.dataclass(frozen=True)
class Mixture:
  """Alg. A.2's data mixture: lambda1 = fixed-data fraction, lambda2 = student share of the rest."""
  lambda1: float = 0.0
  lambda2: float = 1.0
  temperature: float = 1.0
  seed: int = 0

  def __post_init__(self):
    for name in ("lambda1", "lambda2"):
      value = getattr(self, name)
      if not 0.0 <= value <= 1.0:
        raise ValueError(f"mixture {name} must lie in [0, 1], got {value}")
    if not 0 <= self.temperature < float("inf"):
      raise ValueError(f"sampling temperature must be a finite number >= 0, got "
                       f"{self.temperature}")

  def source(self, step: int) -> str:
    """FIXED / STUDENT / TEACHER for this step; deterministic in (seed, step)."""
    u1, u2 = np.random.default_rng([self.seed, 0x5EED, int(step)]).random(2)
    if u1 < self.lambda1:
      return FIXED
    return STUDENT if u2 < self.lambda2 else TEACHER

  @property
  def needs_generation(self) -> bool:
    return self.lambda1 < 1.0


@dataclasses.dataclass(frozen=True)
class Recipe:
  """A Table-1 method: the loss and the data mixture."""
  loss: str
  lambda1: float
  lambda2: float


RECIPES = {
    "seqkd": Recipe("seqkd", 0.0, 0.0),     # NLL of online teacher samples (black-box)
    "supkd": Recipe("fkl", 1.0, 0.0),       # white-box FKL on the fixed dataset
    "imitkd": Recipe("fkl", 0.5, 1.0),      # lambda1 unstated in the paper: 0.5
    "f_distill": Recipe("tvd", 0.0, 0.5),   # student and teacher samples in equal parts
    "gkd": Recipe("fkl", 0.0, 1.0),         # on-policy, ground truth excluded
}


def recipe(name: str) -> Recipe:
  key = name.lower().replace("-", "_")
  if key not in RECIPES:
    raise ValueError(f"unknown DistillSpec recipe '{name}'; known: SeqKD, SupKD, ImitKD, "
                     f"f-Distill, GKD (or set distill.loss / lambda1 / lambda2 directly)")
  return RECIPES[key]


def fit_width(tokens: jax.Array, lengths: jax.Array, width: int, pad_id: int = 0):
  """Sampled tokens [B, N] -> (targets [B, width], mask [B, width]); pads or truncates."""
  n = tokens.shape[1]
  if n < width:
    tokens = jnp.pad(tokens, ((0, 0), (0, width - n)), constant_values=pad_id)
  tokens = tokens[:, :width]
  mask = jnp.arange(width)[None, :] < jnp.minimum(lengths, width)[:, None]
  return jnp.where(mask, tokens, pad_id).astype(jnp.int32), mask


@dataclasses.dataclass(frozen=True)
class Sampler:
  """Replaces a batch's outputs with samples of the student or the teacher."""
  student: object
  teacher: object | None
  eos_id: int
  temperature: float = 1.0
  pad_id: int = 0

  def __call__(self, source: str, batch: Batch, student_params, teacher_params, key) -> Batch:
    from specjax.decoding import autoregressive
    from specjax.sampling import Warp
    if source == FIXED:
      return batch
    if source == TEACHER and self.teacher is None:
      raise ValueError("teacher-sampled data needs a teacher model (set lambda2=1 or lambda1=1)")
    model, params = ((self.student, student_params) if source == STUDENT
                     else (self.teacher, teacher_params))
    width = batch.targets.shape[1]
    # No host read of the finite flags: a non-finite student makes a non-finite loss, which the
    # trainer checks on the device before each save (distill/step.py); a non-finite teacher
    # does too, through the distillation target.
    gen = autoregressive.generate(model, params, batch.prompt, key, max_new_tokens=width,
                                  warp=Warp(temperature=self.temperature), eos_id=self.eos_id,
                                  check_finite=False)
    targets, mask = fit_width(gen.tokens, gen.lengths, width, self.pad_id)
    sharding = getattr(batch.targets, "sharding", None)
    if sharding is not None:
      targets, mask = jax.device_put((targets, mask), sharding)
    return batch.replace(targets=targets, mask=mask)


def mixed_batch(mixture: Mixture, sampler: Sampler | None, step: int, batch: Batch,
                student_params, teacher_params, key) -> tuple[Batch, str]:
  """The step's training batch and its source (Alg. A.2); `batch` is the dataset batch."""
  source = mixture.source(step)
  if source != FIXED and sampler is None:
    raise ValueError(f"step {step} needs {source}-sampled data but no sampler was configured")
  if source == FIXED:
    return batch, source
  return sampler(source, batch, student_params, teacher_params, key), source


SPLIT_STREAMS = {"train": 0, "validation": 1, "test": 2}


@dataclasses.dataclass(frozen=True)
class MarkovSource:
  """A seeded order-1 Markov language: a stand-in dataset for tests, the tiny configs and
  throughput runs, with real entropy (temperature-1 samples and TVD are non-trivial).

  Every token has `successors` candidate next tokens, drawn once from a seeded generator (a [V, k]
  table: O(V k) time and memory, 8 MB for V = 32128, k = 64), taken with Zipf weights over their k
  ranks. A batch then costs O(batch * length) table lookups whatever the vocabulary size.
  `.batch(step, split)` is deterministic in (seed, split, step); the splits are disjoint random
  streams of the same language. Token 0 is padding, 1 is EOS (never emitted by the chain).
  """
  vocab_size: int
  batch_size: int
  prompt_len: int = 8
  target_len: int = 16
  seed: int = 0
  zipf: float = 1.2
  successors: int = 64

  def __post_init__(self):
    if self.vocab_size < 3:
      raise ValueError(f"a Markov source needs vocab_size >= 3 (pad, EOS, a token), got "
                       f"{self.vocab_size}")
    if min(self.batch_size, self.prompt_len, self.target_len, self.successors) < 1:
      raise ValueError(f"batch_size, prompt_len, target_len and successors must be >= 1: {self}")

  @functools.cached_property
  def successor_table(self) -> np.ndarray:
    """[V, k] int32: row v lists the candidate next tokens of v (ids >= 2), most likely first.
    Drawn with replacement: a repeated candidate only merges two ranks' weights."""
    rng = np.random.default_rng([self.seed, 0x4D4B])
    k = min(self.successors, self.vocab_size - 2)
    return rng.integers(2, self.vocab_size, (self.vocab_size, k), dtype=np.int32)

  @functools.cached_property
  def rank_cdf(self) -> np.ndarray:
    """[k] cumulative Zipf probabilities of the ranks (the last is exactly 1)."""
    k = self.successor_table.shape[1]
    weights = 1.0 / np.arange(1, k + 1) ** self.zipf
    cdf = np.cumsum(weights / weights.sum())
    cdf[-1] = 1.0
    return cdf

  def sequences(self, step: int, split: str = "train") -> np.ndarray:
    """[batch_size, prompt_len + target_len] int32 token ids of the batch at `step`."""
    if split not in SPLIT_STREAMS:
      raise ValueError(f"unknown split {split!r}: use one of {tuple(SPLIT_STREAMS)}")
    rng = np.random.default_rng([self.seed, SPLIT_STREAMS[split], int(step)])
    total = self.prompt_len + self.target_len
    seq = np.zeros((self.batch_size, total), np.int32)
    seq[:, 0] = rng.integers(2, self.vocab_size, self.batch_size)
    ranks = np.searchsorted(self.rank_cdf, rng.random((self.batch_size, total - 1)), side="right")
    table = self.successor_table
    for t in range(1, total):
      seq[:, t] = table[seq[:, t - 1], ranks[:, t - 1]]
    return seq

  def batch(self, step: int, split: str = "train") -> Batch:
    from specjax.models import Prompt
    seq = self.sequences(step, split)
    prompt = Prompt(tokens=jnp.asarray(seq[:, :self.prompt_len]),
                    lengths=jnp.full((self.batch_size,), self.prompt_len, jnp.int32))
    return Batch(prompt=prompt, targets=jnp.asarray(seq[:, self.prompt_len:]),
                 mask=jnp.ones((self.batch_size, self.target_len), bool))
