"""specjax.app.outputs: paths refused before work, atomic writes, strict JSON."""

import json
import math
import os

import numpy as np
import pytest

from specjax.app import outputs


def test_output_file_refusals(tmp_path):
  with pytest.raises(outputs.OutputPathError, match="is a directory"):
    outputs.check_output_file(tmp_path, "--output_json")
  with pytest.raises(outputs.OutputPathError, match="does not exist"):
    outputs.check_output_file(tmp_path / "missing" / "out.json", "--output_json")
  assert outputs.check_output_file(tmp_path / "out.json", "--output_json").is_absolute()


def test_read_only_directory_refused(tmp_path, monkeypatch):
  ro = tmp_path / "ro"
  ro.mkdir()
  ro.chmod(0o500)
  if os.geteuid() == 0:     # root writes anywhere: let access() answer as for a user
    monkeypatch.setattr(outputs.os, "access", lambda p, mode: False)
  with pytest.raises(outputs.OutputPathError, match="not writable"):
    outputs.check_output_file(ro / "out.json", "--output_json")
  with pytest.raises(outputs.OutputPathError, match="not writable"):
    outputs.check_workdir(ro, "--config.workdir")


def test_workdir_created_and_file_refused(tmp_path):
  assert outputs.check_workdir(tmp_path / "a" / "b", "--workdir").is_dir()
  (tmp_path / "f").write_text("x")
  with pytest.raises(outputs.OutputPathError, match="is a file"):
    outputs.check_workdir(tmp_path / "f", "--workdir")


def test_strict_json_and_atomic_write(tmp_path):
  path = tmp_path / "r.json"
  path.write_text("old")
  outputs.write_json(path, {"a": math.nan, "b": [np.float32(1.5), np.inf], "c": np.arange(2)})
  assert json.loads(path.read_text()) == {"a": None, "b": [1.5, None], "c": [0, 1]}
  with pytest.raises(RuntimeError):
    with outputs.atomic_path(path) as tmp:
      tmp.write_text("half")
      raise RuntimeError
  assert json.loads(path.read_text())["a"] is None     # the old file is untouched
  assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
