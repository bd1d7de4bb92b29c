"""Tiny random Llama-family checkpoints with real Hugging Face tokenizers, written by specjax itself
(no torch): a Qwen2-style target with a byte-level BPE ("Ġ" for a space, GPT-2 / Qwen style) and a
Llama-style draft with a Metaspace BPE ("▁" for a space, byte-fallback pieces <0x00>..<0xFF>, the
layout of Llama 2's tokenizer.json). Shared by test_cross_family and test_load_errors."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from specjax.models import hf_import, llama

TEXT = ("def read_lines(path):\n    with open(path) as f:\n        return f.read().split()\n"
        "class Stack:\n    def __init__(self):\n        self.items = []\n"
        "    def push(self, item):\n        self.items.append(item)\n"
        "the cat sat on the mat and the dog ate the bone\n")
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def byte_level_bpe(path: Path, vocab_size: int = 300) -> int:
  """A Qwen-style byte-level BPE saved in `path`; returns its size. Ids 0-2 are QWEN_SPECIALS."""
  tk = pytest.importorskip("tokenizers")
  transformers = pytest.importorskip("transformers")
  bpe = tk.Tokenizer(tk.models.BPE())
  bpe.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = tk.decoders.ByteLevel()
  trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=QWEN_SPECIALS,
                                   initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
  bpe.train_from_iterator([TEXT] * 10, trainer)
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
      chat_template=CHAT_TEMPLATE)
  fast.save_pretrained(path)
  return len(fast)


def metaspace_bpe(path: Path, merges_vocab: int = 120) -> int:
  """A Llama-2-style BPE saved in `path`; returns its size: <unk> <s> </s>, then the 256
  byte-fallback pieces, then the pieces learned on TEXT with "▁" for a space."""
  tk = pytest.importorskip("tokenizers")
  transformers = pytest.importorskip("transformers")
  learner = tk.Tokenizer(tk.models.BPE(unk_token="<unk>"))
  learner.pre_tokenizer = tk.pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
  learner.train_from_iterator([TEXT] * 10, tk.trainers.BpeTrainer(
      vocab_size=merges_vocab, special_tokens=LLAMA_SPECIALS))
  learned = json.loads(learner.to_str())["model"]
  vocab = {s: i for i, s in enumerate(LLAMA_SPECIALS)}
  vocab.update({f"<0x{b:02X}>": len(LLAMA_SPECIALS) + b for b in range(256)})
  for piece, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
    vocab.setdefault(piece, len(vocab))
  merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
  tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                                   byte_fallback=True, fuse_unk=True))
  tok.pre_tokenizer = tk.pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
  tok.decoder = tk.decoders.Sequence([tk.decoders.Replace("▁", " "), tk.decoders.ByteFallback(),
                                      tk.decoders.Fuse(), tk.decoders.Strip(" ", 1, 0)])
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                              bos_token="<s>", eos_token="</s>")
  fast.save_pretrained(path)
  return len(fast)


def tiny_llama(model_type: str, vocab_size: int, seed: int, *, eos: int, num_layers: int = 2,
               d_model: int = 32):
  """(model, params) of a random Llama-family decoder (qwen2: q/k/v biases), logits spread wide
  (embedding and head x4) so that random greedy decoding has no near ties."""
  cfg = llama.LlamaConfig(
      vocab_size=vocab_size, d_model=d_model, num_layers=num_layers, num_heads=4, num_kv_heads=2,
      head_dim=8, d_ff=64, max_position_embeddings=512, qkv_bias=model_type == "qwen2",
      tie_word_embeddings=False, bos_token_id=None if model_type == "qwen2" else 1,
      eos_token_id=eos, pad_token_id=eos if model_type == "qwen2" else None,
      model_type=model_type)
  model = llama.Llama(cfg)
  params = model.init_params(jax.random.PRNGKey(seed))
  spread = lambda path, x: x * 4.0 if any(
      getattr(p, "key", None) in ("token_embed", "lm_head") for p in path) else x
  return model, jax.tree_util.tree_map_with_path(spread, params)


def silence_padding(params, used: int):
  """Zero the head's columns past the tokenizer (`used` ids): padded ids get logit 0, below
  the best real token, as in Qwen checkpoints whose embedding is padded past the tokenizer."""
  kernel = np.array(params["lm_head"]["kernel"])
  kernel[:, used:] = 0.0
  return {**params, "lm_head": {"kernel": kernel}}


def qwen2_checkpoint(path: Path, seed: int = 1, pad_to: int = 64) -> Path:
  """A tiny random Qwen2 target with its byte-level tokenizer in `path`; the embedding is padded
  past the tokenizer to a multiple of `pad_to`, as Qwen's are."""
  size = byte_level_bpe(path)
  vocab = -(-size // pad_to) * pad_to
  model, params = tiny_llama("qwen2", vocab, seed, eos=0)
  hf_import.save_model(model, silence_padding(params, size), path)
  return path


def llama_checkpoint(path: Path, seed: int = 2) -> Path:
  """A tiny random Llama draft (one layer) with its Metaspace tokenizer in `path`."""
  size = metaspace_bpe(path)
  model, params = tiny_llama("llama", size, seed, eos=2, num_layers=1)
  hf_import.save_model(model, params, path)
  return path
