"""specjax: speculative decoding and DistillSpec in JAX/Flax.

The Python API (specjax.api, docs/api.md): `load`, `generate`, `SpeculativeDecoder`, `Result`,
`LoadedModel`, `NGram` (prompt lookup), `early_exit` (the target's first layers as its draft),
`sub_vocab` (a draft head over its K most frequent tokens), `UsageError`, imported on first use
so that `import specjax.models...` stays light.
"""

import os

__version__ = "0.1.0"


def _xla_defaults() -> None:
  """XLA:GPU's DotMerger turns dots that share an input and weigh 32 MB or less (a layer's q, k
  and v projections) into one dot against the concatenation of their weights, and makes that
  concatenation on every call: in an H200 profile, once per layer per decoding step, 14-30 us
  each (15% of the step). 0 turns it off; other backends ignore the flag. Set before jax starts
  its backends (XLA reads XLA_FLAGS once); a setting of the user's own is kept."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_gpu_dot_merger_threshold_mb" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_dot_merger_threshold_mb=0".strip()


_xla_defaults()

_API = ("LoadedModel", "NGram", "Result", "SpeculativeDecoder", "UsageError", "early_exit",
        "generate", "load", "sub_vocab")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
  if name in _API:
    from specjax import api
    from specjax.app import zoo  # noqa: F401  (registers the builtin: pairs, trained on first use)
    return getattr(api, name)
  raise AttributeError(f"module 'specjax' has no attribute {name!r}")
