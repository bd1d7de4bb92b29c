"""The tokenizer a GGUF file's metadata describes (`tokenizer.ggml.*`), built as a transformers
fast tokenizer: byte-level BPE with the pre-tokenizer `tokenizer.ggml.pre` names, the file's
control and user-defined tokens, its chat template and special ids. Only the tokens and merges
come from the file; the tokenizers library does the tokenizing."""

from __future__ import annotations

from specjax.models import gguf_import
from specjax.models.gguf_import import GGUFCheckpoint, GGUFError
from specjax.models.transformers_lock import TRANSFORMERS

# Pre-tokenizer regexes by `tokenizer.ggml.pre` (from the models' own tokenizer.json files).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_TOKENIZERS = ("default", "gpt2", "qwen2", "llama-bpe", "llama3", "smollm")


def adds_bos(meta: dict) -> bool:
  """Whether text is encoded with a leading BOS: tokenizer.ggml.add_bos_token, which a byte-level
  BPE vocabulary (all that specjax builds) leaves false when absent, as llama.cpp does. Qwen2.5
  sets it false: a leading <|endoftext|> was prepended to every prompt before."""
  return bool(meta.get("tokenizer.ggml.add_bos_token", False))


def build(ckpt: GGUFCheckpoint):
  """A transformers fast tokenizer from the metadata (byte-level BPE only)."""
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
  from tokenizers import pre_tokenizers, processors
  meta = ckpt.metadata
  kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
  if kind != "gpt2":
    raise GGUFError(f"{ckpt.path}: tokenizer.ggml.model '{kind}' is not supported (specjax builds "
                    f"byte-level BPE tokenizers, 'gpt2'); name a tokenizer directory instead.")
  if pre not in _PRE_TOKENIZERS:
    raise GGUFError(f"{ckpt.path}: tokenizer.ggml.pre '{pre}' is not supported; known: "
                    f"{', '.join(_PRE_TOKENIZERS)}.")
  tokens = list(meta["tokenizer.ggml.tokens"])
  merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
  # Llama 3's tokenizer.json looks a piece up whole before merging (ignore_merges); Qwen2's not.
  tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                             ignore_merges=pre in ("llama-bpe", "llama3")))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  if pre in ("qwen2", "llama-bpe", "llama3"):
    split = _QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
  elif pre == "smollm":
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  else:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre == "qwen2":
    tok.normalizer = normalizers.NFC()
  tok.decoder = decoders.ByteLevel()
  types = list(meta.get("tokenizer.ggml.token_type") or [])
  added = lambda kind: [t for t, k in zip(tokens, types) if k == kind]
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t in added(gguf_import.CONTROL)])
  tok.add_tokens([AddedToken(t, special=False, normalized=False)
                  for t in added(gguf_import.USER_DEFINED)])
  ids = gguf_import.special_ids(meta)
  unknown = meta.get("tokenizer.ggml.unknown_token_id")
  for key, value in (*ids.items(), ("unknown_token_id", unknown)):
    outside = [i for i in (value if isinstance(value, list) else [value])
               if i is not None and not 0 <= int(i) < len(tokens)]
    if outside:
      raise GGUFError(f"{ckpt.path}: its tokenizer's {key.replace('_token_id', '')} id "
                      f"{outside[0]} is outside its {len(tokens)} tokens "
                      f"(tokenizer.ggml.tokens): the file is damaged; re-download or re-export it")
  name = lambda i: tokens[i] if i is not None else None
  if adds_bos(meta) and ids["bos_token_id"] is not None:
    # What llama.cpp and the source tokenizer do: encoding with special tokens starts with BOS.
    bos = name(ids["bos_token_id"])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, ids["bos_token_id"])])
  eos = ids["eos_token_id"]
  with TRANSFORMERS:
    import transformers
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=name(ids["bos_token_id"]),
        eos_token=name(eos[0] if isinstance(eos, list) else eos),
        pad_token=name(ids["pad_token_id"]),
        unk_token=name(meta.get("tokenizer.ggml.unknown_token_id")),
        chat_template=meta.get("tokenizer.chat_template"), clean_up_tokenization_spaces=False)
