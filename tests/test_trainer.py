"""Trainer: LR schedule (§6.15), distillation lowers on-policy TVD (§6.16), SIGKILL + resume,
clear errors for bad inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from specjax import checkpoint, sharding, testing
from specjax.distill import data, trainer

ROOT = Path(__file__).resolve().parents[1]


def test_paper_schedule_values():
  schedule = trainer.paper_schedule(3e-4, 300_000, 5_000, 150_000, 0.1)
  steps = [0, 2_500, 5_000, 150_000, 225_000, 300_000]
  expected = [0.0, 1.5e-4, 3e-4, 3e-4, 1.65e-4, 3e-5]
  np.testing.assert_allclose([float(schedule(s)) for s in steps], expected, rtol=1e-5, atol=1e-12)
  assert trainer.TrainConfig().learning_rate == 3e-4 and trainer.TrainConfig().optimizer == "adafactor"


def models(vocab=32):
  teacher, tp = testing.tiny_decoder(seed=1, vocab_size=vocab, d_model=32, num_layers=2)
  student, sp = testing.tiny_decoder(seed=2, vocab_size=vocab, d_model=16, num_layers=1,
                                     num_heads=2, d_ff=32)
  return teacher, tp, student, sp


def test_distillation_lowers_on_policy_tvd(tmp_path):
  """GKD on a toy pair: on-policy TVD (student samples, fixed seeds) goes down."""
  teacher, tp, student, sp = models()
  source = data.MarkovSource(vocab_size=32, batch_size=8, prompt_len=4, target_len=8)
  cfg = trainer.TrainConfig(steps=24, batch_size=8, learning_rate=3e-2, warmup_steps=0,
                            decay_start=12, loss="fkl", lambda1=0.0, lambda2=1.0, log_every=8,
                            checkpoint_every=100, eval_every=24, progress=False)
  tr = trainer.Trainer(cfg, student, teacher, source, tmp_path, eos_id=1, model_desc=repr(student))
  hook = trainer.on_policy_eval(tr, source.batch(10**6), tp, jax.random.PRNGKey(3))
  tr.eval_fn = hook
  before = hook(0, tr.init_state(sp))["eval_tvd"]
  state = tr.run(sp, tp)
  after = hook(24, state)["eval_tvd"]
  print(f"on-policy TVD {before:.4f} -> {after:.4f}")
  assert after < 0.8 * before, (before, after)
  records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [8, 16, 24]
  assert all({"loss", "tvd", "accept", "lr", "tokens_per_s"} <= set(r) for r in records)
  assert records[-1]["eval_tvd"] == pytest.approx(after, rel=1e-4)
  assert records[-1]["loss"] < records[0]["loss"]


def test_bad_inputs_give_clear_errors(tmp_path, monkeypatch):
  teacher, tp, student, sp = models()
  other, _ = testing.tiny_decoder(vocab_size=40, d_model=16, num_layers=1, num_heads=2, d_ff=32)
  source = data.MarkovSource(vocab_size=32, batch_size=8, prompt_len=4, target_len=8)
  cfg = trainer.TrainConfig(steps=2, batch_size=8, lambda1=1.0, progress=False, log_every=1)
  with pytest.raises(ValueError, match="teacher vocab 32 != student vocab 40"):
    trainer.Trainer(cfg, other, teacher, source, tmp_path, eos_id=1)
  with pytest.raises(sharding.MeshError, match="needs 5 devices"):
    trainer.Trainer(dataclasses_replace(cfg, mesh_data=5), student, teacher, source, tmp_path, eos_id=1)
  monkeypatch.setattr(jax, "process_count", lambda: 3)
  with pytest.raises(sharding.MeshError, match="does not divide across 3 hosts"):
    trainer.Trainer(cfg, student, teacher, source, tmp_path, eos_id=1)
  monkeypatch.undo()
  with pytest.raises(ValueError, match="needs a teacher"):
    trainer.Trainer(cfg, student, None, source, tmp_path, eos_id=1)
  # A workdir holding another model's checkpoint: clear error, nothing overwritten.
  ckpt = checkpoint.Checkpointer(tmp_path, checkpoint.fingerprint(tp, repr(teacher)), every=1)
  ckpt.save(1, {"params": tp})
  ckpt.close()
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
  before = sorted(str(p) for p in tmp_path.rglob("*"))
  metrics = (tmp_path / "metrics.jsonl").read_text()
  with pytest.raises(checkpoint.CheckpointMismatchError, match="another model"):
    trainer.Trainer(cfg, student, teacher, source, tmp_path, eos_id=1,
                    model_desc=repr(student)).run(sp, tp)
  assert sorted(str(p) for p in tmp_path.rglob("*")) == before
  assert (tmp_path / "metrics.jsonl").read_text() == metrics


def dataclasses_replace(cfg, **kw):
  import dataclasses
  return dataclasses.replace(cfg, **kw)


CHILD = textwrap.dedent("""
    import os, signal, sys
    import jax
    from specjax import testing
    from specjax.distill import data, trainer
    workdir, kill_at = sys.argv[1], int(sys.argv[2])
    teacher, tp = testing.tiny_decoder(seed=1, vocab_size=32, d_model=32, num_layers=2)
    student, sp = testing.tiny_decoder(seed=2, vocab_size=32, d_model=16, num_layers=1,
                                       num_heads=2, d_ff=32)
    source = data.MarkovSource(vocab_size=32, batch_size=4, prompt_len=4, target_len=6)
    cfg = trainer.TrainConfig(steps=10, batch_size=4, learning_rate=1e-2, warmup_steps=2,
                              decay_start=5, loss="jsd", lambda1=0.3, lambda2=0.5, log_every=1,
                              checkpoint_every=3, progress=False)
    tr = trainer.Trainer(cfg, student, teacher, source, workdir, eos_id=1, model_desc=repr(student))
    def on_step(step, state):
      if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    tr.run(sp, tp, on_step=on_step)
""")


def run_child(workdir, kill_at, cache):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
             JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  return subprocess.run([sys.executable, "-c", CHILD, str(workdir), str(kill_at)], env=env,
                        capture_output=True, text=True, timeout=300, cwd=ROOT)


def last_losses(workdir):
  losses = {}
  for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines():
    record = json.loads(line)
    losses[record["step"]] = record["loss"]
  return losses


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
  """Kill -9 at step 7 (checkpoints every 3 steps), rerun: it resumes from step 6 and the later
  losses equal an uninterrupted run's (mixed fixed/student/teacher data, so rng and data
  position are restored too)."""
  cache = tmp_path / "jax_cache"
  killed = run_child(tmp_path / "a", 7, cache)
  assert killed.returncode == -9, killed.stderr[-2000:]
  assert max(last_losses(tmp_path / "a")) == 7
  resumed = run_child(tmp_path / "a", -1, cache)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert "resuming from" in resumed.stdout
  full = run_child(tmp_path / "b", -1, cache)
  assert full.returncode == 0, full.stderr[-2000:]
  a, b = last_losses(tmp_path / "a"), last_losses(tmp_path / "b")
  assert sorted(a) == sorted(b) == list(range(1, 11))
  for step in range(1, 11):
    assert a[step] == pytest.approx(b[step], abs=1e-6), step


def test_configs_convert_at_the_edge():
  from specjax.app import builders
  from specjax.app.config import load_config
  big = builders.train_config(load_config("distill_t5_xl_small.py"))
  assert (big.batch_size, big.learning_rate, big.steps, big.optimizer) == (32, 3e-4, 300_000,
                                                                           "adafactor")
  assert (big.mesh_data, big.mesh_model, big.loss, big.lambda2) == (16, 4, "fkl", 1.0)
  tiny = load_config("distill_tiny.py", ["--config.distill.recipe=f-Distill"])
  cfg = builders.train_config(tiny)
  assert (cfg.loss, cfg.lambda1, cfg.lambda2) == ("tvd", 0.0, 0.5)
  pre = builders.train_config(tiny, pretrain=True)
  assert (pre.loss, pre.lambda1, pre.steps) == ("nll", 1.0, tiny.pretrain.steps)
  lm1b = load_config("distill_lm1b.py")
  model = builders.model_from_fields(builders.model_spec(lm1b, "draft"))
  assert (model.config.d_model, model.config.num_layers, model.vocab_size) == (512, 4, 32128)


@pytest.mark.slow
def test_cli_pretrain_then_distill(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  common = ["--config", "distill_tiny.py", "--config.train.steps=4", "--config.train.log_every=2",
            "--config.train.progress=false", "--config.train.eval_every=4"]
  pre = subprocess.run([sys.executable, "-m", "train.pretrain", "--workdir", str(tmp_path / "t"),
                        "--config.pretrain.steps=4", *common], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert pre.returncode == 0, pre.stderr[-2000:]
  assert (tmp_path / "t" / "params").exists()
  dis = subprocess.run([sys.executable, "-m", "train.distill", "--workdir", str(tmp_path / "d"),
                        f"--config.target.init_from={tmp_path / 't'}", *common], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert dis.returncode == 0, dis.stderr[-2000:]
  last = json.loads((tmp_path / "d" / "metrics.jsonl").read_text().splitlines()[-1])
  assert last["step"] == 4 and "eval_tvd" in last and "loss" in last
