"""eval.llamacpp: llama.cpp as eval.versus's benchmark peer, on stand-in programs that print
llama.cpp's reports (the real one is built by hand: eval/llamacpp.py's docstring)."""

from __future__ import annotations

import stat
from pathlib import Path

import numpy as np
import pytest

from eval import llamacpp, timing
from specjax.app.config import load_config

# The report lines as llama.cpp 11434 prints them (common_perf_print,
# examples/speculative-simple/speculative-simple.cpp), times in ms and seconds.
COMPLETION = """#!/usr/bin/env python3
import sys
args = sys.argv[1:]
sys.stdout.write("    return a + b\\n")
sys.stderr.write(
    "llama_perf_context_print:        load time =    9000.00 ms\\n"
    "llama_perf_context_print: prompt eval time =     100.00 ms /    12 tokens\\n"
    "llama_perf_context_print:        eval time =     350.00 ms /     7 runs\\n")
open(sys.argv[0] + ".args", "a").write(" ".join(args) + "\\n")
"""

SPECULATIVE = """#!/usr/bin/env python3
import sys
args = sys.argv[1:]
prompt = args[args.index("-p") + 1]
sys.stdout.write("\\n\\n" + prompt + "    return a + b\\n\\n\\n")
sys.stderr.write(
    "0.06.326.609 I encoded   12 tokens in    0.050 seconds, speed:  240.000 t/s\\n"
    "0.06.326.621 I decoded   10 tokens in    0.150 seconds, speed:   66.667 t/s\\n"
    "0.06.326.635 I n_draft   = 3\\n0.06.326.648 I n_drafted = 9\\n"
    "0.06.326.654 I n_accept  = 6\\n")
open(sys.argv[0] + ".args", "a").write(" ".join(args) + "\\n")
"""

FAILING = """#!/usr/bin/env python3
import sys
sys.stderr.write("error: failed to load model\\n")
sys.exit(1)
"""


class Chars:
  """A stand-in tokenizer: one id per character."""
  def encode(self, text):
    return [ord(c) for c in text]


def _programs(tmp_path: Path, completion=COMPLETION, speculative=SPECULATIVE) -> Path:
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for name, text in (("llama-completion", completion), ("llama-speculative-simple", speculative)):
    path = bin_dir / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
  return bin_dir


def _setup(bin_dir: Path) -> llamacpp.Setup:
  return llamacpp.Setup(llamacpp.binaries(str(bin_dir)), Path("t.gguf"), Path("d.gguf"))


def test_each_program_is_timed_by_its_own_report_not_by_loading_its_model(tmp_path):
  bin_dir = _programs(tmp_path)
  decoders = _setup(bin_dir).decoders(Chars(), max_new_tokens=8, draft_max=3, threads=2)
  target, spec = decoders.values()
  assert list(decoders) == ["llama.cpp: target", "llama.cpp: speculative (draft max 3)"]
  prompt = "def add(a, b):\n"
  gen, seconds = timing.once(lambda: target.generate(target.prepare([prompt])))
  assert seconds == pytest.approx(0.45)                   # prompt 100 ms + generation 350 ms
  assert gen.tokens.tolist() == [[ord(c) for c in "    retu"]]      # cut at max_new_tokens
  assert gen.stats is None
  gen2, seconds = timing.once(lambda: spec.generate(spec.prepare([prompt])))
  assert seconds == pytest.approx(0.05 + 0.15 * 8 / 10)   # the 8 tokens counted of 10 decoded
  assert gen2.tokens.tolist() == gen.tokens.tolist()      # the prompt's echo is left out
  assert (int(gen2.stats.accepted[0]), int(gen2.stats.verified[0])) == (6, 9)
  completion_args = (bin_dir / "llama-completion.args").read_text().split()
  assert {"--temp", "-no-cnv", "--no-display-prompt"} <= set(completion_args)
  assert completion_args[completion_args.index("--temp") + 1] == "0"
  spec_args = (bin_dir / "llama-speculative-simple.args").read_text().split()
  assert spec_args[spec_args.index("--spec-draft-n-max") + 1] == "3"
  assert spec_args[spec_args.index("--spec-type") + 1] == "draft-simple"
  assert spec_args[spec_args.index("-md") + 1] == "d.gguf"


def test_a_result_without_its_own_seconds_is_timed_by_the_clock():
  _, seconds = timing.once(lambda: np.zeros(3))
  assert 0 <= seconds < 5


def test_a_failing_program_and_a_report_without_times_are_named(tmp_path):
  bin_dir = _programs(tmp_path, completion=FAILING,
                      speculative="#!/usr/bin/env python3\nprint('no report')\n")
  target, spec = _setup(bin_dir).decoders(Chars(), 8, 3, 2).values()
  with pytest.raises(llamacpp.LlamaCppError, match="llama-completion exited with 1:\nerror: "
                                                   "failed to load model"):
    target.generate("x")
  with pytest.raises(llamacpp.LlamaCppError, match="no encoded time"):
    spec.generate("x")


def test_bad_setups_are_refused_before_any_model_loads(tmp_path):
  with pytest.raises(llamacpp.LlamaCppError, match="no llama-completion, llama-speculative-simple"
                                                   " there; build them"):
    llamacpp.binaries(str(tmp_path))
  bin_dir = _programs(tmp_path)
  config = load_config("tiny.py", ["--config.decode.temperature=0"])
  with pytest.raises(llamacpp.LlamaCppError, match="builtin:tiny/target is not a GGUF checkpoint"):
    llamacpp.Setup.of(str(bin_dir), config)
  with pytest.raises(llamacpp.LlamaCppError, match="add --config.decode.temperature=0"):
    llamacpp.Setup.of(str(bin_dir), load_config("tiny.py", []))
  gguf = tmp_path / "m.gguf"
  gguf.write_bytes(b"GGUF")
  config = load_config("tiny.py", ["--config.decode.temperature=0",
                                   f"--config.target.checkpoint={gguf}",
                                   f"--config.draft.checkpoint={tmp_path}"])
  setup = llamacpp.Setup.of(str(bin_dir), config)
  assert (setup.target, setup.draft) == (gguf, gguf)


def test_versus_refuses_llama_cpp_on_a_config_without_gguf_files(tmp_path, capsys):
  from eval import versus
  bin_dir = _programs(tmp_path)
  out = tmp_path / "v.json"
  assert versus.main(["--config", "tiny.py", "--methods", "target,greedy", "--llama_cpp",
                      str(bin_dir), "--config.decode.temperature=0",
                      "--output_json", str(out)]) == 2
  assert "is not a GGUF checkpoint" in capsys.readouterr().err
  assert not out.exists()
