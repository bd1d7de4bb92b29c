"""The teacher cache of head training (distill/features.py): its lumped divergence is the full one
when the top-k ids hold all of the teacher's mass and a lower bound otherwise; a cached run trains
the head as an uncached one does; a killed build resumes without recomputing what it wrote; a
cache built for another run is refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest

from specjax import testing
from specjax.distill import data, features, losses, trainer
from specjax.distill import head as head_lib
from specjax.models.draft_head import DraftHead

VOCAB = 32


def _target(seed=1):
  return testing.tiny_decoder(seed=seed, vocab_size=VOCAB, d_model=32, num_layers=2)


def _source():
  return data.MarkovSource(VOCAB, batch_size=4, prompt_len=4, target_len=8, seed=3)


def _loss(top_k: int, name="fkl"):
  target, tparams = _target()
  head = DraftHead.for_target(target)
  batch = _source().batch(0)
  teacher = head_lib.teacher_outputs(target, tparams, batch, top_k=top_k)
  value, metrics = head_lib.head_loss(head.init_params(jax.random.PRNGKey(0)), head, tparams,
                                      teacher, batch.targets, batch.mask, jax.random.PRNGKey(1),
                                      loss=losses.get(name))
  return float(value), {k: float(v) for k, v in metrics.items()}


@pytest.mark.parametrize("name", ["fkl", "rkl", "jsd", "tvd"])
def test_the_lumped_loss_is_the_full_one_when_the_top_k_cover_the_vocabulary(name):
  full, full_metrics = _loss(0, name)
  covered, covered_metrics = _loss(VOCAB, name)
  np.testing.assert_allclose(covered, full, rtol=1e-5)
  assert covered_metrics["top1"] == full_metrics["top1"]


def test_the_lumped_divergence_is_a_lower_bound():
  full = _loss(0)[1]["divergence"]
  lumped = [_loss(k)[1]["divergence"] for k in (1, 4, 16)]
  assert 0 < lumped[0] <= lumped[1] <= lumped[2] <= full + 1e-6, (lumped, full)


def _cfg(**overrides):
  values = dict(steps=3, batch_size=4, learning_rate=1e-2, warmup_steps=0, decay_start=3,
                optimizer="adamw", student="head", lambda1=0.0, lambda2=0.0, log_every=1,
                checkpoint_every=10, async_checkpoint=False, progress=False, mesh_data=1)
  values.update(overrides)
  return trainer.TrainConfig(**values)


def _run(cfg, workdir, source=None, tparams=None):
  target, default_params = _target()
  tparams = default_params if tparams is None else tparams
  head = DraftHead.for_target(target)
  tr = trainer.Trainer(cfg, head, target, source or _source(), workdir, eos_id=1,
                       model_desc=repr(head))
  state = tr.run(head.init_params(jax.random.PRNGKey(0)), tparams)
  return tr, state


def test_a_cached_run_trains_the_head_as_an_uncached_one(tmp_path):
  """Teacher-sampled continuations (lambda2=0) and a cache whose top-k cover the vocabulary:
  the same batches, the same divergence, the same params after 3 steps."""
  _, plain = _run(_cfg(), tmp_path / "plain")
  tr, cached = _run(_cfg(cache_batches=3, cache_top_k=VOCAB), tmp_path / "cached")
  assert isinstance(tr.source, features.FeatureCache)
  assert len(list((tmp_path / "cached" / "teacher_cache").glob("batch_*.safetensors"))) == 3
  for a, b in zip(jax.tree_util.tree_leaves(plain.params), jax.tree_util.tree_leaves(cached.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)


class Flaky:
  """A source that fails at batch `fail_at` (a killed build) and counts what it was asked."""

  def __init__(self, fail_at=None):
    self.inner, self.fail_at, self.asked = _source(), fail_at, []

  def batch(self, step, split="train"):
    if step == self.fail_at:
      raise KeyboardInterrupt("killed")
    self.asked.append(step)
    return self.inner.batch(step, split)


def test_a_killed_cache_build_resumes_where_it_stopped(tmp_path):
  cfg = _cfg(steps=5, cache_batches=4, cache_top_k=8)
  with pytest.raises(KeyboardInterrupt):
    _run(cfg, tmp_path / "run", Flaky(fail_at=2))
  cache_dir = tmp_path / "run" / "teacher_cache"
  assert sorted(p.name for p in cache_dir.glob("batch_*")) == [
      "batch_000000.safetensors", "batch_000001.safetensors"]
  assert not list(cache_dir.glob(".*tmp"))
  resumed = Flaky()
  tr, _ = _run(cfg, tmp_path / "run", resumed)
  assert [s for s in resumed.asked if s not in (0,)] == [2, 3]     # 0: the cache's key
  _run(cfg, tmp_path / "fresh")
  fresh = features.FeatureCache(tmp_path / "fresh" / "teacher_cache", {}, 4)
  for i in range(4):
    for a, b in zip(jax.tree_util.tree_leaves(tr.source.read(i)),
                    jax.tree_util.tree_leaves(fresh.read(i))):
      np.testing.assert_array_equal(a, b)


def test_a_cache_built_for_another_run_is_refused(tmp_path):
  shared = str(tmp_path / "cache")
  _run(_cfg(steps=1, cache_batches=1, cache_dir=shared), tmp_path / "a")
  with pytest.raises(features.CacheMismatchError, match=r"top_k: 64 there, 8 here.*delete"):
    _run(_cfg(steps=1, cache_batches=1, cache_top_k=8, cache_dir=shared), tmp_path / "b")
  other = jax.tree_util.tree_map(lambda x: x * 2, _target()[1])
  with pytest.raises(features.CacheMismatchError, match="teacher_params"):
    _run(_cfg(steps=1, cache_batches=1, cache_dir=shared), tmp_path / "c", tparams=other)


def test_bad_cache_settings_are_refused():
  with pytest.raises(ValueError, match="cache_batches must be >= 0"):
    _cfg(cache_batches=-1)
  with pytest.raises(ValueError, match="a draft model .*set cache_batches=0"):
    dataclasses.replace(_cfg(), student="draft", lambda2=1.0, cache_batches=2)
  with pytest.raises(ValueError, match="holds training batches only"):
    features.FeatureCache(Path("/nonexistent"), {}, 1).batch(0, "validation")
