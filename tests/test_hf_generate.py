"""Greedy decoding against transformers' own `generate`, end to end through checkpoint files.

Tiny random GPT-2 and T5 v1.1 (gated-GELU, untied lm_head) models are saved by transformers,
loaded with `hf_import.load_model`, and decoded by the jitted loops on a ragged batch of three
prompts. Each row must equal transformers' greedy `generate` on that row alone (no padding), EOS
included; after a row's EOS specjax holds zeros where a batched transformers run pads. The EOS id
is chosen from the models' own free-running greedy output so that rows stop at different steps.
Greedy speculative decoding (rules `greedy` and `exact` at temperature 0, a 1-layer draft) must
give the same tokens.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specjax.decoding import autoregressive, speculative  # noqa: E402
from specjax.models import Prompt, hf_import  # noqa: E402
from specjax.sampling import Warp  # noqa: E402

VOCAB, MAX_NEW, GAMMA, PAD = 64, 10, 3, 0
PROMPTS = [[5, 9, 17, 3, 40, 22], [33, 2], [7, 7, 12, 50, 61, 8, 11, 30, 4]]   # ragged
GREEDY = Warp(temperature=0.0)


def _gpt2(seed: int, width: int, layers: int, heads: int):
  torch.manual_seed(seed)
  cfg = transformers.GPT2Config(
      vocab_size=VOCAB, n_positions=64, n_embd=width, n_layer=layers, n_head=heads,
      n_inner=2 * width, bos_token_id=1, eos_token_id=1, pad_token_id=PAD, resid_pdrop=0.0,
      embd_pdrop=0.0, attn_pdrop=0.0)
  model = transformers.GPT2LMHeadModel(cfg).eval()
  with torch.no_grad():                 # every tensor random, LayerNorm scales around 1
    for name, p in model.named_parameters():
      p.normal_(0.0, 0.1)
      if "ln_" in name and name.endswith("weight"):
        p.add_(1.0)
  return model


def _t5(seed: int, width: int, layers: int, heads: int):
  """T5 v1.1: gated-gelu, separate lm_head, no output scaling; H*Dh != D on purpose."""
  torch.manual_seed(seed)
  cfg = transformers.T5Config(
      vocab_size=VOCAB, d_model=width, d_kv=12, d_ff=48, num_layers=layers,
      num_decoder_layers=layers, num_heads=heads, feed_forward_proj="gated-gelu",
      tie_word_embeddings=False, relative_attention_num_buckets=8,
      relative_attention_max_distance=16, dropout_rate=0.0, pad_token_id=PAD, eos_token_id=1,
      decoder_start_token_id=PAD)
  model = transformers.T5ForConditionalGeneration(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "layer_norm" in name:
        p.uniform_(0.5, 1.5)
      elif "relative_attention_bias" in name:
        p.normal_(0.0, 1.0)
    # transformers >= 5 ties lm_head to shared even for v1.1 configs: untie it explicitly.
    model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, width) * 0.5)
  return model


def _copy_perturbed(target, draft, noise: float = 0.3):
  """Make a 1-layer `draft` the target's first layer and embeddings, every tensor perturbed, so
  that greedy speculative decoding both accepts and rejects drafts (an unrelated random draft is
  almost never accepted, which would leave the acceptance path untested)."""
  weights = target.state_dict()
  with torch.no_grad():
    for name, p in draft.named_parameters():
      src = weights[name]
      p.copy_(src + noise * src.std() * torch.randn_like(src))
  return draft


def _save_and_load(torch_model, path):
  torch_model.save_pretrained(str(path), safe_serialization=True)
  if torch_model.config.model_type == "t5":
    # config.json as the hub's v1.1 checkpoints have it (transformers 5 writes tied + no scaling).
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = False
    config.pop("scale_decoder_outputs", None)
    (path / "config.json").write_text(json.dumps(config))
  return hf_import.load_model(str(path))


def _hf_greedy(torch_model, row: list[int], eos: int | None) -> list[int]:
  """transformers' greedy continuation of one unpadded row (eos None: never stop early)."""
  ids = torch.tensor([row], dtype=torch.long)
  with torch.no_grad():
    out = torch_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                               do_sample=False, num_beams=1, max_new_tokens=MAX_NEW,
                               min_new_tokens=0, eos_token_id=eos, pad_token_id=PAD)
  out = out[0].tolist()
  return out[1:] if torch_model.config.is_encoder_decoder else out[len(row):]


def _pick_eos(free: list[list[int]]) -> int:
  """The EOS id that makes the rows of free-running greedy output stop at the most distinct steps
  (then: the most tokens kept, so that much is still compared). Example: rows [4 7 7], [7 2 2],
  [5 5 5] -> 7 (stops after 2, 1 and 3 tokens)."""
  def stops(t):
    return [row.index(t) + 1 if t in row else len(row) for row in free]
  candidates = sorted({t for row in free for t in row} - {PAD})
  return max(candidates, key=lambda t: (len(set(stops(t))), sum(stops(t))))


@pytest.fixture(scope="module", params=["gpt2", "t5"])
def family(request, tmp_path_factory):
  """torch target, specjax target and draft (model, params), EOS id, HF outputs per row."""
  build = _gpt2 if request.param == "gpt2" else _t5
  torch_target = build(0, 32, 2, 4)
  target = _save_and_load(torch_target, tmp_path_factory.mktemp(f"{request.param}_target"))
  draft = _save_and_load(_copy_perturbed(torch_target, build(1, 32, 1, 4)),
                         tmp_path_factory.mktemp(f"{request.param}_draft"))
  eos = _pick_eos([_hf_greedy(torch_target, row, None) for row in PROMPTS])
  expected = [_hf_greedy(torch_target, row, eos) for row in PROMPTS]
  lengths = [len(e) for e in expected]
  # The test has power only if EOS cuts some rows while others go on.
  assert min(lengths) < MAX_NEW and len(set(lengths)) > 1, (eos, expected)
  assert all(e[-1] == eos for e in expected if len(e) < MAX_NEW)
  return dict(name=request.param, torch=torch_target, target=target, draft=draft, eos=eos,
              expected=expected)


def _check_rows(gen, expected: list[list[int]]) -> None:
  tokens, lengths = np.asarray(gen.tokens), np.asarray(gen.lengths)
  assert tokens.shape == (len(PROMPTS), MAX_NEW)
  for b, want in enumerate(expected):
    assert int(lengths[b]) == len(want), (b, tokens[b].tolist(), want)
    assert tokens[b, :len(want)].tolist() == want, (b, tokens[b].tolist(), want)
    assert (tokens[b, len(want):] == PAD).all()                # nothing after EOS
  assert np.asarray(gen.stats.emitted).tolist() == lengths.tolist()


def test_autoregressive_equals_hf_generate(family):
  model, params = family["target"]
  gen = autoregressive.generate(model, params, Prompt.from_lists(PROMPTS), jax.random.PRNGKey(0),
                                max_new_tokens=MAX_NEW, warp=GREEDY, eos_id=family["eos"])
  _check_rows(gen, family["expected"])


@pytest.mark.parametrize("family", ["t5"], indirect=True)
def test_t5_batched_hf_generate_pads_after_eos(family):
  """A batched transformers T5 run pads finished rows with pad (0): the same array as specjax.
  (Decoder-only batched HF generation needs left padding, so GPT-2 rows are compared alone.)"""
  prompt = Prompt.from_lists(PROMPTS, pad_id=PAD)
  ids = torch.tensor(np.asarray(prompt.tokens), dtype=torch.long)
  mask = torch.tensor(np.arange(ids.shape[1])[None] < np.asarray(prompt.lengths)[:, None],
                      dtype=torch.long)
  with torch.no_grad():
    theirs = family["torch"].generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                      num_beams=1, max_new_tokens=MAX_NEW, min_new_tokens=0,
                                      eos_token_id=family["eos"], pad_token_id=PAD).numpy()[:, 1:]
  model, params = family["target"]
  gen = autoregressive.generate(model, params, prompt, jax.random.PRNGKey(0),
                                max_new_tokens=MAX_NEW, warp=GREEDY, eos_id=family["eos"])
  ours = np.asarray(gen.tokens)[:, :theirs.shape[1]]
  np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("rule", ["greedy", "exact"])
def test_greedy_speculative_equals_hf_generate(family, rule):
  (target, tparams), (draft, dparams) = family["target"], family["draft"]
  gen = speculative.generate(target, tparams, draft, dparams, Prompt.from_lists(PROMPTS),
                             jax.random.PRNGKey(1), rule=rule, gamma=GAMMA,
                             max_new_tokens=MAX_NEW, warp=GREEDY, eos_id=family["eos"])
  _check_rows(gen, family["expected"])
  accepted, verified = np.asarray(gen.stats.accepted), np.asarray(gen.stats.verified)
  assert (accepted <= verified).all() and 0 < accepted.sum() < verified.sum()
  assert (np.asarray(gen.stats.blocks) <= np.asarray(gen.lengths)).all()   # >= 1 token a block
