"""specjax: speculative decoding and DistillSpec in JAX/Flax.

The Python API (specjax.api, docs/api.md): `load`, `generate`, `SpeculativeDecoder`, `Result`,
`LoadedModel`, `NGram` (prompt lookup), `early_exit` (the target's first layers as its draft),
`draft_head` (an EAGLE-style head trained on the target's features, `LoadedHead`),
`sub_vocab` (a draft head over its K most frequent tokens), `UsageError`, imported on first use
so that `import specjax.models...` stays light.
"""

__version__ = "0.1.0"


_API = ("LoadedHead", "LoadedModel", "NGram", "Result", "SpeculativeDecoder", "UsageError",
        "draft_head", "early_exit", "generate", "load", "sub_vocab")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
  if name in _API:
    from specjax import api
    from specjax.app import zoo  # noqa: F401  (registers the builtin: pairs, trained on first use)
    return getattr(api, name)
  raise AttributeError(f"module 'specjax' has no attribute {name!r}")
