"""Quantized layers read in place (models/layer_view.py): where specjax's CPU kernels run a
model's products (int8 stored [out, in], int4), its scanned layers hand them the whole weight
stacks and the KV cache with the layer's index, so no layer's weights or cache are copied; the
logits are the unrolled layout's bits, a verify pass keeps a decoding step's bits, and
`layers="auto"` scans such a model on the CPU."""

from __future__ import annotations

import inspect
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.data.tokenizer import train_sentencepiece
from specjax.models import hf_import, llama, quant, transformer

pytestmark = pytest.mark.skipif(not quant.reads_in_place("int4", "out_in"),
                                reason="specjax's CPU kernels run here only (one CPU device)")

CAPACITY = 24       # a cache length no other array of these models has


@pytest.fixture(autouse=True)
def fresh_traces():
  """jax caches a model's traces by its config: a test must not see another's (traced with
  reads_in_place patched, or through the other path)."""
  jax.clear_caches()
  yield
  jax.clear_caches()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A 3-layer Qwen2-shaped float checkpoint (widths multiples of 64, as int4 needs), with a
  small tokenizer."""
  model = llama.Llama(llama.LlamaConfig(
      vocab_size=400, d_model=128, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
      d_ff=256, qkv_bias=True, model_type="qwen2", bos_token_id=1, eos_token_id=2,
      max_position_embeddings=256))
  path = tmp_path_factory.mktemp("qwen2")
  hf_import.save_model(model, model.init_params(jax.random.PRNGKey(0)), str(path))
  train_sentencepiece(inspect.getsource(textwrap).split("\n\n"), path / "spm.model",
                      model_type="bpe", vocab_size=400, num_threads=1)
  return str(path)


def _load(checkpoint, q: str, scan: bool):
  return hf_import.load_model(checkpoint, "float32", scan_layers=scan, layout="out_in", quant=q)


def _layer_shaped(text: str, cache_shape, stacked=None) -> list[str]:
  """The arrays of a compiled program (its HLO text) shaped as one layer's cache ([B, Hkv, S,
  Dh] or [1, ...] of the stacked [L, B, Hkv, S, Dh]) or, given the `stacked` params, one layer's
  quantized weights ([N, K] or [1, N, K]): the copies a slice of a stack passed to a kernel
  makes."""
  one = {tuple(cache_shape[1:]), (1, *cache_shape[1:])}
  for leaf in jax.tree.leaves(stacked or {}):
    if leaf.dtype in (jnp.int8, jnp.uint8):
      one |= {leaf.shape[1:], (1, *leaf.shape[1:])}
  found = re.findall(r"= [a-z0-9]+\[([0-9,]+)\]", text)
  return sorted({s for s in found if tuple(int(d) for d in s.split(",")) in one})


@pytest.mark.parametrize("q", ["int8", "int4"])
def test_scanned_layers_read_weights_and_cache_in_place(checkpoint, monkeypatch, q):
  """The scanned model's compiled program holds no array shaped as one layer's weights or cache
  (the nn.scan slicing it replaces does: the broken variant below), and its logits are the
  unrolled model's bits, whose cache is read in place too."""
  tokens = jnp.array([[3, 7, 9, 2, 5]])
  logits = {}
  for scan in (True, False):
    model, params = _load(checkpoint, q, scan)
    assert transformer.reads_in_place(model.config.arch())
    cache = model.init_cache(1, CAPACITY)
    extend = jax.jit(model.extend)
    text = extend.lower(params, tokens, cache).compile().as_text()
    assert _layer_shaped(text, cache.k.shape, params.get("layers")) == []
    logits[scan] = np.asarray(extend(params, tokens, cache)[0])
  np.testing.assert_array_equal(logits[True], logits[False])
  # The broken variant: the layers sliced out of the stacks (nn.scan) copy them.
  monkeypatch.setattr(transformer, "reads_in_place", lambda a: False)
  model, params = _load(checkpoint, q, True)
  cache = model.init_cache(1, CAPACITY)
  jax.clear_caches()                      # not the traces of the same model made above
  text = jax.jit(model.extend).lower(params, tokens, cache).compile().as_text()
  assert _layer_shaped(text, cache.k.shape, params["layers"])


@pytest.mark.parametrize("q", ["int8", "int4"])
def test_a_verify_pass_keeps_a_steps_bits_when_scanned_in_place(checkpoint, q):
  """What greedy SD over the quantized target needs (tests/test_quant.py, unrolled): a pass over
  T positions and T one-position steps give each position the same logits, bit for bit."""
  model, params = _load(checkpoint, q, True)
  rng = np.random.RandomState(0)
  prompt, block = rng.randint(3, 400, (2, 9)), rng.randint(3, 400, (2, 5))
  extend = jax.jit(model.extend)
  _, _, cache = extend(params, jnp.asarray(prompt), model.init_cache(2, CAPACITY))
  wide, _, _ = extend(params, jnp.asarray(block), cache)
  steps = []
  for t in range(block.shape[1]):
    logits, _, cache = extend(params, jnp.asarray(block[:, t:t + 1]), cache)
    steps.append(np.asarray(logits[:, 0]))
  np.testing.assert_array_equal(np.asarray(wide), np.stack(steps, 1))


@pytest.mark.parametrize("q, scanned", [("int8", True), ("int4", True), ("", False)])
def test_auto_scans_what_the_kernels_read_in_place(checkpoint, q, scanned):
  """layers="auto" on the CPU: quantized layers on the kernels load stacked and scan (a first
  run compiles one layer), float layers unrolled (XLA copies a scanned float layer's weights)."""
  from specjax.api import loading
  loaded = loading.load(checkpoint, layers="auto", quant=q, layout="out_in")
  assert loaded.model.config.scan_layers == scanned
  assert ("layers" in loaded.params) == scanned
