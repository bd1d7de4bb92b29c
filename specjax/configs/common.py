"""Config fragments shared by the shipped configs (big_vision's `configs/common.py` habit)."""

from __future__ import annotations

import ml_collections

STDLIB_PROMPTS = (
    "def read_lines(path):\n    \"\"\"Return the lines of a text file.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
)


def model(checkpoint: str, dtype: str = "float32", quant: str = "",
          **fields) -> ml_collections.ConfigDict:
  """A model section: a checkpoint (local HF directory, hub id in the local cache, or
  `builtin:PAIR/ROLE`), its dtype, its layer layout (`layers`: auto, scan or unrolled), `quant`
  ("int8" or "int4": quantized dense layers, models/quant.py), its dense-kernel layout (`layout`: auto, in_out
  or out_in; auto measures once per machine on CPU: models/layout_choice.py) and optionally
  `tokenizer` or `init_from`."""
  section = dict(checkpoint=checkpoint, dtype=dtype, layers="auto", quant=quant, layout="auto",
                 init_from="")
  section.update(fields)
  return ml_collections.ConfigDict(section)


def draft(checkpoint: str, dtype: str = "float32", **fields) -> ml_collections.ConfigDict:
  """The draft section: a model section plus the drafter (`method`: "model", the checkpoint
  drafts; "ngram", prompt lookup: no model, the longest suffix of ngram_max down to ngram_min
  tokens matched in the prompt and the output; "early_exit": the target's first exit_layer
  layers with its head). vocab_top_k > 0: the draft's head scores only its K most frequent ids
  in the stdlib corpus (FR-Spec; exact SD stays lossless)."""
  drafter = dict(method="model", ngram_max=3, ngram_min=1, exit_layer=0, vocab_top_k=0)
  return model(checkpoint, dtype, **{**drafter, **fields})


def embedded_pair(config: ml_collections.ConfigDict, pair: str) -> None:
  """The sections of an embedded pair (specjax.app.zoo builds it on first use): the target, the
  DistillSpec-distilled draft (`draft`) and the same draft before distillation (`draft_raw`)."""
  config.target = model(f"builtin:{pair}/target")
  config.draft = draft(f"builtin:{pair}/draft_distilled")
  config.draft_raw = model(f"builtin:{pair}/draft")


def decode(**overrides) -> ml_collections.ConfigDict:
  """The `decode` section: speculative and sampling settings of `python -m specjax.decode`.
  truncate="left" keeps the end of a prompt too long for the cache ("": refuse it); stop: stop
  strings (`--config.decode.stop="['\\n\\n\\n']"`); stream: print text as it is generated;
  draft_confidence > 0: a block's drafting ends after a draft whose top probability under the
  draft model is below it (gamma is then the most per block; 0: blocks of gamma drafts);
  gamma="auto": chosen for the machine when the config is read (app/builders.auto_blocks: 7, 4
  or 3 at most, with a draft_confidence of 0.7 or 0.8 where none is set)."""
  fields = dict(gamma=4, max_new_tokens=64, temperature=1.0, top_k=0, top_p=1.0, seed=0,
                max_len=0, batch_size=1, lookbehind=10, chat=False, truncate="", stop=(),
                stream=True,
                draft_confidence=ml_collections.config_dict.placeholder(float))  # None: unset
  fields.update(overrides)
  return ml_collections.ConfigDict(fields)


def rule(name: str = "exact", **hparams) -> ml_collections.ConfigDict:
  """The `rule` section: a registered acceptance rule's name and its hyperparameters (or a
  decoding method's: slem, slrs, sprinter)."""
  return ml_collections.ConfigDict(dict(name=name, **hparams))


def stdlib_lm_data(**overrides) -> ml_collections.ConfigDict:
  """Evaluation data of the embedded decoder pair: code completion on the stdlib corpus."""
  fields = dict(task="stdlib_lm", tokenizer="stdlib:bpe:2000", lm_prompt_len=32,
                max_target_len=64)
  fields.update(overrides)
  return ml_collections.ConfigDict(fields)


def training(**overrides) -> ml_collections.ConfigDict:
  """The `train` section of train.pretrain / train.distill (Table B.1 defaults)."""
  fields = dict(steps=300_000, batch_size=32, learning_rate=3e-4, warmup_steps=5_000,
                decay_start=150_000, final_lr_ratio=0.1, optimizer="adafactor", seed=0,
                log_every=100, checkpoint_every=2_000, eval_every=5_000, eval_at_start=False,
                async_checkpoint=True, progress=True)
  fields.update(overrides)
  return ml_collections.ConfigDict(fields)


def distill(**overrides) -> ml_collections.ConfigDict:
  fields = dict(recipe="", loss="fkl", beta=0.5, lambda1=0.0, lambda2=1.0, temperature=1.0,
                student="draft", cache_batches=0, cache_top_k=64, cache_dir="")
  fields.update(overrides)
  return ml_collections.ConfigDict(fields)


def mesh(data: int = -1, model: int = 1) -> ml_collections.ConfigDict:
  """The `mesh` section: a data x model device mesh (data=-1: every device the model axis leaves).
  Training shards batches over data and heads / mlp / vocab over model; decoding does the same
  with prompts and KV caches (configs that decode start at 1 x 1, one device):

      python -m specjax.decode --config tiny.py --config.mesh.data=2 --config.mesh.model=4
  """
  return ml_collections.ConfigDict(dict(data=data, model=model))


def distributed() -> ml_collections.ConfigDict:
  """The `distributed` section: enabled=True calls jax.distributed.initialize first (multi-host:
  every process runs the same command; coordinator / num_processes / process_id where JAX does
  not find them itself). Decoding gives every process the same results; process 0 reports."""
  return ml_collections.ConfigDict(dict(enabled=False, coordinator="", num_processes=0,
                                        process_id=-1))
