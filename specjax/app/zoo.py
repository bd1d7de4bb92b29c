"""The embedded default pairs: trained here, by specjax's own trainers, on the offline corpus.

`ensure("tiny/target")` returns a local Hugging Face-layout checkpoint directory (config.json,
model.safetensors, spm.model), building the whole pair the first time:

  1. train the SentencePiece tokenizer on the stdlib corpus (specjax.data),
  2. pretrain the target, 3. pretrain the draft (NLL, `train.pretrain`'s trainer),
  4. DistillSpec-distill the draft towards the target (`train.distill`'s trainer) -> draft_distilled.

Each stage shows progress, checkpoints into CACHE/zoo/NAME/work/STAGE (a killed build resumes),
and exports its model when done. CACHE is $SPECJAX_CACHE or ~/.cache/specjax.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import ml_collections as mlc
from rich.console import Console

from specjax.api import loading
from specjax.app import builders, cli
from specjax.app.config import ConfigError
from specjax.app.fit import fit
from specjax.data.cache import cache_dir
from specjax.data.tokenizer import get_tokenizer
from specjax.distill import trainer as trainer_lib
from specjax.models import hf_import

SPM_FILE = loading.SPM_FILE

ROLES = ("target", "draft", "draft_distilled")   # built together, in this order
EXTRA_ROLES = ("draft_other_vocab",)                 # built on demand: a draft on another tokenizer
OTHER_TOKENIZER = "stdlib:unigram:8000"
STAGE_KIND = {"draft_distilled": "distill", "draft_other_vocab": "draft"}   # steps / LR to use


def _decoder(d_model, layers, heads, d_ff, vocab, positions=256):
  return mlc.ConfigDict(dict(arch="decoder", vocab_size=vocab, n_positions=positions,
                             d_model=d_model, num_layers=layers, num_heads=heads, d_ff=d_ff,
                             bos_token_id=3, eos_token_id=1, pad_token_id=0, init_from=""))


def _t5(d_model, layers, heads, d_kv, d_ff, vocab):
  # Tied, with the d_model**-0.5 output scaling: v1.1's untied head (init std 1) starts at a loss
  # above log(V) and trains far slower on this budget.
  return mlc.ConfigDict(dict(arch="t5", vocab_size=vocab, d_model=d_model, d_kv=d_kv, d_ff=d_ff,
                             num_heads=heads, num_layers=layers, num_decoder_layers=layers,
                             feed_forward_proj="gated-gelu", tie_word_embeddings=True,
                             pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                             init_from=""))


def recipe(name: str) -> mlc.ConfigDict:
  """The training config of a pair (trainer schema of specjax.distill.trainer)."""
  vocab, tokenizer = 2000, "stdlib:bpe:2000"
  c = mlc.ConfigDict()
  if name == "tiny":
    c.target, c.draft = _decoder(256, 4, 4, 1024, vocab), _decoder(64, 1, 2, 256, vocab)
    c.data = mlc.ConfigDict(dict(source="task", task="stdlib_lm", tokenizer=tokenizer,
                                 vocab_size=vocab, prompt_len=32, target_len=64, eos_id=1,
                                 pad_id=0, seed=0))
    steps = dict(target=600, draft=300, distill=150)
  elif name == "tiny_t5":
    c.target, c.draft = _t5(256, 3, 4, 64, 768, vocab), _t5(64, 1, 2, 32, 256, vocab)
    c.data = mlc.ConfigDict(dict(source="task", task="stdlib_sum", tokenizer=tokenizer,
                                 vocab_size=vocab, prompt_len=96, target_len=32, eos_id=1,
                                 pad_id=0, seed=0))
    steps = dict(target=400, draft=300, distill=100)
  else:
    raise ValueError(f"unknown embedded pair '{name}'; known: tiny, tiny_t5")
  scale = step_scale()
  c.steps = mlc.ConfigDict({k: max(int(v * scale), 2) for k, v in steps.items()})
  # A smoke build's models are untrained: its second tokenizer reads only the corpus's first 2M
  # characters, an eighth of the training time of the full one.
  c.other_tokenizer = OTHER_TOKENIZER + ("" if scale >= 1 else ":2000000")
  # The deeper target is unstable at the draft's rate (loss 4.4 vs 3.8 after 500 steps at 3e-3).
  c.learning_rates = mlc.ConfigDict(dict(target=1e-3, draft=3e-3, distill=1e-3))
  c.distill = mlc.ConfigDict(dict(recipe="", loss="jsd", beta=0.5, lambda1=0.0, lambda2=0.5,
                                  temperature=1.0))
  # A smoke build's few steps train nothing whatever their batch: 8 rows cost a quarter.
  c.train = mlc.ConfigDict(dict(
      steps=0, batch_size=32 if scale >= 1 else 8, learning_rate=3e-3, warmup_steps=50,
      decay_start=0, final_lr_ratio=0.1, optimizer="adamw", seed=0, log_every=50,
      checkpoint_every=200, eval_every=0, async_checkpoint=False, progress=True))
  c.pretrain = mlc.ConfigDict(dict(model="target", steps=0))
  c.mesh = mlc.ConfigDict(dict(data=-1, model=1))
  c.distributed = mlc.ConfigDict(dict(enabled=False))
  return c


def step_scale() -> float:
  """$SPECJAX_ZOO_STEP_SCALE: what the embedded pairs' training steps are multiplied by (default
  1; below 1 a quick smoke build of barely trained models). ConfigError naming the variable for
  anything but a number >= 0."""
  text = os.environ.get("SPECJAX_ZOO_STEP_SCALE", "1")
  try:
    scale = float(text)
  except ValueError:
    scale = math.nan
  if not (math.isfinite(scale) and scale >= 0):
    raise ConfigError(f"SPECJAX_ZOO_STEP_SCALE={text!r}: the embedded pairs' training steps are "
                      f"multiplied by it; give a number >= 0 (1, the default, builds the full "
                      f"pair; 0 a smoke build of two steps per stage)")
  return scale


def pair_dir(name: str) -> Path:
  """CACHE/zoo/NAME; a build at another step scale is kept apart (NAME-steps0.5), so a full run
  never takes a smoke build's models for the pair's."""
  scale = step_scale()
  return cache_dir() / "zoo" / (name if scale == 1 else f"{name}-steps{scale:g}")


def ensure(spec: str) -> Path:
  """`NAME/ROLE` -> the exported checkpoint directory, building the pair on first use."""
  name, _, role = spec.partition("/")
  if role not in ROLES + EXTRA_ROLES:
    raise ValueError(f"builtin:{spec}: role must be one of {ROLES + EXTRA_ROLES}")
  out = pair_dir(name) / role
  if not (out / "config.json").exists():
    build(name, [role] if role in EXTRA_ROLES else ROLES)
  return out


def _stage_config(rec: mlc.ConfigDict, stage: str) -> mlc.ConfigDict:
  c = mlc.ConfigDict(rec.to_dict())
  kind = STAGE_KIND.get(stage, stage)
  steps = int(rec.steps[kind])
  c.train.steps = steps
  c.train.decay_start = steps // 2
  c.train.warmup_steps = max(steps // 30, 1)
  c.train.learning_rate = float(rec.learning_rates[kind])
  if stage == "draft_other_vocab":          # the draft architecture on the second tokenizer
    vocab = 8000
    c.data.tokenizer, c.data.vocab_size = rec.other_tokenizer, vocab
    c.draft.vocab_size = vocab
    c.pretrain.model = "draft"
    c.pretrain.steps = steps
  elif stage in ("target", "draft"):
    c.pretrain.model = stage
    c.pretrain.steps = steps
  else:                                      # distill the pretrained draft towards the target
    c.target.init_from = str(pair_dir_work(rec) / "target")
    c.draft.init_from = str(pair_dir_work(rec) / "draft")
  return c


def pair_dir_work(rec) -> Path:
  return pair_dir(rec.name) / "work"


def build(name: str, stages=ROLES) -> None:
  """Train the tokenizer and each stage's model; export each as an HF-layout directory."""
  console = Console(stderr=True)
  rec = recipe(name)
  rec.name = name
  console.print(f"[bold]specjax: building the embedded pair '{name}' into {pair_dir(name)} "
                f"(first use only; about 15 minutes on 2 CPU cores)")
  for stage in stages:
    out = pair_dir(name) / stage
    if (out / "config.json").exists():
      continue
    console.print(f"[bold]stage {stage}")
    config = _stage_config(rec, stage)
    tokenizer = get_tokenizer(config.data.tokenizer)
    try:
      state = _train_stage(config, str(pair_dir_work(rec) / stage), stage)
    except (trainer_lib.TrainingInterrupted, trainer_lib.TrainingAbandoned) as stopped:
      console.print(f"stage {stage} {stopped}: the next use of the pair resumes the build")
      if isinstance(stopped, trainer_lib.TrainingAbandoned):
        cli.exit_now(130)             # no wait on the save its threads were making
      raise SystemExit(130) from None
    role = "target" if stage == "target" else "draft"
    model = builders.model_from_fields(builders.model_spec(config, role))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    hf_import.save_model(model, state.params, str(tmp))
    shutil.copy(tokenizer.path, tmp / SPM_FILE)
    tmp.rename(out)


def _train_stage(config: mlc.ConfigDict, workdir: str, stage: str):
  """Pretrain one model (NLL), or distill the pretrained draft towards the target."""
  seed = builders.train_config(config).seed
  if stage != "draft_distilled":
    role = config.pretrain.model
    return fit(config, workdir, builders.init_model(builders.model_spec(config, role), seed),
               pretrain=True)
  student = builders.init_model(builders.model_spec(config, "draft"), seed)
  teacher = builders.init_model(builders.model_spec(config, "target"), seed + 1)
  return fit(config, workdir, student, teacher)


loading.register_pair_source("builtin", ensure)
