"""Loaded params kept in the model's layout and dtype (models.param_cache): a checkpoint inside
the specjax cache is converted once, its params written when the process exits, and later loads
map them: the same params, in the same layout, read-only and without a copy; a cache that does
not match the model is ignored, and a user's checkpoint elsewhere is never copied."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

from specjax import testing
from specjax.api import loading
from specjax.app import builders, resolve
from specjax.models import hf_import, param_cache
from specjax.data.tokenizer import train_sentencepiece


@pytest.fixture
def cached_checkpoint(tmp_path, monkeypatch):
  """A tiny decoder exported inside SPECJAX_CACHE (as specjax's own conversions are), with a
  SentencePiece model of its vocabulary size beside it."""
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  model, params = testing.tiny_decoder(seed=3, vocab_size=300)
  path = hf_import.save_model(model, params, tmp_path / "cache" / "gguf" / "tiny")
  text = ["def f(x):\n    return x + 1\n" * 20, "class A:\n    pass\n" * 20]
  spm = train_sentencepiece(text * 20, tmp_path / "spm.model", model_type="bpe",
                            vocab_size=300, num_threads=1)
  shutil.copy(spm, path / "spm.model")
  return path, params


def _load(path, layers="unrolled"):
  spec = builders.ModelSpec(role="target", checkpoint=str(path), layers=layers)
  return resolve.load(spec)


def test_the_second_load_maps_the_params_the_first_one_kept(cached_checkpoint, monkeypatch):
  path, _ = cached_checkpoint
  pending = []
  monkeypatch.setattr(loading, "_save_at_exit", lambda *a: pending.append(a))
  first = _load(path)
  (out, params, role), = pending
  assert role == "target" and not param_cache.complete(out)
  param_cache.save(params, out)                     # what the exit hook does
  pending.clear()
  second = _load(path)
  assert not pending                                # nothing left to keep
  for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert jax.tree.structure(first.params) == jax.tree.structure(second.params)
  leaf = jax.tree.leaves(second.params)[0]
  assert not np.asarray(leaf).flags.writeable       # a read-only map of the file


def test_a_cache_of_another_layout_or_a_damaged_one_is_not_used(cached_checkpoint, monkeypatch):
  path, _ = cached_checkpoint
  pending = []
  monkeypatch.setattr(loading, "_save_at_exit", lambda *a: pending.append(a))
  _load(path, layers="unrolled")
  out, params, _ = pending.pop()
  param_cache.save(params, out)
  _load(path, layers="scan")                        # another key: converted again, kept apart
  scan_out, _, _ = pending.pop()
  assert scan_out != out
  first = sorted(out.glob("leaf-*.npy"))[0]
  np.save(first, np.zeros((1, 2), np.float32))      # damaged: another shape
  _load(path, layers="unrolled")
  assert pending and pending[-1][0] == out          # ignored, loaded again and kept again


def test_checkpoints_outside_the_cache_are_not_copied(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  assert loading._param_cache_dir(tmp_path / "elsewhere", "float32", False) is None
  monkeypatch.setenv("SPECJAX_PARAM_CACHE", "0")
  assert loading._param_cache_dir(tmp_path / "cache" / "gguf" / "x", "float32", False) is None


def test_a_partial_write_is_never_taken(tmp_path):
  params = {"a": jax.numpy.ones((2, 3))}
  out = tmp_path / "p"
  (tmp_path / "p.partial").mkdir()
  assert not param_cache.complete(out)
  param_cache.save(params, out)
  assert param_cache.complete(out) and not (tmp_path / "p.partial").exists()


def test_bfloat16_params_come_back_as_bfloat16(tmp_path):
  """.npy stores bfloat16 as raw 2-byte records: the cache was refused ("|V2, the model expects
  bfloat16") and written again by every run of a bfloat16 model."""
  params = {"a": jax.numpy.arange(6, dtype=jax.numpy.bfloat16).reshape(2, 3),
            "b": jax.numpy.ones((4,), jax.numpy.float32)}
  out = param_cache.save(params, tmp_path / "p")
  back = param_cache.load(out, jax.eval_shape(lambda: params))
  assert back["a"].dtype == jax.numpy.bfloat16
  np.testing.assert_array_equal(np.asarray(back["a"], np.float32), np.arange(6.).reshape(2, 3))
  with pytest.raises(ValueError, match=r"\['a'\] is float16\(2, 3\), the model expects "):
    param_cache.load(param_cache.save({**params, "a": params["a"].astype("float16")},
                                      tmp_path / "q"), jax.eval_shape(lambda: params))


@pytest.mark.parametrize("manifest", ["{}", "[1]", '{"leaves": {"[\'a\']": 3}}'])
def test_a_manifest_without_leaves_is_refused_as_damaged(tmp_path, manifest):
  """Probe round 6: leaves.json holding {} raised KeyError 'leaves' from the load, which only
  ValueError and OSError were caught for (the cache is then ignored and the model loaded)."""
  params = {"a": jax.numpy.ones((2, 3))}
  out = param_cache.save(params, tmp_path / "p")
  (out / param_cache.MANIFEST).write_text(manifest)
  with pytest.raises(ValueError, match="lists no leaves"):
    param_cache.load(out, jax.eval_shape(lambda: params))
