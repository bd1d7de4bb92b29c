"""Issue #26's command-line cases as one table: no lost file, no silent wrong result, no traceback.

Each case is a command (a tool and its argv, with {placeholders} for the paths the fixtures
make), the exit status it must end with, a phrase its last stderr line must hold, and the paths
that must be unchanged afterwards (a file's bytes, a device's kind and number, a directory's whole
tree; a path that did not exist must still not exist). The tools run in-process (`main(argv)`).

Refusals that must come before any model is built carry a checkpoint that does not exist
(MISSING; distill_tiny's models are built from fields: a missing init_from, NO_TEACHER and
NO_STUDENT): if the check under test did not fire, the run stops on that instead, with another
message (never on a long build or a zoo download)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.resources
import inspect
import json
import logging
import os
import shutil
import stat
import string
import textwrap
from pathlib import Path

import jax
import pytest

from eval import humaneval, latency, matmul, quality, startup, tradeoff
from specjax import checkpoint, decode
from specjax.data.tokenizer import train_sentencepiece
from specjax.models import hf_import
from train import distill

TOOLS = {"train.distill": distill.main,
         "train.pretrain": lambda argv: distill.main(argv, pretrain=True),
         "eval.latency": latency.main, "eval.humaneval": humaneval.main,
         "eval.startup": startup.main, "eval.matmul": matmul.main, "specjax.decode": decode.main,
         "eval.tradeoff": tradeoff.main, "eval.quality": quality.main}
MISSING = "--config.target.checkpoint=/nonexistent/specjax-target"
# distill_tiny's models are built from fields: a missing init_from stops them instead.
NO_TEACHER = "--config.target.init_from=/nonexistent/specjax-target"
NO_STUDENT = "--config.draft.init_from=/nonexistent/specjax-draft"
MATMUL = ["--k", "8", "--n", "8", "--rows", "2", "--dtypes", "float32", "--repeats", "1"]
TRAIN = ["--config", "distill_tiny.py", "--config.train.progress=false",
         "--config.train.eval_every=0", "--config.train.batch_size=4",
         "--config.train.async_checkpoint=false"]
PRETRAIN_DRAFT = [*TRAIN, "--config.pretrain.model=draft", "--config.pretrain.steps=1"]
HUMANEVAL = ["--config", "tiny.py", MISSING, "--problems", "{problems}"]


@dataclasses.dataclass(frozen=True)
class Case:
  id: str
  tool: str
  argv: tuple[str, ...]
  code: int
  phrase: str
  unchanged: tuple[str, ...] = ()
  needs: tuple[str, ...] = ()        # fixtures beyond the files: devices, pair, pretrained, busy


def case(id, tool, argv, code, phrase, unchanged=(), needs=()) -> Case:
  return Case(id, tool, tuple(argv), code, phrase, tuple(unchanged), tuple(needs))


CASES = [
    # ------------------------------------------------------------------------------- lost data
    case("output-null-device", "eval.matmul", [*MATMUL, "--output_json", "{null}"], 0, "",
         ["{null}"], ["devices"]),
    case("output-full-device", "eval.matmul", [*MATMUL, "--output_json", "{full}"], 2,
         "{full} could not be written (No space left on device)", ["{full}"], ["devices"]),
    case("output-fifo", "eval.matmul", [*MATMUL, "--output_json", "{fifo}"], 0, "", ["{fifo}"]),
    case("output-empty", "specjax.decode", ["--config", "tiny.py", MISSING, "--prompt", "x",
                                            "--output_json", ""], 2,
         "--output_json is empty: give a file name"),
    case("output-is-config", "eval.latency", ["--config", "{cfg}", MISSING, "--output_json",
                                              "{cfg}"], 2,
         "--output_json {cfg} would overwrite --config {cfg}", ["{cfg}"]),
    case("output-is-config-by-symlink", "eval.latency",
         ["--config", "{cfg}", MISSING, "--output_json", "{cfg_link}"], 2,
         "would overwrite --config {cfg}", ["{cfg}", "{cfg_link}"]),
    case("output-is-gguf-checkpoint", "eval.latency",
         ["--config", "tiny.py", MISSING, "--config.draft.checkpoint={gguf}",
          "--output_json", "{gguf}"], 2, "would overwrite --config.draft.checkpoint {gguf}",
         ["{gguf}"]),
    case("output-is-checkpoint-config-json", "eval.latency",
         ["--config", "tiny.py", MISSING, "--config.draft.checkpoint={ckpt}",
          "--output_json", "{ckpt}/config.json"], 2,
         "would overwrite --config.draft.checkpoint {ckpt}", ["{ckpt}"]),
    case("output-is-problems-by-hard-link", "eval.humaneval",
         ["--config", "tiny.py", MISSING, "--problems", "{problems}", "--output_json",
          "{problems_link}"], 2, "would overwrite --problems {problems}", ["{problems}"]),
    case("startup-output-is-config", "eval.startup",
         ["--config", "{cfg}", MISSING, "--output_md", "{cfg}"], 2,
         "--output_md {cfg} would overwrite --config {cfg}", ["{cfg}"]),
    case("startup-two-outputs-one-file", "eval.startup",
         ["--config", "tiny.py", MISSING, "--output_json", "{tmp}/o.txt", "--output_md",
          "{tmp}/o.txt"], 2, "--output_md {tmp}/o.txt is also --output_json", ["{tmp}/o.txt"]),
    case("workdir-is-init-from", "train.distill",
         [*TRAIN, "--workdir", "{init}", "--config.target.init_from={init}"], 2,
         "--workdir {init} would overwrite --config.target.init_from {init}", ["{init}"]),
    # ------------------------------------------------------------------------------ tracebacks
    case("quality-output-is-config", "eval.quality", ["--config", "{cfg}", "--output_json",
                                                      "{cfg}"], 2,
         "would overwrite --config {cfg}, an input of this run", ["{cfg}"]),
    case("tradeoff-negative-value", "eval.tradeoff",
         ["--config", "tiny.py", "--rule", "fuzzy", "--values", "-1,0.5", "--random_values", ""],
         2, "fuzzy threshold must be >= 0 (0 = target only, inf = accept all), got -1.0"),
    case("config-syntax-error", "eval.latency", ["--config", "{tmp}/syntax.py"], 2,
         "config {tmp}/syntax.py, line 3 (def get_config(:): SyntaxError: invalid syntax: fix "
         "the config file", ["{tmp}/syntax.py"]),
    case("config-get-config-raises", "eval.latency", ["--config", "{tmp}/raises.py"], 2,
         "config {tmp}/raises.py, line 6 (c.x = 1 / 0): ZeroDivisionError: division by zero"),
    case("config-import-fails", "train.distill",
         ["--config", "{tmp}/imports.py", "--workdir", "{tmp}/w"], 2,
         "config {tmp}/imports.py, line 1 (import specjax_no_such_module): "
         "ModuleNotFoundError", ["{tmp}/w"]),
    case("config-returns-a-dict", "eval.latency", ["--config", "{tmp}/plain.py"], 2,
         "get_config() returned dict, not an ml_collections.ConfigDict"),
    case("chat-without-template", "specjax.decode",
         ["--config", "tiny.py", "--config.target.checkpoint={target}",
          "--config.draft.checkpoint={draft}", "--config.decode.chat=true", "--prompt", "hi"], 2,
         "has no chat template: drop --config.decode.chat=true", needs=["pair"]),
    # ------------------------------------------------------------ silent wrong training results
    case("workdir-empty", "train.distill", [*TRAIN, NO_TEACHER, "--workdir", ""], 2,
         "--workdir is empty", ["{cwd}"]),
    case("workdir-in-use", "train.distill", [*TRAIN, NO_TEACHER, "--workdir", "{busy}"], 2,
         "workdir {busy} is in use by another training run (process {pid} holds",
         ["{busy}"], ["busy"]),
    case("learning-rate-nan", "train.distill",
         [*TRAIN, NO_TEACHER, "--workdir", "{tmp}/w", "--config.train.learning_rate=nan"], 2,
         "--config.train.learning_rate=nan is not a learning rate", ["{tmp}/w"]),
    case("pretrain-model-unknown", "train.pretrain",
         [*TRAIN, NO_TEACHER, "--workdir", "{tmp}/w", "--config.pretrain.model=bogus"], 2,
         "--config.pretrain.model='bogus': pretraining trains the target or the draft"),
    case("humaneval-problems-not-jsonl", "eval.humaneval",
         ["--config", "tiny.py", MISSING, "--problems", "{cfg}"], 2,
         "is not a JSON-lines problems file"),
    case("pretrain-learning-rate-negative", "train.pretrain",
         [*TRAIN, NO_TEACHER, "--workdir", "{tmp}/w", "--config.pretrain.learning_rate=-1"], 2,
         "--config.pretrain.learning_rate=-1.0 is not a learning rate", ["{tmp}/w"]),
    case("distill-in-a-pretrain-workdir", "train.distill",
         [*TRAIN, NO_TEACHER, "--workdir", "{pretrained}", "--config.train.steps=2"], 2,
         "holds a train.pretrain run, and this is train.distill", ["{pretrained}"],
         ["pretrained"]),
    case("pretrain-resumed-with-other-data", "train.pretrain",
         [*PRETRAIN_DRAFT, NO_STUDENT, "--workdir", "{pretrained}", "--config.data.seed=1"], 2,
         "--config.data.seed: 0 there, 1 now", ["{pretrained}"], ["pretrained"]),
    case("pretrain-resumed-as-another-model", "train.pretrain",
         [*PRETRAIN_DRAFT, NO_TEACHER, "--workdir", "{pretrained}",
          "--config.pretrain.model=target"], 2,
         '--config.pretrain.model: "draft" there, "target" now', ["{pretrained}"], ["pretrained"]),
    # ------------------------------------------------------------------- misleading messages
    case("distributed-without-coordinator", "train.distill",
         [*TRAIN, NO_TEACHER, "--workdir", "{tmp}/w", "--config.distributed.enabled=true"], 2,
         "--config.distributed.coordinator=HOST:PORT"),
    case("startup-probe-fails", "eval.startup", ["--config", "tiny.py", MISSING], 2,
         "the probe failed (eval.startup_probe --config ...): "),
    case("damaged-verifier-json", "specjax.decode",
         ["--config", "tiny.py", MISSING, "--config.rule.name=sprinter",
          "--config.rule.verifier={verifier}", "--prompt", "x"], 2,
         "the verifier file {verifier}/verifier.json is damaged (not JSON",
         ["{verifier}"]),
    # D83: the target alone ignores the rule and the draft's settings; the user's own are refused
    case("rule-without-draft", "specjax.decode",
         ["--config", "tiny.py", MISSING, "--config.draft.checkpoint=",
          "--config.rule.name=lenient", "--config.decode.gamma=5", "--prompt", "x"], 2,
         "--config.rule.name=lenient, --config.decode.gamma=5 have no effect without a draft: "
         "the target decodes alone"),
    case("rule-turned-off-with-rule-settings", "specjax.decode",
         ["--config", "tiny.py", MISSING, "--config.rule.name=", "--config.rule.threshold=0.5",
          "--prompt", "x"], 2,
         "--config.rule.threshold=0.5 has no effect with --config.rule.name=''"),
    case("no-draft-keeps-the-config-rule-silently", "specjax.decode",   # stops on MISSING
         ["--config", "tiny.py", MISSING, "--config.draft.checkpoint=", "--prompt", "x"], 2,
         "/nonexistent/specjax-target"),
    # T17: a bad value of the pretrain section is named by the pretrain flag
    case("pretrain-steps-negative", "train.pretrain",
         [*TRAIN, NO_TEACHER, "--workdir", "{tmp}/w", "--config.pretrain.steps=-1"], 2,
         "--config.pretrain: steps must be >= 1, got -1", ["{tmp}/w"]),
    case("train-steps-negative-when-distilling", "train.distill",
         [*TRAIN, NO_TEACHER, "--workdir", "{tmp}/w", "--config.train.steps=-1"], 2,
         "--config.train: steps must be >= 1, got -1", ["{tmp}/w"]),
    # 6: a workdir from before run.json: its checkpoint's metadata tells the job that wrote it
    case("distill-in-an-old-pretrain-workdir", "train.distill",
         [*TRAIN, NO_TEACHER, "--workdir", "{old_pretrained}", "--config.train.steps=2"], 2,
         "--workdir {old_pretrained} has no run.json, but its checkpoint of step 1 was written by "
         "train.pretrain (loss nll), and this is train.distill", ["{old_pretrained}"],
         ["pretrained"]),
    # T44: a decoding config given to a trainer is refused by its sections, before any work
    case("distill-with-a-decoding-config", "train.distill",
         ["--config", "tiny.py", "--workdir", "{tmp}/w"], 2,
         "tiny.py is a decoding config (no train section; its sections: data, decode, "
         "distributed, draft, draft_raw, mesh, rule, target): train.distill needs a training "
         "config: use distill_tiny.py (or distill_lm1b.py", ["{tmp}/w"]),
    case("pretrain-with-a-verifier-config", "train.pretrain",
         ["--config", "sprinter_tiny.py", "--workdir", "{tmp}/w"], 2,
         "sprinter_tiny.py is a train.verifier config (no train section", ["{tmp}/w"]),
    # ------------------------------------------------------------- probe round 3 (issue #26)
    case("output-over-a-file-of-the-specjax-cache", "specjax.decode",
         ["--config", "tiny.py", MISSING, "--prompt", "x", "--output_json", "{cache}/kept.json"],
         2, "--output_json {cache}/kept.json is in specjax's cache ({cache}",
         ["{cache}/kept.json"]),
    case("output-under-a-file", "specjax.decode",
         ["--config", "tiny.py", MISSING, "--prompt", "x", "--output_json", "{cfg}/out.json"], 2,
         "{cfg} is a file, not a directory: choose another path", ["{cfg}"]),
    case("input-jsonl-without-prompt", "specjax.decode",
         ["--config", "tiny.py", MISSING, "--input_file", "{tmp}/wrong.jsonl"], 2,
         'wrong.jsonl line 1 has no "prompt" (fields \'text\'): a .jsonl file holds one JSON '
         'object per line'),
    case("input-json-document", "specjax.decode",
         ["--config", "tiny.py", MISSING, "--input_file", "{tmp}/prompts.json"], 2,
         "is a JSON document, and its lines would be decoded as text"),
    case("slrs-max-depth-zero", "specjax.decode",
         ["--config", "tiny.py", MISSING, "--config.rule.name=slrs", "--config.rule.max_depth=0",
          "--prompt", "x"], 2, "--config.rule: max_depth=0: SLRS drafts at least one token"),
    case("pretrain-ignores-train-learning-rate", "train.pretrain",
         [*TRAIN, NO_TEACHER, "--workdir", "{tmp}/w", "--config.train.learning_rate=1e-3"], 2,
         "--config.train.learning_rate has no effect on train.pretrain (this config's pretrain "
         "section sets it, and pretraining reads that): set --config.pretrain.learning_rate",
         ["{tmp}/w"]),
    case("distill-ignores-pretrain-steps", "train.distill",
         [*TRAIN, NO_TEACHER, "--workdir", "{tmp}/w", "--config.pretrain.steps=5"], 2,
         "--config.pretrain.steps has no effect on train.distill (the pretrain section is "
         "train.pretrain's): set --config.train.steps", ["{tmp}/w"]),
    case("humaneval-limit-negative", "eval.humaneval", [*HUMANEVAL, "--limit", "-1"], 2,
         "--limit must be at least 0 (0: all problems), got -1"),
    case("humaneval-chunk-tokens-negative", "eval.humaneval",
         [*HUMANEVAL, "--chunk_tokens", "-1"], 2,
         "--chunk_tokens must be at least 0 (0: all --max_new_tokens at once), got -1"),
    case("humaneval-timeout-zero", "eval.humaneval", [*HUMANEVAL, "--timeout_s", "0"], 2,
         "--timeout_s must be a number of seconds above 0, got 0.0"),
    case("humaneval-memory-zero", "eval.humaneval", [*HUMANEVAL, "--memory_mb", "0"], 2,
         "--memory_mb must be at least 16 (below that the Python that runs a test cannot start"),
    case("humaneval-problems-missing", "eval.humaneval",
         ["--config", "tiny.py", MISSING, "--problems", "{tmp}/none.jsonl"], 2,
         "--problems {tmp}/none.jsonl does not exist: give a JSON-lines problems file"),
    case("humaneval-problems-directory", "eval.humaneval",
         ["--config", "tiny.py", MISSING, "--problems", "{init}"], 2,
         "--problems {init} is a directory: give a JSON-lines problems file", ["{init}"]),
    case("startup-t5-benchmark-is-a-file", "eval.startup", ["--t5_benchmark", "{cfg}"], 2,
         "--t5_benchmark {cfg} is a file, not a directory: choose another path", ["{cfg}"]),
    case("startup-t5-memory-is-a-file", "eval.startup", ["--t5_memory", "{cfg}"], 2,
         "--t5_memory {cfg} is a file, not a directory: choose another path", ["{cfg}"]),
    # ------------------------------------------------------------- probe round 4 (7, 9-12)
    case("target-dtype-unknown", "specjax.decode",
         ["--config", "tiny.py", MISSING, "--config.target.dtype=float16", "--prompt", "x"], 2,
         "--config.target: dtype='float16': use one of float32, bfloat16"),
    case("draft-dtype-unknown-before-the-target-loads", "specjax.decode",   # draft not loadable
         ["--config", "tiny.py", "--config.target.checkpoint={target}",
          "--config.draft.checkpoint=/nonexistent/specjax-draft", "--config.draft.dtype=bf16",
          "--prompt", "x"], 2, "--config.draft: dtype='bf16': use one of float32, bfloat16",
         needs=["pair"]),
    case("distill-student-unknown", "train.distill",
         [*TRAIN, NO_TEACHER, "--workdir", "{tmp}/w", "--config.distill.student=bogus"], 2,
         "--config.distill: student must be one of draft, head, got 'bogus'", ["{tmp}/w"]),
    case("distill-cache-batches-negative", "train.distill",
         [*TRAIN, NO_TEACHER, "--workdir", "{tmp}/w", "--config.distill.cache_batches=-1"], 2,
         "--config.distill: cache_batches must be >= 0 and cache_top_k >= 1, got -1 and 64",
         ["{tmp}/w"]),
    case("distill-cache-top-k-zero", "train.distill",
         [*TRAIN, NO_TEACHER, "--workdir", "{tmp}/w", "--config.distill.cache_top_k=0"], 2,
         "--config.distill: cache_batches must be >= 0 and cache_top_k >= 1, got 0 and 0",
         ["{tmp}/w"]),
    # a file as the written models' directory stops a run that got past the check under test
    case("startup-gpt2-memory-with-config", "eval.startup",
         ["--gpt2_memory", "{cfg}", "--config", "qwen_coder.py"], 2,
         "--gpt2_memory runs fixed cases under a config of its own, and would ignore --config "
         "qwen_coder.py: drop it", ["{cfg}"]),
    case("startup-t5-memory-with-case", "eval.startup",
         ["--t5_memory", "{cfg}", "--case", "g2=--config.decode.gamma=2"], 2,
         "--t5_memory runs fixed cases under a config of its own, and would ignore --case "
         "g2=--config.decode.gamma=2", ["{cfg}"]),
    case("startup-t5-benchmark-with-override", "eval.startup",
         ["--t5_benchmark", "{cfg}", "--config.decode.max_new_tokens=64"], 2,
         "--t5_benchmark runs fixed cases under a config of its own, and would ignore "
         "--config.decode.max_new_tokens=64", ["{cfg}"]),
    case("startup-gpt2-memory-with-the-default-config", "eval.startup",   # not refused
         ["--gpt2_memory", "{cfg}", "--config", "tiny.py"], 2,
         "--gpt2_memory {cfg} is a file, not a directory", ["{cfg}"]),
    case("matmul-rows-empty", "eval.matmul", [*MATMUL, "--rows", ""], 2,
         "--rows '' has an empty value: give comma-separated whole numbers, e.g. 1,3,5 (or leave "
         "--rows out for its default)"),
    case("latency-gamma-empty", "eval.latency",
         ["--config", "tiny.py", MISSING, "--gamma", ""], 2, "--gamma '' has an empty value"),
    case("latency-gamma-empty-item", "eval.latency",
         ["--config", "tiny.py", MISSING, "--gamma", "3,,4"], 2,
         "--gamma '3,,4' has an empty value"),
    case("train-steps-zero", "train.distill",
         [*TRAIN, NO_TEACHER, "--workdir", "{tmp}/w", "--config.train.steps=0"], 2,
         "--config.train: steps must be >= 1, got 0 (0 steps would export the untrained "
         "initial params", ["{tmp}/w"]),
    case("pretrain-steps-zero", "train.pretrain",
         [*TRAIN, NO_TEACHER, "--workdir", "{tmp}/w", "--config.pretrain.steps=0"], 2,
         "--config.pretrain: steps must be >= 1, got 0", ["{tmp}/w"]),
]


# ---------------------------------------------------------------------------------- fixtures

@pytest.fixture(autouse=True)
def _restore_process_state():
  """cli.setup gives the specjax logger a handler on the sys.stderr of its time (pytest's
  capture closes it after the test); the distributed set-up picks a CPU collectives backend."""
  root = logging.getLogger("specjax")
  handlers, collectives = list(root.handlers), jax.config.jax_cpu_collectives_implementation
  yield
  root.handlers[:] = handlers
  jax.config.update("jax_cpu_collectives_implementation", collectives)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  """A private specjax cache (compiled programs) for the module's runs."""
  with pytest.MonkeyPatch.context() as patch:
    root = tmp_path_factory.mktemp("cache")
    patch.setenv("SPECJAX_CACHE", str(root))
    patch.setenv("JAX_COMPILATION_CACHE_DIR", str(root / "jax-compile"))
    yield root


def make_files(tmp: Path, stack: contextlib.ExitStack) -> dict[str, str]:
  """The small files and directories the cases name, by placeholder."""
  shutil.copy(importlib.resources.files("specjax.configs") / "tiny.py", tmp / "cfg.py")
  (tmp / "cfg_link.json").symlink_to(tmp / "cfg.py")
  (tmp / "model.gguf").write_bytes(b"GGUF not really")
  (tmp / "ckpt").mkdir()
  (tmp / "ckpt" / "config.json").write_text('{"model_type": "gpt2"}')
  (tmp / "problems.jsonl").write_text('{"task_id": "t/0", "prompt": "def f():", "test": "", '
                                      '"entry_point": "f"}\n')
  os.link(tmp / "problems.jsonl", tmp / "problems_link.jsonl")
  (tmp / "syntax.py").write_text("import ml_collections\n\ndef get_config(:\n  return 1\n")
  (tmp / "raises.py").write_text("import ml_collections\n\n\ndef get_config():\n"
                                 "  c = ml_collections.ConfigDict()\n  c.x = 1 / 0\n  return c\n")
  (tmp / "imports.py").write_text("import specjax_no_such_module\n")
  (tmp / "plain.py").write_text("def get_config():\n  return {'decode': {}}\n")
  (tmp / "init").mkdir()
  (tmp / "verifier").mkdir()
  (tmp / "verifier" / "verifier.json").write_text('{"verifier": {"hidden_size": 8,')
  (tmp / "cwd").mkdir()
  (tmp / "prompts.json").write_text('["def f():", "import os"]\n')
  (tmp / "wrong.jsonl").write_text('{"text": "def f():"}\n')
  os.mkfifo(tmp / "fifo")
  reader = os.open(tmp / "fifo", os.O_RDONLY | os.O_NONBLOCK)   # a writer's open then returns
  stack.callback(os.close, reader)
  names = ("cfg", "cfg_link", "gguf", "ckpt", "problems", "problems_link", "init", "verifier",
           "cwd", "fifo")
  files = ("cfg.py", "cfg_link.json", "model.gguf", "ckpt", "problems.jsonl",
           "problems_link.jsonl", "init", "verifier", "cwd", "fifo")
  return {"tmp": str(tmp), "pid": str(os.getpid()),
          **{n: str(tmp / f) for n, f in zip(names, files)}}


def make_devices(tmp: Path) -> dict[str, str]:
  """Private copies of /dev/null and /dev/full (root only: mknod), so that a tool that replaced
  its output would not take the machine's own."""
  if os.geteuid() != 0:
    pytest.skip("character devices can be made by root only")
  for name, minor in (("null", 3), ("full", 7)):
    os.mknod(tmp / name, stat.S_IFCHR | 0o666, os.makedev(1, minor))
  return {"null": str(tmp / "null"), "full": str(tmp / "full")}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  """test_cli_end_to_end's tiny random target / draft checkpoints, with a SentencePiece
  tokenizer (which has no chat template)."""
  import test_cli_end_to_end as e2e      # tests/ is on sys.path under pytest
  root = tmp_path_factory.mktemp("pair")
  text = inspect.getsource(string) + inspect.getsource(textwrap)
  spm = train_sentencepiece(text[:12000].split("\n\n"), root / "bpe.model", model_type="bpe",
                            vocab_size=e2e.VOCAB, num_threads=1)
  dirs = {}
  for role, (model, params) in zip(("target", "draft"), e2e._tiny_pair()):
    dirs[role] = hf_import.save_model(model, params, root / role)
    shutil.copy(spm, dirs[role] / "spm.model")
  return dirs


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, cache):
  """A train.pretrain workdir of distill_tiny's draft, one step."""
  workdir = tmp_path_factory.mktemp("pretrained")
  assert TOOLS["train.pretrain"]([*PRETRAIN_DRAFT, "--workdir", str(workdir)]) == 0
  logging.getLogger("specjax").handlers.clear()
  return workdir


@pytest.fixture
def paths(request, tmp_path, monkeypatch, cache):
  """The placeholders of the requested case: files, and the fixtures it needs."""
  case_ = request.param
  with contextlib.ExitStack() as stack:
    values = make_files(tmp_path, stack)
    if "devices" in case_.needs:
      values.update(make_devices(tmp_path))
    if "pair" in case_.needs:
      found = request.getfixturevalue("pair")
      values.update(target=str(found["target"]), draft=str(found["draft"]))
    if "pretrained" in case_.needs:
      values["pretrained"] = str(request.getfixturevalue("pretrained"))
      old = shutil.copytree(values["pretrained"], tmp_path / "old_pretrained")
      (old / "run.json").unlink()             # as a specjax from before run records left it
      values["old_pretrained"] = str(old)
    if "busy" in case_.needs:
      values["busy"] = str(tmp_path / "busy")
      (tmp_path / "busy").mkdir()
      stack.enter_context(checkpoint.lock_workdir(tmp_path / "busy"))
    values["cache"] = str(cache)
    (cache / "kept.json").write_text("{}")
    monkeypatch.chdir(values["cwd"])
    yield values


def snapshot(path: Path):
  """What must not change: a file's bytes, a link's target, a device's kind and number, a
  directory's tree; None for a path that does not exist."""
  if not os.path.lexists(path):
    return None
  mode = os.lstat(path).st_mode
  if stat.S_ISLNK(mode):
    return ("link", os.readlink(path))
  if stat.S_ISDIR(mode):
    return ("dir", {str(p.relative_to(path)): snapshot(p) for p in sorted(path.rglob("*"))})
  if stat.S_ISREG(mode):
    return ("file", path.read_bytes())
  return ("special", stat.S_IFMT(mode), os.lstat(path).st_rdev)


# -------------------------------------------------------------------------------------- test

@pytest.mark.parametrize("paths", CASES, ids=[c.id for c in CASES], indirect=True)
def test_case(paths, request, capsys):
  case_ = request.node.callspec.params["paths"]
  argv = [a.format(**paths) for a in case_.argv]
  watched = [Path(u.format(**paths)) for u in case_.unchanged]
  before = [snapshot(p) for p in watched]
  code = TOOLS[case_.tool](argv)
  err = capsys.readouterr().err
  assert "Traceback" not in err, err
  assert code == case_.code, err[-3000:]
  if case_.code:
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{case_.tool}: error: ") or ": error: " in last, err[-3000:]
    assert case_.phrase.format(**paths) in last, err[-3000:]
  assert [snapshot(p) for p in watched] == before


def test_a_pretrain_workdir_records_its_run_and_resumes_with_more_steps(pretrained, cache,
                                                                        capsys):
  """What the refusals above must not refuse: the same job and fields with more steps (and the
  lock is gone with the run that held it)."""
  record = json.loads((pretrained / "run.json").read_text())
  assert record["job"] == "train.pretrain" and record["fields"]["pretrain.model"] == "draft"
  assert not (pretrained / ".specjax.lock.pid").exists()
  argv = [*PRETRAIN_DRAFT, "--workdir", str(pretrained), "--config.pretrain.steps=2"]
  assert TOOLS["train.pretrain"](argv) == 0, capsys.readouterr().err[-3000:]
  steps = [json.loads(line).get("step") for line in (pretrained / "metrics.jsonl").open()]
  assert 2 in steps
