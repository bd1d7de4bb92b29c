"""`python -m specjax.decode`: generate text with the target alone or with speculative decoding.

    python -m specjax.decode                                   # tiny.py, the embedded default
    python -m specjax.decode --config t5_xl_small.py --prompt "summarize: ..."
    python -m specjax.decode --config tiny.py --config.rule.name=exact --config.decode.gamma=5 \
        --input_file prompts.txt --output_json out.json

Speculative decoding runs when the config names a draft checkpoint and a rule; otherwise the
target decodes alone (greedy when decode.temperature == 0).
"""

from __future__ import annotations

import json
import sys
import time

from specjax.app import cli, config, runner


def read_prompts(args, cfg) -> list[str]:
  prompts = list(args.prompt)
  if args.input_file:
    with open(args.input_file, encoding="utf-8") as f:
      prompts += [line.rstrip("\n") for line in f if line.strip()]
  prompts = prompts or list(cfg.get("prompts", []))
  if not prompts:
    raise config.ConfigError("no prompt: pass --prompt TEXT or --input_file FILE")
  return prompts


def main(argv=None) -> int:
  p = cli.parser("python -m specjax.decode", __doc__)
  p.add_argument("--config", default="tiny.py", help="a shipped config name or a config file")
  p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
  p.add_argument("--input_file", help="a file with one prompt per line")
  p.add_argument("--output_json", help="write texts, token ids, statistics and settings here")
  args, overrides = cli.parse(p, argv)

  def go() -> int:
    cli.setup()
    cfg = config.load_config(args.config, overrides)
    prompts = read_prompts(args, cfg)
    start = time.perf_counter()
    report = runner.run(cfg, prompts)
    wall = time.perf_counter() - start
    if not runner.reports():        # multi-host: process 0 prints and writes
      return 0
    for item in report["results"]:
      print(f"> {item['prompt']}\n{item['text']}\n")
    print(runner.summary_line(report["stats"], wall))
    if args.output_json:
      with open(args.output_json, "w") as f:
        json.dump(report, f, indent=2)
    return 0

  return cli.run("specjax.decode", go)


if __name__ == "__main__":
  sys.exit(main())
