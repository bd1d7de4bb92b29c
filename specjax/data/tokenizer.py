"""Tokenizers: SentencePiece models trained here on the offline corpus, and local HF tokenizers.

Both wrappers expose one interface (what data sources, decoding CLIs and the cross-vocabulary rules
use): `encode(text) -> list[int]`, `decode(ids) -> str`, `vocab_size`, `pad_id`, `eos_id`,
`bos_id`, `unk_id`, `id_to_piece(id)`, `piece_to_id(piece)`.

SentencePiece settings (why):
* ids pad=0, eos=1, unk=2, bos=3: pad=0 matches T5 (its decoder start token is pad) and the
  zero-initialised buffers of the models; eos=1 as in T5.
* `byte_fallback=True` and `normalization_rule_name="identity"`, no whitespace collapsing, no dummy
  prefix: any text round-trips exactly (`decode(encode(t)) == t`), and decoding is concatenative
  (`decode(a + b) == decode(a) + decode(b)` unless a UTF-8 byte sequence is split), which the
  string-level SD algorithms rely on.
* "\n" is a user-defined piece and whitespace-only pieces are allowed, so indentation costs one
  token per level rather than one per space.

Trained models are cached under `cache_dir()` in a file named by the training settings; a second
call with the same settings loads it (`stdlib_tokenizer`, `get_tokenizer`).
"""

from __future__ import annotations

import logging
import dataclasses
import functools
import hashlib
import io
import json
import os
import pathlib
import re
import time
from typing import Iterable, Sequence

import sentencepiece as spm

from specjax.data.cache import atomic_write_bytes, cache_dir, settings_key
from specjax.models.hf_import import read_json_object
from specjax.models.transformers_lock import TRANSFORMERS

log = logging.getLogger(__name__)

PAD_ID, EOS_ID, UNK_ID, BOS_ID = 0, 1, 2, 3
MODEL_TYPES = ("unigram", "bpe")
TRAINER_VERSION = 1
_SPEC = re.compile(r"^stdlib:(unigram|bpe):(\d+)(?::(\d+))?$")


# The files a Hugging Face tokenizer is read from (one of them must be there).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "spiece.model", "vocab.txt")
SPM_FILE = "spm.model"   # a SentencePiece model saved beside specjax-trained checkpoints


class TokenizerNotFoundError(FileNotFoundError):
  """A checkpoint directory without tokenizer files; the message names the files looked for."""

  def __init__(self, path):
    super().__init__(f"{path} holds no tokenizer (looked for {', '.join(TOKENIZER_FILES)}, "
                     f"{SPM_FILE}): copy "
                     f"the model's tokenizer files there, or name them with "
                     f"--config.target.tokenizer / --config.draft.tokenizer")
    self.path = path


class TokenizerFileError(ValueError):
  """A checkpoint's tokenizer or config files that cannot be read; the message names the file."""


# The JSON files transformers reads to build a checkpoint's tokenizer (and specjax, for its ids).
_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "config.json", "generation_config.json")


def _unreadable(path, err: Exception) -> TokenizerFileError:
  """What transformers' failure to read the tokenizer of `path` means: a JSON file of it that is
  not JSON (named), else transformers' own reason."""
  for name in _JSON_FILES:
    file = pathlib.Path(path) / name
    try:
      if file.is_file():
        read_json_object(file, name)
    except ValueError as bad:
      return TokenizerFileError(str(bad))
  if type(err).__module__.split(".")[0] == "huggingface_hub":   # a strict config check
    reason = str(err).strip().splitlines()[-1].strip()
    return TokenizerFileError(f"{pathlib.Path(path) / 'config.json'}: transformers refuses it "
                              f"while reading the tokenizer ({reason}): write the field as that "
                              f"type (1.0 for a float, 32 for an integer)")
  return TokenizerFileError(f"transformers cannot read the tokenizer of {path} "
                            f"({type(err).__name__}: {err})")


class NoChatTemplateError(ValueError):
  """A chat prompt asked of a tokenizer without a chat template; carries its `path`."""

  def __init__(self, path: str):
    self.path = path
    super().__init__(f"the tokenizer {path} has no chat template (a Hugging Face checkpoint "
                     f"keeps one in tokenizer_config.json or chat_template.jinja; a SentencePiece "
                     f"model never has one): pass the prompts as plain text, or use a checkpoint "
                     f"whose tokenizer has a chat template (an instruct model)")


def _ints(ids) -> list[int]:
  return [int(i) for i in getattr(ids, "tolist", lambda: ids)()]


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
  """A SentencePiece model. `decode` drops pad/eos/bos and ids outside the vocabulary (models may
  pad their vocabulary to a round size), so raw generated ids can be decoded directly."""
  path: str
  sp: spm.SentencePieceProcessor = dataclasses.field(repr=False)

  @classmethod
  def load(cls, path: str | os.PathLike) -> "Tokenizer":
    path = str(path)
    if not os.path.isfile(path):
      raise FileNotFoundError(f"no SentencePiece model at {path}: train one with "
                              "specjax.data.tokenizer.stdlib_tokenizer() or pass a .model file")
    try:
      sp = spm.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError) as err:
      raise ValueError(f"{path} is not a SentencePiece model ({err}): the file is damaged or of "
                       f"another kind; copy the checkpoint's tokenizer again") from None
    return cls(path=path, sp=sp)

  @property
  def vocab_size(self) -> int:
    return self.sp.get_piece_size()

  @property
  def pad_id(self) -> int:
    return self.sp.pad_id()

  @property
  def eos_id(self) -> int:
    return self.sp.eos_id()

  @property
  def bos_id(self) -> int:
    return self.sp.bos_id()

  @property
  def unk_id(self) -> int:
    return self.sp.unk_id()

  def encode(self, text: str) -> list[int]:
    return self.sp.encode(text)

  def decode(self, ids: Sequence[int]) -> str:
    special = {self.pad_id, self.eos_id, self.bos_id}
    return self.sp.decode([i for i in _ints(ids) if 0 <= i < self.vocab_size and i not in special])

  def id_to_piece(self, i: int) -> str:
    return self.sp.id_to_piece(int(i))

  def piece_to_id(self, piece: str) -> int:
    return self.sp.piece_to_id(piece)

  @functools.cached_property
  def fingerprint(self) -> str:
    """A digest of what decides the ids of a text and the text of ids: every piece, its score
    and type (the trainer's settings and file names do not count)."""
    sp = self.sp
    rows = [(sp.id_to_piece(i), round(float(sp.get_score(i)), 6), sp.is_control(i),
             sp.is_unknown(i), sp.is_byte(i)) for i in range(sp.get_piece_size())]
    return _digest({"pieces": rows, "special": [self.pad_id, self.eos_id, self.bos_id]})

  def apply_chat_template(self, user_text: str) -> str:
    """Never returns: a SentencePiece model has no chat template (NoChatTemplateError)."""
    raise NoChatTemplateError(self.path)


@dataclasses.dataclass(frozen=True, eq=False)
class HFTokenizer:
  """A Hugging Face tokenizer from a local checkpoint directory, with the `Tokenizer` interface.

  `encode` adds no special tokens (the data sources add BOS/EOS themselves). Special ids come from
  the checkpoint: the tokenizer's, else its generation_config.json's, else `eos_id` (GPT-2 defines
  neither pad nor BOS). `eos_ids` are all the ids that end a text, the tokenizer's EOS first
  (`eos_id`), then generation_config.json's `eos_token_id` (an int or a list): Qwen instruct ends a
  turn with <|im_end|> and a text with <|endoftext|>, Llama 3 instruct with <|eot_id|> and
  <|end_of_text|>.
  """
  path: str
  tok: object = dataclasses.field(repr=False)
  eos_ids: tuple[int, ...]
  bos_id: int
  pad_id: int
  add_bos: bool = True           # whether a model input starts with bos_id (the tokenizer's own
                                 # encoding with special tokens does: Llama yes, Qwen and GPT-2 no)

  @classmethod
  def load(cls, path: str | os.PathLike) -> "HFTokenizer":
    if not os.path.isdir(path):
      raise FileNotFoundError(f"no Hugging Face checkpoint directory at {path}: pass a local "
                              "directory holding tokenizer.json / tokenizer_config.json")
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
      # transformers would build a tokenizer that knows no text and decode every id to ""
      raise TokenizerNotFoundError(path)
    with TRANSFORMERS:
      import transformers   # heavy import, only when used
      try:
        tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
      except Exception as err:     # huggingface_hub's strict config checks raise Exception's
        if not isinstance(err, (ValueError, TypeError, KeyError, OSError)) and \
            type(err).__module__.split(".")[0] != "huggingface_hub":
          raise
        raise _unreadable(path, err) from err
    if not tok.encode("def f(x):", add_special_tokens=False):
      # Files that name a tokenizer class but hold no vocabulary (a tokenizer_config.json alone)
      raise ValueError(f"the tokenizer files in {path} give a tokenizer of {len(tok)} ids that "
                       "encodes text to no ids: copy the model's tokenizer.json (or vocab.json "
                       "and merges.txt) there, or name a tokenizer with --config.target.tokenizer "
                       "/ --config.draft.tokenizer")
    generation = _generation_config(path)
    candidates = [tok.eos_token_id, *_id_list(generation.get("eos_token_id"))]
    eos_ids = tuple(dict.fromkeys(i for i in candidates if i is not None))   # unique, in order
    if not eos_ids:
      raise ValueError(f"the checkpoint in {path} defines no EOS token; set eos_token in its "
                       "tokenizer_config.json or eos_token_id in its generation_config.json")
    return cls(path=str(path), tok=tok, eos_ids=eos_ids,
               bos_id=_first_id(tok.bos_token_id, generation.get("bos_token_id"), eos_ids[0]),
               pad_id=_first_id(tok.pad_token_id, generation.get("pad_token_id"), eos_ids[0]),
               add_bos=_adds_bos(tok))

  @classmethod
  def from_gguf(cls, path: str | os.PathLike) -> "HFTokenizer":
    """The tokenizer a GGUF file's metadata describes (byte-level BPE, its chat template, and
    every end-of-generation id), built in memory."""
    from specjax.data import gguf_tokenizer
    from specjax.models import gguf_import
    ckpt = gguf_import.GGUFCheckpoint(path)
    ids = gguf_import.generation_config(ckpt)
    eos_ids = tuple(_id_list(ids.get("eos_token_id")))
    if not eos_ids:
      raise ValueError(f"the GGUF file {path} defines no EOS token (tokenizer.ggml.eos_token_id)")
    return cls(path=str(path), tok=gguf_tokenizer.build(ckpt), eos_ids=eos_ids,
               bos_id=_first_id(ids.get("bos_token_id"), eos_ids[0]),
               pad_id=_first_id(ids.get("pad_token_id"), eos_ids[0]),
               add_bos=gguf_tokenizer.adds_bos(ckpt.metadata))

  @property
  def vocab_size(self) -> int:
    return len(self.tok)

  @property
  def eos_id(self) -> int:
    return self.eos_ids[0]

  @property
  def unk_id(self) -> int | None:
    return self.tok.unk_token_id

  def encode(self, text: str) -> list[int]:
    return list(self.tok.encode(text, add_special_tokens=False))

  def decode(self, ids: Sequence[int]) -> str:
    ids = [i for i in _ints(ids) if 0 <= i < self.vocab_size]
    return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

  def id_to_piece(self, i: int) -> str:
    return self.tok.convert_ids_to_tokens(int(i))

  def piece_to_id(self, piece: str) -> int:
    return self.tok.convert_tokens_to_ids(piece)

  @functools.cached_property
  def fingerprint(self) -> str:
    """A digest of what decides the ids of a text and the text of ids: the vocabulary and merges,
    normalizer, pre-tokenizer, decoder, added tokens and special ids (a chat template, file names
    and sizes do not count: the Qwen coder pair differs only in its template)."""
    backend = getattr(self.tok, "backend_tokenizer", None)
    if backend is not None:
      spec = json.loads(backend.to_str())
      parts = {k: spec.get(k) for k in ("model", "normalizer", "pre_tokenizer", "decoder",
                                         "added_tokens")}
    else:
      parts = {"vocab": sorted(self.tok.get_vocab().items())}
    return _digest({**parts, "special": [list(self.eos_ids), self.bos_id, self.pad_id]})

  def apply_chat_template(self, user_text: str) -> str:
    """One user turn in the checkpoint's chat format, ending where the assistant's reply starts:
    the text to `encode` (its special tokens are in the text, so none are added again)."""
    if not getattr(self.tok, "chat_template", None):
      raise NoChatTemplateError(self.path)
    return self.tok.apply_chat_template([{"role": "user", "content": user_text}],
                                        add_generation_prompt=True, tokenize=False)


def _digest(obj) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


# What a fast tokenizer in a checkpoint directory is loaded from: tokenizer.json, and the files
# that add tokens to it or name its special tokens (the chat template does not count).
FAST_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "added_tokens.json")


def _fast_files_digest(tok) -> str | None:
  """sha256 of FAST_FILES in the directory an HFTokenizer was loaded from, with its special ids;
  None for other tokenizers (a SentencePiece model, one built from a GGUF file) or a directory
  without tokenizer.json. Equal digests load the same tokenizer: a check of a few milliseconds
  where the fingerprint parses and re-serialises the whole vocabulary (about a second for
  Qwen's 151,646 tokens)."""
  if not isinstance(tok, HFTokenizer) or not os.path.isfile(os.path.join(tok.path,
                                                                          FAST_FILES[0])):
    return None
  digest = hashlib.sha256(repr([list(tok.eos_ids), tok.bos_id, tok.pad_id]).encode())
  for name in FAST_FILES:
    file = pathlib.Path(tok.path, name)
    digest.update(f"\0{name}\0".encode())
    digest.update(file.read_bytes() if file.is_file() else b"(absent)")
  return digest.hexdigest()


def cache_key(tok) -> str:
  """A key for what is computed from a tokenizer's ids and cached (token counts): the digest of
  its tokenizer files and special ids where it was loaded from a directory (_fast_files_digest:
  a read of a few files), else its fingerprint (which re-serialises the whole vocabulary, on
  every run that reads the cache). Two keys for one vocabulary only cost one more computation."""
  files = _fast_files_digest(tok)
  return f"files-{type(tok.tok).__name__}-{files}" if files else tok.fingerprint


def same_vocabulary(a, b) -> bool:
  """Whether two tokenizers give every text the same ids (and ids the same text): the same
  object or file, the same tokenizer files with the same special ids (_fast_files_digest), else
  equal fingerprints."""
  if a is b or a.path == b.path:
    return True
  files = _fast_files_digest(a)
  return (files is not None and files == _fast_files_digest(b)) or a.fingerprint == b.fingerprint


def _adds_bos(tok) -> bool:
  """Whether a transformers tokenizer starts its encoding with special tokens with BOS (what
  transformers' generate feeds the model for a text): Llama's do; Qwen2's and GPT-2's add none,
  though they name a BOS token."""
  bos = tok.bos_token_id
  if bos is None:
    return False
  plain, special = (tok.encode("a", add_special_tokens=flag) for flag in (False, True))
  return special[:1] == [bos] and plain[:1] != [bos]


def _generation_config(path: str | os.PathLike) -> dict:
  """The checkpoint's generation_config.json ({} when it has none)."""
  file = pathlib.Path(path) / "generation_config.json"
  if not file.is_file():
    return {}
  return read_json_object(file, "a generation_config.json")


def _first_id(*ids: int | None) -> int:
  return next(i for i in ids if i is not None)


def _id_list(value) -> list[int]:
  """An HF token-id field: None, an int or a list of ints."""
  if value is None:
    return []
  return [int(i) for i in value] if isinstance(value, (list, tuple)) else [int(value)]


def train_sentencepiece(texts: Iterable[str], path: str | os.PathLike, *,
                        model_type: str = "unigram", vocab_size: int = 8000,
                        num_threads: int = 2) -> pathlib.Path:
  """Train a SentencePiece model on `texts` (one example per string, newlines allowed) to `path`."""
  if model_type not in MODEL_TYPES:
    raise ValueError(f"model_type {model_type!r} is not one of {MODEL_TYPES}")
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(texts), model_writer=model, model_type=model_type,
      vocab_size=vocab_size, pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=BOS_ID,
      byte_fallback=True, character_coverage=0.9995, normalization_rule_name="identity",
      remove_extra_whitespaces=False, add_dummy_prefix=False, allow_whitespace_only_pieces=True,
      split_digits=True, user_defined_symbols=["\n"], max_sentence_length=1 << 16,
      num_threads=num_threads, minloglevel=2)
  path = pathlib.Path(path)
  atomic_write_bytes(path, model.getvalue())
  return path


def stdlib_tokenizer(model_type: str = "unigram", vocab_size: int = 8000, *,
                     max_chars: int | None = None, verbose: bool = True) -> Tokenizer:
  """A SentencePiece model trained on the `stdlib_lm` train split (first `max_chars` characters
  of it if given), cached under `cache_dir()` by its settings."""
  from specjax.data import stdlib_corpus
  corpus = stdlib_corpus.load_corpus(verbose=verbose)
  settings = {"v": TRAINER_VERSION, "corpus": corpus.digest, "type": model_type,
              "vocab": vocab_size, "max_chars": max_chars, "sp": spm.__version__}
  path = cache_dir() / f"sp-stdlib-{model_type}{vocab_size}-{settings_key(settings)}.model"
  if not path.exists():
    texts = _take_chars(corpus.lm_split("train"), max_chars)
    if verbose:
      log.info("training SentencePiece %s vocab=%d on %d texts (%.1f MB) ...", model_type,
               vocab_size, len(texts), sum(map(len, texts)) / 1e6)
    start = time.perf_counter()
    train_sentencepiece(texts, path, model_type=model_type, vocab_size=vocab_size)
    if verbose:
      log.info("tokenizer trained in %.1fs -> %s", time.perf_counter() - start, path)
  return Tokenizer.load(path)


def _take_chars(texts: Sequence[str], max_chars: int | None) -> list[str]:
  if max_chars is None:
    return list(texts)
  out, total = [], 0
  for t in texts:
    if total >= max_chars:
      break
    out.append(t)
    total += len(t)
  return out


def get_tokenizer(spec: str) -> Tokenizer | HFTokenizer:
  """A tokenizer from a config string: "stdlib:unigram:8000" / "stdlib:bpe:2000" (trained and
  cached on first use; "stdlib:unigram:8000:2000000" trains on the corpus's first 2M characters
  only, a few seconds instead of half a minute), a SentencePiece .model file, a GGUF file (its
  metadata's tokenizer), or a checkpoint directory: its spm.model where specjax saved one (a
  specjax-trained checkpoint: transformers would read that directory as a tokenizer without a
  vocabulary), else its Hugging Face tokenizer files."""
  match = _SPEC.match(spec)
  if match:
    max_chars = int(match.group(3)) if match.group(3) else None
    return stdlib_tokenizer(match.group(1), int(match.group(2)), max_chars=max_chars)
  if os.path.isdir(spec):
    own = os.path.join(spec, SPM_FILE)
    return Tokenizer.load(own) if os.path.isfile(own) else HFTokenizer.load(spec)
  if os.path.isfile(spec) and spec.endswith(".gguf"):
    return HFTokenizer.from_gguf(spec)
  if os.path.isfile(spec):
    return Tokenizer.load(spec)
  if os.sep in spec or spec.endswith((".model", ".gguf")):
    raise FileNotFoundError(f"tokenizer {spec} does not exist: give an existing SentencePiece "
                            f".model file, GGUF file or Hugging Face checkpoint directory")
  raise ValueError(f"tokenizer {spec!r} is neither 'stdlib:<unigram|bpe>:<vocab_size>[:<chars>]', "
                   "a SentencePiece .model file, a GGUF file, nor a local Hugging Face checkpoint "
                   "directory")
