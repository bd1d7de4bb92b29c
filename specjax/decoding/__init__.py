"""Decoding loops: autoregressive (target only) and speculative (draft + target + rule)."""

from specjax.decoding.state import Generation, SpecState, SpecStats

__all__ = ["Generation", "SpecState", "SpecStats"]
