"""The CLI's compile log (api/timing.CompileLog): a long compile is announced while it runs and
ended with its time, a fetch from the persistent cache is told apart from a compile, and a log
line never lands at the end of streamed text."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import monitoring

from specjax.api import timing
from specjax.app import cli


class _Lines(logging.Handler):
  def __init__(self):
    super().__init__()
    self.lines: list[str] = []

  def emit(self, record):
    self.lines.append(record.getMessage())


@contextlib.contextmanager
def _listening(after: float):
  """A CompileLog on a logger of its own -> the list of the lines it logs (until exit)."""
  log = logging.getLogger(f"specjax.test_compile_log.{after}")
  lines = _Lines()
  log.addHandler(lines)
  log.setLevel(logging.INFO)
  made = timing.CompileLog(log, after)
  try:
    yield lines.lines
  finally:
    made.close()
    log.removeHandler(lines)


def test_a_compile_is_ended_with_its_time():
  with _listening(after=0.0) as lines:             # every compile is "long"
    width = 7 + len(lines)                         # a shape no other test compiled
    jax.jit(lambda x: jnp.sin(x) * 2)(np.ones(width, np.float32)).block_until_ready()
  ends = [line for line in lines if line.startswith("compiled jit(<lambda>) in ")]
  assert ends and ends[-1].endswith("s")


def test_a_long_compile_is_announced_while_it_runs():
  """The events jax records around a compile (the start as a scalar, then the span), with the
  compile outlasting `after`: the announcement comes before the end."""
  with _listening(after=0.05) as lines:
    monitoring.record_scalar(timing._BACKEND_COMPILE, 10.0, fun_name="jit(h)")
    for _ in range(100):                           # up to 5 s for the timer's thread
      if lines:
        break
      time.sleep(0.05)
    monitoring.record_event_time_span(timing._BACKEND_COMPILE, 10.0, 14.0, fun_name="jit(h)")
  assert lines == ["compiling jit(h) (or fetching it from the compile cache) ...",
                   "compiled jit(h) in 4.0s"]


def test_a_cache_hit_is_said_as_a_fetch():
  """The events jax records around compile_or_get_cached (the start as a scalar, the cache hit,
  the span), as a fetch from the persistent cache sends them."""
  with _listening(after=0.0) as lines:
    monitoring.record_scalar(timing._BACKEND_COMPILE, 100.0, fun_name="jit(f)")
    monitoring.record_event(timing._CACHE_HIT)
    monitoring.record_event_time_span(timing._BACKEND_COMPILE, 100.0, 102.5, fun_name="jit(f)")
    monitoring.record_scalar(timing._BACKEND_COMPILE, 200.0, fun_name="jit(g)")
    monitoring.record_event_time_span(timing._BACKEND_COMPILE, 200.0, 203.0, fun_name="jit(g)")
  assert "fetched jit(f) from the compile cache in 2.5s" in lines
  assert "compiled jit(g) in 3.0s" in lines          # the hit of f's fetch is not g's


def test_a_short_compile_says_nothing():
  with _listening(after=60.0) as lines:
    jax.jit(lambda x: x - 1)(np.ones(11, np.float32)).block_until_ready()
  assert lines == []


def test_a_log_line_starts_its_own_line_after_streamed_text(monkeypatch, tmp_path):
  """stdout and stderr into one file (2>&1): streamed text that leaves a line open gets a line
  break before the next log line; a closed line gets none; separate files get none."""
  path = tmp_path / "both.txt"
  with open(path, "w") as both:
    monkeypatch.setattr(sys, "stdout", both)
    monkeypatch.setattr(sys, "stderr", both)
    handler = cli._Stderr()
    handler.setFormatter(logging.Formatter("LOG %(message)s"))
    record = lambda msg: logging.LogRecord("specjax", logging.INFO, __file__, 1, msg, (), None)
    cli.show("> prompt\n    return")
    handler.emit(record("one"))
    cli.show(" a + b\n")
    handler.emit(record("two"))
    both.flush()
  assert path.read_text() == "> prompt\n    return\nLOG one\n a + b\nLOG two\n"
  out, err = io.StringIO(), io.StringIO()                  # no file behind them: no guess
  monkeypatch.setattr(sys, "stdout", out)
  monkeypatch.setattr(sys, "stderr", err)
  cli.show("open")
  cli._Stderr().emit(record("three"))
  assert err.getvalue() == "three\n" and out.getvalue() == "open"
  cli.show("\n")


def test_the_cli_says_its_compiles_on_the_specjax_log():
  cli.setup()
  lines = _Lines()
  logging.getLogger("specjax").addHandler(lines)
  try:
    monitoring.record_scalar(timing._BACKEND_COMPILE, 300.0, fun_name="jit(z)")
    monitoring.record_event_time_span(timing._BACKEND_COMPILE, 300.0, 303.0, fun_name="jit(z)")
  finally:
    logging.getLogger("specjax").removeHandler(lines)
  assert lines.lines.count("compiled jit(z) in 3.0s") == 1       # one log, however many setups
