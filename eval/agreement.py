"""How far a variant of the target (int8 weights, bfloat16, another layout) is from the target:
greedy continuations side by side, and the next-token KL on held-out text.

    python -m eval.agreement --config qwen_coder.py --variant=--config.target.quant=int8
    python -m eval.agreement --config tiny.py --variant=--config.target.quant=int8 \\
        --num_texts 4 --text_tokens 64 --output_json agreement.json

The base is the config's target decoding alone; the variant is the same with the --variant flags
(repeatable) added. Greedy: the config's prompts (or --num_prompts of its evaluation data) decoded
by both with decode.max_new_tokens; per prompt, the tokens both produce before they first differ.
KL: --num_texts chunks of the stdlib corpus's test split, --text_tokens tokens each under the
target's tokenizer, read teacher-forced by both models; KL(base || variant) of the next-token
distributions, mean over positions, and how often the two argmaxes agree.
"""

from __future__ import annotations

import statistics
import sys

import jax
import jax.numpy as jnp

from eval import flags
from specjax.app import cli, methods, outputs, runner
from specjax.app.config import input_paths, load_config
from specjax import sampling
from specjax.data import stdlib_corpus
from specjax.data import tokenizer as tokenizer_lib
from specjax.decoding.state import position_limit


def parse_args(argv):
  p = cli.parser("python -m eval.agreement", __doc__)
  p.add_argument("--config", default="tiny.py")
  p.add_argument("--variant", action="append", default=[],
                 help="a --config.* flag of the variant (repeatable)")
  p.add_argument("--num_prompts", type=int, default=3)
  p.add_argument("--num_texts", type=int, default=8)
  p.add_argument("--text_tokens", type=int, default=256)
  p.add_argument("--output_json")
  return cli.parse(p, argv)


def greedy(base, variant, prompts: list[str]) -> dict:
  """Per prompt: tokens of each, and the common prefix; totals."""
  key = jax.random.PRNGKey(0)
  rows = []
  for a, b in zip(runner.generate_texts(base, prompts, key, 1),
                  runner.generate_texts(variant, prompts, key, 1)):
    same = next((i for i, (x, y) in enumerate(zip(a[1], b[1])) if x != y),
                min(len(a[1]), len(b[1])))
    rows.append({"prompt": a[0], "tokens": len(a[1]), "common_prefix": same,
                 "identical": a[1] == b[1]})
  return {"prompts": rows, "identical": sum(r["identical"] for r in rows),
          "common_prefix_share": sum(r["common_prefix"] for r in rows)
          / max(sum(r["tokens"] for r in rows), 1)}


@jax.jit
def _kl(base_logits, variant_logits):
  """[T, V] logits each -> (KL(base || variant) [T], argmax agreement [T])."""
  logp, logq = jax.nn.log_softmax(base_logits), jax.nn.log_softmax(variant_logits)
  kl = jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)
  return kl, jnp.argmax(logp, -1) == jnp.argmax(logq, -1)


def teacher_forced(base, variant, num_texts: int, length: int) -> dict:
  """Mean next-token KL and argmax agreement over held-out stdlib chunks."""
  tok = base.target.tokenizer
  encoded = [tok.encode(t) for t in stdlib_corpus.load_corpus().lm_split("test")]
  texts = [ids[:length] for ids in encoded if len(ids) >= length][:num_texts]
  if not texts:
    raise ValueError(f"--text_tokens {length}: no held-out text is that long under the target's "
                     f"tokenizer (the longest has {max(map(len, encoded))} tokens): use "
                     f"--text_tokens {max(map(len, encoded))} or less")
  kls, agree = [], []
  for ids in texts:
    tokens = jnp.asarray([ids], jnp.int32)
    logits = [m.target.model.extend_entries(m.target.params, tokens,
                                            m.target.model.init_cache(1, length))[0][0]
              for m in (base, variant)]
    width = min(x.shape[-1] for x in logits)     # one tokenizer, rows padded to other counts
    kl, same = _kl(*(sampling.fit_width(x, width) for x in logits))
    kls += [float(x) for x in kl]
    agree += [bool(x) for x in same]
  return {"texts": len(texts), "positions": len(kls), "kl_mean": statistics.fmean(kls),
          "kl_median": statistics.median(kls), "argmax_agreement": sum(agree) / len(agree)}


def check_variant(variant_flags: list[str]) -> None:
  """Refuse no --variant, or one whose flags do not reach the target (draft, rule and decode
  settings change nothing when the target decodes alone: the report would say 'identical')."""
  if not variant_flags:
    raise ValueError("--variant: give the variant's flags, e.g. "
                     "--variant=--config.target.quant=int8")
  elsewhere = [f for f in variant_flags if not f.startswith("--config.target.")]
  if elsewhere:
    raise ValueError(f"--variant {' '.join(elsewhere)}: the variant is the target decoding "
                     f"alone with other --config.target.* settings (quant, dtype, layout, ...); "
                     f"other flags change nothing here")


def check_comparable(base, variant) -> None:
  """Refuse, before decoding, a variant whose tokenizer is not the target's (another model
  family): its ids mean other texts, so its greedy tokens and next-token distributions cannot be
  set against the target's (the KL failed on a shape error after both had decoded)."""
  a, b = base.target.tokenizer, variant.target.tokenizer
  if not tokenizer_lib.same_vocabulary(a, b):
    raise ValueError(f"--variant: the variant's tokenizer ({b.path}) is not the target's "
                     f"({a.path}), so their ids cannot be compared: a variant is the target "
                     f"with other settings, or a checkpoint with the target's tokenizer")


def check_length(base, length: int) -> None:
  """Refuse --text_tokens beyond the target's position table."""
  limit = position_limit(base.target.model)
  if limit is not None and length > limit:
    raise ValueError(f"--text_tokens {length}: the target reads at most {limit} positions (its "
                     f"n_positions): use --text_tokens {limit} or less")


def main(argv=None) -> int:
  args, overrides = parse_args(argv)

  def go():
    flags.check_counts(num_prompts=args.num_prompts, num_texts=args.num_texts,
                       text_tokens=args.text_tokens)
    check_variant(args.variant)
    output = flags.output_file(args.output_json, "--output_json")
    cli.setup()
    config = load_config(args.config, overrides)
    variant_config = load_config(args.config, [*overrides, *args.variant])
    outputs.check_not_input(output, input_paths(args.config, config), "--output_json")
    base = methods.autoregressive(config).with_settings(temperature=0.0)
    check_length(base, args.text_tokens)
    variant = methods.autoregressive(variant_config).with_settings(temperature=0.0)
    check_comparable(base, variant)
    prompts = runner.eval_prompts(config, args.num_prompts)
    report = {"variant": args.variant, "greedy": greedy(base, variant, prompts),
              "teacher_forced": teacher_forced(base, variant, args.num_texts, args.text_tokens)}
    g, t = report["greedy"], report["teacher_forced"]
    print(f"greedy: {g['identical']} of {len(g['prompts'])} continuations identical, common "
          f"prefix {g['common_prefix_share']:.3f} of the tokens; teacher-forced over "
          f"{t['positions']} positions: KL mean {t['kl_mean']:.4f} (median {t['kl_median']:.4f}), "
          f"argmax agreement {t['argmax_agreement']:.3f}")
    if output:
      outputs.write_json(output, report)

  return cli.run("eval.agreement", go)


if __name__ == "__main__":
  sys.exit(main())
