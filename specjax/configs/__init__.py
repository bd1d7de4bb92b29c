"""Shipped configs: each module defines `get_config(arg=None) -> ml_collections.ConfigDict`.

`python -m specjax.decode --config tiny.py` finds `tiny.py` here after any install; shared
sections live in `common.py`. A path to a file of the same form works too.
"""
