"""Every same-vocabulary rule with every drafter in the one jitted loop (the drafters issue's
item 5): a pairing either decodes a batch (ragged prompts, every row to its length, ids in the
target's vocabulary) or is refused before anything compiles, with the reason. The one-hot
drafter (prompt lookup) cannot be verified by a rule that reads a draft distribution; a draft
model, an early exit and the draft head can be verified by all of them. Their laws are tested
beside each drafter (test_ngram, test_early_exit, test_draft_head); this is the matrix."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from specjax import testing
from specjax.decoding import speculative
from specjax.drafting import HeadDrafter, NGram
from specjax.models import Prompt, layers
from specjax.models.draft_head import DraftHead, with_target
from specjax.models.llama import Llama, LlamaConfig
from specjax.models.transformer import Rope
from specjax.sampling import Warp

RULES = ["exact", "greedy", "lenient", "fuzzy", "adaptive", "hf_greedy_draft"]
REFUSED = {("ngram", "fuzzy"), ("ngram", "adaptive")}
V, MAX_NEW = 32, 8


def _llama(num_layers=2, seed=0):
  cfg = LlamaConfig(vocab_size=V, d_model=32, num_layers=num_layers, num_heads=4, num_kv_heads=2,
                    head_dim=8, d_ff=64, rope=Rope(theta=10000.0), scan_layers=False)
  model = Llama(cfg)
  return model, model.init_params(jax.random.PRNGKey(seed))


def _drafter(kind, target, tparams):
  if kind == "ngram":
    return NGram(3, 1), None
  if kind == "model":
    return _llama(num_layers=1, seed=1)
  if kind == "early_exit":   # the target's first layer, its norm and head (api.early_exit)
    model = dataclasses.replace(target, config=dataclasses.replace(target.config, num_layers=1))
    return model, layers.first_layers(tparams, 1)
  head = DraftHead.for_target(target)
  return HeadDrafter(head=head), with_target(head.init_params(jax.random.PRNGKey(2)), tparams)


def _run(kind, rule):
  target, tparams = _llama()
  draft, dparams = _drafter(kind, target, tparams)
  prompt = Prompt.from_lists([[1, 2, 3, 1, 2], [4], [5, 6, 5, 6, 5, 6]])
  warp = Warp(temperature=0.0 if rule == "greedy" else 1.0)
  return speculative.generate(target, tparams, draft, dparams, prompt, jax.random.PRNGKey(0),
                              rule=rule, gamma=3, max_new_tokens=MAX_NEW, warp=warp, eos_id=None)


def _case(kind, rule):
  # by default: the refusals and the head with the rules its own file does not run; prompt
  # lookup with exact / greedy and the two-model rules run by default in their own files
  slow = (kind, rule) not in REFUSED | {("head", "lenient"), ("head", "adaptive")}
  return pytest.param(kind, rule, marks=pytest.mark.slow) if slow else (kind, rule)


@pytest.mark.parametrize("kind,rule", [_case(k, r) for k in ("ngram", "model", "early_exit", "head")
                                       for r in RULES])
def test_each_pairing_decodes_or_is_refused_with_the_reason(kind, rule):
  if (kind, rule) in REFUSED:
    with pytest.raises(ValueError, match=f"{rule}.*(draft distribution|cannot verify)"):
      _run(kind, rule)
    return
  gen = _run(kind, rule)
  tokens, lengths = np.asarray(gen.tokens), np.asarray(gen.lengths)
  assert (lengths == MAX_NEW).all()
  assert ((tokens[:, :MAX_NEW] >= 0) & (tokens[:, :MAX_NEW] < V)).all()
  totals = gen.stats.totals()
  assert totals["emitted"] == 3 * MAX_NEW and 0 < totals["blocks"] <= totals["emitted"]


_SHARDED_HEAD = """
import jax, numpy as np
from specjax import sharding
from specjax.decoding import sharded, speculative
from specjax.drafting import HeadDrafter
from specjax.models import Prompt, layers
from specjax.models.draft_head import DraftHead, with_target
from specjax.models.llama import Llama, LlamaConfig
from specjax.models.transformer import Rope
from specjax.sampling import Warp
cfg = LlamaConfig(vocab_size=32, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, d_ff=64, rope=Rope(theta=10000.0), scan_layers=False)
target = Llama(cfg)
tparams = target.init_params(jax.random.PRNGKey(0))
head = DraftHead.for_target(target)
hparams = with_target(head.init_params(jax.random.PRNGKey(1)), tparams)
prompt = Prompt.from_lists([[1, 2, 3, 4, 5], [7, 7, 8], [3], [5, 6, 5, 6], [9, 1]])
def run(tp, hp, mesh):
  return speculative.generate(target, tp, HeadDrafter(head=head), hp, prompt,
                              jax.random.PRNGKey(0), rule="exact", gamma=3, max_new_tokens=12,
                              warp=Warp(temperature=1.0), eos_id=None, mesh=mesh)
one = run(tparams, hparams, None)
mesh = sharding.make_mesh(4, 2)
many = run(sharded.place_params(target, tparams, mesh), hparams, mesh)
assert np.array_equal(np.asarray(one.tokens), np.asarray(many.tokens))
assert one.stats.totals() == many.stats.totals()
print("same")
"""


@pytest.mark.slow   # a subprocess with 8 simulated devices: about 30 s
def test_the_draft_head_on_a_mesh_gives_the_one_device_tokens():
  testing.assert_prints_on_devices(_SHARDED_HEAD, "same")
