"""Two local processes joined by jax.distributed.initialize train together and agree on the loss."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specjax import testing

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    from specjax import sharding
    from specjax.distill import trainer
    workdir, port, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if pid >= 0:
      sharding.initialize_distributed(f"localhost:{port}", 2, pid)
    from specjax import testing
    from specjax.distill import data
    teacher, tp = testing.tiny_decoder(seed=1, vocab_size=32, d_model=32, num_layers=2)
    student, sp = testing.tiny_decoder(seed=2, vocab_size=32, d_model=16, num_layers=1,
                                       num_heads=2, d_ff=32)
    source = data.MarkovSource(vocab_size=32, batch_size=4, prompt_len=4, target_len=6)
    cfg = trainer.TrainConfig(steps=4, batch_size=4, learning_rate=1e-2, warmup_steps=1,
                              decay_start=2, loss="fkl", lambda1=0.5, lambda2=1.0, log_every=1,
                              checkpoint_every=2, progress=False)
    tr = trainer.Trainer(cfg, student, teacher, source, workdir, eos_id=1)
    losses, probe = [], {}
    def on_step(step, state):
      batch = tr.place_batch(source.batch(100))
      fn = probe.setdefault("fn", tr.compiled_step(state, batch, tp))   # compiled once
      losses.append(float(fn(jax.tree_util.tree_map(jnp.copy, state), batch, tp)[1]["loss"]))
    state = tr.run(sp, tp, on_step=on_step)
    print("RESULT" + json.dumps(dict(pid=jax.process_index(), count=jax.process_count(),
                                     devices=len(jax.devices()), losses=losses)))
""")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def result(proc):
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
  return json.loads(line[len("RESULT"):])


@pytest.mark.slow
def test_two_processes_agree_on_the_loss(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  port = free_port()
  procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "mh"), str(port), str(i)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT) for i in range(2)]
  outs = []
  for p in procs:
    stdout, stderr = p.communicate(timeout=400)
    outs.append(result(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)))
  assert [o["pid"] for o in outs] == [0, 1] and all(o["count"] == 2 for o in outs)
  assert outs[0]["losses"] == outs[1]["losses"]
  # The same global computation in one process on 2 simulated devices gives the same losses.
  single_env = dict(env, XLA_FLAGS=testing.with_devices(2))
  single = result(subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "one"), "0", "-1"],
                                 env=single_env, capture_output=True, text=True, timeout=400,
                                 cwd=ROOT))
  assert single["devices"] == 2
  for a, b in zip(outs[0]["losses"], single["losses"]):
    assert a == pytest.approx(b, abs=1e-5)
  metrics = (tmp_path / "mh" / "metrics.jsonl").read_text().splitlines()
  assert len(metrics) == 4                   # process 0 alone writes the metrics file
  assert (tmp_path / "mh" / "checkpoints" / "4").exists()
