"""pmap's pieces, the legacy path (`config.parallelism='pmap'`): every leaf has a leading axis of
one entry per local device. `replicate` makes it, `unreplicate` takes it away, `shard_batch`
splits a batch into per-device pieces; `fold_in_device_index` gives each device its own dropout;
`on_devices` wraps a step on one batch (steps.py's) for pmap's axis, `compiled` makes
dispatch.py's steps pmap's. A reader of the spmd and fsdp paths (jit,
sharding.py) needs nothing from this module.
"""

import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..data import batches
from . import sharding

PMAP_AXIS = "batch"  # pmap's axis, the steps mapped over it (`on_devices`): Flax's examples' name


def local_devices_mesh() -> Mesh:
  """pmap's layout: the leading axis of an array spread over this process's devices."""
  return Mesh(np.array(jax.local_devices()), (PMAP_AXIS,))


def replicate(tree):
  """Every leaf as `[local_devices, ...]`, one copy on each local device, each sent there from
  this process's copy on the host: no device ever holds more than its own copy."""
  mesh = local_devices_mesh()
  sharding = NamedSharding(mesh, P(PMAP_AXIS))

  def put(x):
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(put(jax.random.key_data(x)), impl=jax.random.key_impl(x))
    one = np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)[None]
    return jax.make_array_from_callback((mesh.size, *one.shape[1:]), sharding, lambda _: one)

  return jax.tree.map(put, tree)


def unreplicate(tree):
  """This process's copy (on its first device) of every leaf of a replicated tree, on the host:
  a plain transfer, where indexing `x[0]` on the devices would compile a program per shape.
  NumPy arrays, but PRNG keys stay keys."""

  def first(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(first(jax.random.key_data(x)), impl=jax.random.key_impl(x))
    return np.asarray(x.addressable_data(0))[0]

  return jax.tree.map(first, tree)


def shard_batch(batch, num_devices: int, axis: int = 0):
  """`[global, ...]` -> `[num_devices, global // num_devices, ...]` for every leaf (NumPy views:
  no copy).

  Args:
    batch: the batch's arrays.
    num_devices: the devices it is split over.
    axis: the batch's axis; 1: stacked batches `[k, global, ...]` ->
      `[num_devices, k, global // num_devices, ...]`.
  """

  def split(x):
    size = x.shape[axis]
    if size % num_devices:
      raise ValueError(f"shard_batch: a batch of {size} examples does not split over "
                       f"{num_devices} devices; use a batch size that is a multiple of "
                       f"{num_devices}.")
    x = x.reshape(*x.shape[:axis], num_devices, size // num_devices, *x.shape[axis + 1:])
    return np.moveaxis(x, axis, 0)

  return jax.tree.map(split, batch)


def unshard_batch(batch):
  """The inverse of `shard_batch`: `[devices, per_device, ...]` -> `[devices * per_device, ...]`."""
  return jax.tree.map(lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), batch)


def pmap_batch(local_batch):
  """This process's stacked batches `[k, local_batch, ...]` split over its devices and placed
  there in one call, for pmap: `[local_devices, k, local_batch // local_devices, ...]`.
  `local_batch`: one dict, or the devices' shares in order (a list), each sent as it is. Photos'
  crops packed a device each (`batches.pack`): each device's bytes sent alone (`batches.sent`)."""
  mesh = local_devices_mesh()
  where, devices = NamedSharding(mesh, P(PMAP_AXIS)), list(mesh.devices.flat)
  shares, pieces, nbytes = batches.sent_apart(local_batch)
  if len(shares) == 1:
    placed = jax.device_put(shard_batch(shares[0], mesh.size, axis=1), where)
  else:
    on_devices = jax.device_put([jax.tree.map(lambda x: x[None], share) for share in shares],
                                devices)
    placed = {key: jax.make_array_from_single_device_arrays(
        (len(devices), *shares[0][key].shape), where, [share[key] for share in on_devices])
              for key in shares[0]}
  if pieces:  # (each device's bytes: [1, 1, 1, n])
    on_devices = sharding.padded(jax.device_put(
        [piece.reshape(1, 1, 1, -1) for piece in pieces], devices), devices, nbytes, axis=0)
    placed["image"] = jax.make_array_from_single_device_arrays(
        (len(devices), 1, 1, nbytes), where, on_devices)
  return placed


def fold_in_device_index(model, axis_name):
  """pmap gives every device the same RNG keys: fold in the device index so that dropout differs
  between devices (each key of a stream's stack alike). Returns a function that puts the shared
  keys back (keeping the state replicated; the streams' counters advance identically
  everywhere)."""
  streams = [s for _, s in nnx.iter_graph(model) if isinstance(s, nnx.RngStream)]
  keys = [stream.key[...] for stream in streams]
  fold_in = lambda key: jax.random.fold_in(key, jax.lax.axis_index(axis_name))  # noqa: E731
  for stream in streams:  # (a stream of stacked layers holds a key a layer: nnx.vmap's)
    key = stream.key[...]
    stream.key[...] = jax.vmap(fold_in)(key.reshape(-1)).reshape(key.shape)

  def restore():
    for stream, key in zip(streams, keys, strict=True):
      stream.key[...] = key

  return restore


def batch_norm_over_devices(model, axis_name) -> None:
  """A plain nnx.BatchNorm takes the statistics of the batch it sees, under pmap one device's:
  give each one without an axis of its own `axis_name`, so that they are the global batch's (and
  its running statistics one value on every device), as on spmd and fsdp."""
  for _, node in nnx.iter_graph(model):
    if isinstance(node, nnx.BatchNorm) and node.axis_name is None:
      node.axis_name = axis_name


def under_axis(fn, devices: int):
  """`fn(x_B...)` -> `[B, ...]`, traced as pmap runs it: `x` split over `devices` devices under
  pmap's axis, each its share (a check of the model, `optim.check_model`, as the step runs it)."""

  def on_devices(x):
    y = jax.vmap(fn, axis_name=PMAP_AXIS)(x.reshape(devices, -1, *x.shape[1:]))
    return jax.tree.map(lambda y: y.reshape(-1, *y.shape[2:]), y)

  return on_devices


def on_devices(step):
  """`step` (steps.train_step or eval_step on one batch, as a partial) as each device runs it
  under pmap's axis: its sums over the devices (`sum_devices`), its BatchNorm's statistics over
  them (`batch_norm_over_devices`) and its dropout its own a device (`fold_in_device_index`; the
  shared keys are put back in the state it returns, which stays one value on every device)."""
  sum_devices = functools.partial(jax.lax.psum, axis_name=PMAP_AXIS)

  @functools.wraps(step)
  def on_each_device(graphdef, state, running, batch):
    objects = nnx.merge(graphdef, state)
    batch_norm_over_devices(objects, PMAP_AXIS)
    shared = [s.key[...] for _, s in nnx.iter_graph(objects) if isinstance(s, nnx.RngStream)]
    fold_in_device_index(objects, PMAP_AXIS)
    graphdef, state = nnx.split(objects)
    out = step(graphdef, state, running, batch, sum_devices=sum_devices)
    if not isinstance(out, tuple):  # (eval_step's metrics)
      return out
    objects = nnx.merge(graphdef, out[0])
    streams = [s for _, s in nnx.iter_graph(objects) if isinstance(s, nnx.RngStream)]
    for stream, key in zip(streams, shared, strict=True):
      stream.key[...] = key
    return nnx.state(objects), out[1]

  return on_each_device


def compiled(train, evaluate, mesh: Mesh, devices=None) -> dict:
  """`dispatch.Steps`' fields under pmap. State and batch: one slice a device (axis 0); metrics:
  one value, the same everywhere. The state is placed as `replicate` places it, and given back
  as `mesh`'s.

  Args:
    train: the train step over stacked batches (`on_devices`' step).
    evaluate: the eval step, the same.
    mesh: the devices' mesh.
    devices: the devices compiled for; None: the local ones.
  """
  mapped = functools.partial(jax.pmap, axis_name=PMAP_AXIS, in_axes=(0, None, 0),
                             devices=devices)
  local = sharding.replicated(local_devices_mesh())
  return dict(train=mapped(train, out_axes=(0, None), donate_argnums=(0, 1)),
              eval=mapped(evaluate, out_axes=None, donate_argnums=1),
              put_state=replicate,
              get_state=lambda state: sharding.to_global(unreplicate(state), mesh),
              put_batch=pmap_batch,
              empty=lambda cls: jax.device_put(cls.empty(), local))
