"""Training SPRINTER's verifier (docs/papers/sprinter.md §2): BCE + Adam with early stopping, then metrics.

The examples of `specjax.sprinter.data` are split by sequence (train / validation / test), so a
held-out prefix is never seen in training. Training stops once the validation loss has not
improved for `patience` epochs and keeps the best params. The report gives the label balance
(overall and per prefix group) and, on the test split, the AUROC and the true/false-positive
rates at the decoding threshold tau: eta_TP = P(s >= tau | acceptable), eta_FP = P(s >= tau |
not acceptable), which set SPRINTER's speed (eta_TP) and its distance to the target (eta_FP).

`train_verifier` is the end-to-end entry: rollouts -> examples -> trained verifier, saved in a
verifier workdir (`specjax.sprinter.verifier.save`) with metrics.json beside it.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax import checkpoint as ckpt_lib
from specjax import sampling
from specjax.data.batch import Batch
from specjax.sprinter import data as data_lib
from specjax.sprinter.verifier import Verifier, save

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  learning_rate: float = 1e-3
  batch_size: int = 256
  max_epochs: int = 20
  patience: int = 3           # epochs without a better validation loss before stopping
  pos_weight: float = 0.0     # BCE weight of positives; 0: none, < 0: auto (negatives/positives)
  val_fraction: float = 0.1   # early stopping split (by sequence)
  test_fraction: float = 0.1  # reported split (by sequence)
  threshold: float = 0.5      # tau, for the reported true/false-positive rates
  seed: int = 0

  def __post_init__(self):
    for name in ("batch_size", "max_epochs", "patience"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if not self.learning_rate > 0:
      raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
    if not 0.0 <= self.threshold <= 1.0:
      raise ValueError(f"threshold is a probability (the verifier's score): it must lie in "
                       f"[0, 1], got {self.threshold}")
    for name in ("val_fraction", "test_fraction"):
      if not 0.0 < getattr(self, name) < 1.0:
        raise ValueError(f"{name} must lie in (0, 1), got {getattr(self, name)}")
    if self.val_fraction + self.test_fraction >= 1.0:
      raise ValueError(f"val_fraction + test_fraction must leave examples to train on: "
                       f"{self.val_fraction} + {self.test_fraction} >= 1")


class TooFewSequencesError(ValueError):
  """The dataset has fewer sequences than the train/val/test split needs (generate more)."""

  def __init__(self, sequences: int, needed: int):
    self.sequences, self.needed = sequences, needed
    super().__init__(f"only {sequences} sequences: the train/val/test split needs at least "
                     f"{needed}")


def split_by_sequence(seq: np.ndarray, cfg: TrainConfig) -> tuple[np.ndarray, ...]:
  """(train, val, test) example indices; whole sequences go to one split."""
  ids = np.unique(seq)
  perm = np.random.default_rng(cfg.seed).permutation(ids)
  n_test = max(1, int(round(cfg.test_fraction * len(ids))))
  n_val = max(1, int(round(cfg.val_fraction * len(ids))))
  if len(ids) < n_test + n_val + 1:
    raise TooFewSequencesError(len(ids), n_test + n_val + 1)
  test, val = set(perm[:n_test]), set(perm[n_test:n_test + n_val])
  where = lambda s: np.flatnonzero(np.isin(seq, list(s)))
  return where(set(perm) - test - val), where(val), where(test)


def bce(logits: jax.Array, labels: jax.Array, pos_weight: jax.Array | float = 1.0) -> jax.Array:
  """Mean binary cross-entropy from logits; positives weighted by pos_weight."""
  y = labels.astype(jnp.float32)
  per = -(pos_weight * y * jax.nn.log_sigmoid(logits) + (1 - y) * jax.nn.log_sigmoid(-logits))
  return jnp.mean(per)


def auroc(scores: np.ndarray, labels: np.ndarray) -> float:
  """Area under the ROC curve (Mann-Whitney, ties count 1/2); nan with a single class."""
  scores, labels = np.asarray(scores, np.float64), np.asarray(labels, bool)
  n_pos, n_neg = int(labels.sum()), int((~labels).sum())
  if not n_pos or not n_neg:
    return float("nan")
  uniq, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
  avg_rank = np.cumsum(counts) - (counts - 1) / 2.0                      # 1-based average ranks
  ranks = avg_rank[inverse]
  return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def rates(scores: np.ndarray, labels: np.ndarray, threshold: float) -> dict[str, float]:
  """eta_TP = P(s >= tau | acceptable), eta_FP = P(s >= tau | not acceptable)."""
  accept, labels = np.asarray(scores) >= threshold, np.asarray(labels, bool)
  mean = lambda m: float(accept[m].mean()) if m.any() else float("nan")
  return {"tpr": mean(labels), "fpr": mean(~labels), "accept_rate": float(accept.mean())}


def train(verifier: Verifier, ds: dict, cfg: TrainConfig) -> tuple[dict, dict]:
  """BCE + Adam with early stopping on the validation split. Returns (best params, metrics).

  ds: `build_dataset`'s arrays; features [N, D], labels [N], seq [N] and group [N] are read.
  """
  x, y = ds["features"].astype(np.float32), ds["labels"].astype(bool)
  tr, va, te = split_by_sequence(ds["seq"], cfg)
  pos_rate = float(y[tr].mean())
  pw = cfg.pos_weight if cfg.pos_weight >= 0 else (1 - pos_rate) / max(pos_rate, 1e-6)
  pw = pw or 1.0
  opt = optax.adam(cfg.learning_rate)
  loss_fn = lambda p, xb, yb: bce(verifier.logits(p, xb), yb, pw)

  @jax.jit
  def update(params, opt_state, xb, yb):
    loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  evaluate = jax.jit(loss_fn)
  params = verifier.init_params(jax.random.PRNGKey(cfg.seed))
  opt_state, rng = opt.init(params), np.random.default_rng(cfg.seed)
  size = min(cfg.batch_size, len(tr))
  best, best_loss, stale, history = params, float("inf"), 0, []
  for epoch in range(cfg.max_epochs):
    order = tr[rng.permutation(len(tr))]
    for start in range(0, len(order) - size + 1, size):
      idx = order[start:start + size]
      params, opt_state, _ = update(params, opt_state, x[idx], y[idx])
    val_loss = float(evaluate(params, x[va], y[va]))
    history.append(val_loss)
    logger.debug("verifier epoch %d: val loss %.4f", epoch, val_loss)
    if val_loss < best_loss - 1e-6:
      best, best_loss, stale = params, val_loss, 0
    else:
      stale += 1
      if stale >= cfg.patience:
        break
  metrics = report(verifier, best, ds, (tr, va, te), cfg)
  metrics.update(epochs=len(history), val_loss_history=history, best_val_loss=best_loss,
                 pos_weight=float(pw))
  return best, metrics


def report(verifier: Verifier, params, ds: dict, splits, cfg: TrainConfig) -> dict:
  """Label balance (overall and per group), held-out AUROC and TPR/FPR at the threshold."""
  tr, va, te = splits
  y = ds["labels"].astype(bool)
  scores = np.asarray(verifier.score(params, jnp.asarray(ds["features"][te], jnp.float32)))
  out = {"examples": int(len(y)), "train": int(len(tr)), "val": int(len(va)), "test": int(len(te)),
         "positive_rate": float(y.mean()), "test_auroc": auroc(scores, y[te]),
         "threshold": cfg.threshold, "test_positive_rate": float(y[te].mean())}
  out.update({f"test_{k}": v for k, v in rates(scores, y[te], cfg.threshold).items()})
  for g, name in enumerate(data_lib.GROUPS):
    m = ds["group"] == g
    out[f"positive_rate_{name}"] = float(y[m].mean()) if m.any() else float("nan")
  return out


def train_verifier(target, target_params, draft, draft_params, batches: Iterable[Batch],
                   key: jax.Array, *, warp: sampling.Warp, data: data_lib.DataConfig,
                   training: TrainConfig, eos: int, mlp_width: int, workdir,
                   gamma_max: int, models: dict | None = None) -> dict:
  """Text prefixes -> examples -> a trained verifier on `draft`'s hidden states, saved in workdir
  (params, verifier.json with the decoding defaults, metrics.json). Returns the metrics.

  The decoding defaults saved are training.threshold (the tau the reported rates use), gamma_max
  and data.lam; the verifier reads data.features. models: what names the target and the draft
  it was trained on ({"target": ..., "draft": ...}), saved beside them for decoding to check.
  """
  ds = data_lib.build_dataset(target, target_params, draft, draft_params, batches, key,
                              warp=warp, data=data, eos=eos)
  logger.info("verifier data: %d examples from %d sequences", len(ds["labels"]),
              len(ds["prompt_len"]))
  verifier = Verifier(hidden_size=int(draft.hidden_size), mlp_width=int(mlp_width),
                      features=data.features)
  params, metrics = train(verifier, ds, training)
  metrics.update(lam=float(data.lam), features=verifier.features, mlp_width=verifier.mlp_width,
                 parameters=int(sum(x.size for x in jax.tree_util.tree_leaves(params))))
  save(workdir, verifier, params, {"threshold": float(training.threshold),
                                   "gamma_max": int(gamma_max), "lam": float(data.lam),
                                   **({"models": dict(models)} if models else {})})
  ckpt_lib.write_json(Path(workdir) / "metrics.json", metrics)
  logger.info("verifier saved in %s: test AUROC %.3f, TPR %.3f, FPR %.3f at tau %.2f", workdir,
              metrics["test_auroc"], metrics["test_tpr"], metrics["test_fpr"], training.threshold)
  return metrics
