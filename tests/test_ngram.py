"""Prompt lookup (decoding/ngram.py): what it proposes, that greedy verification of it equals the
target's greedy decoding, that exact verification keeps the target's law (and a broken rule
does not), and which rules it refuses."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import testing
from specjax.acceptance import registry
from specjax.decoding import autoregressive, speculative
from specjax.drafting import NGram
from specjax.models import Prompt
from specjax.sampling import Warp


def _propose(history, generated, gamma=3, drafter=NGram(3, 1)):
  h = Prompt.from_lists(history)
  width = max(len(g) for g in generated) + 1
  tokens = np.zeros((len(generated), width), np.int32)
  for b, g in enumerate(generated):
    tokens[b, :len(g)] = g
  drafts, count = drafter.lookup(h.tokens, h.lengths, jnp.asarray(tokens),
                                  jnp.asarray([len(g) for g in generated]), gamma)
  return [list(map(int, d[:c])) for d, c in zip(np.asarray(drafts), np.asarray(count))]


def test_the_longest_suffix_is_looked_up_in_the_prompt_and_the_output():
  # "7 8" was followed by "9 10 11" in the prompt: the 2-gram beats the 1-gram "8" -> 5.
  assert _propose([[1, 8, 5, 7, 8, 9, 10, 11]], [[7, 8]]) == [[9, 10, 11]]
  # Nothing matches: no drafts (the block is the target's own step).
  assert _propose([[1, 2, 3]], [[4]]) == [[]]
  # A match in the output itself; fewer than gamma tokens follow it.
  assert _propose([[1]], [[5, 6, 5]]) == [[6, 5]]
  # Ragged rows in one batch; a continuation runs on into the output ([1 2 3 4 | 2]).
  assert _propose([[1, 2, 3, 4], [9, 9]], [[2], [4, 9]]) == [[3, 4, 2], [9, 4, 9]]


def test_the_latest_match_followed_by_gamma_tokens_wins():
  # "3" appears at 1 (-> 4 5 6) and at 5 (-> 7 8 9): the later one, followed by gamma tokens.
  assert _propose([[1, 3, 4, 5, 6, 3, 7, 8, 9]], [[3]]) == [[7, 8, 9]]
  # In a run of one token the latest match is followed by one token only: the earliest wins.
  assert _propose([[1, 4, 4, 4, 4, 4]], [[4]]) == [[4, 4, 4]]


def test_a_window_longer_than_the_stream_matches_what_fits(monkeypatch):
  """ngram_max past the stream's length (prompt width + output width) looks up only the
  windows that fit (each window is traced, and 10**5 of them never finished compiling)."""
  from specjax.drafting import ngram
  rows = ([[1, 8, 5, 7, 8, 9, 10, 11]], [[7, 8]])
  windows, match = [], ngram.best_match
  monkeypatch.setattr(ngram, "best_match", lambda stream, end, n, gamma: (
      windows.append(n) if len(windows) < 100 else pytest.fail("traced 100 windows"),
      match(stream, end, n, gamma))[1])
  assert _propose(*rows, drafter=NGram(ngram_max=10**5)) == [[9, 10, 11]]
  assert max(windows) == 8 + 3 - 1 and len(windows) == max(windows)   # stream: 8 + 3 wide
  assert _propose(*rows) == [[9, 10, 11]]


def test_bad_windows_are_refused():
  for lo, hi in ((0, 3), (3, 2), (1.5, 3)):
    with pytest.raises(ValueError, match="1 <= ngram_min <= ngram_max"):
      NGram(ngram_max=hi, ngram_min=lo)


def test_greedy_verification_of_prompt_lookup_is_greedy_decoding():
  model, params = testing.tiny_decoder(seed=3, vocab_size=16)
  rows = [[1, 2, 3, 4, 5, 2, 3, 4], [7, 7, 8, 7, 7], [3]]
  prompt, key, greedy = Prompt.from_lists(rows), jax.random.PRNGKey(0), Warp(temperature=0.0)
  ar = autoregressive.generate(model, params, prompt, key, max_new_tokens=24, warp=greedy,
                               eos_id=None)
  sd = speculative.generate(model, params, NGram(3, 1), None, prompt, key, rule="greedy",
                            gamma=4, max_new_tokens=24, warp=greedy, eos_id=None)
  np.testing.assert_array_equal(sd.tokens, ar.tokens)
  stats = sd.stats.totals()
  assert stats["draft_passes"] == 0 and stats["accepted"] > 0 and stats["blocks"] < 3 * 24


V, MAX_NEW, PROMPT = 4, 4, [1, 2, 1, 3, 1]
MODEL = testing.ToyAR(V, 10)
N_RUNS = 50_000        # the broken rule's p-value is 0.0 at 50k rows


_ResampleFromP = testing.ResampleFromP


def _pvalue(rule, lookup=NGram(2, 1), drafted=N_RUNS) -> float:
  params = MODEL.init_params(jax.random.PRNGKey(0))
  warp = Warp(temperature=1.0)
  gen = speculative.generate(MODEL, params, lookup, None, Prompt.from_lists([PROMPT] * N_RUNS),
                             jax.random.PRNGKey(5), rule=rule, gamma=3, max_new_tokens=MAX_NEW,
                             warp=warp, eos_id=None)
  assert gen.stats.totals()["drafted"] > drafted          # the lookup proposed, often
  law = testing.enumerate_law(MODEL, params, PROMPT, max_new_tokens=MAX_NEW, warp=warp,
                              eos_id=None)
  return testing.chi_square_pvalue(law, testing.sequence_counts(gen.tokens, gen.lengths))


def test_exact_verification_of_prompt_lookup_keeps_the_target_law():
  assert _pvalue(registry.get("exact")) > 1e-3


def test_blocks_without_a_match_keep_the_target_law():
  """Trigrams only: the prompt's last three tokens occur nowhere before them, so every row's first
  block has no match and is verified at width 1 (the target's own step), later ones mix."""
  assert _pvalue(registry.get("exact"), NGram(3, 3), drafted=N_RUNS // 2) > 1e-3


def test_a_broken_rule_fails_the_same_law_test():
  assert _pvalue(_ResampleFromP()) < 1e-6


@pytest.mark.parametrize("name, phrase", [
    ("fuzzy", "KL\\(p\\|\\|q\\) is infinite"), ("fuzzy_random", "KL"), ("adaptive", "entropy"),
    ("intersection", "proposes the target's own ids"), ("union", "proposes the target's own ids")])
def test_rules_that_need_a_draft_model_are_refused(name, phrase):
  assert re.search(phrase, NGram().refusal(registry.rule_class(name)))


@pytest.mark.parametrize("name", ["exact", "greedy", "lenient", "hf_greedy_draft"])
def test_rules_that_read_the_drafted_token_alone_are_taken(name):
  assert NGram().refusal(registry.rule_class(name)) == ""


def test_the_loop_refuses_fuzzy_with_the_reason():
  model, params = testing.tiny_decoder(vocab_size=16)
  with pytest.raises(ValueError, match="cannot verify prompt lookup"):
    speculative.generate(model, params, NGram(), None, Prompt.from_lists([[1, 2]]),
                         jax.random.PRNGKey(0), rule="fuzzy", gamma=2, max_new_tokens=4,
                         warp=Warp(), eos_id=None)


_SHARDED = """
import jax, numpy as np
from specjax import sharding, testing
from specjax.decoding import sharded, speculative
from specjax.drafting import NGram
from specjax.models import Prompt
from specjax.sampling import Warp
model, params = testing.tiny_decoder(seed=3, vocab_size=16)
prompt = Prompt.from_lists([[1, 2, 3, 4, 5, 2, 3, 4], [7, 7, 8, 7, 7], [3], [5, 6, 5, 6]])
run = lambda p, mesh: speculative.generate(
    model, p, NGram(3, 1), None, prompt, jax.random.PRNGKey(0), rule="exact", gamma=4,
    max_new_tokens=16, warp=Warp(temperature=1.0), eos_id=None, mesh=mesh)
one = run(params, None)
mesh = sharding.make_mesh(4, 2)
many = run(sharded.place_params(model, params, mesh), mesh)
assert np.array_equal(np.asarray(one.tokens), np.asarray(many.tokens))
assert one.stats.totals() == many.stats.totals()
print("same")
"""


@pytest.mark.slow   # 23 s; sharded speculative decoding with a draft model runs by default
def test_prompt_lookup_on_a_mesh_gives_the_one_device_tokens():
  testing.assert_prints_on_devices(_SHARDED, "same")


def test_the_edit_config_holds_its_prompts():
  from specjax.app.config import load_config
  from specjax.app.methods import drafter, method_name
  config = load_config("qwen_coder_edit.py", ["--config.draft.method=ngram"])
  assert config.decode.chat and config.decode.temperature == 0 and len(config.prompts) == 6
  assert all("def " in p and "Reply with the code only." in p for p in config.prompts)
  assert drafter(config) == NGram(3, 1) and method_name(config) == "speculative"
