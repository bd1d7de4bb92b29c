"""Decoding over a ('data', 'model') mesh: the loops of `speculative`, `autoregressive` and
`sprinter.loop` jitted with explicit in/out shardings built from the ONE rules table
(specjax.sharding), around the same loop function the single-device `run` jits.

Placement:
  params       sharding.param_shardings with the model's head counts as units: heads (by whole
               KV-head groups), KV heads, mlp and vocab over 'model' (scanned [L, ...] leaves
               too), the rest replicated
  prompts, per-row keys, every per-row leaf of the loop state: rows over 'data'
  KV caches    sharding.cache_shardings: rows over 'data', KV heads over 'model'
The loops pin their state to these shardings after the prefill and after every block (`pin`), so
the while loop's carry has one layout and nothing reshards a cache inside the loop.

The mesh's 'model' axis must divide the target's attention heads (sharding.HeadsError otherwise);
where it does not divide a model's KV heads (grouped-query attention, or a draft's heads) that
model's attention and cache stay replicated over 'model' (model_units). A batch that
the 'data' axis does not divide is padded with copies of its last row (and key); the padding rows
are dropped from the Generation, which comes back replicated on every device (one all-gather of
tokens and counters after the loop), so every process of a multi-host run holds all of it.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp

from specjax import sharding
from specjax.decoding.state import Generation, finish, loop_compiler_options
from specjax.models import kv_cache


def model_units(model) -> dict[str, int] | None:
  """The rules table's units of a model's head dims: query heads split only by whole KV-head
  groups (the G = H / Hkv query heads that read one KV head), so that attention never needs a KV
  head from another device. A 'model' axis that does not divide Hkv then leaves the attention
  (and the cache) replicated over 'model'; mlp and vocab still split: splitting the query heads
  alone made XLA regather the whole replicated cache every block."""
  heads = model.heads
  return None if heads is None else {"heads": heads[1], "kv_heads": heads[1]}


def check_target(model, mesh, what: str = "the target") -> None:
  """sharding.HeadsError when the mesh's 'model' axis divides none of the target's heads."""
  heads = model.heads
  if heads is not None:
    sharding.check_heads(mesh, heads[0], heads[1], what)


def param_shardings(model, params, mesh) -> Any:
  """The rules table's shardings of a model's params (model None: replicated, e.g. a verifier)."""
  if model is None:
    return jax.tree_util.tree_map(lambda _: sharding.replicated(mesh), params)
  return sharding.param_shardings(params, mesh, model_units(model), model.layout, model.quant)


def place_params(model, params, mesh) -> Any:
  return sharding.place(params, param_shardings(model, params, mesh))


def state_shardings(state, mesh) -> Any:
  """Shardings of a loop state (arrays or ShapeDtypeStructs): caches by the cache rules, every
  other leaf per-row over 'data'."""
  def one(x):
    if isinstance(x, kv_cache.KVCache):
      return sharding.cache_shardings(x, mesh)
    return sharding.row_sharding(x, mesh)
  return jax.tree_util.tree_map(one, state, is_leaf=lambda x: isinstance(x, kv_cache.KVCache))


def pin(state, mesh):
  """The state constrained to state_shardings inside a jitted loop (as it is without a mesh)."""
  if mesh is None:
    return state
  return jax.lax.with_sharding_constraint(state, state_shardings(state, mesh))


def init_cache(model, batch: int, max_len: int, enc_len: int, mesh) -> kv_cache.KVCache:
  """model.init_cache; with a mesh, created on its shardings and carrying the k/v layout
  (KVCache.layout), so that writes keep every row and KV head where the cache holds it."""
  cache = model.init_cache(batch, max_len, enc_len)
  if mesh is None:
    return cache
  return pin(cache.replace(layout=sharding.cache_shardings(cache, mesh).k), mesh)


def pad_rows(tree, rows: int):
  """Every leaf [B, ...] padded to `rows` rows with copies of its last row."""
  def one(x):
    extra = rows - x.shape[0]
    return x if extra == 0 else jnp.concatenate([x, jnp.repeat(x[-1:], extra, axis=0)])
  return jax.tree_util.tree_map(one, tree)


def _place_rows(tree, mesh):
  """Per-row inputs (prompts, keys) placed rows over 'data'; typed PRNG keys via their data."""
  def one(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      data = jax.random.key_data(x)
      placed = sharding.place(data, sharding.row_sharding(data, mesh))
      return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(x))
    return sharding.place(x, sharding.row_sharding(x, mesh))
  return jax.tree_util.tree_map(one, tree)


def place_args(models, params, prompts, keys, mesh):
  """(params, prompts, keys) of a loop placed on the mesh; params[i] belongs to models[i]."""
  placed = tuple(place_params(m, p, mesh) for m, p in zip(models, params))
  return placed, _place_rows(prompts, mesh), _place_rows(keys, mesh)


def place_shared(tree, mesh, rows: int):
  """Arguments every device reads whole (the warp's values, the rule's, the limit), replicated;
  a leaf with an axis (a warp's per-row values [B]) is padded to `rows` rows like the prompts."""
  def one(x):
    x = jnp.asarray(x)
    return sharding.place(pad_rows(x, rows) if x.ndim else x, sharding.replicated(mesh))
  return jax.tree_util.tree_map(one, tree)


def jitted(loop: Callable, setup, args) -> Callable:
  """`loop(setup, *args)` jitted with in_shardings = the args' placements and out_shardings =
  the state's shardings (cached per setup and argument signature)."""
  leaves, tree = jax.tree_util.tree_flatten(args)
  signature = tuple((x.shape, x.dtype, x.sharding) for x in leaves)
  return _jitted(loop, setup, tree, signature)


@functools.lru_cache(maxsize=64)
def _jitted(loop, setup, tree, signature):
  structs = [jax.ShapeDtypeStruct(shape, dtype, sharding=s) for shape, dtype, s in signature]
  fn = functools.partial(loop, setup)
  out = jax.eval_shape(fn, *jax.tree_util.tree_unflatten(tree, structs))
  in_shardings = jax.tree_util.tree_unflatten(tree, [s for _, _, s in signature])
  return jax.jit(fn, in_shardings=tuple(in_shardings),
                 out_shardings=state_shardings(out, setup.mesh),
                 compiler_options=loop_compiler_options(structs))


@functools.lru_cache(maxsize=64)
def _gatherer(mesh, rows: int) -> Callable:
  def real_rows(state) -> Generation:
    gen = finish(state)
    return jax.tree_util.tree_map(lambda x: x[:rows], gen)
  return jax.jit(real_rows, out_shardings=sharding.replicated(mesh))


def generate(loop: Callable, setup, models, params, prompts, keys, *shared) -> Generation:
  """Run `loop(setup, params, prompts, keys, *shared) -> state` on setup.mesh; models[0] is the
  target; `shared` (the warp, the traced limit) is replicated. Returns the Generation of the
  real rows, replicated, with the whole token buffer (state.run_loop cuts it to the limit)."""
  mesh = setup.mesh
  check_target(models[0], mesh)
  batch = keys.shape[0]
  rows = sharding.padded_batch(batch, mesh)
  args = place_args(models, params, pad_rows(prompts, rows), pad_rows(keys, rows), mesh)
  args += place_shared(shared, mesh, rows)
  state = jitted(loop, setup, args)(*args)
  return _gatherer(mesh, batch)(state)


# ------------------------------------------------------------------ what the compiled loop runs

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{$")
_CALLED = re.compile(r"(?:body|condition|calls|to_apply|branch_computations|true_computation|"
                     r"false_computation)=(?:\{([^}]*)\}|(%?[\w.\-]+))")
_TOP_WHILE = re.compile(r'op_name="jit\([^)"]*\)/while"')    # the jitted function's own loop
_OP = re.compile(r"= (\S+) (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_GROUPS = re.compile(r"(?:replica_groups|source_target_pairs)=(.*?)(?:, (?:use_global_device_ids|"
                     r"dimensions|to_apply|metadata|backend_config|channel_id)=|$)")


def _computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
  """(computation name -> its instruction lines, the entry's name) of compiled HLO text."""
  comps, name, entry = {}, None, None
  for line in hlo.splitlines():
    head = _HEADER.match(line)
    if head:
      name = head.group(2)
      comps[name] = []
      entry = name if head.group(1) else entry
    elif name is not None and line.startswith(" "):
      comps[name].append(line)
  return comps, entry


def _called(line: str) -> list[str]:
  """Names of the computations an HLO instruction line calls."""
  names = []
  for m in _CALLED.finditer(line):
    names += [n.strip().lstrip("%") for n in (m.group(1) or m.group(2)).split(",")]
  return names


def loop_collectives(hlo: str) -> list[tuple[str, str, str]]:
  """(collective, result shape, device groups as HLO writes them) of every collective in the
  decoding loop of a compiled program (`jax.jit(...).lower(...).compile().as_text()`): the entry's
  top-level lax.while_loop and all it calls; the scanned layers and the drafting loop inside it
  run theirs once per layer / step. The prefill (and its layer scan) sits outside."""
  comps, entry = _computations(hlo)
  todo = [name for line in comps.get(entry, []) if " while(" in line and _TOP_WHILE.search(line)
          for name in _called(line)]
  inside = set()
  while todo:
    name = todo.pop()
    if name not in inside and name in comps:
      inside.add(name)
      todo += [called for line in comps[name] for called in _called(line)]
  return [(m.group(2), m.group(1), _groups(line)) for name in sorted(inside)
          for line in comps[name] for m in _OP.finditer(line)]


def _groups(line: str) -> str:
  found = _GROUPS.search(line)
  return found.group(1) if found else ""
