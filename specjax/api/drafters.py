"""Drafters made from loaded models: early exit, the target's first layers with its final norm and
head (LayerSkip's self-speculation; transformers' `assistant_early_exit`), a draft whose head
scores only its K most frequent tokens (FR-Spec), and an EAGLE-style draft head trained on the
target's features (`draft_head`). Prompt lookup, the drafter without a model, is
drafting/ngram.NGram."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any, ClassVar

import jax
import numpy as np

from specjax import checkpoint
from specjax.api.errors import UsageError
from specjax.api.loading import LoadedModel
from specjax.data.token_counts import stdlib_counts
from specjax.drafting import HeadDrafter
from specjax.models import dense_layout
from specjax.models.draft_head import DraftHead, with_target
from specjax.models import layers as layers_lib
from specjax.models import quant as quant_lib
from specjax.models.prompting import eos_ids
from specjax.models.sub_vocab import SubVocab


def _loaded(model, name: str) -> LoadedModel:
  if not isinstance(model, LoadedModel):
    raise UsageError(f"{name}={type(model).__name__}: pass a loaded model, "
                     f"specjax.load(NAME_OR_PATH)")
  return model


def early_exit(target: LoadedModel, exit_layer: int, flag: str = "exit_layer") -> LoadedModel:
  """The target's first `exit_layer` layers (1 .. layers - 1) with its embedding, final norm and
  head, as a draft model with the target's tokenizer and its own cache. A model that was not
  trained to exit early (LayerSkip was) predicts poorly from a middle layer: expect a low
  acceptance rate. `flag` names the setting in errors."""
  model = _loaded(target, "target").model
  if model.is_encoder_decoder:
    raise UsageError(f"{flag}: early exit drafts with a decoder-only target's first layers; "
                     f"{type(model).__name__} is an encoder-decoder: give a draft checkpoint")
  layers = model.config.num_layers
  if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or \
      not 1 <= exit_layer <= layers - 1:
    raise UsageError(f"{flag}={exit_layer!r}: the target has {layers} layers: choose a whole "
                     f"number from 1 to {layers - 1}")
  draft = dataclasses.replace(model, config=dataclasses.replace(model.config,
                                                                num_layers=exit_layer))
  return LoadedModel(model=draft, params=layers_lib.first_layers(target.params, exit_layer),
                     tokenizer=target.tokenizer, path=target.path)


def sub_vocab(draft, k: int, counts=None, flag: str = "vocab_top_k", target=None):
  """`draft` with a head that scores only k token ids (FR-Spec): its stop ids and the most
  frequent others of `counts` ([V] array; None: the stdlib corpus under the draft's tokenizer,
  counted once and cached, data/token_counts.py). Every other id gets q = 0: exact SD stays
  lossless (the residual covers them) and acceptance is capped by the target's mass on the k ids.
  The params keep the embedding and gain a head kernel [D, k] (a separate [D, V] head kernel is
  replaced). A draft head (LoadedHead, which reads its target's LM head) needs `target`: it gets
  its own [D, k] cut of the target's head and counts under the target's tokenizer; a head is
  trained on the full vocabulary and cut at load. Returns the same kind as `draft`. `flag` names
  the setting in errors."""
  if isinstance(draft, LoadedHead):
    return _cut_draft_head(draft, k, counts, flag, target)
  model = _loaded(draft, "draft").model
  if model.is_encoder_decoder:
    raise UsageError(f"{flag}: a sub-vocabulary head is built for decoder-only drafts; "
                     f"{type(model).__name__} is an encoder-decoder")
  if model.config.head_subset is not None:
    raise UsageError(f"{flag}: this draft's head already scores {model.config.head_subset.size} "
                     f"ids; cut it from the full draft")
  subset = _most_frequent(draft.tokenizer, model.vocab_size, k, counts, flag, "draft")
  params = dict(draft.params)
  params["lm_head"] = _cut_head(params, subset, model.quant, model.config.tie_word_embeddings,
                                model.layout)
  config = dataclasses.replace(model.config, head_subset=subset)
  return dataclasses.replace(draft, model=dataclasses.replace(model, config=config),
                             params=params)


def _most_frequent(tokenizer, vocab: int, k, counts, flag: str, who: str) -> SubVocab:
  """The stop ids of `tokenizer` and the most frequent others of `counts` (None: the stdlib
  corpus's), k ids of `vocab`; a UsageError naming `flag` and the range that fits."""
  stops = eos_ids(tokenizer)
  if isinstance(k, bool) or not isinstance(k, int) or not len(stops) <= k < vocab:
    raise UsageError(f"{flag}={k!r}: choose a whole number of ids from {max(len(stops), 1)} to "
                     f"{vocab - 1} (the {who} has {vocab}); 0 in a config keeps the full head")
  counts = stdlib_counts(tokenizer, vocab) if counts is None else np.asarray(counts)
  if counts.shape != (vocab,):
    raise UsageError(f"counts has shape {counts.shape}: give one count per {who} id, ({vocab},)")
  if not (np.issubdtype(counts.dtype, np.number) and np.all(np.isfinite(counts))
          and np.all(counts >= 0)):
    raise UsageError(f"counts: give finite counts >= 0, one per {who} id (an id's count ranks "
                     f"it; found {counts.dtype} values outside that)")
  return SubVocab.most_frequent(counts, k, always=stops)


def _cut_head(params, subset: SubVocab, quant: str, tied: bool, layout: str) -> dict:
  """The `lm_head` params of a head that scores `subset` only, cut from a model's `params`: an
  int8 kernel [D, k] ([k, D] in layout out_in) with its scale [k], an int4 one [k, D / 2] with
  its scales [k, D / 64], or a float kernel [D, k] from the embedding (tied) or from the full
  [D, V] kernel."""
  head = params.get("lm_head", {})
  if quant:
    out_in = dense_layout.transposes(("lm_head", "kernel"), layout, quant)
    kernel = head["kernel"]
    return {"kernel": (quant_lib.take_rows(kernel, subset.ids) if out_in
                       else subset.head_columns(kernel)),
            "scale": quant_lib.take_rows(head["scale"], subset.ids)}
  if tied:
    return {"kernel": subset.head_rows(params["token_embed"]["embedding"])}
  return {"kernel": subset.head_columns(head["kernel"])}


@dataclasses.dataclass(frozen=True)
class LoadedHead:
  """An EAGLE-style draft head trained for `target` (draft_head): the drafter and the head's own
  params; the target's embedding and LM head are read from the target at decoding time."""
  drafter: HeadDrafter
  params: Any
  path: str = ""
  lm_head: Any = None        # a sub-vocabulary head's own kernel [D, K] (None: the target's)
  name: ClassVar[str] = "head"

  def loop_params(self, target: LoadedModel):
    """The params the loop passes the drafter: the head's with the target's shared ones (and
    its own sub-vocabulary LM head, when it has one)."""
    params = with_target(self.params, target.params)
    return params if self.lm_head is None else {**params, "lm_head": self.lm_head}


def _head_params(path, head: DraftHead):
  """The params saved in `path`, in `head`'s dense layout whichever layout they were trained in
  (and quantized like its target's layers, for an int8 or int4 target):
  the target's layout is chosen per machine at load (layout="auto"), so a head trained beside an
  [in, out] target must load beside an [out, in] one. Tried in the target's layout, then in the
  other (its fc kernel, [2D, D] or [D, 2D], cannot fit both); the error is the first's."""
  if head.quant:             # saved float (training is): quantized as the target's layers were
    float_head = dataclasses.replace(head, arch=dataclasses.replace(head.arch, quant=""))
    return quant_lib.quantize_params(_head_params(path, float_head), tied=False,
                                     layout=head.layout, quant=head.quant)
  shapes = lambda h: jax.eval_shape(h.init_params, jax.random.PRNGKey(0))
  try:
    return checkpoint.load_params(path, shapes(head))
  except ValueError as err:
    other = dense_layout.IN_OUT if head.layout == dense_layout.OUT_IN else dense_layout.OUT_IN
    twin = dataclasses.replace(head, arch=dataclasses.replace(head.arch, layout=other))
    try:
      saved = checkpoint.load_params(path, shapes(twin))
    except ValueError:
      raise err from None
  flip = lambda p, x: x.T if dense_layout.transposes(tuple(k.key for k in p),
                                                     dense_layout.OUT_IN) else x
  return jax.tree_util.tree_map_with_path(flip, saved)


def draft_head(target: LoadedModel, path: str, flag: str = "draft") -> LoadedHead:
  """The draft head saved in `path` (the workdir of `python -m train.distill
  --config.distill.student=head`) for `target` (a loaded decoder-only model). A head trained for
  another target is refused, naming the tensor whose shape differs. sub_vocab(head, k,
  target=target) cuts its vocabulary. `flag` names the setting in errors."""
  model = _loaded(target, "target").model
  check_head_dir(path, flag)
  try:
    head = DraftHead.for_target(model)
  except ValueError as err:
    raise UsageError(f"{flag}: {err}") from None
  try:
    params = _head_params(path, head)
  except (FileNotFoundError, ValueError) as err:
    raise UsageError(f"{flag}={str(path)!r}: {err} (a draft head is trained with "
                     f"`python -m train.distill --config.distill.student=head`)") from None
  return LoadedHead(drafter=HeadDrafter(head=head), params=params, path=str(path))


HEAD_RUN = "python -m train.distill --config.distill.student=head --workdir WORKDIR"


def check_head_dir(path, flag: str) -> None:
  """UsageError unless `path` is a directory holding saved params (a head run's workdir);
  `flag` names the setting."""
  if not isinstance(path, (str, os.PathLike)) or not str(path):
    raise UsageError(f"{flag}={path!r}: pass the workdir of a draft head run ({HEAD_RUN})")
  where = pathlib.Path(path)
  if not where.exists() and ":" in str(path):
    raise UsageError(f"{flag}={str(path)!r} names a model; a draft head is loaded from the "
                     f"workdir of its training run ({HEAD_RUN})")
  problem = ("does not exist" if not where.exists() else
             "is a file, not a workdir" if not where.is_dir() else
             "holds no saved params (a head run saves them when it finishes or is stopped)"
             if not (where / "params").exists() else "")
  if problem:
    raise UsageError(f"{flag}={str(path)!r} {problem}: pass the workdir of a draft head run "
                     f"({HEAD_RUN})")


def _cut_draft_head(loaded: LoadedHead, k, counts, flag: str, target) -> LoadedHead:
  """sub_vocab for a draft head: its arch scores k ids through its own cut of `target`'s head."""
  head = loaded.drafter.head
  if target is None:
    raise UsageError(f"{flag}: a draft head scores through its target's LM head: pass the "
                     f"target, sub_vocab(head, {k!r}, target=TARGET)")
  if head.arch.head_subset is not None:
    raise UsageError(f"{flag}: this draft head already scores {head.arch.head_subset.size} ids; "
                     f"cut it from the full head")
  model = _loaded(target, "target").model
  if (model.vocab_size, model.hidden_size) != (head.vocab_size, head.hidden_size):
    raise UsageError(f"{flag}: this draft head was built for a target of vocabulary "
                     f"{head.vocab_size} and hidden size {head.hidden_size}; the target has "
                     f"{model.vocab_size} and {model.hidden_size}")
  subset = _most_frequent(target.tokenizer, head.vocab_size, k, counts, flag, "target")
  cut = DraftHead(arch=dataclasses.replace(head.arch, head_subset=subset))
  lm_head = _cut_head(target.params, subset, head.quant, head.arch.tie_word_embeddings,
                      head.arch.layout)
  return dataclasses.replace(loaded, drafter=dataclasses.replace(loaded.drafter, head=cut),
                             lm_head=lm_head)
