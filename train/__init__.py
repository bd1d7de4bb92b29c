"""Thin training CLIs: `python -m train.pretrain`, `python -m train.distill`."""

import specjax  # noqa: F401  (a Ctrl-C while the command imports: one line, no traceback)
