"""Sharding: the rules table, mesh errors, and one train step on 8 simulated devices == 1 device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from specjax import sharding, testing
from specjax.models import layers

ROOT = Path(__file__).resolve().parents[1]


def test_rules_table_on_decoder_params():
  _, params = testing.tiny_decoder(vocab_size=48, d_model=32, num_heads=4, d_ff=64)
  axes = sharding.logical_axes(params)
  layer = axes["layers"]                               # stacked: [L, ...] leaves
  assert layer["attention"]["query"]["kernel"] == ("layers", "embed", "heads")
  assert layer["attention"]["query"]["bias"] == ("layers", "heads")
  assert layer["attention"]["out"]["kernel"] == ("layers", "heads", "embed")
  assert layer["mlp"]["wi"]["kernel"] == ("layers", "embed", "mlp")
  assert layer["mlp"]["wo"]["kernel"] == ("layers", "mlp", "embed")
  assert layer["ln_1"]["scale"] == ("layers", "embed")
  assert axes["token_embed"]["embedding"] == ("vocab", "embed")
  fake = type("M", (), {"shape": {"data": 1, "model": 2}})()   # scanned kernels still split
  wi = params["layers"]["mlp"]["wi"]["kernel"]
  assert sharding.spec_for(layer["mlp"]["wi"]["kernel"], wi.shape, fake) == P(None, None, "model")
  assert sharding.leaf_axes(("lm_head", "kernel"), 2) == ("embed", "vocab")
  assert sharding.leaf_axes(("relpos_bias",), 2) == ("relpos", "heads")
  assert sharding.leaf_axes(("blocks", "wi_0", "kernel"), 3) == ("layers", "embed", "mlp")
  assert sharding.leaf_axes(("mystery",), 2) == (None, None)
  # An int8 layer's scale [out] follows its kernel's output axis; a norm's scale stays 'embed'.
  assert sharding.leaf_axes(("layers", "mlp", "wi", "scale"), 2) == ("layers", "mlp")
  assert sharding.leaf_axes(("lm_head", "scale"), 1) == ("vocab",)
  assert sharding.leaf_axes(("layers_0", "ln_1", "scale"), 1) == ("embed",)


def test_spec_for_replicates_what_does_not_divide():
  mesh = sharding.make_mesh(1, 1)
  assert sharding.spec_for(("embed", "heads"), (8, 8), mesh) == P(None, "model")
  fake = type("M", (), {"shape": {"data": 2, "model": 4}})()
  assert sharding.spec_for(("vocab", "embed"), (50, 8), fake) == P(None, None)
  assert sharding.spec_for(("vocab", "embed"), (48, 8), fake) == P("model", None)


def test_adafactor_state_shardings_follow_params():
  _, params = testing.tiny_decoder(vocab_size=48, d_model=32, num_heads=4, d_ff=64)
  mesh = sharding.make_mesh(1, 1)
  state = optax.adafactor(1e-3).init(params)
  shardings = sharding.opt_state_shardings(state, params, mesh)
  leaves = jax.tree_util.tree_leaves(shardings)
  assert len(leaves) == len(jax.tree_util.tree_leaves(state))
  with_model = [s for s in leaves if "model" in tuple(s.spec)]
  assert with_model                       # factored moments of the mlp / heads kernels are sharded


def test_rules_table_on_unstacked_layers():
  """layers_i leaves (no [L] axis) get the stacked leaf's axes without the leading 'layers'."""
  _, params = testing.tiny_decoder(vocab_size=48, d_model=32, num_layers=4, num_heads=4, d_ff=64)
  stacked = sharding.logical_axes(params)["layers"]
  unstacked = sharding.logical_axes(layers.unstack(params))
  assert unstacked["layers_3"]["attention"]["query"]["kernel"] == ("embed", "heads")
  axes = lambda tree: jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, tuple))
  for i in range(4):
    assert axes(stacked) == [("layers",) + leaf for leaf in axes(unstacked[f"layers_{i}"])]
  fake = type("M", (), {"shape": {"data": 1, "model": 2}})()
  wi = unstacked["layers_3"]["mlp"]["wi"]["kernel"]
  assert sharding.spec_for(wi, (32, 64), fake) == P(None, "model")


def test_mesh_errors():
  count = len(jax.devices())
  with pytest.raises(sharding.MeshError, match="needs 3 devices"):
    sharding.make_mesh(3, 1)
  with pytest.raises(sharding.MeshError, match="does not divide"):
    sharding.make_mesh(-1, count + 1)
  with pytest.raises(sharding.MeshError, match="global batch 3 does not divide"):
    sharding.check_batch(3, type("M", (), {"shape": {"data": 2}})())


CHILD = textwrap.dedent("""
    import json, time, sys
    import jax, numpy as np
    from specjax import sharding, testing
    from specjax.distill import data, trainer
    teacher, tp = testing.tiny_decoder(seed=1, vocab_size=48, d_model=32, num_heads=4, d_ff=64)
    student, sp = testing.tiny_decoder(seed=2, vocab_size=48, d_model=16, num_layers=1,
                                       num_heads=2, d_ff=32)
    source = data.MarkovSource(vocab_size=48, batch_size=8, prompt_len=4, target_len=8)
    cfg = trainer.TrainConfig(steps=10, batch_size=8, learning_rate=1e-2, warmup_steps=0,
                              decay_start=5, loss="jsd", lambda1=1.0, progress=False)
    TIMED = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    out = {}
    for shape in [(1, 1), (4, 2), (8, 1)]:
      devices = jax.devices()[:shape[0] * shape[1]]
      mesh = sharding.make_mesh(*shape, devices=devices)
      tr = trainer.Trainer(cfg, student, teacher, source, "/nonexistent", eos_id=1, mesh=mesh)
      state = tr.init_state(sp)
      batch = tr.place_batch(source.batch(0))
      step = tr.compiled_step(state, batch, tp)
      tpp = jax.device_put(tp, sharding.param_shardings(tp, mesh))
      s1, m1 = step(state, batch, tpp)
      flat = jax.tree_util.tree_flatten_with_path(s1.params)[0]
      leaves = {jax.tree_util.keystr(k): np.asarray(x).ravel()[:64].tolist() for k, x in flat}
      kernel = s1.params["layers"]["mlp"]["wi"]["kernel"]
      times = []
      for i in range(TIMED):
        b = tr.place_batch(source.batch(i + 1))
        t0 = time.perf_counter(); s1, m = step(s1, b, tpp); jax.block_until_ready(s1)
        times.append(time.perf_counter() - t0)
      out[str(shape)] = dict(loss=float(m1["loss"]), tvd=float(m1["tvd"]), params=leaves,
                             grad_norm=float(m1["grad_norm"]), spec=str(kernel.sharding.spec),
                             step_ms=1000 * float(np.median(times)) if times else None)
    print("RESULT" + json.dumps(out))
""")


@pytest.mark.slow
def test_sharded_train_step_equals_single_device():
  """Meshes 4x2 and 8x1 over 8 simulated CPU devices give the 1-device step (1e-5)."""
  env = dict(os.environ, XLA_FLAGS=testing.with_devices(8),
             JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  proc = subprocess.run([sys.executable, "-c", CHILD, "3"], env=env, capture_output=True, text=True,
                        timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
  out = json.loads(line[len("RESULT"):])
  ref = out["(1, 1)"]
  for shape in ("(4, 2)", "(8, 1)"):
    assert abs(out[shape]["loss"] - ref["loss"]) < 1e-5, (shape, out[shape]["loss"], ref["loss"])
    assert abs(out[shape]["tvd"] - ref["tvd"]) < 1e-5
    assert abs(out[shape]["grad_norm"] - ref["grad_norm"]) < 1e-5
    for name, b in ref["params"].items():
      if "['key']['bias']" in name:
        # Exactly zero gradient (softmax ignores a per-query constant score shift), so its
        # gradient is rounding noise that Adafactor normalises to +-lr*1e-3: nothing to compare.
        continue
      np.testing.assert_allclose(out[shape]["params"][name], b, atol=1e-5, err_msg=f"{shape} {name}")
  assert "model" in out["(4, 2)"]["spec"]                # the mlp kernel really is split
  print({k: (v["loss"], round(v["step_ms"], 2)) for k, v in out.items()})
