"""Sharded decoding (specjax/decoding/sharded.py): the cache rules, the heads check, and on 8
simulated CPU devices (a subprocess: this process has one device) every mesh gives exactly the
tokens and counters of one device, with no cache-sized collective inside the decoding loop.

The full matrix (meshes 8x1, 4x2, 2x4, 1x8; decoder, Llama with grouped-query attention, T5;
greedy and sampled; exact, AdaSD, a cross-tokenizer rule, target-only, SPRINTER), the CLI and
eval.latency on a mesh, and two processes joined by jax.distributed are slow-marked.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from specjax import sharding, testing
from specjax.app import cli, methods
from specjax.app.config import ConfigError
from specjax.decoding import sharded
from specjax.models import decoder, llama, t5

ROOT = Path(__file__).resolve().parents[1]


def fake_mesh(data: int, model: int):
  """What the rules read of a mesh (its axis sizes and device count), without the devices."""
  return type("Mesh", (), {"shape": {"data": data, "model": model},
                           "devices": np.zeros((data, model))})()


# ------------------------------------------------------------------------------- the rules

def test_cache_rules_split_rows_and_kv_heads():
  model = decoder.Decoder(decoder.DecoderConfig(vocab_size=64, n_positions=32, d_model=32,
                                                num_layers=2, num_heads=8, d_ff=64))
  cache = jax.eval_shape(lambda: model.init_cache(6, 16))
  specs = sharding.cache_specs(cache, fake_mesh(2, 4))
  assert specs.k == specs.v == P(None, "data", "model", None, None)    # [L, B, H, S, Dh]
  assert specs.lengths == P("data")
  assert sharding.cache_specs(cache, fake_mesh(4, 2)).k == P(None, None, "model", None, None)


def test_cache_rules_of_grouped_query_attention_and_t5():
  gqa = llama.Llama(llama.LlamaConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=8,
                                      num_kv_heads=2, head_dim=4, d_ff=64))
  cache = jax.eval_shape(lambda: gqa.init_cache(4, 16))
  assert sharding.cache_specs(cache, fake_mesh(2, 2)).k == P(None, "data", "model", None, None)
  # 2 KV heads over a model axis of 4: the cache is replicated over 'model', heads stay whole.
  assert sharding.cache_specs(cache, fake_mesh(2, 4)).k == P(None, "data", None, None, None)
  enc_dec = t5.T5(t5.T5Config(vocab_size=64, d_model=32, d_kv=4, num_heads=8, num_layers=1,
                              num_decoder_layers=1, d_ff=64))
  specs = sharding.cache_specs(jax.eval_shape(lambda: enc_dec.init_cache(4, 8, 5)),
                               fake_mesh(2, 4))
  assert specs.cross_k == specs.cross_v == P(None, "data", "model", None, None)
  assert specs.enc_mask == P("data", None)


def test_attention_splits_by_whole_kv_head_groups():
  """Llama with 8 query heads on 2 KV heads: attention splits over a model axis of 2 (one KV head
  and its 4 query heads per device) and stays whole over 4; the mlp splits either way."""
  gqa = llama.Llama(llama.LlamaConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=8,
                                      num_kv_heads=2, head_dim=4, d_ff=64))
  units = sharded.model_units(gqa)
  assert units == {"heads": 2, "kv_heads": 2}
  key = sharding.leaf_axes(("layers", "attention", "key", "kernel"), 3)
  assert key == ("layers", "embed", "kv_heads")
  assert sharding.leaf_axes(("layers", "attention", "value", "bias"), 2) == ("layers", "kv_heads")
  query = sharding.leaf_axes(("layers", "attention", "query", "kernel"), 3)
  gate = sharding.leaf_axes(("layers", "mlp", "wi_0", "kernel"), 3)
  for model_axis, split in ((2, "model"), (4, None)):
    mesh = fake_mesh(1, model_axis)
    assert sharding.spec_for(query, (2, 32, 32), mesh, units) == P(None, None, split)
    assert sharding.spec_for(key, (2, 32, 8), mesh, units) == P(None, None, split)
    assert sharding.spec_for(gate, (2, 32, 64), mesh, units) == P(None, None, "model")
  # Without units a [D, Hkv*Dh] kernel would be cut inside a head.
  assert sharding.spec_for(key, (2, 32, 8), fake_mesh(1, 4)) == P(None, None, "model")
  mha = decoder.Decoder(decoder.DecoderConfig(num_heads=8, d_model=32))
  assert sharded.model_units(mha) == {"heads": 8, "kv_heads": 8}


def test_out_in_layout_swaps_the_kernel_axes(monkeypatch):
  """layout="out_in" stores Dense kernels [out, in]: their logical axes are swapped, so the
  same dims split; biases, the embedding and a float LM head keep theirs."""
  gqa = llama.Llama(llama.LlamaConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=8,
                                      num_kv_heads=2, head_dim=4, d_ff=64, qkv_bias=True,
                                      layout="out_in"))
  out_in = lambda *names: sharding.leaf_axes(names, 3, "out_in")
  assert out_in("layers", "attention", "query", "kernel") == ("layers", "heads", "embed")
  assert out_in("layers", "attention", "out", "kernel") == ("layers", "embed", "heads")
  assert out_in("layers", "mlp", "wo", "kernel") == ("layers", "embed", "mlp")
  assert sharding.leaf_axes(("layers", "mlp", "wi_0", "bias"), 2, "out_in") == ("layers", "mlp")
  assert sharding.leaf_axes(("lm_head", "kernel"), 2, "out_in") == ("embed", "vocab")
  # an int8 output layer is stored [V, D] with out_in (models/dense_layout.transposes)
  assert sharding.leaf_axes(("lm_head", "kernel"), 2, "out_in", "int8") == ("vocab", "embed")
  assert sharding.leaf_axes(("lm_head", "kernel"), 2, "in_out", "int8") == ("embed", "vocab")
  assert sharding.leaf_axes(("lm_head", "scale"), 1, "out_in", "int8") == ("vocab",)
  assert sharding.leaf_axes(("token_embed", "embedding"), 2, "out_in") == ("vocab", "embed")
  monkeypatch.setattr(sharding, "NamedSharding", lambda mesh, spec: spec)   # a fake mesh's
  for layout, gate in (("out_in", P(None, "model", None)), ("in_out", P(None, None, "model"))):
    model = llama.Llama(dataclasses.replace(gqa.config, layout=layout))
    params = jax.eval_shape(model.init_params, jax.random.PRNGKey(0))
    specs = sharded.param_shardings(model, params, fake_mesh(1, 2))["layers"]
    assert specs["mlp"]["wi_0"]["kernel"] == gate                  # out_in [L, F, D]: F splits
    assert specs["mlp"]["wo"]["kernel"] == P(None, *reversed(gate[1:]))
    assert specs["attention"]["query"]["kernel"] == gate
    assert specs["attention"]["query"]["bias"] == P(None, "model")


def test_a_model_axis_that_splits_no_head_is_refused_with_the_choices():
  with pytest.raises(sharding.HeadsError) as info:
    sharding.check_heads(fake_mesh(1, 8), heads=12, kv_heads=2, what="the target model")
  err = info.value
  assert (err.model_axis, err.heads, err.kv_heads, err.valid) == (8, 12, 2, (1, 2, 4))
  assert "mesh model axis 8 divides neither the 12 attention heads nor the 2 KV heads" in str(err)
  advice = cli.advice(err)
  assert "--config.mesh.model=8" in advice and "one of 1, 2, 4" in advice
  sharding.check_heads(fake_mesh(2, 4), heads=12, kv_heads=2)     # 4 divides 12: allowed


def test_padded_batch_and_row_padding():
  assert sharding.padded_batch(6, fake_mesh(4, 2)) == 8
  assert sharding.padded_batch(6, fake_mesh(2, 4)) == 6
  padded = sharded.pad_rows(np.arange(6).reshape(3, 2), 5)
  np.testing.assert_array_equal(padded, [[0, 1], [2, 3], [4, 5], [4, 5], [4, 5]])


def test_one_device_configs_build_no_mesh():
  config = {"mesh": {"data": 1, "model": 1}}
  assert methods.mesh_from_config(config) is None
  assert methods.mesh_from_config({}) is None                        # no mesh section
  with pytest.raises(ConfigError, match="known fields: data, model"):
    methods.mesh_from_config({"mesh": {"rows": 2}})


# ------------------------------------------------------------- 8 simulated devices == 1 device

CHILD = textwrap.dedent("""
    import collections, dataclasses, json, sys
    import jax, jax.numpy as jnp, numpy as np
    from specjax import sharding, testing
    from specjax.acceptance import registry, vocab
    from specjax.decoding import autoregressive, sharded, speculative
    from specjax.models import Prompt, decoder, llama
    from specjax.sampling import Warp
    from specjax.sprinter import loop as sprinter_loop

    ROWS = [[1, 5, 7], [1, 9], [1, 3, 4, 6, 2], [1, 8, 8], [1, 11]]   # 8x1, 4x2, 2x4 pad
    V, MAX_NEW = 64, 10

    def spread(params):
      return testing._spread(params)

    def noisy(params, key, scale=0.3):
      leaves, tree = jax.tree.flatten(params)
      keys = jax.random.split(key, len(leaves))
      return jax.tree.unflatten(tree, [x + scale * jnp.std(x) * jax.random.normal(k, x.shape)
                                       for x, k in zip(leaves, keys)])

    def decoder_pair(draft_vocab=V):
      cfg = decoder.DecoderConfig(vocab_size=V, n_positions=64, d_model=32, num_layers=2,
                                  num_heads=8, d_ff=64, tie_word_embeddings=False,
                                  bos_token_id=1, eos_token_id=1, pad_token_id=0)
      target = decoder.Decoder(cfg)
      tp = spread(target.init_params(jax.random.PRNGKey(0)))
      draft = decoder.Decoder(dataclasses.replace(cfg, num_layers=1, vocab_size=draft_vocab))
      if draft_vocab != V:
        return target, tp, draft, spread(draft.init_params(jax.random.PRNGKey(1)))
      first = dict(tp, layers=jax.tree.map(lambda x: x[:1], tp["layers"]))
      return target, tp, draft, noisy(first, jax.random.PRNGKey(1))

    def llama_pair(draft_vocab=V, layout="in_out"):
      cfg = llama.LlamaConfig(vocab_size=V, d_model=32, num_layers=2, num_heads=8,
                              num_kv_heads=2, head_dim=4, d_ff=64, bos_token_id=1,
                              eos_token_id=None, layout=layout)
      target = llama.Llama(cfg)
      tp = spread(target.init_params(jax.random.PRNGKey(0)))
      draft = llama.Llama(dataclasses.replace(cfg, num_layers=1, vocab_size=draft_vocab))
      if draft_vocab != V:
        return target, tp, draft, spread(draft.init_params(jax.random.PRNGKey(1)))
      first = dict(tp, layers=jax.tree.map(lambda x: x[:1], tp["layers"]))
      return target, tp, draft, noisy(first, jax.random.PRNGKey(1))

    def t5_pair():
      target, tp = testing.tiny_t5(seed=0, vocab_size=V, d_model=32, num_heads=8,
                                   tie_word_embeddings=False, feed_forward_proj="gated-gelu")
      tp = dict(tp, lm_head={"kernel": 0.25 * tp["lm_head"]["kernel"]})   # sampling matters
      draft = type(target)(dataclasses.replace(target.config, num_layers=1, num_decoder_layers=1))
      cut = lambda stack: dict(stack, layers=jax.tree.map(lambda x: x[:1], stack["layers"]))
      first = dict(tp, encoder=cut(tp["encoder"]), decoder=cut(tp["decoder"]))
      return target, tp, draft, noisy(first, jax.random.PRNGKey(1))

    def int8_pair(draft_vocab=V, layout="in_out"):
      from specjax.models import quant
      pair = llama_pair(draft_vocab, layout)
      out = []
      for model, params in (pair[:2], pair[2:]):
        cfg = dataclasses.replace(model.config, quant="int8")
        out += [type(model)(cfg), spread(quant.quantize_params(dict(params), False, layout))]
      return tuple(out)

    PAIRS = {"decoder": decoder_pair, "llama": llama_pair, "t5": t5_pair,
             "llamaoutin": lambda draft_vocab=V: llama_pair(draft_vocab, layout="out_in"),
             "llamaint8": int8_pair,
             "llamaint8outin": lambda draft_vocab=V: int8_pair(draft_vocab, "out_in")}

    def cross_vocab():
      # Draft ids 0..39 are target ids 0..39; target ids 40..63 are two draft tokens each.
      t2d = np.where(np.arange(V) < 40, np.arange(V), -1).astype(np.int32)
      d2t = np.where(np.arange(48) < 40, np.arange(48), -1).astype(np.int32)
      images = np.stack([np.where(t2d >= 0, t2d, np.arange(V) % 40),
                         np.where(t2d >= 0, 0, 40 + np.arange(V) % 8)], 1).astype(np.int32)
      lens = np.where(t2d >= 0, 1, 2).astype(np.int32)
      return vocab.VocabMap(d2t=d2t, t2d=t2d, images=images, image_len=lens, target_vocab=V,
                            draft_vocab=48)

    @dataclasses.dataclass(frozen=True)
    class SignVerifier:
      features: str = "A"
      hidden_size: int = 32
      def score(self, params, hidden, keys):
        return hidden @ params["w"]

    SPECULATIVE = ("exact", "adaptive", "cross")

    def warp_of(temperature):   # "rows": a value per row, greedy and sampled rows mixed
      if temperature == "rows":
        return Warp(temperature=(0.0, 1.0, 0.7, 1.3, 1.0), top_p=(1.0, 0.9, 1.0, 1.0, 0.8))
      return Warp(temperature=float(temperature))

    def spec_args(case):   # (target, tp, draft, dp, rule, gamma, warp) of a speculative case
      family, method, temperature = case.split(":")
      pair = PAIRS[family](draft_vocab=48) if method == "cross" else PAIRS[family]()
      rule = {"exact": "exact", "adaptive": registry.get("adaptive", max_window=6),
              "cross": registry.get("intersection", vocab=VOCAB_MAP)}[method]
      return (*pair, rule, 6 if method == "adaptive" else 3, warp_of(temperature))

    def run(case, mesh):
      family, method, temperature = case.split(":")
      prompt, key = Prompt.from_lists(ROWS), jax.random.PRNGKey(7)
      kw = dict(max_new_tokens=MAX_NEW, warp=warp_of(temperature), eos_id=None, mesh=mesh)
      if method in SPECULATIVE:
        target, tp, draft, dp, rule, gamma, warp = spec_args(case)
        gen = speculative.generate(target, tp, draft, dp, prompt, key, rule=rule, gamma=gamma,
                                   **kw)
      else:
        target, tp, draft, dp = PAIRS[family]()
      if method == "ar":
        gen = autoregressive.generate(target, tp, prompt, key, **kw)
      if method == "sprinter":
        w = {"w": jax.random.normal(jax.random.PRNGKey(5), (32,))}
        gen = sprinter_loop.generate(target, tp, draft, dp, SignVerifier(), w, prompt, key,
                                     threshold=0.0, gamma_max=3, **kw)
      stats = {f.name: np.asarray(getattr(gen.stats, f.name)).tolist()
               for f in dataclasses.fields(gen.stats)}
      return dict(tokens=np.asarray(gen.tokens).tolist(), lengths=np.asarray(gen.lengths).tolist(),
                  stats=stats)

    def loop_hlo(case, mesh):   # what the loop of run(case, mesh) communicates (cached compile)
      target, tp, draft, dp, rule, gamma, warp = spec_args(case)
      prompt = Prompt.from_lists(ROWS)
      setup = speculative._validate(target, draft, prompt, None, rule=rule, gamma=gamma,
                                    max_new_tokens=MAX_NEW, warp=warp, eos_id=None, max_len=None)
      setup = dataclasses.replace(setup, mesh=mesh)
      keys = jax.random.split(jax.random.PRNGKey(7), len(ROWS))
      rows = sharding.padded_batch(len(ROWS), mesh)
      args = sharded.place_args((target, draft), (tp, dp),
                                sharded.pad_rows((prompt, prompt), rows),
                                sharded.pad_rows(keys, rows), mesh)
      args += sharded.place_shared(((setup.rule, setup.warp, setup.limit),), mesh, rows)
      text = sharded.jitted(speculative.loop, setup, args).lower(*args).compile().as_text()
      return dict(collectives=[list(c) for c in sharded.loop_collectives(text)],
                  capacity=setup.max_len)

    # argv: cases, mesh shapes, hlo (the loop's collectives too) or -, [port, process id]
    if len(sys.argv) > 5:
      sharding.initialize_distributed(f"localhost:{sys.argv[4]}", 2, int(sys.argv[5]))
    VOCAB_MAP = cross_vocab()
    cases, shapes = sys.argv[1].split(","), [s for s in sys.argv[2].split(",") if s]
    out = {"process": jax.process_index()}
    for case in cases:
      out[case] = {"1": run(case, None)}
      for shape in shapes:
        mesh = sharding.make_mesh(*map(int, shape.split("x")))
        out[case][shape] = run(case, mesh)
        if sys.argv[3] == "hlo" and case.split(":")[1] in SPECULATIVE:
          out[case][shape]["hlo"] = loop_hlo(case, mesh)
    print("RESULT" + json.dumps(out))
""")


def child_env(devices: int) -> dict:
  env = dict(os.environ, XLA_FLAGS=testing.with_devices(devices),
             JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  env.pop("SPECJAX_DEBUG", None)
  return env


def result(proc) -> dict:
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
  return json.loads(line[len("RESULT"):])


def run_child(cases: list[str], shapes: list[str], hlo: bool = False, timeout: int = 900):
  argv = [sys.executable, "-c", CHILD, ",".join(cases), ",".join(shapes), "hlo" if hlo else "-"]
  return result(subprocess.run(argv, env=child_env(8), capture_output=True, text=True,
                               timeout=timeout, cwd=ROOT))


def assert_same_as_one_device(out: dict, cases: list[str], shapes: list[str]) -> None:
  for case in cases:
    ref = out[case]["1"]
    assert len(ref["tokens"]) == 5 and max(ref["lengths"]) > 1
    for shape in shapes:
      got = out[case][shape]
      assert got["tokens"] == ref["tokens"], (case, shape)
      assert got["lengths"] == ref["lengths"], (case, shape)
      assert got["stats"] == ref["stats"], (case, shape)
      if "hlo" in got:
        assert_no_cache_traffic(got["hlo"], (case, shape))


def assert_no_cache_traffic(hlo: dict, where) -> None:
  """Inside the loop only per-row activations, logits and flags move (and, were a KV head split
  another way, a block's few new entries): no collective result spans the cache's positions
  ([L, B, H, S, Dh] with S = the capacity, larger than every other dimension but D and V)."""
  assert hlo["collectives"], f"{where}: the sharded loop runs no collective at all: is it split?"
  for op, shape, groups in hlo["collectives"]:
    dims = [int(d) for d in shape[shape.index("[") + 1:shape.index("]")].split(",") if d]
    assert not (len(dims) == 5 and hlo["capacity"] in dims), (where, op, shape, groups)


def test_sharded_speculative_equals_one_device_and_keeps_the_cache_in_place():
  """Sampled exact SD of a Llama pair with grouped-query attention (8 query heads, 2 KV heads) on
  a 2x4 mesh (5 rows padded to 6; mlp and vocab over 4, attention whole since 4 does not divide
  the KV heads) gives the one-device tokens and counters, with a temperature and top_p per row
  (a greedy row among sampled ones; the values padded with the rows), and its compiled loop
  moves nothing of a cache's size. One warp for every row: FULL (-m slow)."""
  cases, shapes = ["llama:exact:rows"], ["2x4"]
  out = run_child(cases, shapes, hlo=True)
  assert_same_as_one_device(out, cases, shapes)
  kinds = {op for op, _, _ in out[cases[0]]["2x4"]["hlo"]["collectives"]}
  assert "all-reduce" in kinds                     # row-parallel matmuls sum over 'model'


@pytest.mark.slow   # 30 s; the in_out layout on the same meshes runs by default
def test_sharded_out_in_layout_equals_one_device():
  """The same Llama pair with its dense kernels stored [out, in] (models/dense_layout.py): the
  rules split each kernel along its swapped axes, and the 2x4 mesh gives the one-device tokens
  without moving a cache."""
  cases, shapes = ["llamaoutin:exact:1.0"], ["2x4"]
  out = run_child(cases, shapes, hlo=True)
  assert_same_as_one_device(out, cases, shapes)


@pytest.mark.parametrize("case", [
    "llamaint8outin:exact:0",
    # slow: 20 s; the [out, in] int8 case above splits the same scales, and the [in, out] float
    # pair runs on the same mesh by default.
    pytest.param("llamaint8:exact:0", marks=pytest.mark.slow)])
def test_sharded_int8_equals_one_device(case):
  """The Llama pair with int8 layers (models/quant.py), stored [out, in] (and [in, out]): each
  kernel's scale is split with the kernel's output axis (sharding.leaf_axes), and greedy SD on
  the 2x4 mesh gives the one-device tokens without moving a cache."""
  out = run_child([case], ["2x4"], hlo=True)
  assert_same_as_one_device(out, [case], ["2x4"])


FULL = ["decoder:exact:0", "decoder:exact:1.0", "decoder:adaptive:1.0", "decoder:cross:1.0",
        "decoder:ar:1.0", "decoder:ar:rows", "decoder:sprinter:1.0", "decoder:sprinter:rows",
        "llama:exact:0", "llama:exact:1.0",
        "llama:adaptive:1.0", "llama:cross:1.0", "t5:exact:0", "t5:exact:1.0",
        "t5:adaptive:1.0"]
MESHES = ["8x1", "4x2", "2x4", "1x8"]


@pytest.mark.slow
@pytest.mark.parametrize("case", FULL)
def test_every_mesh_gives_the_one_device_tokens(case):
  out = run_child([case], MESHES, hlo=True, timeout=1800)
  assert_same_as_one_device(out, [case], MESHES)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_decode_as_one_device():
  """Two processes (2 CPU devices each) joined by jax.distributed decode on a 2x2 mesh whose
  'data' axis spans the processes: both hold the whole result, equal to one device's."""
  cases, port = ["decoder:exact:1.0", "decoder:ar:1.0"], free_port()
  procs = [subprocess.Popen([sys.executable, "-c", CHILD, ",".join(cases), "2x2", "-", str(port),
                             str(i)], env=child_env(2), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT) for i in range(2)]
  outs = []
  for proc in procs:
    stdout, stderr = proc.communicate(timeout=900)
    outs.append(result(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)))
  assert [o["process"] for o in outs] == [0, 1]
  for out in outs:
    assert_same_as_one_device(out, cases, ["2x2"])
  assert outs[0]["decoder:exact:1.0"] == outs[1]["decoder:exact:1.0"]


# ----------------------------------------------------------------- the CLI and eval.latency

VOCAB, PROMPTS = 400, ("def f(x):", "class Stack:", "import os")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """A 12-head target (2 layers, untied head) and a 1-layer draft made from it, in the Hugging
  Face layout with a 400-piece SentencePiece model beside each."""
  import dataclasses
  import inspect
  import shutil
  import string
  from specjax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, train_sentencepiece
  from specjax.models import hf_import
  root = tmp_path_factory.mktemp("sharded_cli")
  text = inspect.getsource(string) + inspect.getsource(textwrap)
  spm = train_sentencepiece(text[:12000].split("\n\n"), root / "bpe.model", model_type="bpe",
                            vocab_size=VOCAB, num_threads=1)
  cfg = decoder.DecoderConfig(vocab_size=VOCAB, n_positions=128, d_model=48, num_layers=2,
                              num_heads=12, d_ff=96, tie_word_embeddings=False,
                              bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
  target = decoder.Decoder(cfg)
  params = target.init_params(jax.random.PRNGKey(0))
  params = {k: jax.tree.map(lambda x: 4.0 * x, v) if k in ("token_embed", "lm_head") else v
            for k, v in params.items()}
  first = dict(params, layers=jax.tree.map(lambda x: x[:1], params["layers"]))
  leaves, tree = jax.tree.flatten(first)
  keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
  draft_params = jax.tree.unflatten(tree, [x + 0.2 * (jax.numpy.std(x) + 1e-3)
                                           * jax.random.normal(k, x.shape)
                                           for x, k in zip(leaves, keys)])
  draft = decoder.Decoder(dataclasses.replace(cfg, num_layers=1))
  dirs = {}
  for role, model, p in (("target", target, params), ("draft", draft, draft_params)):
    dirs[role] = hf_import.save_model(model, p, root / role)
    shutil.copy(spm, dirs[role] / "spm.model")
  return dict(root=root, spm=spm, **dirs)


def config_flags(ck) -> list[str]:
  return ["--config", "tiny.py", f"--config.target.checkpoint={ck['target']}",
          f"--config.draft.checkpoint={ck['draft']}", "--config.decode.max_new_tokens=8"]


def decode_command(ck, name: str, *extra: str) -> list[str]:
  prompts = [a for p in PROMPTS for a in ("--prompt", p)]
  return [sys.executable, "-m", "specjax.decode", *config_flags(ck), *prompts,
          "--config.decode.batch_size=3", "--output_json", str(ck["root"] / f"{name}.json"),
          *extra]


def run_all(ck, commands, devices: int = 8) -> list[subprocess.CompletedProcess]:
  """The commands concurrently from the repo root, on `devices` simulated CPU devices each."""
  env = dict(child_env(devices), SPECJAX_CACHE=str(ck["root"] / "cache"))
  procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for c in commands]
  done = []
  for cmd, proc in zip(commands, procs):
    out, err = proc.communicate(timeout=900)
    done.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
  return done


def tokens_of(ck, name: str) -> list[list[int]]:
  return [r["tokens"] for r in json.loads((ck["root"] / f"{name}.json").read_text())["results"]]


@pytest.mark.slow
def test_decode_cli_on_a_mesh_and_a_refused_one(checkpoints):
  """specjax.decode on 8 simulated devices: a 2x4 mesh (3 prompts padded to 4 rows, 12 heads
  over 4) prints the one-device texts; --config.mesh.model=8 is refused with the choices."""
  ck = checkpoints
  one, mesh, refused = run_all(ck, [
      decode_command(ck, "one"),
      decode_command(ck, "mesh", "--config.mesh.data=2", "--config.mesh.model=4"),
      decode_command(ck, "refused", "--config.mesh.data=1", "--config.mesh.model=8")])
  assert one.returncode == 0 and mesh.returncode == 0, (one.stderr[-2000:], mesh.stderr[-2000:])
  assert tokens_of(ck, "mesh") == tokens_of(ck, "one")
  report = json.loads((ck["root"] / "mesh.json").read_text())
  assert report["settings"]["devices"] == {"mesh": "2x4", "data": 2, "model": 4, "devices": 8,
                                           "processes": 1}
  assert refused.returncode == 2 and "Traceback" not in refused.stderr
  assert ("--config.mesh.model=8 divides neither the 12 attention heads nor the 12 KV heads of "
          "the target model: set --config.mesh.model to one of 1, 2, 4") in refused.stderr


@pytest.mark.slow
def test_latency_reports_a_tensor_parallel_mesh(checkpoints):
  """eval.latency on 8 simulated devices with heads / mlp / vocab split 4 ways (2x4) completes
  and names its mesh."""
  ck, out = checkpoints, checkpoints["root"] / "latency.json"
  (proc,) = run_all(ck, [[sys.executable, "-m", "eval.latency", *config_flags(ck),
                          f"--config.data.tokenizer={ck['spm']}", "--config.mesh.data=2",
                          "--config.mesh.model=4", "--num_prompts", "1", "--repeats", "1",
                          "--output_json", str(out)]])
  assert proc.returncode == 0, proc.stderr[-3000:]
  (record,) = json.loads(out.read_text())
  assert (record["mesh"], record["devices"], record["processes"]) == ("2x4", 8, 1)
  assert record["sd_ms_per_token"] > 0 and "| 2x4 |" in proc.stdout


@pytest.mark.slow
def test_two_processes_decode_cli_reports_once(checkpoints):
  """`--config.distributed.enabled=true` on two processes (2 devices each, a 2x2 mesh): process
  0 prints and writes the one-device texts, process 1 neither."""
  ck, port = checkpoints, free_port()
  flags = ["--config.distributed.enabled=true", "--config.distributed.num_processes=2",
           f"--config.distributed.coordinator=localhost:{port}", "--config.mesh.data=2",
           "--config.mesh.model=2"]
  procs = run_all(ck, [decode_command(ck, f"mh{i}", *flags, f"--config.distributed.process_id={i}")
                       for i in range(2)] + [decode_command(ck, "one_mh")], devices=2)
  assert all(p.returncode == 0 for p in procs), [p.stderr[-2000:] for p in procs]
  assert tokens_of(ck, "mh0") == tokens_of(ck, "one_mh")
  assert not (ck["root"] / "mh1.json").exists()
  ours = lambda out: [l for l in out.splitlines() if not l.startswith("[Gloo]")]   # gloo's own
  assert ours(procs[1].stdout) == [] and "stats:" in procs[0].stdout
