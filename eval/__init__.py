"""Measuring tools: `python -m eval.NAME` (README.md, Measuring)."""

import specjax  # noqa: F401  (a Ctrl-C while the command imports: one line, no traceback)
