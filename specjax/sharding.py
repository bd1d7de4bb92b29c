"""Device mesh and the ONE rules table that places params, optimizer state and batches on it.

Parameter leaf name (fixed by docs/architecture.md) -> logical axes -> mesh axes:

  query [D, H*Dh]  ('embed', 'heads')   key/value [D, Hkv*Dh] ('embed', 'kv_heads')
  out [H*Dh, D]    ('heads', 'embed')
  wi/wi_0/wi_1    [D, F]     ('embed', 'mlp')        wo  [F, D]      ('mlp', 'embed')
  embedding       [V, D]     ('vocab', 'embed')      lm_head [D, V]  ('embed', 'vocab')
  relpos_bias     [N, H]     ('relpos', 'heads')     scale / bias    [D] ('embed',)

and logical -> mesh: heads, kv_heads, mlp, vocab -> 'model' (tensor parallelism); batch ->
'data'; embed, relpos, layers, length, head_dim -> replicated. Flax Dense leaves take their
module's name: `query/kernel` is `query`, and `query/bias` gets the kernel's output axis
(('heads',)), as does an int8 layer's `query/scale` (models/quant.py; an int4 layer's scale
[out, in / 64] takes its kernel's two axes). A model whose dense
kernels are stored [out, in] (`layout="out_in"`, models/dense_layout.py) gets each Dense
kernel's two axes swapped (`out` [D, H*Dh] is
('embed', 'heads')); its biases, the embedding and the LM head keep theirs. A leaf with one extra
leading axis (scanned layers) gets 'layers' in front. Names
outside the table, dimensions that the mesh axis does not divide, and leaves of another rank are
replicated (correct, just not sharded). `units` ({'heads': H, 'kv_heads': Hkv}) keeps a head whole:
a [D, Hkv*Dh] kernel is split only when the mesh axis divides Hkv itself (grouped-query attention
with fewer KV heads than the axis replicates the KV projections and the cache instead of cutting
heads in half).

KV cache fields (decoding; `cache_shardings`):

  k/v/cross_k/cross_v [L, B, Hkv, S, Dh]  ('layers', 'batch', 'kv_heads', 'length', 'head_dim')
  lengths [B] ('batch',)                  enc_mask [B, E] ('batch', 'length')

so every device holds its rows ('data') and its KV heads ('model') of every layer and position.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

log = logging.getLogger(__name__)

MESH_AXES = ("data", "model")

PARAM_AXES: dict[str, tuple[str, ...]] = {
    "query": ("embed", "heads"), "key": ("embed", "kv_heads"), "value": ("embed", "kv_heads"),
    "out": ("heads", "embed"),
    "wi": ("embed", "mlp"), "wi_0": ("embed", "mlp"), "wi_1": ("embed", "mlp"),
    "wo": ("mlp", "embed"),
    "embedding": ("vocab", "embed"), "lm_head": ("embed", "vocab"),
    "relpos_bias": ("relpos", "heads"),
    "scale": ("embed",), "bias": ("embed",),
}

LOGICAL_TO_MESH: dict[str, str | None] = {
    "batch": "data", "heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model",
    "embed": None, "relpos": None, "layers": None, "length": None, "head_dim": None,
}

_KV = ("layers", "batch", "kv_heads", "length", "head_dim")
CACHE_AXES: dict[str, tuple[str, ...]] = {
    "k": _KV, "v": _KV, "cross_k": _KV, "cross_v": _KV,
    "lengths": ("batch",), "enc_mask": ("batch", "length"),
}


class MeshError(ValueError):
  pass


class HeadsError(MeshError):
  """The mesh 'model' axis divides neither a model's attention heads nor its KV heads; carries
  `model_axis`, `heads`, `kv_heads`, `valid` (model axis sizes that work) and `what`."""

  def __init__(self, model_axis: int, heads: int, kv_heads: int, valid: tuple[int, ...],
               what: str = "the model"):
    choices = ", ".join(str(v) for v in valid)
    super().__init__(f"mesh model axis {model_axis} divides neither the {heads} attention heads "
                     f"nor the {kv_heads} KV heads of {what}: use a model axis of {choices}")
    self.model_axis, self.heads, self.kv_heads = model_axis, heads, kv_heads
    self.valid, self.what = valid, what


def make_mesh(data: int = -1, model: int = 1, devices=None) -> Mesh:
  """A ('data', 'model') mesh; data=-1 takes every device not used by the model axis."""
  devices = list(jax.devices() if devices is None else devices)
  count = len(devices)
  if model < 1 or (data < 1 and data != -1):
    raise MeshError(f"mesh shape ({data}, {model}) is invalid: use positive sizes (data may be -1)")
  if data == -1:
    if count % model:
      raise MeshError(f"mesh model axis {model} does not divide the {count} devices: use a "
                      f"divisor of {count}")
    data = count // model
  if data * model != count:
    raise MeshError(f"mesh shape (data={data}, model={model}) needs {data * model} devices but "
                    f"{count} are available: choose data * model = {count} (or data=-1)")
  grid = np.asarray(devices).reshape(data, model)
  return Mesh(grid, MESH_AXES)


def _names(path) -> tuple[str, ...]:
  return tuple(str(getattr(e, "key", getattr(e, "name", getattr(e, "idx", "")))) for e in path)


OUT_IN = "out_in"       # models/dense_layout.OUT_IN (sharding sits beside models, not above it)


def leaf_axes(names: tuple[str, ...], ndim: int, layout: str = "in_out",
              quant: str = "") -> tuple[str | None, ...]:
  """Logical axes of a param leaf from its path names and rank (see the module docstring);
  layout: the model's dense-kernel layout ("in_out" or "out_in": Dense kernels' axes swapped,
  and a quantized model's (quant "int8" or "int4") output layer's too:
  models/dense_layout.transposes). An int4 layer's scale [out, in / 64] takes its kernel's axes."""
  leaf = names[-1] if names else ""
  parent = names[-2] if len(names) > 1 else ""
  if leaf == "kernel" or (leaf == "scale" and quant == "int4"):
    axes = PARAM_AXES.get(parent)
    if layout == OUT_IN and axes is not None and (parent != "lm_head" or quant):
      axes = axes[::-1]
  elif leaf in ("bias", "scale") and parent in PARAM_AXES and len(PARAM_AXES[parent]) == 2:
    axes = PARAM_AXES[parent][-1:]                  # a Dense bias or int8 scale: [out]
  else:
    axes = PARAM_AXES.get(leaf)
  if axes is None:
    return (None,) * ndim
  if ndim == len(axes) + 1:
    return ("layers",) + axes
  return axes if ndim == len(axes) else (None,) * ndim


def logical_axes(params, layout: str = "in_out") -> Any:
  """A pytree like params whose leaves are tuples of logical axis names (layout: leaf_axes)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: leaf_axes(_names(path), np.ndim(x), layout), params)


def spec_for(axes, shape, mesh: Mesh, units: dict[str, int] | None = None) -> P:
  """Mesh PartitionSpec for logical axes; a dim the mesh axis does not divide is replicated, and
  so is a dim whose `units` count (heads in a [.., H*Dh] dim) the mesh axis does not divide."""
  out, used = [], set()
  for logical, size in zip(axes, shape):
    mesh_axis = LOGICAL_TO_MESH.get(logical) if logical else None
    parts = mesh.shape[mesh_axis] if mesh_axis else 1
    whole = (units or {}).get(logical, size)
    if mesh_axis is None or mesh_axis in used or size % parts or whole % parts:
      out.append(None)
    else:
      out.append(mesh_axis)
      used.add(mesh_axis)
  return P(*out)


def param_shardings(params, mesh: Mesh, units: dict[str, int] | None = None,
                    layout: str = "in_out", quant: str = "") -> Any:
  """NamedSharding per param leaf (works on arrays or jax.ShapeDtypeStruct); units: see
  spec_for (decoding passes the model's head counts); layout, quant: the model's dense-kernel
  layout and weight format (leaf_axes)."""
  def one(path, x):
    axes = leaf_axes(_names(path), len(x.shape), layout, quant)
    return NamedSharding(mesh, spec_for(axes, x.shape, mesh, units))
  return jax.tree_util.tree_map_with_path(one, params)


def cache_specs(cache, mesh: Mesh) -> Any:
  """PartitionSpec per KV-cache leaf (CACHE_AXES by field name; another field: rows over 'data').
  Heads are split only when the 'model' axis divides the cached (KV) heads."""
  def one(path, x):
    names = _names(path)
    axes = CACHE_AXES.get(names[-1] if names else "", ("batch",) + (None,) * (len(x.shape) - 1))
    return spec_for(axes, x.shape, mesh)
  return jax.tree_util.tree_map_with_path(one, cache)


def cache_shardings(cache, mesh: Mesh) -> Any:
  """NamedSharding per KV-cache leaf: rows over 'data', KV heads over 'model' (see cache_specs)."""
  return jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), cache_specs(cache, mesh),
                                is_leaf=lambda x: isinstance(x, P))


def row_sharding(x, mesh: Mesh) -> NamedSharding:
  """Per-row decoding state [B, ...]: rows over 'data' (scalars replicated)."""
  axes = ("batch",) + (None,) * (len(x.shape) - 1) if len(x.shape) else ()
  return NamedSharding(mesh, spec_for(axes, x.shape, mesh))


def check_heads(mesh: Mesh, heads: int, kv_heads: int, what: str = "the model") -> None:
  """Refuse a 'model' axis that splits no head: it must divide the attention heads (a divisor of
  the KV heads divides them too; then the KV cache is split as well)."""
  model_axis = mesh.shape["model"]
  if heads % model_axis:
    devices = mesh.devices.size
    valid = tuple(m for m in range(1, heads + 1) if heads % m == 0 and devices % m == 0)
    raise HeadsError(model_axis, heads, kv_heads, valid, what)


def padded_batch(batch: int, mesh: Mesh) -> int:
  """The smallest batch >= `batch` that the 'data' axis divides (decoding pads up to it)."""
  data = mesh.shape["data"]
  return -(-batch // data) * data


def _param_index(params) -> dict:
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return {_names(path): x.shape for path, x in flat}


def _match_param(path, index) -> tuple | None:
  """The param path that ends this optimizer-state path (optax state nests the params tree)."""
  names = _names(path)
  for start in range(len(names)):
    if names[start:] in index:
      return names[start:]
  return None


def opt_state_shardings(opt_state, params, mesh: Mesh) -> Any:
  """Shardings for optax state: moments shaped like a param reuse its spec; Adafactor's factored
  moments (the param shape minus one dim) drop that dim's axis; anything else is replicated."""
  index = _param_index(params)

  def one(path, x):
    shape = tuple(x.shape)
    key = _match_param(path, index)
    if key is None:
      return NamedSharding(mesh, P())
    pshape = tuple(index[key])
    axes = leaf_axes(key, len(pshape))
    if shape == pshape:
      return NamedSharding(mesh, spec_for(axes, shape, mesh))
    for drop in reversed(range(len(pshape))):
      if pshape[:drop] + pshape[drop + 1:] == shape:
        kept = axes[:drop] + axes[drop + 1:]
        return NamedSharding(mesh, spec_for(kept, shape, mesh))
    return NamedSharding(mesh, P())
  return jax.tree_util.tree_map_with_path(one, opt_state)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis over 'data', the rest replicated; applies to every batch leaf."""
  return NamedSharding(mesh, P("data"))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def check_batch(batch_size: int, mesh: Mesh) -> None:
  """The global batch must split evenly over the data axis and over the hosts."""
  data = mesh.shape["data"]
  if batch_size % data:
    raise MeshError(f"global batch {batch_size} does not divide over the mesh data axis "
                    f"({data}): pick a batch size that is a multiple of {data}")
  hosts = jax.process_count()
  if batch_size % hosts:
    raise MeshError(f"global batch {batch_size} does not divide across {hosts} hosts: pick a "
                    f"batch size that is a multiple of {hosts}")


def host_slice(batch_size: int) -> slice:
  """Rows of the global batch that this host feeds."""
  per_host = batch_size // jax.process_count()
  start = jax.process_index() * per_host
  return slice(start, start + per_host)


def shard_batch(tree, mesh: Mesh, local: bool = False):
  """Place a batch pytree sharded over 'data'. local=True: each host passes only its own rows
  (host_slice) and the global array is assembled from the process-local pieces."""
  sharding = batch_sharding(mesh)
  if local and jax.process_count() > 1:
    return jax.tree_util.tree_map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree)
  return jax.device_put(tree, sharding)


def place(tree, shardings):
  """Put every leaf on its sharding (leaves already there are kept). Across processes each leaf
  must hold the same value on every process (params, prompts and keys of a decoding call): the
  global array is assembled from that value, so no process needs the others' data."""
  def one(x, s):
    if isinstance(x, jax.Array) and x.sharding == s:
      return x
    if jax.process_count() == 1:
      return jax.device_put(x, s)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, s, lambda index: host[index])
  return jax.tree_util.tree_map(one, tree, shardings)


def num_params(params) -> int:
  return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))


class DistributedSetupError(ValueError):
  """jax.distributed.initialize refused or failed; carries the `coordinator`, `num_processes`
  and `process_id` it was given (None: left to JAX's cluster detection) and JAX's `reason`."""

  def __init__(self, coordinator, num_processes, process_id, reason: str):
    self.coordinator, self.num_processes, self.process_id = coordinator, num_processes, process_id
    self.reason = reason
    values = (("coordinator", coordinator), ("num_processes", num_processes),
              ("process_id", process_id))
    given = ", ".join(f"{k} {'(not set)' if v is None else v}" for k, v in values)
    unset = any(v is None for _, v in values)
    detect = "; no cluster environment (a TPU pod, SLURM) supplied what is not set" if unset else ""
    super().__init__(f"the multi-process set-up failed: {reason} (given: {given}{detect})")


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> None:
  """jax.distributed.initialize before any computation; on TPU pods all arguments may be None.
  Raises DistributedSetupError when JAX refuses the arguments or cannot connect."""
  if jax.distributed.is_initialized():
    return
  try:   # CPU processes (tests, dev boxes) need a collectives backend; harmless on TPU/GPU
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  except (AttributeError, ValueError):
    pass
  kwargs = {k: v for k, v in dict(coordinator_address=coordinator, num_processes=num_processes,
                                  process_id=process_id).items() if v is not None}
  if coordinator and process_id:
    _reach(coordinator, num_processes, process_id)
  if coordinator:
    log.info("joining %s processes through the coordinator %s as process %s (each process waits "
             "for all of them, up to %d s)", num_processes, coordinator, process_id,
             JOIN_TIMEOUT_S)
  waiting = threading.Event()
  threading.Thread(target=_still_waiting, args=(waiting, coordinator, num_processes),
                   daemon=True).start()
  try:
    jax.distributed.initialize(**kwargs, initialization_timeout=JOIN_TIMEOUT_S)
  except (ValueError, RuntimeError) as err:       # RuntimeError: XlaRuntimeError (connection)
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    raise DistributedSetupError(coordinator, num_processes, process_id, reason) from err
  finally:
    waiting.set()


JOIN_TIMEOUT_S = 300        # jax.distributed.initialize's own default


def _reach(coordinator: str, num_processes, process_id) -> None:
  """DistributedSetupError when nothing answers at the coordinator's address within
  JOIN_TIMEOUT_S (JAX would wait as long in silence, then abort the process)."""
  host, _, port = coordinator.rpartition(":")
  deadline = time.monotonic() + JOIN_TIMEOUT_S
  while True:
    try:
      socket.create_connection((host, int(port)), timeout=5).close()
      return
    except (OSError, ValueError) as err:
      if isinstance(err, (ValueError, socket.gaierror)) or time.monotonic() > deadline:
        raise DistributedSetupError(coordinator, num_processes, process_id,
                                    f"nothing answered at {coordinator} ({err}); start process "
                                    f"0 there first") from None
      time.sleep(1)


def _still_waiting(done: threading.Event, coordinator, num_processes) -> None:
  """Says every 30 s that joining the other processes goes on (it is silent otherwise)."""
  start = time.monotonic()
  while not done.wait(30):
    log.warning("still waiting after %.0f s for the %s processes of %s to join: start each "
                "with the same coordinator and num_processes (process_id 0 .. N-1)",
                time.monotonic() - start, num_processes, coordinator)
