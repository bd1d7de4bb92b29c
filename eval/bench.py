"""Decoding speed at real model shapes on any backend, against the roofline.

    python -m eval.bench                                   # every shape, batch 1, 8, 32
    python -m eval.bench --shapes qwen-coder-1.5b --batches 1 --gammas 3,5,7
    python -m eval.bench --scale 16 --batches 1 --new_tokens 16    # a CPU-sized run
    python -m eval.bench --shapes qwen-coder-1.5b-90m --batches 1 --quant int8   # int8 weights

Per shape (a target with its draft: Qwen2.5-Coder-1.5B with Qwen2.5-0.5B and with a 90M-parameter
4-layer draft, Qwen2.5-7B with Qwen2.5-0.5B, Llama-3.1-8B with Llama-3.2-1B, T5 v1.1 XL with
Small), the models are built from
their config.json (written on the fly) with random bfloat16 weights (`--scale N` divides every
width, head count, layer count and the vocabulary by N) and, per batch size:

  target alone   ms per decoding step, after the first token (the prefill is timed apart), and
                 the roofline's share: the floor of a step (every weight a step reads and the
                 KV cache of the filled positions over the device's memory bandwidth, or the
                 matmul FLOPs over its bf16 rate where that is larger: batch 32 on a small model)
                 over the measured step
  speculative    per gamma: ms per generated token, tau (tokens per block), c (draft step /
                 target step), v (target pass over gamma+1 tokens / one-token step), speedup
  start-up       compile seconds of each program (cold: an empty compilation cache) and the same
                 programs fetched from the persistent cache (warm)
  memory         the device's peak bytes in use (where the backend reports it)

Random weights agree with nothing, so the draft's acceptance is set by a knob: rule
`SetAcceptance(alpha)` accepts each draft token with probability --alpha, independently, and
takes the target's argmax at the first rejection (or as the bonus token). Everything else is
real decoding: the same compiled loop, the same passes, shapes and caches as the greedy rule.
The expected tau at gamma g is (1 - alpha^(g+1)) / (1 - alpha).

Cases run in priority order (every shape at batch 1 first) and the JSON is rewritten after each;
a case already in the file (same shape, batch, scale, device) is skipped, so a run that is cut
short resumes where it stopped. --output_md gets the table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from eval import flags, roofline, shapes, timing, trace
from eval.shapes import SHAPES
from specjax.acceptance import base
from specjax.api import results
from specjax.app import cli, outputs
from specjax.decoding import autoregressive, speculative
from specjax.models import hf_import, prompting
from specjax.models import layers as layouts
from specjax.models.prompting import Prompt
from specjax.sampling import Warp

# ------------------------------------------------------------------------------ the knob


@dataclasses.dataclass(frozen=True)
class SetAcceptance(base.Rule):
  """Accepts each draft token with probability alpha, whatever the models say; the next token is
  the target's argmax. A benchmark's stand-in for agreement between random models: what it
  costs per block is the greedy rule's."""
  alpha: float = 0.8
  traced: ClassVar[tuple[str, ...]] = ("alpha",)

  def verify(self, draft_tokens, draft_len, q_logp, p_logp, keys, rule_state):
    uniforms, _ = base.verify_streams(keys, draft_tokens.shape[1])
    n = base.prefix_accepted(uniforms < self.alpha, draft_len)
    return n, jnp.argmax(base.take_position(p_logp, n), -1).astype(jnp.int32), rule_state


def expected_tau(alpha: float, gamma: int) -> float:
  return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


# ------------------------------------------------------------------------------ measuring


@dataclasses.dataclass(frozen=True)
class Run:
  """How every case is run (the flags)."""
  prompt_len: int = 128
  new_tokens: int = 128
  gammas: tuple[int, ...] = (3, 5, 7)
  alpha: float = 0.8
  repeats: int = 5
  probe_steps: int = 32
  seed: int = 0
  profile: bool = False      # one target-alone and one speculative call under the profiler
  precision: str | None = None   # of every matmul (None: the models' default, "highest")
  layers: str = "auto"           # the layer layout (models/layers.py)
  quant: str = ""                # "int8": both models' dense layers (models/quant.py)


def prompts(model, batch: int, length: int, seed: int) -> Prompt:
  """`batch` rows of `length` random ids (never pad 0)."""
  rng = np.random.default_rng(seed)
  rows = rng.integers(1, model.config.vocab_size, size=(batch, length)).tolist()
  return prompting.batch(rows, 0, minimum=length)


def peak_memory() -> int | None:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def measure(name: str, batch: int, run: Run, scale: int, workdir: pathlib.Path,
            peak: tuple[float, float] | None, say) -> dict:
  """One case: the shape's pair at `batch` rows, target alone and speculative at every gamma."""
  t_cfg, d_cfg = (shapes.scaled(c, scale) for c in SHAPES[name])
  d_cfg = dict(d_cfg, vocab_size=t_cfg["vocab_size"])
  start = time.perf_counter()
  target, t_params = shapes.build(t_cfg, workdir / name / "target", run.seed, run.precision,
                                  run.layers, quant=run.quant)
  draft, d_params = shapes.build(d_cfg, workdir / name / "draft", run.seed + 1, run.precision,
                                 run.layers, quant=run.quant)
  init_s = time.perf_counter() - start
  say(f"{name} b{batch}: random weights in {init_s:.1f} s")
  prompt = prompts(target, batch, run.prompt_len, run.seed)
  greedy, key = Warp(temperature=0.0), jax.random.PRNGKey(run.seed)
  ar = lambda n: lambda: autoregressive.generate(target, t_params, prompt, key, max_new_tokens=n,
                                                 warp=greedy, eos_id=None)
  rule = SetAcceptance(alpha=run.alpha)
  sd = lambda g, n: lambda: speculative.generate(
      target, t_params, draft, d_params, prompt, key, rule=rule, gamma=g, max_new_tokens=n,
      warp=greedy, eos_id=None)
  calls = {("ar", run.new_tokens): ar(run.new_tokens), ("ar", 1): ar(1)}
  gmax = max(run.gammas)
  probes = timing.cost_probes(target, t_params, draft, d_params, prompt, prompt, rule, gmax,
                              run.new_tokens, run.probe_steps, [g + 1 for g in run.gammas])
  calls.update({("probe", k): fn for k, fn in probes.items()})
  for g in run.gammas:
    calls[("sd", g)] = sd(g, run.new_tokens)
    calls[("sd1", g)] = sd(g, 1)
  timed = timing.alternating(calls, run.repeats)
  say(f"{name} b{batch}: timed {len(calls)} programs x {run.repeats}")
  warm = _warm_compile(calls, timed)
  per_step = lambda k: timed[("probe", k)][2] / run.probe_steps
  t1, d1 = per_step("t1"), per_step("d1")
  ar_step = (timed[("ar", run.new_tokens)][2] - timed[("ar", 1)][2]) / (run.new_tokens - 1)
  positions = run.prompt_len + run.new_tokens / 2
  cost = roofline.step_cost(target, t_params, batch, positions)
  floor = roofline.floor_s(cost, peak)
  record = dict(
      case=case_key(name, batch, scale, run), shape=name, batch=batch, scale=scale,
      precision=target.config.precision, quant=run.quant or None,
      layers="scan" if target.config.scan_layers else "unrolled",
      target_params=_count(t_params), draft_params=_count(d_params),
      target_layers=t_cfg.get("num_hidden_layers", t_cfg.get("num_layers")),
      draft_layers=d_cfg.get("num_hidden_layers", d_cfg.get("num_layers")),
      prompt_len=run.prompt_len, new_tokens=run.new_tokens, alpha=run.alpha,
      init_s=init_s, ar_ms_per_step=1e3 * ar_step, target_step_ms=1e3 * t1,
      draft_step_ms=1e3 * d1, cost_ratio=d1 / t1,
      ar_first_token_ms=1e3 * timed[("ar", 1)][2],
      floor_ms=None if floor is None else 1e3 * floor,
      roofline_pct=None if floor is None else 100 * floor / ar_step,
      step_roofline_pct=None if floor is None else 100 * floor / t1,
      ar_compile_s=timed[("ar", run.new_tokens)][1], ar_warm_s=warm[("ar", run.new_tokens)],
      **{k: v for k, v in cost.items()}, sd=[])
  for g in run.gammas:
    gen = timed[("sd", g)][0]
    stats = results.aggregate(results.stats_rows(gen.stats, batch))
    emitted = run.new_tokens - 1          # after the first token, per row
    sd_s = (timed[("sd", g)][2] - timed[("sd1", g)][2]) / emitted
    v = per_step(f"t{g + 1}") / t1
    tau = stats.get("block_efficiency", 1.0)
    record["sd"].append(dict(
        gamma=g, ms_per_token=1e3 * sd_s, speedup=ar_step / sd_s, tau=tau,
        expected_tau=expected_tau(run.alpha, g), alpha=stats.get("acceptance_rate") or 0.0,
        verify_cost_ratio=v, predicted_speedup=tau / (d1 / t1 * g + v),
        compile_s=timed[("sd", g)][1], warm_s=warm[("sd", g)]))
  record["peak_memory_gb"] = None if (m := peak_memory()) is None else m / 2**30
  if run.profile:
    g = run.gammas[len(run.gammas) // 2]
    blocks = (run.new_tokens - 1) / max(record["sd"][len(run.gammas) // 2]["tau"], 1.0)
    record["profile"] = dict(
        ar=trace.profile(calls[("ar", run.new_tokens)], run.new_tokens - 1),
        sd=dict(gamma=g, **(trace.profile(calls[("sd", g)], round(blocks)) or {})))
    say(f"{name} b{batch}: profile {json.dumps(record['profile'])[:2000]}")
  return record


def _warm_compile(calls: dict, timed: dict) -> dict:
  """Per program, the first call's excess over its median after the in-memory caches are
  dropped: the program comes back from the persistent compilation cache (a warm start-up)."""
  jax.clear_caches()
  out = {}
  for k, fn in calls.items():
    if k[0] in ("ar", "sd"):
      out[k] = max(timing.once(fn)[1] - timed[k][2], 0.0)
  return out


def _count(params) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


def case_key(name: str, batch: int, scale: int, run: Run) -> str:
  """What makes two records comparable: shape, batch, scale, precision, layout, device and the
  XLA flags the process started with (e.g. command buffers), then what is measured (run_key)."""
  layout = "scan" if layouts.scan_layers(run.layers) else "unrolled"
  flags_text = " ".join(os.environ.get("XLA_FLAGS", "").split())
  precision = run.precision or hf_import.default_precision("bfloat16")     # shapes.build's dtype
  return (f"{name}/b{batch}/scale{scale}/{precision}/{layout}/"
          + (f"{run.quant}/" if run.quant else "")
          + f"{jax.devices()[0].device_kind}" + (f"/{flags_text}" if flags_text else "")
          + f"/{run_key(run)}")


def run_key(run: Run) -> str:
  """The settings that change a case's numbers: prompt and output lengths, gammas, alpha."""
  return (f"p{run.prompt_len}/n{run.new_tokens}/g{','.join(map(str, run.gammas))}/"
          f"a{run.alpha:g}")


def check_same_run(records: list[dict], run: Run, out) -> None:
  """One output file holds one set of measuring settings: a record measured with others (or
  before they were part of its key) is refused, naming both, so a resumed table never mixes
  them."""
  want = run_key(run)
  for r in records:
    if not str(r.get("case", "")).endswith(f"/{want}"):
      theirs = (f"prompt_len {r.get('prompt_len')}, new_tokens {r.get('new_tokens')}, gammas "
                f"{','.join(str(s.get('gamma')) for s in r.get('sd', []))}, alpha {r.get('alpha')}")
      raise ValueError(f"--output_json {out} holds {r.get('shape')} b{r.get('batch')} measured "
                       f"with {theirs}; this run measures {want}: use another --output_json")


def order(names: list[str], batches: list[int]) -> list[tuple[str, int]]:
  """Cases by priority: every shape at the smallest batch first (the latency case), then the
  next batch size, so that a short run yields the most important rows first."""
  return [(s, b) for b in sorted(batches) for s in names]


# ------------------------------------------------------------------------------ output


COLUMNS = ("shape", "batch", "precision", "quant", "layers", "target_params", "draft_params",
           "ar_ms_per_step", "floor_ms",
           "roofline_pct", "gamma", "tau", "cost_ratio", "verify_cost_ratio", "ms_per_token",
           "speedup", "predicted_speedup", "ar_compile_s", "compile_s", "warm_s",
           "peak_memory_gb", "xla_flags")


def table(records: list[dict]) -> str:
  def fmt(v):
    if v is None:
      return "-"
    if isinstance(v, float):
      return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    if isinstance(v, int) and v >= 10**6:
      return f"{v / 1e6:.0f}M"
    return str(v)
  lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  for r in records:
    for s in r["sd"]:
      row = {**r, **s}
      lines.append("| " + " | ".join(fmt(row.get(c)) for c in COLUMNS) + " |")
  return "\n".join(lines)


def environment() -> dict:
  """What a row was measured on: device, backend, jax version, commit."""
  commit = os.environ.get("SPECJAX_COMMIT")     # a copy of the tree without its .git
  with contextlib.suppress(OSError, subprocess.SubprocessError):
    here = pathlib.Path(__file__).resolve().parent
    commit = commit or subprocess.run(
        ["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        timeout=10).stdout.strip() or None
  d = jax.devices()[0]
  return dict(device=d.device_kind, platform=d.platform, devices=jax.device_count(),
              jax=jax.__version__, commit=commit,
              xla_flags=" ".join(os.environ.get("XLA_FLAGS", "").split()) or None)


def load_done(path: pathlib.Path | None) -> list[dict]:
  """The records of an earlier run of the same file (resuming), [] when there is none."""
  if path is None or not path.is_file():
    return []
  try:
    data = json.loads(path.read_text())
  except (OSError, ValueError) as err:
    raise ValueError(f"--output_json {path} holds no earlier eval.bench results ({err}): "
                     f"choose another file or remove it") from None
  if not isinstance(data, dict) or not isinstance(data.get("records"), list):
    raise ValueError(f"--output_json {path} is not an eval.bench results file: choose another "
                     f"file or remove it")
  return data["records"]


def parse_args(argv):
  p = cli.parser("python -m eval.bench", __doc__)
  p.add_argument("--shapes", default=",".join(SHAPES),
                 help=f"comma-separated, from {', '.join(SHAPES)}")
  p.add_argument("--batches", default="1,8,32")
  p.add_argument("--gammas", default="3,5,7")
  p.add_argument("--alpha", type=float, default=0.8,
                 help="probability that the knob accepts each draft token")
  p.add_argument("--scale", type=int, default=1, help="divide every width and depth by N")
  p.add_argument("--prompt_len", type=int, default=128)
  p.add_argument("--new_tokens", type=int, default=128)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--probe_steps", type=int, default=32)
  p.add_argument("--profile", action="store_true",
                 help="profile the first case measured: device kernels per step, busy share")
  p.add_argument("--precision", choices=("highest", "high", "default"),
                 help="matmul precision of both models (default: by dtype, `default` for the "
                      "bfloat16 weights here: hf_import.default_precision)")
  p.add_argument("--layers", choices=layouts.LAYOUTS, default="auto",
                 help="layer layout of both models (auto: scanned on TPU, unrolled elsewhere)")
  p.add_argument("--quant", choices=("", "int8"), default="",
                 help="int8: both models' dense layers int8 (W8A8 on the CPU, weight-only on "
                      "accelerators); decoder-only shapes")
  p.add_argument("--peak", default="", help="'TBps,TFLOPs' of the device (default: datasheets)")
  p.add_argument("--output_json", default="bench.json")
  p.add_argument("--output_md")
  args, rest = cli.parse(p, argv)
  if rest:
    p.error(f"unrecognized arguments: {' '.join(rest)}")
  return args


def check(args) -> tuple[list[str], list[int], tuple[int, ...]]:
  names = [s for s in args.shapes.split(",") if s.strip()]
  unknown = [s for s in names if s not in SHAPES]
  if unknown or not names:
    raise ValueError(f"--shapes {args.shapes!r}: choose from {', '.join(SHAPES)}")
  batches = flags.parse_gammas(args.batches, "--batches")
  gammas = flags.parse_gammas(args.gammas, "--gammas")         # an empty list is refused
  flags.check_counts(scale=args.scale, prompt_len=args.prompt_len, repeats=args.repeats,
                     probe_steps=args.probe_steps)
  if args.new_tokens < 2:     # a step's time is (n tokens - 1 token) / (n - 1)
    raise ValueError(f"--new_tokens must be at least 2 (a decoding step is timed as the "
                     f"difference of n tokens and 1), got {args.new_tokens}")
  encoder_decoder = [s for s in names if SHAPES[s][0]["model_type"] == "t5"]
  if args.quant and encoder_decoder:
    raise ValueError(f"--quant {args.quant} applies to the decoder-only shapes; "
                     f"{', '.join(encoder_decoder)} has no int8 layers: leave it out of --shapes")
  if not 0 <= args.alpha <= 1:
    raise ValueError(f"--alpha {args.alpha}: a probability, in [0, 1]")
  if args.peak:
    try:
      bw, fl = (float(x) for x in args.peak.split(","))
      assert bw > 0 and fl > 0
    except (ValueError, AssertionError):
      raise ValueError(f"--peak {args.peak!r}: give 'TBps,TFLOPs', e.g. 3.35,989") from None
  return names, batches, tuple(gammas)


def main(argv=None) -> int:
  args = parse_args(argv)

  def go():
    names, batches, gammas = check(args)
    out = flags.output_file(args.output_json, "--output_json")
    md = flags.output_file(args.output_md, "--output_md")
    records = load_done(out)
    # Cold start-up is an empty compilation cache: a fresh one for this run.
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="specjax-bench-")
    cli.setup()
    env = environment()
    peak = roofline.peaks(env["device"], args.peak)
    run = Run(prompt_len=args.prompt_len, new_tokens=args.new_tokens, gammas=gammas,
              alpha=args.alpha, repeats=args.repeats, probe_steps=args.probe_steps,
              profile=args.profile, precision=args.precision, layers=args.layers,
              quant=args.quant)
    say = timing.progress()
    peak_text = ("unknown (no roofline)" if peak is None else
                 f"{peak[0] / 1e12:g} TB/s, {peak[1] / 1e12:g} TFLOP/s")
    say(f"{env['device']} ({env['platform']}), jax {env['jax']}, commit {env['commit']}; "
        f"peaks {peak_text}")
    check_same_run(records, run, out)
    done = {r["case"] for r in records}
    cases = order(names, batches)
    left = [c for c in cases if case_key(*c, args.scale, run) not in done]
    try:
      with tempfile.TemporaryDirectory(prefix="specjax-bench-models-") as tmp:
        for name, batch in cases:
          if (name, batch) not in left:
            say(f"{name} b{batch}: in {out} already, skipped")
            continue
          records.append({**measure(name, batch, run, args.scale, pathlib.Path(tmp), peak,
                                    say), **env})
          left.remove((name, batch))
          run = dataclasses.replace(run, profile=False)     # the first case measured only
          if out:            # marked partial while cases are missing (the same command adds them)
            mark = {"partial": {"cases_left": len(left)}} if left else {}
            outputs.write_json(out, dict(environment=env, records=records, **mark))
          print(table(records[-1:]), flush=True)
          jax.clear_caches()
    except KeyboardInterrupt:
      kept = f": {out} keeps those measured, and the same command measures the rest" if out else ""
      print(f"eval.bench: interrupted with {len(left)} of {len(cases)} cases left{kept}",
            file=sys.stderr)
      return 130
    if md:
      outputs.write_text(md, table(records) + "\n")
    return 0

  return cli.run("eval.bench", go)


if __name__ == "__main__":
  sys.exit(main())
