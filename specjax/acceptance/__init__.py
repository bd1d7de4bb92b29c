"""Acceptance rules for speculative decoding (DESIGN.md §5): a frozen Rule per family, by name."""

from specjax.acceptance.base import Rule
from specjax.acceptance.registry import get, names, register

__all__ = ["Rule", "get", "names", "register"]
