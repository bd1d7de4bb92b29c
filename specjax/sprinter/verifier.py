"""SPRINTER's verifier model (docs/papers/sprinter.md §1) and the workdir that stores a trained one.

The verifier reads one draft hidden state h and outputs s = sigmoid(f(h)) = P(the draft token is
acceptable), where x is acceptable iff q(x)/p(x) <= lambda. The loop (`specjax.sprinter.loop`)
accepts a draft token without calling the target iff s >= tau.

Feature readings: "A" (default) reads the draft's final hidden state at the last committed token,
h_{t-1}: it comes from the forward pass that produced q_t, so the decision does not depend on the
candidate x. "B" reads h_t, the hidden state after feeding x to the draft.

A verifier workdir holds `params` (Orbax, `specjax.checkpoint.save_params`), `verifier.json` (the
model description and the decoding defaults, e.g. threshold and gamma_max) and `metrics.json`
(what training reported).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from specjax import checkpoint as ckpt_lib

FEATURES = ("A", "B")
# Used when a verifier.json predates the decoding defaults (or lacks one of them).
DEFAULT_THRESHOLD = 0.5
DEFAULT_GAMMA_MAX = 8


class VerifierNotFoundError(FileNotFoundError):
  """The workdir holds no trained verifier (its verifier.json is missing)."""

  def __init__(self, workdir, path):
    self.workdir, self.path = Path(workdir), Path(path)
    super().__init__(f"no verifier in {self.workdir}: {self.path} not found")


class VerifierFileError(ValueError):
  """A workdir's verifier.json that cannot be read as a verifier; carries its `path`."""

  def __init__(self, path, reason: str):
    self.path, self.reason = Path(path), reason
    super().__init__(f"the verifier file {self.path} is damaged ({reason})")


class _Head(nn.Module):
  """Linear(d -> 1) (d+1 parameters, the paper's size) or a one-hidden-layer MLP."""
  mlp_width: int

  @nn.compact
  def __call__(self, h):                                                 # [..., D]
    x = h.astype(jnp.float32)
    if self.mlp_width:
      x = nn.gelu(nn.Dense(self.mlp_width, name="hidden")(x))
    return nn.Dense(1, name="out")(x)[..., 0]                          # [...]


@dataclasses.dataclass(frozen=True)
class Verifier:
  """A frozen, hashable verifier description (a static argument of jit); params are separate.

  score(params, hidden[B, D], keys[B]) -> s[B] in [0, 1]; the loop accepts iff s >= threshold.
  The keys are unused here; they let test verifiers (oracles, class-rate verifiers) be random.
  """
  hidden_size: int
  mlp_width: int = 0
  features: str = "A"

  def __post_init__(self):
    if self.features not in FEATURES:
      raise ValueError(f"verifier features must be 'A' (h_(t-1), default) or 'B' (h_t after "
                       f"feeding the candidate), got {self.features!r}")
    if self.hidden_size < 1 or self.mlp_width < 0:
      raise ValueError(f"bad verifier sizes: hidden_size {self.hidden_size} must be >= 1 and "
                       f"mlp_width {self.mlp_width} >= 0 (0 = linear)")

  @property
  def module(self) -> _Head:
    return _Head(self.mlp_width)

  def init_params(self, rng: jax.Array) -> dict:
    return self.module.init(rng, jnp.zeros((1, self.hidden_size), jnp.float32))["params"]

  def logits(self, params, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] -> pre-sigmoid scores [...] (f32)."""
    return self.module.apply({"params": params}, hidden)

  def score(self, params, hidden: jax.Array, keys: jax.Array | None = None) -> jax.Array:
    del keys
    return jax.nn.sigmoid(self.logits(params, hidden))

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def save(workdir, verifier: Verifier, params, meta: dict | None = None) -> None:
  """WORKDIR/params (Orbax) + WORKDIR/verifier.json (the model + `meta`, the decoding defaults)."""
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  ckpt_lib.save_params(workdir, params)
  ckpt_lib.write_json(workdir / "verifier.json", {"verifier": verifier.to_json(), **(meta or {})})


def load(workdir) -> tuple[Verifier, Any, dict]:
  """(Verifier, params, meta) saved by `save`; VerifierNotFoundError if there is none.

  Not cached: a caller that decodes many batches loads once and keeps the result.
  """
  path = Path(workdir) / "verifier.json"
  if not path.exists():
    raise VerifierNotFoundError(workdir, path)
  meta, verifier = read_meta(path)
  like = verifier.init_params(jax.random.PRNGKey(0))
  return verifier, ckpt_lib.load_params(workdir, like), meta


def read_meta(path: Path) -> tuple[dict, Verifier]:
  """(meta without its 'verifier' entry, Verifier) of a verifier.json; VerifierFileError naming
  the file if it is not JSON, not an object, or holds no valid verifier description."""
  try:
    meta = json.loads(path.read_text(encoding="utf-8"))
  except (ValueError, UnicodeDecodeError) as err:      # JSONDecodeError is a ValueError
    raise VerifierFileError(path, f"not JSON: {err}") from None
  if not isinstance(meta, dict) or not isinstance(meta.get("verifier"), dict):
    raise VerifierFileError(path, "no 'verifier' object in it")
  try:
    return meta, Verifier(**meta.pop("verifier"))
  except (TypeError, ValueError) as err:
    raise VerifierFileError(path, f"bad 'verifier' entry: {err}") from None


def decode_settings(meta: dict, threshold: float = -1.0, gamma_max: int = -1) -> tuple[float, int]:
  """(threshold, gamma_max) for the loop: the given values, or where negative the ones saved in
  `meta` (`load`'s third result), else DEFAULT_THRESHOLD / DEFAULT_GAMMA_MAX."""
  if threshold < 0:
    threshold = float(meta.get("threshold", DEFAULT_THRESHOLD))
  if gamma_max < 0:
    gamma_max = int(meta.get("gamma_max", DEFAULT_GAMMA_MAX))
  return float(threshold), int(gamma_max)
