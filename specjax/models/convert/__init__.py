"""Hugging Face checkpoints <-> specjax params, one module per family: `gpt2` (models/decoder.py),
`llama` (models/llama.py: Llama, Mistral, Qwen2, Qwen3) and `t5` (models/t5.py). The architecture
modules hold the networks; these hold what moves between a checkpoint's tensor names and a param
tree. Each family module provides:

  MODEL_TYPES: the HF `model_type` strings it reads; MODEL_CLASS: the model class it builds
  model_from_hf_config(hf_config: dict, dtype: str) -> model
  params_from_hf(model, tensors: Mapping[str, np.ndarray]) -> params
  params_to_hf(model, params) -> dict[str, np.ndarray]
  hf_config(model) -> dict

models/hf_import.py finds and reads the files and dispatches on `model_type` (`families`);
models/gguf_import.py reads GGUF files through the llama module's tensor names.
"""

from __future__ import annotations

from types import ModuleType


def families() -> dict[str, ModuleType]:
  """HF model_type -> the family module that converts it."""
  from specjax.models.convert import gpt2, llama, t5
  return {mt: mod for mod in (t5, gpt2, llama) for mt in mod.MODEL_TYPES}

