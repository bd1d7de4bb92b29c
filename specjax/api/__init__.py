"""specjax from Python: load models, decode with any rule, keep the compiled programs.

    import specjax
    target = specjax.load("pypi:qwen-coder/target")
    draft = specjax.load("pypi:qwen-coder/draft")
    out = specjax.generate(target, ["def fib(n):"], draft=draft, temperature=0)

docs/api.md lists every name, its arguments and what recompiles.
"""

from specjax.api.decoder import SpeculativeDecoder, generate
from specjax.api.drafters import LoadedHead, draft_head, early_exit, sub_vocab
from specjax.api.errors import UsageError
from specjax.api.loading import LoadedModel, load
from specjax.api.results import Result
from specjax.drafting import NGram

__all__ = ["LoadedHead", "LoadedModel", "NGram", "Result", "SpeculativeDecoder", "UsageError",
           "draft_head", "early_exit", "generate", "load", "sub_vocab"]
