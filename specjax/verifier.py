"""SPRINTER's learned verifier (sprinter.md §1-§2): the model, its training data and its training.

The verifier reads one draft hidden state and outputs s = sigmoid(f(h)) = P(the draft token is
acceptable), where x is acceptable iff q(x)/p(x) <= lambda. The sequential loop
(`specjax.decoding.sequential`) accepts a draft token without calling the target iff s >= tau.

Feature readings (§1): "A" (default) reads the draft's final hidden state at the last committed
token, h_{t-1}: it comes from the forward pass that produced q_t, and does not depend on the
candidate x. "B" reads h_t, the hidden state after feeding x to the draft.

Data (§2): each text prefix c is extended by a continuation of `cont_len` tokens taken from one of
four sources, one per prefix group: text, draft samples, target samples, or a per-token mix. Every
position i = 0..cont_len of every continuation is one example: prefix c + cont[:i], a candidate
x ~ q(.|prefix), the feature, and the label 1[log q(x) - log p(x) <= log lambda]. The held-out
splits are by sequence, so test prefixes are never seen in training.

Checkpoint layout of a workdir: `params` (Orbax, `specjax.checkpoint.save_params`), `verifier.json`
(the model description and the decoding defaults), `metrics.json` (what training reported).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax import checkpoint as ckpt_lib
from specjax import sampling
from specjax.decoding import autoregressive as ar
from specjax.models import Prompt

FEATURES = ("A", "B")
GROUPS = ("text", "draft", "target", "mixed")


class _Head(nn.Module):
  """Linear(d -> 1) (about d+1 parameters, the paper's size) or a one-hidden-layer MLP."""
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


# -------------------------------------------------------------------------------- training data

@dataclasses.dataclass(frozen=True)
class DataConfig:
  lam: float = 1.2            # x is acceptable iff q(x)/p(x) <= lam
  cont_len: int = 20          # continuations of 0..cont_len tokens
  mix_prob: float = 0.5       # group "mixed": P(a continuation token comes from the target)
  features: str = "A"


@dataclasses.dataclass(frozen=True)
class _Rollout:
  """Static description of one jitted data-generation call."""
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
  need = max(ar.prefix_len(target, prompt), ar.prefix_len(draft, prompt)) + data.cont_len + 1
  setup = _Rollout(target=target, draft=draft, warp=warp, data=data, max_len=need)
  return _rollout(setup, target_params, draft_params, prompt, text, group, key)


@functools.partial(jax.jit, static_argnums=0)
def _rollout(setup: _Rollout, tparams, dparams, prompt, text, group, key):
  target, draft, warp, data = setup.target, setup.draft, setup.warp, setup.data
  batch = prompt.tokens.shape[0]
  tcache = target.init_cache(batch, setup.max_len, ar.enc_len(target, prompt))
  dcache = draft.init_cache(batch, setup.max_len, ar.enc_len(draft, prompt))
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


def build_dataset(target, target_params, draft, draft_params, batches, key, *, warp, data,
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
    seq_ids = np.broadcast_to((seq0 + np.arange(rows))[:, None], valid.shape)
    pos = np.broadcast_to(np.arange(valid.shape[1])[None, :], valid.shape)
    parts.append(dict(features=out["features"][valid], log_q=out["log_q"][valid],
                      log_p=out["log_p"][valid], x=out["x"][valid],
                      group=np.broadcast_to(group[:, None], valid.shape)[valid],
                      seq=seq_ids[valid], pos=pos[valid]))
    seqs.append((np.asarray(batch.prompt.tokens), np.asarray(batch.prompt.lengths), out["cont"]))
    seq0 += rows
  ds = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
  ds["log_ratio"] = ds.pop("log_q").astype(np.float64) - ds.pop("log_p")
  ds["labels"] = ds["log_ratio"] <= math.log(data.lam)
  ds["sequences"], ds["prompt_len"] = _stack_sequences(seqs)
  return ds


def _fit(a: np.ndarray, width: int) -> np.ndarray:
  """Cut or zero-pad the columns of a [B, L] array to `width`."""
  if a.shape[1] >= width:
    return a[:, :width]
  return np.pad(a, ((0, 0), (0, width - a.shape[1])))


def _stack_sequences(seqs) -> tuple[np.ndarray, np.ndarray]:
  width = max(p.shape[1] for p, _, _ in seqs)
  rows, lens = [], []
  for prompt, lengths, cont in seqs:
    for b in range(len(lengths)):
      rows.append(np.concatenate([prompt[b, :lengths[b]], cont[b],
                                  np.zeros(width - lengths[b], np.int32)]))
      lens.append(lengths[b])
  return np.stack(rows).astype(np.int32), np.asarray(lens, np.int32)


# -------------------------------------------------------------------------------- training

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


def split_by_sequence(seq: np.ndarray, cfg: TrainConfig) -> tuple[np.ndarray, ...]:
  """(train, val, test) example indices; whole sequences go to one split."""
  ids = np.unique(seq)
  perm = np.random.default_rng(cfg.seed).permutation(ids)
  n_test = max(1, int(round(cfg.test_fraction * len(ids))))
  n_val = max(1, int(round(cfg.val_fraction * len(ids))))
  if len(ids) < n_test + n_val + 1:
    raise ValueError(f"only {len(ids)} sequences: need at least {n_test + n_val + 1} for the "
                     f"train/val/test split; generate more (verifier.num_sequences)")
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
  """BCE + Adam with early stopping on the validation split. Returns (best params, metrics)."""
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
  for g, name in enumerate(GROUPS):
    m = ds["group"] == g
    out[f"positive_rate_{name}"] = float(y[m].mean()) if m.any() else float("nan")
  return out


# -------------------------------------------------------------------------------- save / load

def save(workdir, verifier: Verifier, params, meta: dict | None = None) -> None:
  """WORKDIR/params (Orbax) + WORKDIR/verifier.json (model + decoding defaults)."""
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  ckpt_lib.save_params(workdir, params)
  ckpt_lib.write_json(workdir / "verifier.json", {"verifier": verifier.to_json(), **(meta or {})})


@functools.lru_cache(maxsize=8)
def load(workdir: str) -> tuple[Verifier, Any, dict]:
  """(Verifier, params, meta) saved by `save` / `python -m train.verifier`."""
  path = Path(workdir) / "verifier.json"
  if not path.exists():
    raise FileNotFoundError(f"{path} not found: train a verifier first with `python -m "
                            f"train.verifier --config CONFIG --workdir {workdir}`")
  meta = json.loads(path.read_text())
  verifier = Verifier(**meta.pop("verifier"))
  like = verifier.init_params(jax.random.PRNGKey(0))
  return verifier, ckpt_lib.load_params(workdir, like), meta


# -------------------------------------------------------------------------------- config -> run

def data_config(section) -> DataConfig:
  return DataConfig(lam=float(section.lam), cont_len=int(section.cont_len),
                    mix_prob=float(section.mix_prob), features=str(section.features))


def train_config(section) -> TrainConfig:
  names = {f.name for f in dataclasses.fields(TrainConfig)}
  return TrainConfig(**{k: type(getattr(TrainConfig, k))(v) for k, v in section.items()
                        if k in names})


def text_batches(config, rows: int, count: int):
  """`count` batches of `rows` text prefixes: the config's task via specjax.data (the runner's
  eval_source style), or the seeded Markov language when data.source == 'markov'."""
  d, cont_len = config.data, int(config.verifier.cont_len)
  if d.get("source") == "markov":
    from specjax.distill import data as distill_data
    src = distill_data.MarkovSource(int(d.vocab_size), rows, int(d.prompt_len), cont_len,
                                    int(d.get("seed", 0)))
    return [src.batch(i) for i in range(count)]
  from specjax.data.source import SourceConfig, make_source
  fields = {k: int(d[k]) for k in ("lm_prompt_len", "max_prompt_len") if k in d}
  src = make_source(d.task, d.tokenizer,
                    SourceConfig(batch_size=rows, max_target_len=cont_len, **fields))
  return [src.batch(i, "train") for i in range(count)]


def run_from_config(config, workdir: str) -> dict:
  """What `python -m train.verifier` calls: models + text prefixes -> examples -> trained verifier,
  saved in workdir with verifier.json and metrics.json. Returns the metrics."""
  from specjax.distill import trainer
  v = config.verifier
  seed = int(v.get("seed", 0))
  target, tparams = trainer.build_model(config.target, "target", seed)
  draft, dparams = trainer.build_model(config.draft, "draft", seed + 1)
  d = config.decode
  warp = sampling.Warp(float(d.temperature), int(d.top_k), float(d.top_p))
  rows = int(v.batch_rows)
  batches = text_batches(config, rows, math.ceil(int(v.num_sequences) / rows))
  eos = int(config.data.get("eos_id", getattr(getattr(target, "config", None), "eos_token_id", 1)))
  ds = build_dataset(target, tparams, draft, dparams, batches, jax.random.PRNGKey(seed),
                     warp=warp, data=data_config(v), eos=eos)
  verifier = Verifier(hidden_size=int(draft.hidden_size), mlp_width=int(v.mlp_width),
                      features=str(v.features))
  params, metrics = train(verifier, ds, train_config(v))
  metrics.update(lam=float(v.lam), features=verifier.features, mlp_width=verifier.mlp_width,
                 parameters=int(sum(x.size for x in jax.tree_util.tree_leaves(params))))
  save(workdir, verifier, params, {"threshold": float(v.threshold),
                                   "gamma_max": int(v.gamma_max), "lam": float(v.lam)})
  ckpt_lib.write_json(Path(workdir) / "metrics.json", metrics)
  return metrics
