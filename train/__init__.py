"""Thin training CLIs: `python -m train.pretrain`, `python -m train.distill`."""
