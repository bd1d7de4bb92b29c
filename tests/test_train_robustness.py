"""Training robustness (issue #18 items 4, 5, 8, 10-12): workdirs checked before any work,
divergence stops without saving non-finite state, Ctrl-C saves and says how to resume,
metrics.jsonl marks resumes without repeating steps, lowered steps do nothing, a verifier is
not overwritten unless asked, nonsense values refused, exports atomic and strict."""

from __future__ import annotations

import json
import re
import logging
import os
import signal

import jax
import numpy as np
import pytest

from specjax import checkpoint, testing
from specjax.app import cli, fit, sprinter_train, training
from specjax.app.config import ConfigError
from specjax.distill import data, trainer
from specjax.sprinter import train as sprinter_lib

STUDENT = dict(seed=2, vocab_size=32, d_model=16, num_layers=1, num_heads=2, d_ff=32)


def pretrainer(workdir, **kw):
  """A tiny NLL trainer (no teacher) over a Markov source, checkpoints written synchronously."""
  student, params = testing.tiny_decoder(**STUDENT)
  source = data.MarkovSource(vocab_size=32, batch_size=4, prompt_len=4, target_len=6)
  settings = dict(steps=3, batch_size=4, learning_rate=1e-2, warmup_steps=0, loss="nll",
                  lambda1=1.0, lambda2=0.0, log_every=1, checkpoint_every=1, keep_checkpoints=2,
                  async_checkpoint=False, progress=False)
  cfg = trainer.TrainConfig(**{**settings, **kw})
  return trainer.Trainer(cfg, student, None, source, workdir, eos_id=1,
                         model_desc=repr(student)), params


def records(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def saved_steps(workdir):
  return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def restored_params(tr, params):
  ckpt = checkpoint.Checkpointer(tr.workdir, checkpoint.ModelSignature.of(params, tr.model_desc))
  try:
    state, meta = ckpt.restore(trainer._as_dict(tr.abstract_state(params)))
  finally:
    ckpt.close()
  return state["params"], meta["step"]


def test_divergence_stops_before_saving_and_keeps_the_good_checkpoints(tmp_path):
  tr, params = pretrainer(tmp_path)
  tr.run(params)
  assert saved_steps(tmp_path) == [2, 3]
  # Resume with an absurd learning rate: params blow up within a step or two.
  tr, params = pretrainer(tmp_path, steps=8, learning_rate=1e38)
  with pytest.raises(trainer.TrainingDivergedError) as err:
    tr.run(params)
  step, quantity = err.value.step, err.value.quantity
  assert step in (4, 5) and quantity in ("loss", "gradient norm", "params")
  assert f"training diverged at step {step}: the {quantity} is not finite" in str(err.value)
  assert err.value.last_good == step - 1 and saved_steps(tmp_path)[-1] == step - 1
  assert f"last good checkpoint (step {step - 1}) is kept" in str(err.value)
  good, at = restored_params(tr, params)
  assert at == step - 1
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(good))
  last = records(tmp_path)[-1]                 # strict JSON: the non-finite value is null
  assert last["step"] == step and last["event"] == "diverged" and last["non_finite"] == quantity
  assert not (tmp_path / "params").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])   # SIGTERM: schedulers' stop
def test_ctrl_c_saves_the_current_step_and_a_resume_repeats_no_step(tmp_path, sig):
  tr, params = pretrainer(tmp_path, steps=6, checkpoint_every=100)
  # SIG_IGN where the test process was started in the background by a non-interactive shell
  before = signal.getsignal(sig)

  def interrupt(step, state):
    if step == 2:
      os.kill(os.getpid(), sig)

  with pytest.raises(trainer.TrainingInterrupted) as err:
    tr.run(params, on_step=interrupt)
  assert err.value.step == 2 and saved_steps(tmp_path)[-1] == 2
  assert "run the same command again to resume" in str(err.value)
  assert signal.getsignal(sig) is before                                # handler restored
  # A killed run may have logged steps past its last checkpoint, the last line half written.
  with (tmp_path / "metrics.jsonl").open("a") as f:
    f.write('{"step": 3, "loss": 9.0}\n{"step": 4, "lo')
  tr, params = pretrainer(tmp_path, steps=4, checkpoint_every=100)
  tr.run(params)
  steps = [(r.get("event"), r["step"]) for r in records(tmp_path)]
  assert steps == [(None, 1), (None, 2), ("resume", 2), (None, 3), (None, 4)]
  assert all(r.get("loss") != 9.0 for r in records(tmp_path))


def test_a_second_ctrl_c_while_saving_stops_at_once_and_names_the_step_a_rerun_resumes_from(
    tmp_path, monkeypatch):
  """Probe round 8: a second Ctrl-C while the interrupt checkpoint was saved printed three
  tracebacks, one saying the step was saved when it was not, and left orbax's temporary
  directory in the workdir for good."""
  tr, params = pretrainer(tmp_path, steps=6, checkpoint_every=2)

  def second_ctrl_c(self):                     # what the handler raises at the second signal
    raise KeyboardInterrupt

  monkeypatch.setattr(checkpoint.Checkpointer, "wait", second_ctrl_c)
  closed = []
  monkeypatch.setattr(checkpoint.Checkpointer, "close", lambda self: closed.append(1))
  with pytest.raises(trainer.TrainingAbandoned) as err:
    tr.run(params, on_step=lambda step, state: step == 3 and os.kill(os.getpid(), signal.SIGINT))
  # (saved synchronously here: step 3's checkpoint is whole, and named)
  assert err.value.last == 3 == saved_steps(tmp_path)[-1] and not closed   # no wait on a save
  assert str(err.value).startswith("stopped at once, without waiting for a save in progress: a "
                                   "rerun resumes from step 3, the latest whole checkpoint")
  monkeypatch.undo()
  unfinished = tmp_path / "checkpoints" / "5.orbax-checkpoint-tmp-1764800000"
  unfinished.mkdir()                           # what a save cut short leaves
  tr, params = pretrainer(tmp_path, steps=6, checkpoint_every=2)
  tr.run(params)
  assert not unfinished.exists() and saved_steps(tmp_path)[-1] == 6


def test_lower_steps_on_a_finished_workdir_do_nothing(tmp_path, caplog):
  tr, params = pretrainer(tmp_path)
  tr.run(params)
  before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
  for steps in (1, 3):
    tr, params = pretrainer(tmp_path, steps=steps)
    with caplog.at_level(logging.INFO, logger="specjax"):
      state = tr.run(params)
    assert tr.steps_run == 0 and int(state.step) == 3
    assert f"nothing to do: the checkpoint in {tmp_path} is at step 3 and steps is {steps}" \
        in caplog.text
  assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before


@pytest.mark.parametrize("field, value, message", [
    ("steps", -1, "steps must be >= 1, got -1"),
    ("batch_size", 0, "batch_size must be >= 1, got 0"),
    ("learning_rate", -1e-3, "learning_rate must be >= 0"),
    ("checkpoint_every", 0, "checkpoint_every must be >= 1"),
])
def test_nonsense_training_values_are_refused(field, value, message):
  with pytest.raises(ValueError, match=message):
    trainer.TrainConfig(**{field: value})


@pytest.mark.parametrize("cls, field, value, message", [
    (sprinter_lib.TrainConfig, "batch_size", 0, "batch_size must be >= 1"),
    (sprinter_lib.TrainConfig, "threshold", 1.5, r"must lie in \[0, 1\], got 1.5"),
    (sprinter_lib.TrainConfig, "val_fraction", 0.0, r"val_fraction must lie in \(0, 1\)"),
    (sprinter_train.VerifierRun, "batch_rows", 0, "batch_rows must be >= 1"),
    (sprinter_train.VerifierRun, "num_sequences", -5, "num_sequences must be >= 1"),
])
def test_nonsense_verifier_values_are_refused(cls, field, value, message):
  with pytest.raises(ValueError, match=message):
    cls(**{field: value})


@pytest.fixture
def cli_logs(monkeypatch, caplog):
  """The CLIs run in-process: no handler set-up (caplog reads the specjax logger), INFO."""
  monkeypatch.setattr(cli, "setup", lambda: None)
  monkeypatch.setattr(logging.getLogger("specjax"), "propagate", True)
  with caplog.at_level(logging.INFO, logger="specjax"):
    yield caplog


def test_unusable_workdirs_are_refused_before_any_work(tmp_path, monkeypatch, capsys, cli_logs):
  from train import distill, verifier
  monkeypatch.setattr(training, "build", lambda *a: pytest.fail("built a model"))
  monkeypatch.setattr(sprinter_train.resolve, "build_model", lambda *a: pytest.fail("built"))
  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  cases = [(a_file, "is a file, not a directory"), (a_file / "sub", "cannot be created")]
  if os.geteuid() != 0:                        # root writes anywhere
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    cases.append((locked, "is not writable"))
  for workdir, problem in cases:
    for main, config in ((distill.main, "distill_tiny.py"), (verifier.main, "sprinter_tiny.py")):
      assert main(["--config", config, "--workdir", str(workdir)]) == 2
      assert f"error: --workdir {workdir} {problem}" in capsys.readouterr().err


def test_a_verifier_is_not_overwritten_unless_asked(tmp_path, monkeypatch, capsys, cli_logs):
  from train import verifier
  monkeypatch.setattr(sprinter_train.resolve, "build_model", lambda *a: pytest.fail("built"))
  monkeypatch.chdir(tmp_path)
  (tmp_path / "runs" / "v").mkdir(parents=True)
  (tmp_path / "runs" / "v" / "verifier.json").write_text("{}")
  assert verifier.main(["--config", "sprinter_tiny.py", "--workdir", "runs/v"]) == 2
  err = capsys.readouterr().err
  assert f"--workdir {tmp_path}/runs/v already holds a verifier (verifier.json)" in err
  assert "--config.verifier.overwrite=true" in err
  assert sprinter_train.check_verifier_workdir("runs/v", overwrite=True) == tmp_path / "runs/v"


def test_cli_relative_workdir_ctrl_c_and_lower_steps(tmp_path, monkeypatch, capsys, cli_logs):
  """train.distill in-process on the tiny pair: a relative workdir is printed in full; Ctrl-C at
  step 2 saves step 2, exits 130 and says how to resume; fewer steps than done: exit 0, nothing
  to do, nothing written."""
  from train import distill
  monkeypatch.chdir(tmp_path)
  one_step = trainer.Trainer.one_step

  def interrupted_at_2(self, step, state, teacher_params):
    out = one_step(self, step, state, teacher_params)
    if step + 1 == 2:
      os.kill(os.getpid(), signal.SIGINT)
    return out

  monkeypatch.setattr(trainer.Trainer, "one_step", interrupted_at_2)
  args = ["--config", "distill_tiny.py", "--workdir", "runs/d", "--config.train.steps=4",
          "--config.train.progress=false", "--config.train.eval_every=0",
          "--config.train.batch_size=4", "--config.train.async_checkpoint=false"]
  assert distill.main(args) == 130
  workdir = tmp_path / "runs" / "d"
  assert f"workdir {workdir}" in cli_logs.text
  err = capsys.readouterr().err
  assert f"train.distill: interrupted: a checkpoint of step 2 is saved in {workdir}; run the " \
         f"same command again to resume from it" in err
  assert saved_steps(workdir)[-1] == 2 and not (workdir / "params").exists()
  monkeypatch.setattr(trainer.Trainer, "one_step", one_step)
  before = sorted(map(str, workdir.rglob("*")))
  assert distill.main([*args, "--config.train.steps=1"]) == 0
  assert "nothing to do: the checkpoint in" in cli_logs.text
  assert sorted(map(str, workdir.rglob("*"))) == before


def test_exports_are_atomic_and_json_strict(tmp_path):
  params = {"w": np.arange(3, dtype=np.float32)}
  for scale in (1, 2):
    checkpoint.save_params(tmp_path, {"w": params["w"] * scale})
  assert sorted(p.name for p in tmp_path.iterdir()) == ["params"]      # nothing staged left
  np.testing.assert_array_equal(checkpoint.load_params(tmp_path, params)["w"], [0, 2, 4])
  checkpoint.write_json(tmp_path / "m.json", {"auroc": float("nan"), "x": [np.float32(1.5)]})
  assert json.loads((tmp_path / "m.json").read_text()) == {"auroc": None, "x": [1.5]}
  assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json", "params"]


def test_divergence_at_the_cli_names_the_flags_that_mend_it(tmp_path):
  cfg = trainer.TrainConfig(learning_rate=0.5, warmup_steps=0)
  resumable = fit.diverged_advice(trainer.TrainingDivergedError(7, "loss", tmp_path, 6), cfg)
  assert isinstance(resumable, ConfigError)                # exit status 2 at the CLI
  assert str(resumable).startswith("training diverged at step 7: the loss is not finite")
  assert "Lower --config.train.learning_rate (now 0.5) or raise --config.train.warmup_steps " \
         "(now 0); the same command then resumes from it" in str(resumable)
  fresh = fit.diverged_advice(trainer.TrainingDivergedError(1, "params", tmp_path, None), cfg)
  assert "no checkpoint was saved" in str(fresh) and str(fresh).endswith("starts again")


def test_pretraining_divergence_names_the_pretrain_flags(tmp_path):
  """train.pretrain reads pretrain.learning_rate where the config sets it: the advice names it."""
  config = {"pretrain": {"model": "target", "learning_rate": 0.5}, "train": {}}
  cfg = trainer.TrainConfig(learning_rate=0.5, warmup_steps=0)
  err = trainer.TrainingDivergedError(7, "loss", tmp_path, 6)
  text = str(fit.diverged_advice(err, cfg, config, pretrain=True))
  assert "Lower --config.pretrain.learning_rate (now 0.5) or raise " \
         "--config.train.warmup_steps (now 0)" in text
  assert "--config.train.learning_rate" in str(fit.diverged_advice(err, cfg, config))


def test_a_nan_learning_rate_is_refused_by_the_trainer_config():
  with pytest.raises(ValueError, match="learning_rate must be a finite number, got nan"):
    trainer.TrainConfig(learning_rate=float("nan"))


def test_the_workdir_lock_names_its_holder_and_goes_with_it(tmp_path):
  with checkpoint.lock_workdir(tmp_path):
    assert (tmp_path / ".specjax.lock.pid").read_text().strip() == str(os.getpid())
    with pytest.raises(checkpoint.WorkdirBusyError, match=f"process {os.getpid()} holds") as err:
      with checkpoint.lock_workdir(tmp_path):
        pass
    assert err.value.pid == os.getpid() and err.value.workdir == tmp_path
  assert not (tmp_path / ".specjax.lock.pid").exists()
  with checkpoint.lock_workdir(tmp_path):                  # free again
    pass


def test_run_records_refuse_another_job_or_field_and_allow_more_steps(tmp_path):
  (tmp_path / "params").mkdir()                            # training state
  config = {"pretrain": {"model": "draft"}, "draft": {"d_model": 32}, "data": {"seed": 0},
            "train": {"steps": 1}}
  training.check_run_record(tmp_path, training.run_record(config, pretrain=True))
  assert json.loads((tmp_path / "run.json").read_text())["job"] == "train.pretrain"
  more = dict(config, train={"steps": 5})
  training.check_run_record(tmp_path, training.run_record(more, pretrain=True))
  with pytest.raises(ConfigError, match="holds a train.pretrain run, and this is train.distill"):
    training.check_run_record(tmp_path, training.run_record(config, pretrain=False))
  other = dict(config, data={"seed": 1})
  with pytest.raises(ConfigError, match="--config.data.seed: 0 there, 1 now"):
    training.check_run_record(tmp_path, training.run_record(other, pretrain=True))
  adamw = dict(config, train={"steps": 5, "optimizer": "adamw"})    # probe round 8: its state
  with pytest.raises(ConfigError, match='--config.train.optimizer: "adafactor" there, "adamw" '
                     'now.*train.optimizer may not'):                  # was "damaged" checkpoints
    training.check_run_record(tmp_path, training.run_record(adamw, pretrain=True))
  saved = json.loads((tmp_path / "run.json").read_text())
  del saved["fields"]["train.optimizer"]                    # a run.json from before it was kept
  (tmp_path / "run.json").write_text(json.dumps(saved))
  training.check_run_record(tmp_path, training.run_record(more, pretrain=True))
  (tmp_path / "params").rmdir()                            # nothing trained: a fresh start
  training.check_run_record(tmp_path, training.run_record(other, pretrain=False))
  assert json.loads((tmp_path / "run.json").read_text())["job"] == "train.distill"


def test_a_distillation_resumed_over_a_changed_teacher_is_refused(tmp_path):
  """run.json kept only the teacher's init_from path: a teacher workdir trained further (its
  params exported again) was adopted on resume, and the run distilled towards two teachers."""
  teacher, run = tmp_path / "teacher", tmp_path / "run"
  (teacher / "params").mkdir(parents=True)
  (teacher / "params" / "weights").write_bytes(b"step 60")
  (run / "params").mkdir(parents=True)                      # the distillation's own state
  config = {"target": {"init_from": str(teacher)}, "draft": {"d_model": 32}, "data": {},
            "distill": {"recipe": "gkd"}, "train": {"steps": 20}}
  training.check_run_record(run, training.run_record(config, pretrain=False))
  more = dict(config, train={"steps": 40})
  training.check_run_record(run, training.run_record(more, pretrain=False))   # the same teacher
  (teacher / "params" / "weights").write_bytes(b"step 90 and more")           # exported again
  with pytest.raises(ConfigError, match=re.escape(
      f"--workdir {run} holds a train.distill run whose teacher's params "
      f"(--config.target.init_from={teacher}) have changed since it began")):
    training.check_run_record(run, training.run_record(more, pretrain=False))
  saved = json.loads((run / "run.json").read_text())
  del saved["teacher"]                                      # a run.json from before the stamps
  (run / "run.json").write_text(json.dumps(saved))
  training.check_run_record(run, training.run_record(more, pretrain=False))


def _damage(workdir, step):
  """A step directory whose metadata file is garbage (a torn write)."""
  (workdir / "checkpoints" / str(step) / "meta" / "metadata").write_text("garbage")


def test_a_damaged_latest_checkpoint_is_set_aside_and_the_previous_one_resumed(tmp_path,
                                                                                caplog):
  tr, params = pretrainer(tmp_path)
  tr.run(params)
  _damage(tmp_path, 3)
  tr, params = pretrainer(tmp_path, steps=4)
  with caplog.at_level(logging.WARNING, logger="specjax"):
    tr.run(params)
  assert tr.steps_run == 2 and saved_steps(tmp_path) == [3, 4]     # resumed from step 2
  kept = tmp_path / "checkpoints.damaged" / "3"
  assert (kept / "meta" / "metadata").read_text() == "garbage"     # never deleted
  assert (f"the checkpoint of step 3 ({tmp_path / 'checkpoints' / '3'}) is damaged (Expecting "
          f"value: line 1 column 1 (char 0)): resuming from step 2, the latest good one; the "
          f"damaged one is kept in {kept}") in caplog.text


def test_no_good_checkpoint_is_refused_naming_each_and_nothing_moves(tmp_path):
  tr, params = pretrainer(tmp_path)
  tr.run(params)
  for step in (2, 3):
    _damage(tmp_path, step)
  tr, params = pretrainer(tmp_path, steps=4)
  with pytest.raises(checkpoint.DamagedCheckpointError) as err:
    tr.run(params)
  where = tmp_path / "checkpoints"
  assert str(err.value).startswith(
      f"no checkpoint in {where} can be restored: step 3 ({where / '3'}): Expecting value")
  assert f"move them away (mv {where} {tmp_path / 'checkpoints.damaged'})" in str(err.value)
  assert saved_steps(tmp_path) == [2, 3] and not (tmp_path / "checkpoints.damaged").exists()


def test_checkpoints_of_another_optimizer_are_not_called_damaged(tmp_path):
  """Probe round 8: a workdir whose run.json predates the optimizer field, resumed with another
  optimizer, was told its checkpoints might be damaged and offered to move them away first."""
  tr, params = pretrainer(tmp_path)
  tr.run(params)
  tr, params = pretrainer(tmp_path, steps=4, optimizer="adamw")
  with pytest.raises(checkpoint.DamagedCheckpointError) as err:
    tr.run(params)
  assert str(err.value).startswith(f"no checkpoint in {tmp_path / 'checkpoints'} holds this "
                                   f"run's training state")
  assert "laid out otherwise: if this run's settings differ from theirs" in str(err.value)


def test_a_workdir_without_run_record_or_metadata_is_adopted_with_a_warning(tmp_path, caplog):
  """Item 6: exported params only (no checkpoint metadata to tell the job): adopted, warned."""
  (tmp_path / "params").mkdir()
  record = {"job": "train.distill", "fields": {}}
  with caplog.at_level(logging.WARNING, logger="specjax"):
    training.check_run_record(tmp_path, record)
  assert f"--workdir {tmp_path} has training state but no run.json (written by a specjax from " \
         f"before run records): adopting it as this train.distill run" in caplog.text
  assert json.loads((tmp_path / "run.json").read_text()) == record


def test_a_checkpoint_with_damaged_arrays_resumes_without_a_traceback(tmp_path, monkeypatch):
  """Probe round 3: orbax leaves the other reads of a damaged checkpoint as coroutines that fail
  when collected; Python printed each one's traceback ("Exception ignored in") under the
  warning that already says what happened."""
  tr, params = pretrainer(tmp_path)
  tr.run(params)
  for blob in (tmp_path / "checkpoints" / "3" / "state").rglob("d/*"):
    blob.write_bytes(os.urandom(20))
  unraisable = []
  monkeypatch.setattr("sys.unraisablehook", unraisable.append)
  tr, params = pretrainer(tmp_path, steps=4)
  tr.run(params)
  import gc
  gc.collect()
  assert tr.steps_run == 2 and (tmp_path / "checkpoints.damaged" / "3").is_dir()
  assert unraisable == []
