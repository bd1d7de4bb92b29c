"""The offline corpus: the Python standard library that ships with the interpreter.

Every fresh machine that runs specjax has it (`sysconfig.get_paths()['stdlib']`), so the small
models, tokenizers and benchmarks need no download. Two tasks are cut from it:

* `stdlib_lm` (the LM1B analogue, decoder-only): chunks of source code of about `CHUNK_TARGET`
  characters, cut at blank lines, comments and docstrings included. Code was chosen over docstring
  prose because it is the most predictable text on the machine (indentation, keywords, closing
  brackets, repeated identifiers), so a 1-4M parameter LM trained for a few minutes on 2 CPU cores
  already predicts much of it, and a small draft agrees with a larger target often enough for
  speculative decoding to be measurable; docstring prose alone is only ~1 MB and much harder.
* `stdlib_sum` (the T5 / XSum analogue, input -> output): a function or method with its docstring
  removed -> the first sentence of that docstring (code summarisation), scored with ROUGE-2 and
  ROUGE-L (`specjax.data.metrics`). The names, calls and return statements of a function carry much
  of its summary ("Return the number of ..."), so a small encoder-decoder learns it quickly.

Determinism: files are walked in sorted order with fixed skip lists (tests, idlelib, site-packages,
generated tables, the machine-specific _sysconfigdata, ...), every text is derived from the file
contents alone, and the split of an example is a function of a SHA-256 of its prompt text (not
Python's salted `hash()`), so the same example lands in the same split on every machine, and
identical prompts share a split (no validation/test prompt appears in training). Only top-level
functions and methods of top-level classes become summarisation examples, so no example's input
contains another example's input.
The two tasks are split independently: do not pretrain the summariser on `stdlib_lm` train chunks
and then evaluate it on `stdlib_sum` test (the chunks contain those functions).

The stdlib differs slightly between Python versions; the corpus is therefore fixed per interpreter
version, and the cache key carries that version. Extraction takes ~4 s (ast parsing of ~9 MB), so
the result is cached as gzipped JSON under `cache_dir()`.
"""

from __future__ import annotations

import logging
import ast
import dataclasses
import gzip
import hashlib
import json
import os
import re
import sys
import sysconfig
import textwrap
import time
import warnings

from specjax.data.cache import atomic_write_bytes, cache_dir, settings_key

log = logging.getLogger(__name__)

EXTRACT_VERSION = 2                # bump on any change to the extraction below
SPLITS = ("train", "validation", "test")
SKIP_DIRS = frozenset({
    "test", "tests", "idlelib", "site-packages", "dist-packages", "turtledemo", "ensurepip",
    "lib-dynload", "__pycache__", "encodings", "pydoc_data", "__phello__", "lib2to3", "msilib",
})
SKIP_FILES = frozenset({"html/entities.py", "antigravity.py", "this.py"})   # tables / rot13 text
MAX_FILE_CHARS = 400_000          # guards against generated files; _pydecimal.py (230k) stays
CHUNK_TARGET = 600                # LM chunk: close at the first blank line past this many chars
CHUNK_MAX = 1500                  # ... and never grow past this many
CHUNK_MIN = 80
SUM_MAX_INPUT_CHARS = 4000
SUM_WORDS = (3, 32)               # summary length bounds, in words
VALID_FRAC = 0.05
TEST_FRAC = 0.05


@dataclasses.dataclass(frozen=True)
class Corpus:
  """The extracted texts, in extraction order (sorted files, then position in file)."""
  lm: tuple[str, ...]                    # code chunks
  summaries: tuple[tuple[str, str], ...]  # (function without docstring, first docstring sentence)
  files: int
  python: str
  digest: str = ""                       # content hash: keys caches built from this corpus

  def lm_split(self, split: str) -> tuple[str, ...]:
    return tuple(t for t in self.lm if split_of(t) == _check_split(split))

  def sum_split(self, split: str) -> tuple[tuple[str, str], ...]:
    return tuple(p for p in self.summaries if split_of(p[0]) == _check_split(split))


def _check_split(split: str) -> str:
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}: use one of {SPLITS}")
  return split


def split_of(text: str, valid_frac: float = VALID_FRAC, test_frac: float = TEST_FRAC) -> str:
  """The split of an example, from a SHA-256 of its prompt text: stable across machines and runs."""
  u = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2.0**64
  if u < valid_frac:
    return "validation"
  if u < valid_frac + test_frac:
    return "test"
  return "train"


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def list_files(root: str) -> list[str]:
  """Relative paths of the .py files used, sorted; tests and generated/vendored dirs skipped."""
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-"))
    rel = os.path.relpath(dirpath, root)
    for name in sorted(filenames):
      path = os.path.normpath(os.path.join(rel, name)).replace(os.sep, "/")
      if (name.endswith(".py") and not name.startswith(("test_", "_sysconfigdata"))
          and path not in SKIP_FILES):
        out.append(path)
  return sorted(out)


def _read(path: str) -> str | None:
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except (UnicodeDecodeError, OSError):
    return None
  return text if len(text) <= MAX_FILE_CHARS else None


def code_chunks(source: str) -> list[str]:
  """Cut a file into chunks at blank lines; trailing whitespace is stripped from every line.

  A chunk closes at the first blank line once it holds CHUNK_TARGET chars, or mid-paragraph
  before it would pass CHUNK_MAX; lines longer than CHUNK_MAX are cut. Chunks under CHUNK_MIN
  chars are dropped.
  """
  chunks, cur, size = [], [], 0
  def flush():
    nonlocal cur, size
    text = "\n".join(cur).strip("\n")
    if len(text) >= CHUNK_MIN:
      chunks.append(text)
    cur, size = [], 0
  for line in source.splitlines():
    line = line.rstrip()[:CHUNK_MAX]
    if not line and size >= CHUNK_TARGET:
      flush()
      continue
    if size + len(line) + 1 > CHUNK_MAX:
      flush()
    if cur or line:
      cur.append(line)
      size += len(line) + 1
  flush()
  return chunks


def _summary(doc: str) -> str | None:
  """First sentence of the first paragraph, whitespace collapsed; None if unusable."""
  para = " ".join(doc.strip().split("\n\n")[0].split())
  match = re.search(r"(?<=[.!?])\s", para)
  sentence = para[:match.start()] if match else para
  words = sentence.split()
  if not SUM_WORDS[0] <= len(words) <= SUM_WORDS[1] or ">>>" in sentence:
    return None
  if re.match(r"^[\w.]+\(.*\)\s*(->.*)?$", sentence):   # a signature line, not a summary
    return None
  return sentence


def _strip_docstring(lines: list[str], node: ast.AST) -> str | None:
  """The function's source (decorators included, dedented) without its docstring lines."""
  doc, rest = node.body[0], node.body[1:]
  if not rest or (len(rest) == 1 and _is_trivial(rest[0])):
    return None                                    # nothing to summarise (abstract / stub)
  if rest[0].lineno <= doc.end_lineno or doc.lineno <= node.lineno:
    return None                                    # docstring shares a line with code
  start = min([d.lineno for d in node.decorator_list] + [node.lineno])
  after = lines[doc.end_lineno:node.end_lineno]
  while after and not after[0].strip():
    after = after[1:]
  kept = lines[start - 1:doc.lineno - 1] + after
  text = textwrap.dedent("\n".join(line.rstrip() for line in kept)).strip("\n")
  return text if len(text) <= SUM_MAX_INPUT_CHARS else None


def _is_trivial(stmt: ast.stmt) -> bool:
  if isinstance(stmt, ast.Pass):
    return True
  if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
    return True
  return isinstance(stmt, ast.Raise) and "NotImplementedError" in ast.dump(stmt)


def _functions(tree: ast.Module):
  """Top-level functions and methods of top-level classes (never nested in a function)."""
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      yield node
    elif isinstance(node, ast.ClassDef):
      yield from (n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def summary_pairs(source: str) -> list[tuple[str, str]]:
  try:
    with warnings.catch_warnings():              # invalid escapes in old files: not our concern
      warnings.simplefilter("ignore")
      tree = ast.parse(source)
  except SyntaxError:
    return []
  lines, pairs = source.splitlines(), []
  for node in _functions(tree):
    doc = ast.get_docstring(node, clean=True)
    summary = doc and _summary(doc)
    code = summary and _strip_docstring(lines, node)
    if code:
      pairs.append((code, summary))
  return pairs


def extract(root: str | None = None, files: list[str] | None = None) -> Corpus:
  """Extract the corpus from `root` (default: this interpreter's stdlib); pure and deterministic."""
  root = root or stdlib_root()
  files = list_files(root) if files is None else sorted(files)
  lm, pairs, seen_lm, seen_in, used = [], [], set(), set(), 0
  for rel in files:
    source = _read(os.path.join(root, rel))
    if source is None:
      continue
    used += 1
    for chunk in code_chunks(source):
      if chunk not in seen_lm:
        seen_lm.add(chunk)
        lm.append(chunk)
    for code, summary in summary_pairs(source):
      if code not in seen_in:
        seen_in.add(code)
        pairs.append((code, summary))
  blob = json.dumps([lm, pairs]).encode()
  return Corpus(lm=tuple(lm), summaries=tuple(pairs), files=used, python=_python_tag(),
                digest=hashlib.sha256(blob).hexdigest()[:16])


def _python_tag() -> str:
  return f"{sys.implementation.name}-{'.'.join(map(str, sys.version_info[:3]))}"


_MEMO: dict[str, Corpus] = {}


def _read_cached(path) -> Corpus | None:
  """The cached corpus, or None if absent or unreadable (then it is rebuilt and rewritten)."""
  try:
    data = json.loads(gzip.decompress(path.read_bytes()))
    return Corpus(lm=tuple(data["lm"]), summaries=tuple(map(tuple, data["summaries"])),
                  files=data["files"], python=data["python"], digest=data["digest"])
  except (OSError, ValueError, KeyError, EOFError):
    return None


def load_corpus(verbose: bool = True) -> Corpus:
  """This interpreter's stdlib corpus: from the cache dir if present, else extracted and cached."""
  key = settings_key({"v": EXTRACT_VERSION, "py": _python_tag(), "root": stdlib_root(),
                      "skip": sorted(SKIP_DIRS | SKIP_FILES),
                      "chunk": [CHUNK_TARGET, CHUNK_MAX, CHUNK_MIN],
                      "sum": [SUM_MAX_INPUT_CHARS, *SUM_WORDS]})
  if key in _MEMO:
    return _MEMO[key]
  path = cache_dir() / f"stdlib-corpus-{_python_tag()}-{key}.json.gz"
  corpus = _read_cached(path)
  if corpus is None:
    start = time.perf_counter()
    corpus = extract()
    blob = json.dumps(dataclasses.asdict(corpus)).encode()
    atomic_write_bytes(path, gzip.compress(blob, compresslevel=6, mtime=0))
    if verbose:
      log.info("extracted the stdlib corpus (%d files, %d chunks, %d summaries) in %.1fs -> %s",
               corpus.files, len(corpus.lm), len(corpus.summaries), time.perf_counter() - start,
               path)
  _MEMO[key] = corpus
  return corpus
