"""specjax.app.outputs: paths refused before work, atomic writes, strict JSON."""

import json
import math
import os
import stat

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


def test_a_fifo_is_written_in_place_and_stays_a_fifo(tmp_path):
  fifo = tmp_path / "fifo"
  os.mkfifo(fifo)
  reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
  try:
    assert outputs.check_output_file(fifo, "--output_json") == fifo
    outputs.write_json(fifo, {"a": math.inf})
    assert json.loads(os.read(reader, 1 << 16)) == {"a": None}
  finally:
    os.close(reader)
  assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]       # no temporary left


def test_a_descriptor_path_is_written_in_place(tmp_path):
  """/dev/stdout and /dev/fd/N lead through /proc/self/fd: a pipe gets the text; a regular file
  behind the descriptor keeps its inode and what was written before, and the link stays."""
  read, write = os.pipe()
  try:
    outputs.write_text(f"/proc/self/fd/{write}", "through a pipe\n")
    assert os.read(read, 100) == b"through a pipe\n"
  finally:
    os.close(read), os.close(write)
  behind = tmp_path / "log.txt"
  behind.write_text("printed before\n")
  inode = behind.stat().st_ino
  with open(behind, "a") as f:
    link = tmp_path / "stdout"
    link.symlink_to(f"/proc/self/fd/{f.fileno()}")           # what /dev/stdout is
    assert outputs.writes_in_place(link)
    outputs.write_json(link, [1])
  assert behind.read_text() == "printed before\n[\n  1\n]\n" and behind.stat().st_ino == inode
  assert link.is_symlink()


def test_a_full_device_is_an_error_naming_it(tmp_path):
  if os.geteuid() != 0:
    pytest.skip("a character device can be made by root only")
  full = tmp_path / "full"
  os.mknod(full, stat.S_IFCHR | 0o666, os.makedev(1, 7))      # a private /dev/full
  with pytest.raises(outputs.OutputPathError, match=f"{full} could not be written .No space"):
    outputs.write_json(full, {"a": 1})
  assert stat.S_ISCHR(os.lstat(full).st_mode)


def test_a_device_needs_only_to_be_writable_itself(monkeypatch):
  """A user may write /dev/null though /dev itself is not writable to them."""
  monkeypatch.setattr(outputs.os, "access", lambda p, mode: str(p) == "/dev/null")
  assert str(outputs.check_output_file("/dev/null", "--output_json")) == "/dev/null"


def test_a_symlinked_output_is_replaced_behind_its_link(tmp_path):
  (tmp_path / "real").mkdir()
  target = tmp_path / "real" / "out.json"
  target.write_text("old")
  link = tmp_path / "out.json"
  link.symlink_to(target)
  outputs.write_json(link, {"new": 1})
  assert link.is_symlink() and json.loads(target.read_text()) == {"new": 1}


def test_an_empty_workdir_is_refused():
  with pytest.raises(outputs.OutputPathError, match="--workdir is empty"):
    outputs.check_workdir("", "--workdir")


def test_outputs_that_are_inputs_are_refused(tmp_path):
  config, ckpt = tmp_path / "c.py", tmp_path / "ckpt"
  config.write_text("x")
  ckpt.mkdir()
  (ckpt / "model.safetensors").write_bytes(b"w")
  (ckpt / "latency.json").write_text("{}")
  os.link(config, tmp_path / "hard.py")
  (tmp_path / "soft.py").symlink_to(config)
  inputs = {"--config": str(config), "--config.draft.checkpoint": str(ckpt), "--problems": None,
            "--input_file": str(tmp_path / "absent.txt")}
  for same in (config, tmp_path / "hard.py", tmp_path / "soft.py", tmp_path / "." / "c.py"):
    with pytest.raises(outputs.OutputPathError, match=f"would overwrite --config {config}"):
      outputs.check_not_input(same, inputs, "--output_json")
  with pytest.raises(outputs.OutputPathError, match="would overwrite --config.draft.checkpoint"):
    outputs.check_not_input(ckpt / "model.safetensors", inputs, "--output_json")
  (tmp_path / "weights.json").symlink_to(ckpt / "model.safetensors")    # a link into the input
  with pytest.raises(outputs.OutputPathError, match="would overwrite --config.draft.checkpoint"):
    outputs.check_not_input(tmp_path / "weights.json", inputs, "--output_json")
  with pytest.raises(outputs.OutputPathError, match="--workdir .* would overwrite"):
    outputs.check_not_input(ckpt, inputs, "--workdir")
  for fine in (tmp_path / "new.json", ckpt / "latency.json", None, "/dev/null"):
    outputs.check_not_input(fine, inputs, "--output_json")


def test_an_output_under_proc_is_refused_before_any_work():
  with pytest.raises(outputs.OutputPathError, match="/proc/specjax-x.md is not writable"):
    outputs.check_output_file("/proc/specjax-x.md", "--output_md")
