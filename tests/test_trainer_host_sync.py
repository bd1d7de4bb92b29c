"""The trainer does not wait on the host between records (issue #29 item 3): no per-step
block_until_ready or device read; a divergence between two reads is still caught before the
next save, named at the step where it happened, and never checkpointed; eval hooks get params.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.distill import trainer
from specjax.distill import step as step_lib
from tests import test_train_robustness as robustness
from tests.test_train_robustness import records, saved_steps  # noqa: F401

def pretrainer(workdir, **kw):
  """The robustness tests' tiny NLL trainer, over 10 steps with records every 5 and no
  checkpoint between (the tests below set their own)."""
  settings = dict(steps=10, log_every=5, checkpoint_every=100, keep_checkpoints=100)
  return robustness.pretrainer(workdir, **{**settings, **kw})


def test_no_host_wait_between_records(tmp_path, monkeypatch):
  """Steps 1..10, records at 1, 5, 10: every block_until_ready / device_get happens in the step
  before a record or at the record; steps 2-4 and 6-9 dispatch only, and no value is read
  implicitly (float(), int(), np.asarray) at any step."""
  tr, params = pretrainer(tmp_path)
  calls, current = [], {"step": 0}
  for name in ("block_until_ready", "device_get"):
    real = getattr(jax, name)

    def counted(*args, _real=real, _name=name, **kw):
      calls.append((current["step"], _name))
      return _real(*args, **kw)
    monkeypatch.setattr(jax, name, counted)
  one_step = trainer.Trainer.one_step

  def tracked(self, step, state, teacher_params):
    current["step"] = step + 1
    return one_step(self, step, state, teacher_params)

  monkeypatch.setattr(trainer.Trainer, "one_step", tracked)
  with jax.transfer_guard_device_to_host("disallow"):          # only explicit reads
    tr.run(params)
  read_at = {step for step, _ in calls if step > 0}
  assert read_at == {1, 5, 10}, sorted(calls)
  assert [r["step"] for r in records(tmp_path)] == [1, 5, 10]
  for r in records(tmp_path):
    assert r["step_s"] > 0 and np.isfinite(r["loss"])
    assert r["step_s"] == pytest.approx(r["data_s"] + r["generate_s"] + r["update_s"])


def poison_loss_at(monkeypatch, bad_step: int):
  """The loss of step `bad_step` (1-based) is NaN: traced into the jitted step, no host read."""
  real = step_lib.train_step

  def poisoned(state, batch, teacher_params, *, loss, **kw):
    def bad_loss(*args):
      return jnp.where(state.step + 1 == bad_step, jnp.nan, loss(*args))
    return real(state, batch, teacher_params, loss=bad_loss, **kw)

  monkeypatch.setattr(step_lib, "train_step", poisoned)


def test_a_divergence_between_reads_is_caught_before_the_next_save(tmp_path, monkeypatch):
  """Step 6 of 12 is NaN; records at 1 and 12 only, checkpoints every 4: step 8's save checks
  first and raises, naming step 6, its loss and the last good checkpoint (4). Steps 6-7 ran
  without a host read, and the params they hand on stay those of step 5 (the update of a
  non-finite step is not applied), so no NaN is in memory or on disk."""
  tr, params = pretrainer(tmp_path, steps=12, log_every=100, checkpoint_every=4)
  poison_loss_at(monkeypatch, 6)
  seen = {}

  def on_step(step, state):                 # copied: the next step donates the state's buffers
    seen[step] = jax.device_get((state.params, state.bad_step))

  with pytest.raises(trainer.TrainingDivergedError) as err:
    tr.run(params, on_step=on_step)
  assert (err.value.step, err.value.quantity, err.value.last_good) == (6, "loss", 4)
  assert "training diverged at step 6: the loss is not finite" in str(err.value)
  assert "last good checkpoint (step 4) is kept" in str(err.value)
  assert saved_steps(tmp_path) == [1, 4]                       # orbax saves the first step too
  assert sorted(seen) == list(range(1, 8))                     # steps 6 and 7 were dispatched
  for a, b in zip(jax.tree_util.tree_leaves(seen[5][0]), jax.tree_util.tree_leaves(seen[7][0])):
    np.testing.assert_array_equal(a, b)
    assert np.isfinite(b).all()
  assert (seen[5][1], seen[6][1], seen[7][1]) == (0, 6, 6)
  last = records(tmp_path)[-1]
  assert (last["step"], last["event"], last["non_finite"], last["loss"]) == (6, "diverged",
                                                                             "loss", None)


def test_a_divergence_on_the_last_step_is_not_saved(tmp_path, monkeypatch):
  """The final save (step 3 of 3, not a checkpoint_every multiple) is checked too."""
  tr, params = pretrainer(tmp_path, steps=3, log_every=100, checkpoint_every=2)
  poison_loss_at(monkeypatch, 3)
  with pytest.raises(trainer.TrainingDivergedError) as err:
    tr.run(params)
  assert (err.value.step, err.value.last_good) == (3, 2) and saved_steps(tmp_path) == [1, 2]


def test_eval_hooks_get_params_not_the_trainer(tmp_path):
  """`run(evaluate=)`: called with (step, the student's params) before training and every
  eval_every steps; its values go into the record of that step."""
  tr, params = pretrainer(tmp_path, steps=4, eval_every=2, eval_at_start=True)
  calls = []

  def evaluate(step, got):
    calls.append(step)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(params)
    return {"eval_norm": float(sum(jnp.sum(x * x) for x in jax.tree_util.tree_leaves(got)))}

  tr.run(params, evaluate=evaluate)
  assert calls == [0, 2, 4]
  by_step = {r["step"]: r for r in records(tmp_path)}
  assert {0, 2, 4} <= set(by_step) and all("eval_norm" in by_step[s] for s in (0, 2, 4))
  assert "eval_fn" not in {f.name for f in __import__("dataclasses").fields(trainer.Trainer)}
