"""specjax: speculative decoding and DistillSpec in JAX/Flax."""

__version__ = "0.1.0"
