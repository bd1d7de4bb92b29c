"""specjax: speculative decoding and DistillSpec in JAX/Flax.

The Python API (specjax.api, docs/api.md): `load`, `generate`, `SpeculativeDecoder`, `Result`,
`LoadedModel`, `NGram` (prompt lookup), `early_exit` (the target's first layers as its draft),
`draft_head` (an EAGLE-style head trained on the target's features, `LoadedHead`),
`sub_vocab` (a draft head over its K most frequent tokens), `UsageError`, imported on first use
so that `import specjax.models...` stays light.
"""

import sys

__version__ = "0.1.0"


def _interrupted_quietly(kind, value, tb) -> None:
  """sys.excepthook of a `python -m specjax.X` / `eval.X` / `train.X` command: Ctrl-C before its
  main() runs (while jax and the models' modules import) prints one line, as a later one does,
  not a traceback; every other exception keeps Python's report."""
  if issubclass(kind, KeyboardInterrupt):
    argv = getattr(sys, "orig_argv", [])
    prog = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else "specjax"
    print(f"{prog}: interrupted", file=sys.stderr)
  else:
    sys.__excepthook__(kind, value, tb)


# `python -m PACKAGE.MODULE` imports the package while sys.argv[0] is still "-m": a command of
# this repository is starting (a script or a module elsewhere that imports specjax is not).
if sys.argv[:1] == ["-m"] and sys.excepthook is sys.__excepthook__:
  sys.excepthook = _interrupted_quietly


_API = ("LoadedHead", "LoadedModel", "NGram", "Result", "SpeculativeDecoder", "UsageError",
        "draft_head", "early_exit", "generate", "load", "sub_vocab")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
  if name in _API:
    from specjax import api
    from specjax.app import zoo  # noqa: F401  (registers the builtin: pairs, trained on first use)
    return getattr(api, name)
  raise AttributeError(f"module 'specjax' has no attribute {name!r}")
