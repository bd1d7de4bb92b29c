r"""`python -m specjax.decode`: generate text with the target alone or with speculative decoding.

    python -m specjax.decode                                   # qwen_coder.py: the real pair
    python -m specjax.decode --compare                         # + the target alone, the speedup
    python -m specjax.decode --config tiny.py                  # the embedded pair, offline
    python -m specjax.decode --config t5_xl_small.py --prompt "summarize: ..."
    python -m specjax.decode --config tiny.py --config.rule.name=exact --config.decode.gamma=5 \
        --input_file prompts.txt --output_json out.json

Speculative decoding runs when the config names a draft checkpoint and a rule; otherwise the
target decodes alone (greedy when decode.temperature == 0). A prompt longer than the cache allows
is refused with the longest that fits; --config.decode.truncate=left keeps its last tokens.
With one prompt per batch (decode.batch_size 1) the text is printed as it is generated
(--config.decode.stream=false: at the end). Ctrl-C (or SIGTERM) writes the prompts finished so far to
--output_json (marked partial) and exits 130; a second Ctrl-C stops at once. With --output_json
OUT the finished prompts are also kept in OUT.partial after every batch: the same command run
again after a kill resumes after them (app/progress.py).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from specjax.app import builders, cli, config, outputs, progress, runner


class PromptError(ValueError):
  """A prompt or prompt file that cannot be used; the message names it and the fix."""


def read_prompts(args, cfg) -> list[str]:
  """--prompt texts, then --input_file's prompts (read_prompt_file), else the config's prompts."""
  prompts = list(args.prompt)
  if any(not p.strip() for p in prompts):
    raise PromptError("--prompt is empty: give the text to continue")
  for text in prompts:
    _check_utf8(text)
  if args.input_file:
    prompts += read_prompt_file(args.input_file)
  if not prompts:
    prompts = list(cfg.get("prompts", []))
    bad = next((i for i, p in enumerate(prompts) if not isinstance(p, str) or not p.strip()), None)
    if bad is not None:
      raise PromptError(f"the config's prompts must be non-empty texts; prompt {bad} is "
                        f"{prompts[bad]!r}: fix the config's `prompts`, or pass --prompt TEXT")
  if not prompts:
    raise PromptError("no prompt: pass --prompt TEXT or --input_file FILE")
  return prompts


def _check_utf8(text: str) -> None:
  """PromptError naming the first byte of a --prompt that is not UTF-8 (Python keeps such argv
  bytes as lone surrogates, which no tokenizer encodes)."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as err:
    at = len(text[:err.start].encode("utf-8", "surrogateescape"))
    byte = text[err.start].encode("utf-8", "surrogateescape")[0]
    raise PromptError(f"--prompt is not UTF-8 text (byte {at} is {byte:#04x}): pass UTF-8 "
                      f"text") from None


def read_prompt_file(name: str) -> list[str]:
  """The prompts of a UTF-8 file (a byte-order mark is dropped): one per non-blank line, or in a
  `.jsonl` file the "prompt" field of each line's JSON object (so a prompt may span lines)."""
  path = Path(name).expanduser()
  if path.is_dir():
    raise PromptError(f"--input_file {path} is a directory: give a file with one prompt per line")
  config.check_input_file(path, "--input_file", "a file with one prompt per line")
  try:
    text = path.read_text(encoding="utf-8-sig")
  except FileNotFoundError:
    raise PromptError(f"--input_file {path} does not exist") from None
  except UnicodeDecodeError as err:
    raise PromptError(f"--input_file {path} is not UTF-8 text (byte {err.start} is "
                      f"{err.object[err.start]:#04x}): save it as UTF-8") from None
  except OSError as err:
    raise PromptError(f"--input_file {path} cannot be read ({err.strerror})") from None
  if path.suffix.lower() == ".jsonl":
    prompts = [_jsonl_prompt(path, i, line) for i, line in enumerate(text.splitlines(), 1)
               if line.strip()]
  else:
    _refuse_json(path, text)
    prompts = [line for line in text.splitlines() if line.strip()]
  if not prompts:
    raise PromptError(f"--input_file {path} holds no prompt (every line is blank)")
  return prompts


JSONL_FORM = 'one JSON object per line with the prompt under "prompt", e.g. {"prompt": "def f():"}'


def _jsonl_prompt(path: Path, number: int, line: str) -> str:
  """Line `number` of a .jsonl prompt file -> its "prompt" text, or a PromptError naming it."""
  where = f"--input_file {path} line {number}"
  try:
    record = json.loads(line)
  except json.JSONDecodeError as err:
    raise PromptError(f"{where} is not JSON ({err.msg}): a .jsonl file holds {JSONL_FORM}") \
        from None
  if not isinstance(record, dict) or "prompt" not in record:
    fields = f"fields {', '.join(map(repr, record))}" if isinstance(record, dict) else \
        f"a JSON {type(record).__name__}"
    raise PromptError(f"{where} has no \"prompt\" ({fields}): a .jsonl file holds {JSONL_FORM}")
  prompt = record["prompt"]
  if not isinstance(prompt, str) or not prompt.strip():
    raise PromptError(f"{where}: \"prompt\" is {prompt!r}: give the text to continue")
  return prompt


def _refuse_json(path: Path, text: str) -> None:
  """A .json file that is JSON would be decoded line by line as text (brackets, quotes and
  all): refused, naming the forms that work."""
  if path.suffix.lower() != ".json":
    return
  try:
    json.loads(text)
  except json.JSONDecodeError:
    return
  raise PromptError(f"--input_file {path} is a JSON document, and its lines would be decoded as "
                    f"text: give a text file with one prompt per line, or a .jsonl file with "
                    f"{JSONL_FORM}")


def save_report(path: Path, report: dict) -> None:
  """--output_json, written atomically; if that fails after all, the report goes to a temporary
  file instead of being lost, and the error names both."""
  try:
    outputs.write_json(path, report)
  except OSError as err:
    fallback = Path(tempfile.gettempdir()) / f"specjax-decode-{os.getpid()}.json"
    outputs.write_json(fallback, report)
    raise outputs.OutputPathError(f"--output_json {path} could not be written "
                                  f"({err.strerror or err}); the results are in {fallback}") from None


def main(argv=None) -> int:
  p = cli.parser("python -m specjax.decode", __doc__)
  p.add_argument("--config", default=DEFAULT_CONFIG,
                 help="a shipped config name or a config file (default: %(default)s)")
  p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
  p.add_argument("--input_file", help="a UTF-8 file with one prompt per line (blank lines "
                 "skipped), or a .jsonl file with one {\"prompt\": TEXT} object per line")
  p.add_argument("--output_json", help="write texts, token ids, statistics and settings here")
  p.add_argument("--compare", action="store_true",
                 help="also decode the prompts with the target alone and print both ms/token "
                      "and the speedup")
  args, overrides = cli.parse(p, argv)

  def go() -> int:
    output = (args.output_json is not None
              and outputs.check_output_file(args.output_json, "--output_json"))
    start = time.perf_counter()
    cli.setup()
    cfg = config.load_config(args.config, overrides)
    runner.check_overrides_apply(cfg, overrides)
    if args.compare:
      runner.check_compare(cfg)
    if output:
      inputs = {"--input_file": args.input_file, **config.input_paths(args.config, cfg)}
      outputs.check_not_input(output, inputs, "--output_json")
    prompts = read_prompts(args, cfg)
    settings = builders.decode_settings(cfg)     # (jax starts in runner.run, after any
    streaming = settings.stream                  # jax.distributed.initialize)
    kept = None
    if output and not outputs.writes_in_place(output):      # gamma "auto" as it resolved here
      kept = progress.Progress(output, {**cfg.to_dict(), "prompts": prompts,
                                        "resolved": runner.resolved(settings)})
    ready = time.perf_counter() - start
    report = runner.run(cfg, prompts, show=_show if streaming else None, compare=args.compare,
                        progress=kept)
    times = report["timing"]
    before = ready + times["load_s"] + times["compile_s"]
    if not runner.reports():        # multi-host: process 0 prints and writes
      return 0
    if not streaming:
      for item in report["results"]:
        print(f"> {item['prompt']}\n{item['text']}\n")
    print(runner.summary_line(report["stats"], times, before))
    if "compare" in report:
      print(runner.compare_line(report))
    if output:
      save_report(output, report)
    if "partial" in report:
      done = report["partial"]
      print(f"specjax.decode: interrupted: {done['prompts_done']} of {done['prompts']} prompts "
            f"finished" + (f", written to {output}; the same command resumes after them"
                           if output else ""), file=sys.stderr)
      return 130
    if kept is not None:
      kept.finish()
    return 0

  try:
    return cli.run("specjax.decode", go)
  except KeyboardInterrupt:         # the second Ctrl-C (or one before decoding): stop at once
    print("specjax.decode: interrupted", file=sys.stderr)
    return 130


DEFAULT_CONFIG = "qwen_coder.py"


def _show(text: str) -> None:
  if runner.reports():            # multi-host: process 0 prints
    cli.show(text)


if __name__ == "__main__":
  sys.exit(main())
