"""Real model shapes for eval.bench: target / draft config.json contents (Qwen2.5, Llama 3,
T5 v1.1), shrunk by a factor for CPU runs, and built as random-weight models the way a
checkpoint of them would be."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

import jax

from specjax.models import hf_import
from specjax.models import layers as layouts
from specjax.models import quant as quant_lib

_QWEN = dict(model_type="qwen2", hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1e6,
             max_position_embeddings=32768)
QWEN_0_5B = dict(_QWEN, vocab_size=151936, hidden_size=896, intermediate_size=4864,
                 num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 tie_word_embeddings=True)
QWEN_CODER_1_5B = dict(_QWEN, vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                       num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       tie_word_embeddings=True)
QWEN_7B = dict(_QWEN, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
               num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               tie_word_embeddings=False)
_LLAMA3 = dict(model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, rope_theta=500000.0,
               max_position_embeddings=131072, vocab_size=128256, num_key_value_heads=8)
LLAMA_8B = dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, tie_word_embeddings=False,
                rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=8192))
LLAMA_1B = dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, head_dim=64, tie_word_embeddings=True,
                rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=8192))
_T5 = dict(model_type="t5", vocab_size=32128, d_kv=64, feed_forward_proj="gated-gelu",
           tie_word_embeddings=False, relative_attention_num_buckets=32,
           relative_attention_max_distance=128, decoder_start_token_id=0, eos_token_id=1,
           pad_token_id=0)
T5_XL = dict(_T5, d_model=2048, d_ff=5120, num_heads=32, num_layers=24)
T5_SMALL = dict(_T5, d_model=512, d_ff=1024, num_heads=6, num_layers=8)
# A draft of at most 150M parameters for the 1.5B target (most of it the 151936-row table): the
# 0.5B's 24 layers cost a GPU half a target step in launches alone.
QWEN_90M = dict(_QWEN, vocab_size=151936, hidden_size=512, intermediate_size=1536,
                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                tie_word_embeddings=True)

# name -> (target, draft) config.json contents, in priority order. The draft takes the target's
# vocabulary size (Qwen2.5-7B pads its table to 152064; the 0.5B's has 151936 rows): speculative
# decoding reads draft ids as target ids.
SHAPES = {
    "qwen-coder-1.5b": (QWEN_CODER_1_5B, QWEN_0_5B),
    "qwen-coder-1.5b-90m": (QWEN_CODER_1_5B, QWEN_90M),
    "qwen2.5-7b": (QWEN_7B, QWEN_0_5B),
    "llama-3.1-8b": (LLAMA_8B, LLAMA_1B),
    "t5-xl": (T5_XL, T5_SMALL),
}

def scaled(cfg: dict, n: int) -> dict:
  """A config.json with every width, head count, layer count and the vocabulary divided by n
  (at least 8 wide, 2 layers, one head; query heads stay a multiple of the KV heads)."""
  if n == 1:
    return dict(cfg)
  cut = lambda v, low=8: max(low, v // n // 8 * 8)
  out = dict(cfg, vocab_size=cut(cfg["vocab_size"]))
  if cfg["model_type"] == "t5":
    heads = max(1, cfg["num_heads"] // n)
    return dict(out, d_model=cut(cfg["d_model"]), d_ff=cut(cfg["d_ff"]), num_heads=heads,
                d_kv=max(8, cut(cfg["d_model"]) // heads),
                num_layers=max(2, cfg["num_layers"] // n))
  kv = max(1, cfg["num_key_value_heads"] // n)
  heads = max(kv, cfg["num_attention_heads"] // n // kv * kv)
  hidden = cut(cfg["hidden_size"])
  return dict(out, hidden_size=hidden, intermediate_size=cut(cfg["intermediate_size"]),
              num_hidden_layers=max(2, cfg["num_hidden_layers"] // n), num_attention_heads=heads,
              num_key_value_heads=kv, head_dim=max(8, hidden // heads))


def build(cfg: dict, directory: pathlib.Path, seed: int, precision: str | None = None,
          layers: str = "auto", dtype: str = "bfloat16", quant: str = ""):
  """(model, random params) of a config.json written to `directory`, built as a checkpoint of it
  would be (hf_import; layers: the layer layout, "auto" the backend's default; precision None:
  hf_import.default_precision(dtype), "default" for bfloat16; quant "int8": the dense layers
  quantized as specjax.load(quant="int8") stores them, decoder-only families only)."""
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "config.json").write_text(json.dumps(cfg))
  model = hf_import.model_from_dir(directory, dtype, precision,
                                   scan_layers=layouts.scan_layers(layers))
  params = model.init_params(jax.random.PRNGKey(seed))
  if quant:
    params = quant_lib.quantize_params(params, model.config.tie_word_embeddings)
    model = dataclasses.replace(model, config=dataclasses.replace(model.config, quant=quant))
  return model, jax.block_until_ready(params)


if __name__ == "__main__":         # a library module: say which tool to run, not exit 0
  sys.exit("eval.shapes is a library, not a tool: python -m eval.bench --shapes NAME,... builds checkpoints of these shapes")
