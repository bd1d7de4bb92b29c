"""Non-finite numbers are refused, never decoded: a checkpoint tensor holding NaN / inf is refused
at load by tensor and file (hf_tensors.LazyTensors checks each tensor as it reads it), and NaN
logits while decoding raise NonFiniteLogitsError naming the model, in the autoregressive,
speculative, SPRINTER and string-level loops, instead of returning padding. Tiny random GPT-2
decoders (vocab 48) whose final layer norm is made NaN."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from specjax import sampling, testing
from specjax.decoding import autoregressive, speculative, string_level
from specjax.decoding.state import DRAFT, TARGET, NonFiniteLogitsError
from specjax.models import Prompt, hf_import, hf_tensors
from specjax.sprinter import loop as sprinter_loop

PROMPT = Prompt.from_lists([[5, 9, 17], [3, 4]])
KEY = jax.random.PRNGKey(0)
GREEDY = sampling.Warp(temperature=0.0)


def _poisoned(params, value=np.nan):
  """The params with the final layer norm's scale set to `value`: every logit becomes NaN."""
  return {**params, "ln_f": {**params["ln_f"], "scale": params["ln_f"]["scale"] * value}}


@pytest.fixture(scope="module")
def models():
  target, tparams = testing.tiny_decoder(seed=1)
  draft, dparams = testing.tiny_decoder(seed=2, num_layers=1)
  return target, tparams, draft, dparams


# ------------------------------------------------------------------------------ checkpoints

@pytest.mark.parametrize("dtype, value", [(np.float32, np.nan), (ml_dtypes.bfloat16, np.inf)])
def test_checkpoint_with_nan_or_inf_is_refused_naming_tensor_and_file(models, tmp_path, dtype,
                                                                       value):
  target, tparams, _, _ = models
  path = hf_import.save_model(target, tparams, tmp_path)
  weights = path / "model.safetensors"
  tensors = {k: v.astype(dtype) for k, v in load_file(str(weights)).items()}
  hf_import.load_model(str(path))                                    # finite: loads
  name = "transformer.h.1.mlp.c_fc.weight"
  bad = tensors[name].copy()
  bad[3, 7] = value
  tensors[name] = bad
  save_file(tensors, str(weights), metadata={"format": "pt"})
  with pytest.raises(hf_tensors.NonFiniteTensorError,
                     match=re.escape(f"{weights}: tensor {name} holds 1 NaN/inf values")):
    hf_import.load_model(str(path))


def test_finite_check_covers_every_chunk(monkeypatch):
  monkeypatch.setattr(hf_tensors, "_FINITE_CHUNK", 4)
  array = np.zeros((3, 5), np.float16)
  hf_tensors.check_finite(array, "x", "f")
  array[2, 4] = np.inf                                               # in the last, short chunk
  with pytest.raises(hf_tensors.NonFiniteTensorError, match="tensor x holds 1 NaN/inf"):
    hf_tensors.check_finite(array, "x", "f")
  hf_tensors.check_finite(np.full(3, 7, np.int32), "ids", "f")       # integers are not checked


# ---------------------------------------------------------------------------------- decoding

def test_nonfinite_rows_flags_nan_and_plus_inf_not_minus_inf():
  from specjax.sampling import nonfinite_rows
  logits = jnp.asarray([[0.0, -jnp.inf], [jnp.nan, 1.0], [jnp.inf, 0.0]])
  assert nonfinite_rows(logits).tolist() == [False, True, True]
  assert nonfinite_rows(logits[:, None, :]).tolist() == [False, True, True]   # [B, T, V]


def test_autoregressive_raises_on_nan_logits(models):
  target, tparams, _, _ = models
  gen = autoregressive.generate(target, tparams, PROMPT, KEY, max_new_tokens=4, warp=GREEDY,
                                eos_id=None)
  assert np.asarray(gen.stats.nonfinite).tolist() == [0, 0]
  with pytest.raises(NonFiniteLogitsError,
                     match=r"the target model \(Decoder, float32 weights\) produced non-finite "
                           r"logits \(NaN or inf\) in rows \[0, 1\]: likely a float16 overflow"):
    autoregressive.generate(target, _poisoned(tparams), PROMPT, KEY, max_new_tokens=4,
                            warp=GREEDY, eos_id=None)


@pytest.mark.parametrize("poison, role", [("target", "target"), ("draft", "draft"),
                                          ("both", "target")])
def test_speculative_names_the_model_with_nan_logits(models, poison, role):
  target, tparams, draft, dparams = models
  tp = _poisoned(tparams) if poison in ("target", "both") else tparams
  dp = _poisoned(dparams) if poison in ("draft", "both") else dparams
  with pytest.raises(NonFiniteLogitsError, match=f"the {role} model") as err:
    speculative.generate(target, tp, draft, dp, PROMPT, KEY, rule="exact", gamma=3,
                         max_new_tokens=6, warp=sampling.Warp(), eos_id=None)
  assert err.value.role == role and err.value.rows == [0, 1]


def test_speculative_state_flags_the_draft_alone(models):
  """The flag is per model: a NaN draft under a finite target sets DRAFT only (the loop itself
  runs to the end; generate raises)."""
  target, tparams, draft, dparams = models
  setup = speculative._validate(target, draft, PROMPT, None, rule="exact", gamma=3,
                                max_new_tokens=6, warp=sampling.Warp(), eos_id=None,
                                max_len=None)
  keys, knobs = sampling.as_row_keys(KEY, 2), (setup.rule, setup.warp, setup.limit)
  state = speculative.run(setup, tparams, _poisoned(dparams), PROMPT, PROMPT, keys, knobs)
  assert np.asarray(state.stats.nonfinite).tolist() == [DRAFT, DRAFT]
  state = speculative.run(setup, tparams, dparams, PROMPT, PROMPT, keys, knobs)
  assert np.asarray(state.stats.nonfinite).tolist() == [0, 0]
  state = speculative.run(setup, _poisoned(tparams, np.inf), dparams, PROMPT, PROMPT, keys, knobs)
  assert np.asarray(state.stats.nonfinite).tolist() == [TARGET, TARGET]


@dataclasses.dataclass(frozen=True)
class AcceptAll:
  """A SPRINTER verifier that accepts every draft token (reading A, any draft)."""
  features: str = "A"
  hidden_size: int = 32

  def score(self, params, hidden, keys):
    del params, keys
    return jnp.ones(hidden.shape[:1], jnp.float32)


@pytest.mark.parametrize("poison", ["target", "draft"])
def test_sprinter_names_the_model_with_nan_logits(models, poison):
  target, tparams, draft, dparams = models
  tp = _poisoned(tparams) if poison == "target" else tparams
  dp = _poisoned(dparams) if poison == "draft" else dparams
  run = lambda tp, dp: sprinter_loop.generate(
      target, tp, draft, dp, AcceptAll(), {}, PROMPT, KEY, threshold=0.5, gamma_max=2,
      max_new_tokens=5, warp=sampling.Warp(), eos_id=None)
  assert np.asarray(run(tparams, dparams).stats.nonfinite).tolist() == [0, 0]
  with pytest.raises(NonFiniteLogitsError, match=f"the {poison} model"):
    run(tp, dp)


@dataclasses.dataclass(frozen=True)
class CharTok:
  """One character per token over a fixed alphabet (string-level tests need decode/encode)."""
  chars: str = "abcdefghijklmnopqrstuvwxyz .,:;!?()[]{}<>=+-*/0123456789ABCDEFGHIJ"
  eos_id = None
  bos_id = None
  pad_id = None
  unk_id = None

  @property
  def vocab_size(self):
    return 48

  def encode(self, text):
    return [self.chars.index(c) for c in text if self.chars.index(c) < 48]

  def decode(self, ids):
    return "".join(self.chars[i] for i in ids if 0 <= i < 48)


@pytest.mark.parametrize("poison", ["target", "draft"])
def test_string_level_names_the_model_with_nan_logits(models, poison):
  target, tparams, draft, dparams = models
  tok = CharTok()
  tp = _poisoned(tparams) if poison == "target" else tparams
  dp = _poisoned(dparams) if poison == "draft" else dparams
  ids = tok.encode("abc d")
  gen = string_level.generate(target, tparams, tok, draft, dparams, tok, ids, ids, KEY,
                              max_new_tokens=4, eos_id=None)
  assert np.asarray(gen.stats.nonfinite).tolist() == [0]
  with pytest.raises(NonFiniteLogitsError, match=f"the {poison} model"):
    string_level.generate(target, tp, tok, draft, dp, tok, ids, ids, KEY, max_new_tokens=4,
                          eos_id=None)


class _FakeGGUF:
  """What gguf_import.HFTensors reads of an opened GGUF: one NaN embedding."""
  path = "tiny.gguf"
  architecture = "qwen2"
  tensors = {"token_embd.weight": None}

  def __init__(self):
    self.dequantized_names = []

  def require(self, key):
    return 4

  def get(self, key, default=None):
    return 2

  def dequantized(self, name):
    self.dequantized_names.append(name)
    return np.array([[0.5, np.nan]], np.float32)


def test_gguf_tensors_are_checked_as_dequantized_and_looked_up_by_name():
  from specjax.models import gguf_import
  ckpt = _FakeGGUF()
  tensors = gguf_import.HFTensors(ckpt)
  assert "model.embed_tokens.weight" in tensors and "lm_head.weight" not in tensors
  assert ckpt.dequantized_names == []                        # membership reads no data
  with pytest.raises(hf_tensors.NonFiniteTensorError,
                     match=re.escape("tiny.gguf: tensor token_embd.weight holds 1 NaN/inf")):
    tensors["model.embed_tokens.weight"]


def test_the_cli_advice_names_the_flags_of_the_model_at_fault(models):
  """The CLI's message names the section of the model whose logits were not finite (T17)."""
  from specjax.app import cli
  _, _, draft, _ = models
  text = cli.advice(NonFiniteLogitsError("draft", draft, [0, 1]))
  assert text.startswith("the draft model (Decoder, float32 weights) produced non-finite logits")
  assert "(--config.draft.dtype, --config.draft.checkpoint: decoding with the draft model alone" \
         in text
