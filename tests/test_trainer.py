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
from specjax.distill import data, evals, throughput, trainer
from specjax.distill import step as step_lib

ROOT = Path(__file__).resolve().parents[1]


def test_paper_schedule_values():
  schedule = step_lib.paper_schedule(3e-4, 300_000, 5_000, 150_000, 0.1)
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
  """GKD on a toy pair: on-policy TVD (student samples, fixed seeds) goes down; every logged
  record carries throughput and the step-time split."""
  teacher, tp, student, sp = models()
  source = data.MarkovSource(vocab_size=32, batch_size=8, prompt_len=4, target_len=8)
  cfg = trainer.TrainConfig(steps=24, batch_size=8, learning_rate=3e-2, warmup_steps=0,
                            decay_start=12, loss="fkl", lambda1=0.0, lambda2=1.0, log_every=8,
                            checkpoint_every=100, eval_every=24, eval_at_start=True,
                            progress=False)
  ticks = []
  tr = trainer.Trainer(cfg, student, teacher, source, tmp_path, eos_id=1, model_desc=repr(student),
                       tick=ticks.append)
  sampler = data.Sampler(student, teacher, eos_id=1)
  hook = evals.on_policy_eval(sampler, tr.place_batch(source.batch(0, split="validation")),
                              tr.place_params(tp), jax.random.PRNGKey(3))
  before = hook(0, sp)["eval_tvd"]
  state = tr.run(sp, tp, evaluate=hook)
  after = hook(24, state.params)["eval_tvd"]
  print(f"on-policy TVD {before:.4f} -> {after:.4f}")
  assert after < 0.8 * before, (before, after)
  assert tr.steps_run == 24 and [t["step"] for t in ticks] == list(range(1, 25))
  first, *records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert first["step"] == 0 and first["event"] == "before training"    # eval_at_start
  assert first["eval_tvd"] == pytest.approx(before, rel=1e-4) and "loss" not in first
  assert [r["step"] for r in records] == [1, 8, 16, 24]                # the first step always
  throughput_keys = {"tokens_per_s", "tokens_per_s_per_device", "step_s", "data_s", "generate_s",
                     "update_s"}
  assert all({"loss", "tvd", "accept", "lr"} | throughput_keys <= set(r) for r in records)
  for r in records:
    assert r["step_s"] == pytest.approx(r["data_s"] + r["generate_s"] + r["update_s"])
    assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / jax.device_count())
    # MFU where the device's peak is known (a GPU or TPU), none on a CPU.
    assert ("mfu" in r) == (throughput.peak_flops(jax.devices()[0].device_kind) is not None)
  assert records[-1]["eval_tvd"] == pytest.approx(after, rel=1e-4)
  assert records[-1]["eval_accept"] == pytest.approx(1 - after, rel=1e-4)
  assert records[-1]["loss"] < records[0]["loss"]


def test_speculative_eval_measures_the_loop():
  """alpha / tau come from the speculative loop itself: a draft identical to the target has
  every draft accepted (alpha 1, tau 3 = 9 tokens in 3 blocks unless a row ends early at EOS); a
  different draft has alpha < 1. The same
  prompts and key at every evaluation make the numbers comparable across steps."""
  teacher, tp, student, sp = models()
  source = data.MarkovSource(vocab_size=32, batch_size=8, prompt_len=4, target_len=8)
  settings = evals.SpecEval(gamma=3, max_new_tokens=9)
  prompts = evals.heldout_prompts(source, 4)
  assert prompts.tokens.shape == (4, 4)
  mesh = sharding.make_mesh(-1, 1)
  same = evals.speculative_eval(teacher, teacher, prompts, tp, jax.random.PRNGKey(0), settings,
                                eos_id=1, mesh=mesh)
  result = same(0, tp)
  assert result["eval_alpha"] == 1.0            # blocks of 1 + 4 + 4 tokens; rows may hit EOS
  assert 2.5 < result["eval_tau"] <= 3.0
  hook = evals.speculative_eval(teacher, student, prompts, tp, jax.random.PRNGKey(0), settings,
                                eos_id=1, mesh=mesh)
  first, again = hook(0, sp), hook(0, sp)
  assert first == again and 0.0 < first["eval_alpha"] < 1.0 and 1.0 <= first["eval_tau"] < 3.0
  with pytest.raises(ValueError, match="9 eval prompts asked for but a batch holds 8"):
    evals.heldout_prompts(source, 9)


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
  with pytest.raises(ValueError, match="steps must be >= 1, got -1"):
    trainer.TrainConfig(steps=-1)
  # A workdir holding another model's checkpoint: both models and their shapes named, nothing
  # overwritten.
  ckpt = checkpoint.Checkpointer(tmp_path, checkpoint.ModelSignature.of(tp, repr(teacher)), every=1)
  ckpt.save(1, {"params": tp})
  ckpt.close()
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
  before = sorted(str(p) for p in tmp_path.rglob("*"))
  metrics = (tmp_path / "metrics.jsonl").read_text()
  with pytest.raises(checkpoint.CheckpointMismatchError, match="another model") as err:
    trainer.Trainer(cfg, student, teacher, source, tmp_path, eos_id=1,
                    model_desc=repr(student)).run(sp, tp)
  message = str(err.value)
  assert "d_model=32" in message and "d_model=16" in message        # both models described
  assert "['layers']['attention']['key']['kernel']: (2, 32, 32) float32 vs (1, 16, 16)" in message
  assert "(and 17 more)" in message
  assert err.value.saved.num_params == sum(x.size for x in jax.tree_util.tree_leaves(tp))
  assert sorted(str(p) for p in tmp_path.rglob("*")) == before
  assert (tmp_path / "metrics.jsonl").read_text() == metrics


def test_steps_at_or_below_the_checkpoint_do_nothing(tmp_path, caplog):
  """A checkpoint at step 5 and steps 3 or 5: nothing trained, nothing written. The checkpoint's
  model description differs (as after a config field was added) but every param shape agrees:
  it resumes, with a warning."""
  teacher, tp, student, sp = models()
  source = data.MarkovSource(vocab_size=32, batch_size=8, prompt_len=4, target_len=8)
  cfg = trainer.TrainConfig(steps=5, batch_size=8, lambda1=1.0, progress=False,
                            async_checkpoint=False)
  tr = trainer.Trainer(cfg, student, teacher, source, tmp_path, eos_id=1, model_desc=repr(student))
  ckpt = checkpoint.Checkpointer(tmp_path, checkpoint.ModelSignature.of(sp, "Decoder(older)"))
  state = tr.init_state(sp)
  ckpt.save(5, trainer._as_dict(state.replace(step=state.step + 5)), force=True)
  ckpt.close()
  before = sorted(str(p) for p in tmp_path.rglob("*"))
  for steps in (3, 5):
    tr = trainer.Trainer(dataclasses_replace(cfg, steps=steps), student, teacher, source, tmp_path,
                         eos_id=1, model_desc=repr(student))
    with caplog.at_level("INFO", logger="specjax"):
      state = tr.run(sp, tp)
    assert tr.steps_run == 0 and int(state.step) == 5
    expected = f"nothing to do: the checkpoint in {tmp_path} is at step 5 and steps is {steps}"
    assert expected in caplog.text
    assert "was written for Decoder(older); this run's model is Decoder(" in caplog.text
  assert sorted(str(p) for p in tmp_path.rglob("*")) == before
  assert not (tmp_path / "metrics.jsonl").exists()


def dataclasses_replace(cfg, **kw):
  import dataclasses
  return dataclasses.replace(cfg, **kw)


CHILD = textwrap.dedent("""
    import logging, os, signal, sys
    import jax
    logging.basicConfig(stream=sys.stdout, level=logging.INFO)
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
  """step -> loss of metrics.jsonl; each step logged once (a resume drops the records past its
  checkpoint) and the resume marked."""
  losses, resumes = {}, []
  for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines():
    record = json.loads(line)
    if record.get("event") == "resume":
      resumes.append(record["step"])
      continue
    assert record["step"] not in losses, f"step {record['step']} logged twice"
    losses[record["step"]] = record["loss"]
  return losses, resumes


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
  """Kill -9 at step 7 (checkpoints every 3 steps), rerun: it resumes from step 6 and the later
  losses equal an uninterrupted run's (mixed fixed/student/teacher data, so rng and data
  position are restored too)."""
  cache = tmp_path / "jax_cache"
  killed = run_child(tmp_path / "a", 7, cache)
  assert killed.returncode == -9, killed.stderr[-2000:]
  assert max(last_losses(tmp_path / "a")[0]) == 7
  resumed = run_child(tmp_path / "a", -1, cache)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert "resuming from" in resumed.stdout
  full = run_child(tmp_path / "b", -1, cache)
  assert full.returncode == 0, full.stderr[-2000:]
  (a, resumes), (b, _) = last_losses(tmp_path / "a"), last_losses(tmp_path / "b")
  # Resumed once, from step 6, or from 3 when the kill caught step 6's asynchronous save unfinished.
  assert len(resumes) == 1 and resumes[0] in (3, 6), resumes
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
  assert last["step"] == 4 and {"eval_tvd", "eval_alpha", "eval_tau", "loss"} <= set(last)
