"""`specjax.decode`'s inputs and outputs: prompt files and prompts, decode settings, SPRINTER's
settings, --output_json, and prompts against the cache (refused with numbers, or cut on the left
with decode.truncate=left), for decoder-only, T5 and cross-tokenizer pairs.

Refusals that must come before any model is built run `main` with a target checkpoint that does
not exist: if a check did not fire, the run would stop on that instead (never on a zoo build)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import types
from pathlib import Path

import jax
import numpy as np
import pytest

from specjax import decode
from specjax.app import builders, methods, resolve, runner
from specjax.api import prompt_fit
from specjax.app.config import ConfigError, load_config
from specjax.models import decoder, t5

MISSING = "--config.target.checkpoint=/nonexistent/specjax-target"


@pytest.fixture(autouse=True)
def _fresh_log_handlers():
  """cli.setup gives the specjax logger a handler on the sys.stderr of its time; pytest's capture
  closes that stream after the test, so the handler goes with it."""
  root = logging.getLogger("specjax")
  before = list(root.handlers)
  yield
  root.handlers[:] = before


def _main(capsys, *argv) -> tuple[int, str]:
  code = decode.main(["--config", "tiny.py", MISSING, *argv])
  return code, capsys.readouterr().err


# ------------------------------------------------------------------------- prompts and settings

@pytest.mark.parametrize("make, message", [
    (lambda d: d, "is a directory"),
    (lambda d: d / "absent.txt", "does not exist"),
    (lambda d: (d / "latin1.txt", (d / "latin1.txt").write_bytes(b"caf\xe9\n"))[0],
     "is not UTF-8 text (byte 3 is 0xe9)"),
    (lambda d: (d / "blank.txt", (d / "blank.txt").write_text("\n  \n"))[0], "holds no prompt"),
])
def test_bad_input_files_are_named(tmp_path, capsys, make, message):
  path = make(tmp_path)
  code, err = _main(capsys, "--input_file", str(path))
  assert code == 2 and "Traceback" not in err
  assert f"--input_file {path}" in err and message in err, err


@pytest.mark.parametrize("prompt", ["", "   "])
def test_an_empty_prompt_is_refused(capsys, prompt):
  code, err = _main(capsys, "--prompt", prompt)
  assert code == 2 and "--prompt is empty" in err, err


def test_a_prompt_that_is_not_utf8_is_refused(capsys):
  """The argv bytes b'caf\\xe9' reached the tokenizer as a lone surrogate: a TypeError."""
  code, err = _main(capsys, "--prompt", b"caf\xe9".decode("utf-8", "surrogateescape"))
  assert code == 2 and "--prompt is not UTF-8 text (byte 3 is 0xe9)" in err, err


@pytest.mark.parametrize("prompts", [[1, 2], ["a", ""]])
def test_a_configs_prompts_that_are_not_texts_are_refused(prompts):
  """A config's `prompts = [1, 2]` ended in a TypeError traceback."""
  args = type("Args", (), {"prompt": [], "input_file": None})
  with pytest.raises(decode.PromptError, match=r"the config's prompts must be non-empty texts; "
                     r"prompt \d is"):
    decode.read_prompts(args, {"prompts": prompts})


def test_prompt_file_lines(tmp_path):
  path = tmp_path / "p.txt"
  path.write_text("first\r\n\n  second  \n", encoding="utf-8")
  args = type("Args", (), {"prompt": ["x"], "input_file": str(path)})
  assert decode.read_prompts(args, {}) == ["x", "first", "  second  "]


@pytest.mark.parametrize("override, message", [
    ("--config.decode.seed=1e30", "seed=1000000000000000019884624838656 is out of range"),
    (f"--config.decode.seed={2**80}", f"seed={2**80} is out of range"),
    ("--config.decode.seed=-1", "seed=-1 is out of range"),
    ("--config.decode.batch_size=0", "batch_size=0 must be >= 1"),
    ("--config.decode.batch_size=-2", "batch_size=-2 must be >= 1"),
    ("--config.decode.max_new_tokens=0", "max_new_tokens=0 must be >= 1"),
    ("--config.decode.gamma=0", "gamma=0 must be >= 1"),
    ("--config.decode.truncate=right", "truncate='right'"),
    ("--config.decode.top_p=0", "top_p must be in (0, 1]"),
])
def test_nonsense_decode_settings_are_refused_before_any_build(capsys, override, message):
  code, err = _main(capsys, "--prompt", "x", override)
  assert code == 2 and "Traceback" not in err
  assert message in err and "/nonexistent" not in err, err
  if "seed" in override:
    assert "[0, 4294967295]" in err


def test_a_field_for_a_rule_without_hyperparameters_names_the_flag_to_drop():
  config = load_config("tiny.py", ["--config.rule.name=exact", "--config.rule.eps=0.3"])
  with pytest.raises(ConfigError, match=r"--config.rule.name=exact takes no hyperparameters: "
                     r"drop --config.rule.eps"):
    builders.rule(config)


def test_the_largest_seed_is_accepted():
  settings = builders.decode_settings(load_config("tiny.py", ["--config.decode.seed=4294967295"]))
  assert settings.seed == 2**32 - 1


@pytest.mark.parametrize("values, message", [
    ({"threshold": 1.5}, "threshold=1.5: a verifier score threshold must be in [0, 1]"),
    ({"threshold": -0.5}, "threshold=-0.5"),
    ({"threshold": math.nan}, "threshold=nan"),
    ({"gamma_max": -3}, "gamma_max=-3"),
])
def test_sprinter_settings_out_of_range_are_refused(values, message):
  with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
    builders.typed(methods.SprinterSettings, values, "rule")


def test_sprinter_threshold_refused_before_the_verifier_loads(capsys):
  code, err = _main(capsys, "--prompt", "x", "--config.rule.name=sprinter",
                    "--config.rule.verifier=/nonexistent/verifier", "--config.rule.threshold=2")
  assert code == 2 and "threshold=2.0" in err and "[0, 1]" in err, err


def test_sprinter_defaults_and_saved_values_pass():
  assert builders.typed(methods.SprinterSettings, {"threshold": -1, "gamma_max": -1}, "rule")
  methods.check_sprinter(0.0, 0)
  methods.check_sprinter(1.0, 8)
  with pytest.raises(ValueError, match="threshold=-1"):
    methods.check_sprinter(-1.0, 8)          # a saved value is never the sentinel


# ------------------------------------------------------------------------------- --output_json

def test_output_json_is_checked_before_any_work(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(runner, "run", lambda *a: pytest.fail("decoded before checking the path"))
  out = tmp_path / "no_such_dir" / "out.json"
  code, err = _main(capsys, "--prompt", "x", "--output_json", str(out))
  assert code == 2 and str(out.parent) in err and "does not exist" in err, err
  code, err = _main(capsys, "--prompt", "x", "--output_json", str(tmp_path))
  assert code == 2 and "is a directory" in err, err


def _fake_report(*_, **__):
  return {"settings": {}, "stats": {"emitted": 2, "acceptance_rate": math.nan},
          "results": [{"prompt": "x", "text": "yz", "tokens": [5, 6], "stats": {}}],
          "timing": {"load_s": 0.0, "compile_s": 0.0, "decode_s": 0.1, "tokens": 2,
                     "ms_per_token": 50.0}}


def test_output_json_is_strict_and_atomic(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(runner, "run", _fake_report)
  out = tmp_path / "out.json"
  out.write_text("old")
  code, _ = _main(capsys, "--prompt", "x", "--output_json", str(out))
  assert code == 0
  report = json.loads(out.read_text())       # json.loads accepts NaN; the file must not hold it
  assert report["stats"]["acceptance_rate"] is None and "NaN" not in out.read_text()
  assert [p.name for p in tmp_path.iterdir()] == ["out.json"]      # no temporary file left


def test_a_failed_write_keeps_the_results(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(runner, "run", _fake_report)
  out = tmp_path / "out.json"
  write = decode.outputs.write_json

  def failing(path, obj):
    if Path(path) == out:
      raise PermissionError(13, "Permission denied")
    write(path, obj)

  monkeypatch.setattr(decode.outputs, "write_json", failing)
  code, err = _main(capsys, "--prompt", "x", "--output_json", str(out))
  assert code == 2 and "could not be written (Permission denied)" in err, err
  fallback = Path(err.split("the results are in ")[1].strip())
  assert json.loads(fallback.read_text())["results"][0]["tokens"] == [5, 6]
  fallback.unlink()


# ------------------------------------------------------------------------- prompts vs the cache

class _Chars:
  """One id per character (a=4, b=5, ...); BOS 3, EOS 1, PAD 0."""
  bos_id, eos_id, pad_id = 3, 1, 0

  def encode(self, text):
    return [4 + (ord(c) - ord("a")) % 26 for c in text]

  def decode(self, ids):
    return "".join(chr(ord("a") + i - 4) for i in ids if i >= 4)


def _decoder(layers=1, positions=32):
  cfg = decoder.DecoderConfig(vocab_size=32, n_positions=positions, d_model=16, num_layers=layers,
                              num_heads=2, d_ff=32, bos_token_id=3, eos_token_id=1, pad_token_id=0)
  model = decoder.Decoder(cfg)
  return resolve.LoadedModel(model, model.init_params(jax.random.PRNGKey(layers)), _Chars(),
                             Path("."))


def _settings(**kw):
  return builders.DecodeSettings(**{"gamma": 4, "max_new_tokens": 8, "temperature": 0.0, **kw})


def test_a_prompt_too_long_gets_its_length_and_the_longest_that_fits():
  method = methods.Autoregressive(target=_decoder(), settings=_settings())
  with pytest.raises(prompt_fit.PromptTooLongError) as err:
    method.prepare(["abcdefghijklmnopqrstuvwxyzabcd"])          # BOS + 30 = 31 tokens
  message = str(err.value)
  assert "has 31 tokens for the target" in message
  assert "holds 32 positions (its n_positions)" in message
  assert "the longest prompt that fits is 24 tokens" in message          # 32 - 8
  assert "truncate=left (keeps its last 24 tokens)" in message
  assert "max_new_tokens (at most 1 for this prompt)" in message
  assert "max_len" not in message                                   # the user set none


def test_speculative_room_counts_gamma_and_names_max_len_when_set():
  pair = dict(target=_decoder(2, 64), draft=_decoder(1, 32), rule=object())
  spec = methods.Speculative(settings=_settings(), **pair)
  assert spec.room(spec.target).longest == 32 - 8 - 4          # the draft's table binds both
  assert "the draft's n_positions" in spec.room(spec.target).limit_from
  spec = methods.Speculative(settings=_settings(max_len=20, gamma=2), **pair)
  with pytest.raises(prompt_fit.PromptTooLongError, match=r"holds 20 positions \(--config.decode"
                     r".max_len\).* fits is 10 tokens.*raise --config.decode.max_len"):
    spec.prepare(["abcdefghijklmnop"])


def test_truncate_left_keeps_bos_and_the_last_tokens(caplog):
  method = methods.Autoregressive(target=_decoder(), settings=_settings(truncate="left"))
  logging.getLogger("specjax").addHandler(caplog.handler)
  try:
    with caplog.at_level(logging.WARNING, logger="specjax"):
      prompts = method.prepare(["abcdefghijklmnopqrstuvwxyzabcd", "xyz"])
  finally:
    logging.getLogger("specjax").removeHandler(caplog.handler)
  text = _Chars().encode("abcdefghijklmnopqrstuvwxyzabcd")
  tokens, lengths = prompts.target.tokens.tolist(), prompts.target.lengths.tolist()
  assert lengths == [24, 4] and prompts.target.tokens.shape[1] == 24
  assert tokens[0][:24] == [3] + text[-23:]
  assert "dropped the first 7 of its 31 tokens" in caplog.text and "'xyz'" not in caplog.text
  gen = method.generate(prompts, jax.random.PRNGKey(0))           # the cut prompt decodes
  assert gen.lengths.tolist() == [8, 8]


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_a_cache_that_cannot_fit_in_memory_is_refused_before_compiling(monkeypatch, family):
  """A model without a position table bounds no prompt, but max_new_tokens=10**9 would need a
  cache of terabytes: refused with the memory and the most new tokens that fit (it compiled for
  37 s and then failed to allocate)."""
  from specjax.api.errors import UsageError
  from specjax.models import llama
  if family == "llama":
    model = llama.Llama(llama.LlamaConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=2,
                                          num_kv_heads=1, head_dim=8, d_ff=32, bos_token_id=3,
                                          eos_token_id=1))
  else:
    model = t5.T5(t5.T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_heads=2,
                              num_layers=1, num_decoder_layers=1))
  loaded = resolve.LoadedModel(model, None, _Chars(), Path("."))
  monkeypatch.setattr(prompt_fit, "memory_bytes", lambda: 2**30)
  fine = methods.Autoregressive(target=loaded, settings=_settings(max_new_tokens=1000))
  assert fine.prepare(["abc"]).target.lengths.tolist() == [4]      # BOS or EOS + 3
  huge = methods.Autoregressive(target=loaded, settings=_settings(max_new_tokens=10**9))
  with pytest.raises(UsageError, match=r"--config.decode.max_new_tokens=1000000000: the target's "
                                       r"KV cache would take .* GiB .* more than the 1 GiB of "
                                       r"memory here: lower --config.decode.max_new_tokens "
                                       r"\(at most about"):
    huge.prepare(["abc"])


def test_a_t5_encoder_is_bounded_by_max_len_and_keeps_its_eos():
  cfg = t5.T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_heads=2, num_layers=1,
                    num_decoder_layers=1)
  loaded = resolve.LoadedModel(t5.T5(cfg), None, _Chars(), Path("."))
  unbounded = methods.Autoregressive(target=loaded, settings=_settings())
  assert unbounded.room(loaded) is None
  assert unbounded.prepare(["a" * 40]).target.lengths.tolist() == [41]
  bounded = methods.Autoregressive(target=loaded, settings=_settings(max_len=16))
  with pytest.raises(prompt_fit.PromptTooLongError, match="has 41 tokens.*fits is 16 tokens"):
    bounded.prepare(["a" * 40])
  cut = dataclasses.replace(bounded, settings=_settings(max_len=16, truncate="left"))
  row = cut.prepare(["b" * 30 + "cdefghijklmnop"]).target.tokens.tolist()[0]
  assert row == _Chars().encode("bcdefghijklmnop") + [1]           # the last 15 and the EOS


@dataclasses.dataclass(frozen=True)
class _WideRule:
  """A cross-vocabulary rule's declarations, with a vocabulary map whose images take up to 5
  draft tokens per target token (the model drafter's per_token)."""
  needs_same_vocab = False
  draft_length = "fixed"
  rule_name = "wide"
  vocab = types.SimpleNamespace(images=np.zeros((1, 5), np.int32))


def test_a_cross_tokenizer_draft_gets_the_largest_max_new_tokens_that_fits():
  """A target token may take 5 draft tokens: max_new_tokens 16 needs 5*16 + 4 = 84 draft
  positions, more than the 64 the draft has; with a 4-token prompt (BOS + 3) at most
  (64 - 4 - 4) // 5 = 11 new tokens fit."""
  spec = methods.Speculative(target=_decoder(2, 64), draft=_decoder(1, 64), rule=_WideRule(),
                             settings=_settings(max_new_tokens=16, truncate="left"))
  with pytest.raises(prompt_fit.PromptTooLongError) as err:
    spec.prepare(["abc"])
  message = str(err.value)
  assert "for the draft" in message and "reserves 84 of them" in message
  assert "holds 64 positions (its n_positions)" in message
  assert "each up to 5 draft tokens" in message and "no prompt fits" in message
  assert "at most 11 for this prompt" in message and "truncate" not in message
  fits = dataclasses.replace(spec, settings=_settings(max_new_tokens=11))
  assert fits.prepare(["abc"]).draft.lengths.tolist() == [4]


def test_tiny_hetero_leaves_room_for_its_prompts():
  """The README's cross-tokenizer command: the config's max_new_tokens leaves the draft (256
  positions, up to 5 draft tokens per target token for the built pair) room for a prompt."""
  settings = builders.decode_settings(load_config("tiny_hetero.py"))
  assert 256 - (5 * settings.max_new_tokens + settings.gamma) >= 64


def test_a_gamma_the_cache_cannot_hold_names_the_largest_gamma():
  from specjax.api.prompt_fit import PromptTooLongError, Room
  room = Room(model="the target", limit=128, limit_from="its n_positions", max_new_tokens=64,
              fixed=10**9, fixed_from=f"gamma {10**9}")
  message = str(PromptTooLongError("def f(x):", 5, room, keep_at_least=2))
  assert "lower --config.decode.gamma (at most 59 for this prompt)" in message
  assert "longer position table" not in message


def test_compare_without_a_draft_is_refused(capsys):
  """Probe round 6: --compare was ignored without a word when the target decodes alone."""
  code, err = _main(capsys, "--prompt", "x", "--config.draft.checkpoint=", "--compare")
  assert code == 2 and "--compare decodes the prompts with the target alone too, and this run " \
      "decodes with the target alone: give a draft" in err, err
