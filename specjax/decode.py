"""`python -m specjax.decode`: generate text with the target alone or with speculative decoding.

    python -m specjax.decode                                   # configs/tiny.py, the embedded default
    python -m specjax.decode --config t5_xl_small.py --prompt "summarize: ..."
    python -m specjax.decode --config tiny.py --config.rule.name=exact --config.decode.gamma=5 \
        --input_file prompts.txt --output_json out.json

Speculative decoding runs when the config names a draft checkpoint and a rule; otherwise the
target decodes alone (greedy when decode.temperature == 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from specjax import runner
from specjax.config import load_config


def parse_args(argv):
  parser = argparse.ArgumentParser(prog="python -m specjax.decode", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="tiny.py", help="config file or bare name in configs/")
  parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
  parser.add_argument("--input_file", help="a file with one prompt per line")
  parser.add_argument("--output_json", help="write texts, token ids, statistics and settings here")
  args, rest = parser.parse_known_args(argv)
  bad = [r for r in rest if not r.startswith("--config.")]
  if bad:
    parser.error(f"unrecognized arguments: {' '.join(bad)} (overrides look like --config.a.b=v)")
  return args, rest


def read_prompts(args, config) -> list[str]:
  prompts = list(args.prompt)
  if args.input_file:
    with open(args.input_file) as f:
      prompts += [line.rstrip("\n") for line in f if line.strip()]
  return prompts or list(config.get("prompts", []))


def main(argv=None) -> int:
  args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
  try:
    runner.enable_compilation_cache()
    config = load_config(args.config, overrides)
    prompts = read_prompts(args, config)
    if not prompts:
      raise ValueError("no prompt: pass --prompt TEXT or --input_file FILE")
    start = time.perf_counter()
    report = runner.run(config, prompts)
    wall = time.perf_counter() - start
  except (ValueError, FileNotFoundError, KeyError) as err:
    if os.environ.get("SPECJAX_DEBUG"):
      raise
    print(f"specjax.decode: error: {err}", file=sys.stderr)
    return 2
  for item in report["results"]:
    print(f"> {item['prompt']}\n{item['text']}\n")
  print(runner.summary_line(report["stats"], wall))
  if args.output_json:
    with open(args.output_json, "w") as f:
      json.dump(report, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
