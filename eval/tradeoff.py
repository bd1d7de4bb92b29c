"""Quality against speed for the lossy rules: FSD thresholds, lenient eps, AdaSD against exact SD.

    python -m eval.tradeoff --config tiny.py --rule fuzzy --values 0,0.1,0.2,0.4,0.8,inf
    python -m eval.tradeoff --config tiny.py --rule fuzzy --values 0.1,0.3 --set divergence=js
    python -m eval.tradeoff --config tiny.py --rule lenient --values 0.05,0.1,0.3,1 --set kind=exp
    python -m eval.tradeoff --config tiny.py --rule adaptive --output adasd

Per setting: the task metric on --num_examples validation examples (decoded in batches of
--batch_size); then batch-1 speed on the first --timing_prompts of them, every setting timed in
turn per prompt (median of --repeats runs, after compilation): tokens/s and ms/token; alpha = accepted / verified, tau = emitted / blocks and
the draft share = accepted / emitted (FSD's %MD). Reference points: target only and draft only;
for --rule fuzzy also the random-acceptance curve (fuzzy_random, --random_values). --rule adaptive
compares AdaSD, its Gen-Only and Verify-Only ablations and exact SD (gamma from the config).
Writes OUTPUT.csv, OUTPUT.json and OUTPUT.png (quality against tokens/s, on a log axis when the
speeds span more than LOG_SPAN, e.g. a draft-only point far right of the rest). The three paths
are checked before any work and written atomically; OUTPUT.json is first written with the
quality of every setting, before the timing.
"""

from __future__ import annotations

import ast
import csv
import dataclasses
import os
import pathlib
import sys
from typing import Any, Callable

import jax

from eval import flags
from eval.latency import time_decoding
from specjax.acceptance import registry
from specjax.app import builders, cli, methods, outputs, resolve, runner
from specjax.app.config import input_paths, load_config
from specjax.data import metrics

SWEPT = {"fuzzy": "threshold", "lenient": "eps"}     # the hyperparameter --values sets
PRIMARY = {"rouge": "rouge2", "bleu": "bleu", "exact_match": "exact_match", "gsm8k": "accuracy"}
DEFAULT_RANDOM = "0,0.2,0.4,0.6,0.8,0.9,1"
LOG_SPAN = 4.0          # fastest / slowest tokens/s above which the plot's x axis is logarithmic
OUTPUT_SUFFIXES = (".csv", ".json", ".png")
ADAPTIVE_VARIANTS = {"adasd": {}, "gen_only": {"js_accept": False},
                     "verify_only": {"entropy_stop": False, "max_window": 5}}


@dataclasses.dataclass(frozen=True)
class Setting:
  """One point: a curve name, the swept value, and how to decode (rule None: one model alone)."""
  curve: str
  value: float | str
  rule: Any = None
  gamma: int = 0
  section: str = ""          # "target" / "draft" for the single-model points


def parse_values(text: str) -> list[float]:
  """'0,0.1,inf' -> [0.0, 0.1, inf]."""
  try:
    return [float(v) for v in text.split(",") if v.strip()]
  except ValueError as err:
    raise ValueError(f"--values must be comma-separated numbers (inf allowed), "
                     f"got {text!r}") from err


def parse_sets(items: list[str]) -> dict[str, Any]:
  """['divergence=js', 'k=20'] -> {'divergence': 'js', 'k': 20} (Python literals, else strings)."""
  out = {}
  for item in items:
    name, sep, raw = item.partition("=")
    if not sep or not name:
      raise ValueError(f"--set takes NAME=VALUE (a rule hyperparameter), got {item!r}")
    try:
      out[name] = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
      out[name] = raw
  return out


def settings(rule: str, values: list[float], gamma: int, extra: dict,
             random_values: list[float]) -> list[Setting]:
  """Every point of the sweep, reference points first."""
  points = [Setting("target", "", section="target"), Setting("draft", "", section="draft")]
  if rule == "adaptive":
    points.append(Setting("exact", "", registry.get("exact"), gamma))
    for name, fields in ADAPTIVE_VARIANTS.items():
      r = registry.get("adaptive", **{**extra, **fields})
      points.append(Setting(name, "", r, r.max_window))
    if values:
      raise ValueError("--rule adaptive compares fixed variants; --values is not used with it "
                       "(set fields with --set, e.g. --set tau_v_init=0.3)")
    return points
  if rule not in SWEPT:
    raise ValueError(f"--rule must be one of {sorted(SWEPT) + ['adaptive']}, got {rule!r}")
  if not values:
    raise ValueError(f"--rule {rule} needs --values (its {SWEPT[rule]} settings)")
  if SWEPT[rule] in extra:
    raise ValueError(f"--set {SWEPT[rule]}=... sets what --rule {rule} sweeps: give its settings "
                     f"with --values")
  points += [Setting(rule, v, registry.get(rule, **{**extra, SWEPT[rule]: v}), gamma)
             for v in values]
  random_extra = {k: v for k, v in extra.items() if k != "mode"}
  points += [Setting("fuzzy_random", v, registry.get("fuzzy_random", **{
      **(random_extra if rule == "fuzzy" else {}), "threshold": v}), gamma) for v in random_values]
  return points


def method_for(point: Setting, base: methods.Method, draft_alone: methods.Method):
  if point.section == "target":
    return base.target_only()
  if point.section == "draft":
    return draft_alone
  return dataclasses.replace(base, rule=point.rule).with_settings(gamma=point.gamma)


def measure_quality(method: methods.Method, prompts: list[str], refs: list[str], metric: str,
                    quality_key: str, key, batch_size: int) -> dict:
  """Task quality and decoding statistics of one method (batched)."""
  rows = runner.generate_texts(method, prompts, key, batch_size)
  scores = metrics.evaluate(metric, [text for _, _, text, _, _ in rows], refs)
  stats = runner.aggregate([st for _, _, _, st, _ in rows])
  alpha = stats.get("acceptance_rate")
  return {"quality": scores[quality_key], **scores,
          "alpha": float("nan") if alpha is None else alpha,
          "tau": stats.get("block_efficiency", float("nan")),
          "draft_share": draft_share(stats), "emitted": stats.get("emitted", 0)}


def measure_speed(decoders: list[methods.Method], prompts: list[str], key, repeats: int):
  """Batch-1 tokens/s and ms/token of every decoder, all timed alternately on the same prompts
  (so that machine drift does not favour one setting)."""
  runs = time_decoding(dict(enumerate(decoders)), prompts, key, repeats, first_token=False)
  out = []
  for i in range(len(decoders)):
    seconds, tokens = runs[i]["total_s"], runs[i]["tokens"]
    out.append({"tokens_per_s": tokens / seconds if seconds else float("nan"),
                "ms_per_token": 1e3 * seconds / tokens if tokens else float("nan"),
                "compile_s": runs[i]["compile_s"]})
  return out


def draft_share(stats: dict) -> float:
  """accepted / emitted: the share of emitted tokens that came from the draft (0 without one)."""
  emitted = stats.get("emitted", 0)
  return stats.get("accepted", 0) / emitted if emitted else float("nan")


def record(point: Setting, result: dict) -> dict:
  rule = point.rule
  return {"curve": point.curve, "value": point.value,
          "rule": getattr(rule, "rule_name", "") or point.section, "gamma": point.gamma,
          "hparams": repr(rule) if rule is not None else "", **result}


def write_csv(records: list[dict], path: str) -> None:
  columns = list(dict.fromkeys(k for r in records for k in r))
  with outputs.atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=columns)
    writer.writeheader()
    writer.writerows(records)


def x_scale(speeds: list[float]) -> str:
  """'log' when the finite positive speeds span more than LOG_SPAN (a linear axis would crowd
  every point but the far one into a corner), else 'linear'."""
  finite = [v for v in speeds if v == v and 0 < v < float("inf")]
  return "log" if finite and max(finite) > LOG_SPAN * min(finite) else "linear"


def plot(records: list[dict], path: str, quality_key: str) -> None:
  """Quality against tokens/s, one line per curve, written atomically to `path`."""
  import matplotlib         # here: the other tools need not pay its import
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import ScalarFormatter
  fig, ax = plt.subplots(figsize=(6, 4.5))
  for curve in dict.fromkeys(r["curve"] for r in records):
    pts = [r for r in records if r["curve"] == curve]
    xs, ys = [r["tokens_per_s"] for r in pts], [r["quality"] for r in pts]
    ax.plot(xs, ys, "o-" if len(pts) > 1 else "s", label=curve)
    for r in pts:
      if r["value"] != "":
        ax.annotate(f"{r['value']:g}", (r["tokens_per_s"], r["quality"]), fontsize=7,
                    textcoords="offset points", xytext=(3, 3))
  scale = x_scale([r["tokens_per_s"] for r in records])
  ax.set_xscale(scale)
  if scale == "log":        # plain numbers on the ticks, minor ones included
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(ScalarFormatter())
    ax.tick_params(axis="x", which="minor", labelsize=7)
  ax.set_xlabel(f"tokens/s (batch 1{', log scale' if scale == 'log' else ''})")
  ax.set_ylabel(quality_key)
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3, which="both")
  fig.tight_layout()
  with outputs.atomic_path(path) as tmp:
    fig.savefig(tmp, dpi=150)
  plt.close(fig)


def sweep(points: list[tuple[Setting, methods.Method]], prompts, refs, metric, quality_key, key,
          *, timing_prompts: int, repeats: int, batch_size: int,
          save_quality: Callable[[list[dict]], None] | None = None) -> list[dict]:
  """Quality of every setting, then their speed timed alternately; save_quality gets the
  quality records before the timing starts (so that a failed timing keeps them)."""
  quality = []
  for point, dec in points:
    quality.append(measure_quality(dec, prompts, refs, metric, quality_key, key, batch_size))
    q = quality[-1]
    print(f"{point.curve:>14} {str(point.value):>6}: {quality_key} {q['quality']:.2f}, "
          f"alpha {q['alpha']:.3f}, tau {q['tau']:.2f}, draft share {q['draft_share']:.3f}",
          flush=True)
  if save_quality:
    save_quality([record(point, q) for (point, _), q in zip(points, quality)])
  print(f"timing {len(points)} settings alternately on {timing_prompts} prompts ...", flush=True)
  speed = measure_speed([dec for _, dec in points], prompts[:timing_prompts], key, repeats)
  records = [record(point, {**q, **v}) for (point, _), q, v in zip(points, quality, speed)]
  for r in records:
    print(f"{r['curve']:>14} {str(r['value']):>6}: {r['tokens_per_s']:.1f} tok/s", flush=True)
  return records


QUALITY_ONLY = "the quality of every setting; the timing did not finish"


def write(records: list[dict], output: str, quality_key: str) -> None:
  write_csv(records, f"{output}.csv")
  write_json(records, output, quality_key)
  plot(records, f"{output}.png", quality_key)
  print(f"wrote {output}.csv, {output}.json, {output}.png")


def write_json(records: list[dict], output: str, quality_key: str, partial: str = "") -> None:
  """OUTPUT.json; `partial` says what it lacks (the quality records saved before the timing)."""
  outputs.write_json(f"{output}.json", {"quality_key": quality_key, "records": records,
                                        **({"partial": partial} if partial else {})})


def check_output(prefix: str) -> str:
  """The absolute output prefix, once OUTPUT.csv/.json/.png are known to be writable."""
  if not prefix.strip() or prefix.endswith(("/", os.sep)) or os.path.isdir(prefix):
    raise outputs.OutputPathError(f"--output {prefix!r} is a directory or empty: give a prefix "
                                  f"such as results/fuzzy (OUTPUT.csv, .json and .png are written)")
  for suffix in OUTPUT_SUFFIXES:
    outputs.check_output_file(f"{prefix}{suffix}", "--output")
  return str(pathlib.Path(prefix).expanduser().absolute())


def parse_args(argv):
  p = cli.parser("python -m eval.tradeoff", __doc__)
  p.add_argument("--config", default="tiny.py")
  p.add_argument("--rule", default="fuzzy", help="fuzzy, lenient or adaptive")
  p.add_argument("--values", default="", help="comma-separated threshold / eps values")
  p.add_argument("--random_values", default=None,
                 help=f"random-acceptance probabilities (default for fuzzy: {DEFAULT_RANDOM}; "
                      f"'' for none)")
  p.add_argument("--set", action="append", default=[], help="rule hyperparameter NAME=VALUE")
  p.add_argument("--num_examples", type=int, default=32)
  p.add_argument("--batch_size", type=int, default=8)
  p.add_argument("--timing_prompts", type=int, default=4)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--quality_key", default=None, help="metric key plotted (default per metric)")
  p.add_argument("--output", default=None, help="output prefix (default tradeoff_RULE)")
  return cli.parse(p, _joined_lists(sys.argv[1:] if argv is None else argv))


def _joined_lists(argv: list[str]) -> list[str]:
  """`--values -1,0.5` as `--values=-1,0.5`: argparse takes a value that starts with '-' and is
  not one number for a flag (the rule's own check then refuses a value out of its range)."""
  out, argv = [], list(argv)
  for i, arg in enumerate(argv):
    if i and argv[i - 1] in ("--values", "--random_values") and arg.startswith("-"):
      out[-1] = f"{out[-1]}={arg}"
    else:
      out.append(arg)
  return out


def build_points(config, args) -> list[tuple[Setting, methods.Method]]:
  """The sweep's settings and their methods, from the config and the command line."""
  random_text = args.random_values
  if random_text is None:
    random_text = DEFAULT_RANDOM if args.rule == "fuzzy" else ""
  values, extra, random_values = (parse_values(args.values), parse_sets(args.set),
                                  parse_values(random_text))
  settings(args.rule, values, 1, extra, random_values)    # refuse bad flags before loading
  base = methods.build(config)
  if not isinstance(base, methods.Speculative):
    raise ValueError(f"eval.tradeoff needs speculative decoding; the config runs {base.name}")
  points = settings(args.rule, values, base.settings.gamma, extra, random_values)
  draft_alone = methods.autoregressive(config, target_role="draft")
  return [(p, method_for(p, base, draft_alone)) for p in points]


def check_quality_key(key: str | None, metric: str) -> str:
  """--quality_key (None: the metric's primary key), refused unless the metric reports it."""
  known = metrics.keys(metric)
  if key is not None and key not in known:
    raise ValueError(f"--quality_key {key}: the task's metric {metric} reports "
                     f"{', '.join(known)}")
  return key or PRIMARY[metric]


def main(argv=None) -> int:
  args, overrides = parse_args(argv)

  def go():
    flags.check_counts(num_examples=args.num_examples, batch_size=args.batch_size,
                       timing_prompts=args.timing_prompts, repeats=args.repeats)
    output = check_output(args.output or f"tradeoff_{args.rule}")
    cli.setup()
    config = load_config(args.config, overrides)
    for suffix in OUTPUT_SUFFIXES:
      outputs.check_not_input(f"{output}{suffix}", input_paths(args.config, config), "--output")
    source = resolve.eval_source(config)
    metric = source.task.metric or "rouge"
    quality_key = check_quality_key(args.quality_key, metric)
    points = build_points(config, args)
    examples = source.eval_examples("validation", args.num_examples)
    key = jax.random.PRNGKey(builders.decode_settings(config).seed)
    saved = []
    try:
      records = sweep(points, [p for p, _ in examples], [r for _, r in examples], metric,
                      quality_key, key, timing_prompts=args.timing_prompts, repeats=args.repeats,
                      batch_size=args.batch_size,
                      save_quality=lambda done: saved.append(1) or write_json(
                          done, output, quality_key, partial=QUALITY_ONLY))
    except KeyboardInterrupt:
      print(f"eval.tradeoff: interrupted" + (f"; {output}.json holds the quality of every "
                                            f"setting, marked partial (no timing)" if saved
                                            else ""), file=sys.stderr)
      return 130
    write(records, output, quality_key)

  return cli.run("eval.tradeoff", go)


if __name__ == "__main__":
  sys.exit(main())
