"""Cache builds (a pair fetched, a GGUF converted, the embedded pair trained) hold a cross-process
file lock: a second process waits for the first, saying which process it waits for, instead of
writing into the same half-built folder."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from specjax.data.cache import build_lock

HOLD = """
import sys, time
from specjax.data.cache import build_lock
with build_lock("pypi:fake"):
    print("held", flush=True)
    time.sleep(2)
"""


def test_a_second_process_waits_for_the_build_and_names_the_holder(tmp_path, monkeypatch,
                                                                   caplog):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  env = {**os.environ, "SPECJAX_CACHE": str(tmp_path), "JAX_PLATFORMS": "cpu"}
  holder = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True,
                            env=env)
  try:
    assert holder.stdout.readline().strip() == "held"
    with caplog.at_level(logging.INFO, logger="specjax.data.cache"):
      with build_lock("pypi:fake"):
        finished_first = holder.poll() is not None or holder.wait(timeout=5) == 0
        assert holder.returncode == 0       # the holder ended before we got the lock
    assert finished_first
    assert f"waiting for process {holder.pid}, which is building pypi:fake" in caplog.text
  finally:
    holder.kill()


def test_the_lock_is_reentrant_in_one_thread(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  with build_lock("builtin:tiny"):
    with build_lock("builtin:tiny"):          # a build that resolves another entry under it
      pass
  with build_lock("builtin:tiny"):            # released: taken again at once
    pass
