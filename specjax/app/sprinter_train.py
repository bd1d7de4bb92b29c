"""Config -> SPRINTER verifier training: what `python -m train.verifier` runs.

Reads the config's `verifier`, `target`, `draft`, `data` and `decode` sections, builds the models
and the text prefixes, and hands typed objects to `specjax.sprinter.train.train_verifier`. Errors
the library raises with data (too few sequences) come back here as `--config.` advice.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from specjax import sampling
from specjax.app import builders, resolve
from specjax.app.config import ConfigError
from specjax.data.source import SourceConfig, make_source
from specjax.distill import data as distill_data
from specjax.sprinter import train as train_lib
from specjax.sprinter.data import DataConfig


def data_config(section) -> DataConfig:
  return DataConfig(lam=float(section.lam), cont_len=int(section.cont_len),
                    mix_prob=float(section.mix_prob), features=str(section.features))


def train_config(section) -> train_lib.TrainConfig:
  """The section's keys that name TrainConfig fields, typed like their defaults."""
  cls = train_lib.TrainConfig
  names = {f.name for f in dataclasses.fields(cls)}
  return cls(**{k: type(getattr(cls, k))(v) for k, v in section.items() if k in names})


def text_batches(config, rows: int, count: int):
  """`count` batches of `rows` text prefixes: the config's task via specjax.data (the runner's
  eval_source style), or the seeded Markov language when data.source == 'markov'."""
  d, cont_len = config.data, int(config.verifier.cont_len)
  if d.get("source") == "markov":
    src = distill_data.MarkovSource(int(d.vocab_size), rows, int(d.prompt_len), cont_len,
                                    int(d.get("seed", 0)))
    return [src.batch(i) for i in range(count)]
  fields = {k: int(d[k]) for k in ("lm_prompt_len", "max_prompt_len") if k in d}
  src = make_source(d.task, d.tokenizer,
                    SourceConfig(batch_size=rows, max_target_len=cont_len, **fields))
  return [src.batch(i, "train") for i in range(count)]


def run_from_config(config, workdir: str) -> dict:
  """Models + text prefixes -> examples -> trained verifier, saved in workdir with
  verifier.json and metrics.json. Returns the metrics."""
  v = config.verifier
  seed = int(v.get("seed", 0))
  target, tparams = resolve.build_model(builders.model_spec(config, "target"), seed)
  draft, dparams = resolve.build_model(builders.model_spec(config, "draft"), seed + 1)
  d = config.decode
  warp = sampling.Warp(float(d.temperature), int(d.top_k), float(d.top_p))
  rows = int(v.batch_rows)
  batches = text_batches(config, rows, math.ceil(int(v.num_sequences) / rows))
  eos = int(config.data.get("eos_id", getattr(getattr(target, "config", None), "eos_token_id", 1)))
  try:
    return train_lib.train_verifier(
        target, tparams, draft, dparams, batches, jax.random.PRNGKey(seed), warp=warp,
        data=data_config(v), training=train_config(v), eos=eos, mlp_width=int(v.mlp_width),
        workdir=workdir, gamma_max=int(v.gamma_max))
  except train_lib.TooFewSequencesError as e:
    raise ConfigError(f"{e}; raise --config.verifier.num_sequences (now {int(v.num_sequences)}) "
                      f"or lower --config.verifier.val_fraction / test_fraction") from e
