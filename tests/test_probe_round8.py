"""Defects found by the eighth probe round and the items earlier rounds left alone, each with the
behaviour it had: a device read forever as a prompt or problems file, ..."""

from __future__ import annotations

from pathlib import Path

import pytest

from eval import problems as problem_file
from specjax import decode
from specjax.app.config import ConfigError


@pytest.mark.parametrize("read", [
    lambda path: decode.read_prompt_file(path),
    lambda path: problem_file.load_problems(Path(path)),
])
def test_a_device_is_refused_as_an_input_file(read):
  """--problems /dev/zero read lines forever (memory without bound)."""
  with pytest.raises(ConfigError, match=r"/dev/zero is a device, not a file: give a"):
    read("/dev/zero")
