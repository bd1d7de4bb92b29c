"""The command-line tools end to end, as a user runs them: `python -m specjax.decode` in
subprocesses from the repository root (eval.latency's keys: tests/test_readme.py's
check_latency), on a tiny random target/draft pair exported in the Hugging Face layout with a SentencePiece tokenizer (`spm.model`) beside it.

Each subprocess pays the jax import and its own compiles, so the file runs few of them and shares
their outputs between tests (module-scoped fixtures); the two greedy runs go concurrently.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import re
import shutil
import string
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from specjax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, train_sentencepiece
from specjax.models import hf_import
from specjax.models.decoder import Decoder, DecoderConfig

REPO = Path(__file__).resolve().parent.parent
PROMPT = "def f(x):"
MAX_NEW = 8
# 256 byte-fallback pieces + the corpus' characters + specials already need ~350 ids.
VOCAB = 400
COUNTERS = ("blocks", "accepted", "verified", "emitted", "target_passes", "draft_passes")


def _tiny_pair(seed: int = 0, noise: float = 0.2):
  """(model, params) of a random 2-layer GPT-2-style target with an untied lm_head (so that greedy
  output is not one repeated token) and of a 1-layer draft: the target without its last layer,
  every tensor perturbed. The draft agrees with the target often but not always, so that greedy
  speculative decoding both accepts and rejects drafts."""
  cfg = DecoderConfig(vocab_size=VOCAB, n_positions=128, d_model=32, num_layers=2, num_heads=4,
                      d_ff=64, tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                      pad_token_id=PAD_ID)
  target = Decoder(cfg)
  params = target.init_params(jax.random.PRNGKey(seed))
  params = {k: jax.tree.map(lambda x: 4.0 * x, v) if k in ("token_embed", "lm_head") else v
            for k, v in params.items()}                        # well-separated logits
  kept = dict(params, layers=jax.tree.map(lambda x: x[:1], params["layers"]))   # layer 0 only
  leaves, treedef = jax.tree.flatten(kept)
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
  noisy = [x + noise * (jnp.std(x) + 1e-3) * jax.random.normal(k, x.shape)
           for x, k in zip(leaves, keys)]
  draft = Decoder(dataclasses.replace(cfg, num_layers=1))
  return (target, params), (draft, jax.tree.unflatten(treedef, noisy))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  """Paths of the tiny target and draft checkpoints, sharing a 400-piece BPE SentencePiece."""
  root = tmp_path_factory.mktemp("cli")
  source = inspect.getsource(string) + inspect.getsource(textwrap)          # ~12 KB of Python
  spm_path = train_sentencepiece(source[:12000].split("\n\n"), root / "bpe.model",
                                 model_type="bpe", vocab_size=VOCAB, num_threads=1)
  dirs = {}
  for role, (model, params) in zip(("target", "draft"), _tiny_pair()):
    dirs[role] = hf_import.save_model(model, params, root / role)
    shutil.copy(spm_path, dirs[role] / "spm.model")
  return dict(root=root, target=dirs["target"], draft=dirs["draft"], spm=spm_path,
              cache=root / "specjax_cache")


def _command(pair, module: str, *extra: str) -> list[str]:
  return [sys.executable, "-m", module, "--config", "tiny.py",
          f"--config.target.checkpoint={pair['target']}",
          f"--config.draft.checkpoint={pair['draft']}",
          f"--config.decode.max_new_tokens={MAX_NEW}", *extra]


def _run(pair, *commands: list[str]) -> list[subprocess.CompletedProcess]:
  """Run the commands concurrently from the repo root (CPU, a private specjax cache)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "SPECJAX_CACHE": str(pair["cache"])}
  env.pop("SPECJAX_DEBUG", None)                  # it turns clean errors into tracebacks
  procs = [subprocess.Popen(c, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for c in commands]
  done = []
  for cmd, proc in zip(commands, procs):
    out, err = proc.communicate(timeout=300)
    done.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
  return done


def _decode(pair, name: str, *extra: str) -> list[str]:
  return _command(pair, "specjax.decode", "--prompt", PROMPT,
                  "--output_json", str(pair["root"] / f"{name}.json"), *extra)


def _lookup(pair, name: str, *extra: str) -> list[str]:
  """A prompt-lookup decode: without the draft checkpoint, which prompt lookup never reads (a
  user's --config.draft.checkpoint is refused with it)."""
  return [a for a in _decode(pair, name, "--config.draft.method=ngram", *extra)
          if not a.startswith("--config.draft.checkpoint=")]


def _ok_json(pair, proc, name: str) -> dict:
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads((pair["root"] / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def default_run(pair):
  """The config's own rule (exact) and temperature (1.0)."""
  (proc,) = _run(pair, _decode(pair, "default"))
  return proc, _ok_json(pair, proc, "default")


def test_decode_prints_stats_and_writes_json(pair, default_run):
  proc, report = default_run
  match = re.search(r"^stats: (\d+) tokens, decode [0-9.]+s .*alpha ([0-9.]+), tau ([0-9.]+), "
                    r"blocks (\d+), target_passes (\d+), draft_passes (\d+); start-up ",
                    proc.stdout, re.M)
  assert match, proc.stdout
  (result,) = report["results"]
  assert result["prompt"] == PROMPT
  tokens, stats = result["tokens"], result["stats"]
  assert 1 <= len(tokens) <= MAX_NEW and all(0 <= t < VOCAB for t in tokens)
  assert result["text"] == Tokenizer.load(pair["spm"]).decode(tokens)
  assert result["finish_reason"] == ("length" if len(tokens) == MAX_NEW else "stop")
  assert result["text"] in proc.stdout
  assert set(COUNTERS) <= set(stats)
  assert stats["emitted"] == len(tokens) == int(match.group(1))
  assert stats["accepted"] <= stats["verified"] <= stats["drafted"]
  assert stats["target_passes"] == stats["blocks"] == int(match.group(4))
  assert stats["draft_passes"] == int(match.group(6)) > 0
  total = report["stats"]
  assert total["acceptance_rate"] == pytest.approx(stats["accepted"] / stats["verified"])
  assert float(match.group(2)) == pytest.approx(total["acceptance_rate"], abs=1e-3)
  settings = report["settings"]
  assert settings["mode"] == "speculative" and settings["rule"]["name"] == "exact"
  assert settings["decode"]["max_new_tokens"] == MAX_NEW
  assert settings["resolved"] == {"gamma": settings["decode"]["gamma"], "draft_confidence": 0.0}
  assert settings["target"]["checkpoint"] == str(pair["target"])
  assert settings["draft"]["checkpoint"] == str(pair["draft"])


def test_greedy_speculative_equals_target_only(pair):
  greedy = ("--config.decode.temperature=0",)
  sd, ar = _run(pair, _decode(pair, "greedy_sd", "--config.rule.name=greedy", *greedy),
                _decode(pair, "greedy_ar", "--config.draft.checkpoint=", *greedy))
  sd, ar = _ok_json(pair, sd, "greedy_sd"), _ok_json(pair, ar, "greedy_ar")
  assert sd["settings"]["mode"] == "speculative" and ar["settings"]["mode"] == "autoregressive"
  assert sd["results"][0]["tokens"] == ar["results"][0]["tokens"]
  assert sd["results"][0]["text"] == ar["results"][0]["text"]
  ar_stats = ar["results"][0]["stats"]
  assert ar_stats["blocks"] == ar_stats["emitted"] == len(ar["results"][0]["tokens"])
  assert ar_stats["draft_passes"] == 0 and "acceptance_rate" not in ar["stats"]
  assert len(set(ar["results"][0]["tokens"])) > 1                 # not one repeated token
  sd_stats = sd["stats"]
  assert 0 < sd_stats["accepted"] < sd_stats["verified"]          # drafts accepted and rejected


def test_bad_inputs_fail_cleanly(pair):
  long_prompt = PROMPT + " return x + 1;" * 12
  nope, too_long = _run(
      pair, _command(pair, "specjax.decode", "--prompt", PROMPT, "--config.rule.name=nope"),
      _command(pair, "specjax.decode", "--prompt", long_prompt, "--config.decode.max_len=24"))
  assert nope.returncode != 0 and "Traceback" not in nope.stderr
  assert "unknown acceptance rule 'nope'" in nope.stderr
  assert all(name in nope.stderr for name in ("exact", "greedy", "lenient", "fuzzy"))
  assert too_long.returncode != 0 and "Traceback" not in too_long.stderr
  assert "max_len" in too_long.stderr and "24" in too_long.stderr
  # 24 positions - max_new_tokens 8 - gamma 4; the prompt's own length in tokens, then the fixes
  assert "the longest prompt that fits is 12 tokens" in too_long.stderr
  assert re.search(r"has \d+ tokens for the target", too_long.stderr), too_long.stderr
  assert "--config.decode.truncate=left" in too_long.stderr
  assert "stats:" not in too_long.stdout


@pytest.mark.slow   # ~100 s of compiles; the sweep itself is covered by test_fuzzy's toy-pair run
def test_tradeoff_adaptive_writes_every_setting(pair):
  """eval.tradeoff --rule adaptive: reference points, exact SD and the three AdaSD variants, each
  with quality and an alternately timed speed, in CSV and JSON."""
  out = pair["root"] / "ada"
  (proc,) = _run(pair, _command(pair, "eval.tradeoff", f"--config.data.tokenizer={pair['spm']}",
                                "--rule", "adaptive", "--num_examples", "4", "--batch_size", "2",
                                "--timing_prompts", "1", "--repeats", "1", "--output", str(out)))
  assert proc.returncode == 0, proc.stderr[-3000:]
  records = json.loads(out.with_suffix(".json").read_text())["records"]
  assert [r["curve"] for r in records] == ["target", "draft", "exact", "adasd", "gen_only",
                                           "verify_only"]
  for r in records:
    assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0, r
    assert 0 <= r["quality"] <= 100, r
  assert records[3]["gamma"] == 20 and 1 <= records[3]["tau"] <= 21
  assert out.with_suffix(".csv").read_text().startswith("curve,")


def test_prompt_lookup_from_the_command_line(pair):
  """--config.draft.method=ngram: no draft model; greedy verification equals the target alone,
  and a rule that needs a draft distribution is refused with the reason."""
  greedy = ("--config.decode.temperature=0",)
  lookup, ar, fuzzy = _run(
      pair, _lookup(pair, "ngram", "--config.rule.name=greedy", *greedy),
      _decode(pair, "ngram_ar", "--config.draft.checkpoint=", *greedy),
      _lookup(pair, "ngram_fuzzy", "--config.rule.name=fuzzy"))
  lookup, ar = _ok_json(pair, lookup, "ngram"), _ok_json(pair, ar, "ngram_ar")
  assert lookup["results"][0]["tokens"] == ar["results"][0]["tokens"]
  assert lookup["settings"]["draft"]["method"] == "ngram"
  assert lookup["stats"]["draft_passes"] == 0
  assert fuzzy.returncode == 2 and "cannot verify prompt lookup" in fuzzy.stderr, fuzzy.stderr
  assert "Traceback" not in fuzzy.stderr
