"""The command-line edge shared by `specjax.decode`, `train.*` and `eval.*`: argument parsing with
`--config.a.b=v` overrides, logging, the persistent compilation cache, and user errors turned into
one line of advice and exit status 2 (SPECJAX_DEBUG=1 shows the traceback instead)."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
from typing import Callable

import jax

from specjax import checkpoint, sharding
from specjax.api import timing
from specjax.app.config import ConfigError
from specjax.data.cache import cache_dir
from specjax.data.tokenizer import NoChatTemplateError
from specjax.decoding.state import NonFiniteLogitsError
from specjax.models import hf_import, kv_cache
from specjax.sprinter.verifier import VerifierFileError, VerifierNotFoundError

USER_ERRORS = (ConfigError, ValueError, FileNotFoundError, KeyError, NotADirectoryError,
               IsADirectoryError, PermissionError, UnicodeDecodeError)


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
  return argparse.ArgumentParser(prog=prog, description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)


def parse(p: argparse.ArgumentParser, argv) -> tuple[argparse.Namespace, list[str]]:
  """Known flags, and every `--config.a.b=v` override (anything else is refused)."""
  args, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
  bad = [r for r in rest if not r.startswith("--config.")]
  if bad:
    p.error(f"unrecognized arguments: {' '.join(bad)} (overrides look like --config.a.b=v)")
  return args, rest


class Elapsed(logging.Formatter):
  """`specjax [  12.3s]: message`: every line says when it happened, in seconds since the
  process started (logging's clock starts when the module is first imported, at start-up)."""

  def format(self, record: logging.LogRecord) -> str:
    return f"specjax [{record.relativeCreated / 1e3:6.1f}s]: {record.getMessage()}"


class _Stderr(logging.StreamHandler):
  """A handler that writes to whatever sys.stderr is at each record (a tool run in-process,
  e.g. by a test that captures stderr, keeps logging to the current stream, not a closed one).
  A record that comes while streamed text has left a line open on the same terminal or file
  (`show`) starts on a new line rather than at the end of the text."""

  @property
  def stream(self):
    return sys.stderr

  @stream.setter
  def stream(self, _):
    pass

  def emit(self, record):
    global _open_line
    if _open_line and _same_file(sys.stdout, sys.stderr):
      sys.stderr.write("\n")
      _open_line = False
    super().emit(record)


_open_line = False      # the text streamed last (show) did not end its line


def show(text: str) -> None:
  """Writes streamed text to stdout at once (flushed), and remembers whether it left a line
  open for the log handler (_Stderr)."""
  global _open_line
  sys.stdout.write(text)
  sys.stdout.flush()
  if text:
    _open_line = not text.endswith("\n")


def _same_file(a, b) -> bool:
  """Whether two streams write to one terminal, pipe or file (2>&1)."""
  try:
    return os.path.samestat(os.fstat(a.fileno()), os.fstat(b.fileno()))
  except (AttributeError, OSError, ValueError):     # a stream without a file (a test's buffer)
    return False


def setup() -> None:
  """Library logs (specjax.*) to stderr, and compiled programs persisted under the specjax
  cache (or $JAX_COMPILATION_CACHE_DIR) so that a second run starts fast."""
  handler = _Stderr()
  handler.setFormatter(Elapsed())
  root = logging.getLogger("specjax")
  if not root.handlers:
    root.addHandler(handler)
  root.setLevel(logging.INFO)
  root.propagate = False     # absl (via orbax) configures the root logger: no line twice
  jax.config.update("jax_compilation_cache_dir", os.environ.get("JAX_COMPILATION_CACHE_DIR")
                    or str(cache_dir() / "jax-compile"))
  # Every program is persisted: one compiling in under the old 0.5 s floor was compiled again
  # on every run (docs/results.md, start-up).
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  timing.log_compiles(root)       # a first run's compilation is a phase, said with its time
  # What is alive now (jax, flax, transformers, ... once imported) is never garbage: keep it out
  # of the collections that tracing triggers and of the one at exit, which took 1-1.5 s.
  gc.freeze()
  atexit.register(gc.freeze)


@contextlib.contextmanager
def sigterm_as_interrupt():
  """Within: SIGTERM (a scheduler's stop, `kill`) raises KeyboardInterrupt like Ctrl-C, so that
  `with` blocks and `finally` clauses clean up (temporary directories, child processes) instead
  of the process ending where it stands. The previous handler is restored on leaving."""
  if threading.current_thread() is not threading.main_thread():
    yield                       # only the main thread may set handlers (and gets the signal)
    return

  def interrupt(signum, frame):
    raise KeyboardInterrupt
  previous = signal.signal(signal.SIGTERM, interrupt)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


def exit_now(status: int) -> None:
  """Ends the process at once with `status` (after flushing stdout and stderr), without waiting
  for background threads: a second Ctrl-C during a checkpoint save, whose threads, cut short at
  interpreter exit, printed a traceback for each callback still queued."""
  sys.stdout.flush()
  sys.stderr.flush()
  logging.shutdown()
  os._exit(status)


def advice(err: Exception) -> str:
  """The error's message, with the flag that mends it where the error's data tells which."""
  if isinstance(err, kv_cache.CacheOverflowError):
    # Prompts too long for a decoder-only cache are refused earlier (api.prompt_fit, naming
    # --config.decode.truncate); what gets here is the generated part (a T5 decoder's cache holds
    # its start token, the new tokens and a block), which no truncation of the prompt shortens.
    return (f"{err.what} needs {err.needed} cache positions but the cache holds {err.capacity}: "
            f"raise --config.decode.max_len to at least {err.needed} (0: sized for each batch), "
            f"or lower --config.decode.max_new_tokens or --config.decode.gamma")
  if isinstance(err, sharding.HeadsError):
    choices = ", ".join(str(v) for v in err.valid)
    return (f"--config.mesh.model={err.model_axis} divides neither the {err.heads} attention "
            f"heads nor the {err.kv_heads} KV heads of {err.what}: set --config.mesh.model to "
            f"one of {choices} (and --config.mesh.data=-1 to use the other devices for rows)")
  if isinstance(err, sharding.MeshError):
    return f"{err} (set --config.mesh.data and --config.mesh.model)"
  if isinstance(err, sharding.DistributedSetupError):
    return (f"{err}: on every process set --config.distributed.coordinator=HOST:PORT (process "
            f"0's address), --config.distributed.num_processes=N and "
            f"--config.distributed.process_id=I (0..N-1), or --config.distributed.enabled=false "
            f"for one process")
  if isinstance(err, (VerifierNotFoundError, VerifierFileError)):
    return f"{err} (train one with python -m train.verifier, then --config.rule.verifier=WORKDIR)"
  if isinstance(err, NoChatTemplateError):
    return (f"the tokenizer {err.path} has no chat template: drop --config.decode.chat=true (the "
            f"prompts are then plain text), or use a checkpoint whose tokenizer has one (an "
            f"instruct model)")
  if isinstance(err, checkpoint.WorkdirBusyError):
    return f"{err}: wait for it to finish (or stop it), or choose another --workdir"
  if isinstance(err, hf_import.CheckpointNotFoundError):
    return str(err)
  if isinstance(err, NonFiniteLogitsError):
    return (f"{err} (--config.{err.role}.dtype, --config.{err.role}.checkpoint: decoding with the "
            f"{err.role} model alone shows whether its weights are at fault)")
  if isinstance(err, KeyError):
    return f"missing key {err}"
  return str(err)


def run(prog: str, fn: Callable[[], int | None]) -> int:
  """fn() with user errors reported as `PROG: error: ...` and exit status 2, and SIGTERM taken
  as Ctrl-C (a scheduler's stop keeps what Ctrl-C keeps: a partial report, progress files)."""
  try:
    with sigterm_as_interrupt():
      return fn() or 0
  except USER_ERRORS as err:
    if os.environ.get("SPECJAX_DEBUG"):
      raise
    print(f"{prog}: error: {advice(err)}", file=sys.stderr)
    return 2
