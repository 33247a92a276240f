"""pmap's pieces, the legacy path (`config.parallelism='pmap'`): every leaf has a leading axis of
one entry per local device. `replicate` makes it, `unreplicate` takes it away, `shard_batch`
splits a batch into per-device pieces; `fold_in_device_index` gives each device its own dropout.
`BatchNorm` takes the `[batch]` example mask on every path (model.py uses it), and under pmap
keeps the statistics exact when devices hold different numbers of real examples. A reader of
the spmd and fsdp paths (jit, parallel.py) needs nothing else from this module.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

PMAP_AXIS = "devices"  # the pmap axis name (use it for BatchNorm(axis_name=...))


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
  """`[global, ...]` -> `[num_devices, global // num_devices, ...]` for every leaf; with
  `axis=1`, stacked batches `[k, global, ...]` -> `[num_devices, k, global // num_devices, ...]`.
  NumPy views: no copy."""

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
  there in one call, for pmap: `[local_devices, k, local_batch // local_devices, ...]`."""
  mesh = local_devices_mesh()
  return jax.device_put(shard_batch(local_batch, mesh.size, axis=1),
                        NamedSharding(mesh, P(PMAP_AXIS)))


def bound(axis_name: str) -> bool:
  """Whether the code being traced runs under a pmap (or shard_map) axis of that name."""
  try:
    jax.lax.axis_index(axis_name)
  except NameError:  # "unbound axis name"
    return False
  return True


class BatchNorm(nnx.BatchNorm):
  """nnx.BatchNorm whose batch statistics are those of the real examples of the global batch on
  every path: give `mask` (`[batch]`, False on padding: the `example_mask` that the steps pass
  to the model). Under pmap it reduces over pmap's axis (`PMAP_AXIS`) by itself, unless given
  another `axis_name`. Features on the last axis.

  Under jit the batch is one global array and nnx.BatchNorm's masked mean is already exact. Under
  pmap nnx.BatchNorm averages each device's masked mean: wrong when devices hold different
  numbers of real examples, NaN on a device that holds none. Here sums and counts are summed
  over the devices instead (E[x] and E[x^2], as nnx.BatchNorm's fast variance).
  """

  def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
    if use_running_average is None:
      use_running_average = self.use_running_average
    if mask is not None:  # [batch] -> [batch, 1, ...]: one flag per example
      mask = mask.reshape(-1, *[1] * (x.ndim - 1))
    axis_name = self.axis_name or (PMAP_AXIS if bound(PMAP_AXIS) else None)
    if axis_name is None or mask is None or use_running_average:
      return super().__call__(x, use_running_average, mask=mask)
    axes = tuple(range(x.ndim - 1))  # statistics per feature (the last axis)
    weight = jnp.broadcast_to(mask, x.shape).astype(jnp.float32)
    x32 = x.astype(jnp.float32)
    count, total, squares = jax.lax.psum(
        (weight.sum(axes), (weight * x32).sum(axes), (weight * x32 * x32).sum(axes)),
        axis_name)
    mean = total / jnp.maximum(count, 1)
    var = jnp.maximum(squares / jnp.maximum(count, 1) - mean * mean, 0.0)
    self.mean[...] = self.momentum * self.mean[...] + (1 - self.momentum) * mean
    self.var[...] = self.momentum * self.var[...] + (1 - self.momentum) * var
    scale = jax.lax.rsqrt(var + self.epsilon) * (self.scale[...] if self.use_scale else 1)
    y = (x32 - mean) * scale + (self.bias[...] if self.use_bias else 0)
    return y.astype(self.dtype or x.dtype)



def fold_in_device_index(model, axis_name):
  """pmap gives every device the same RNG keys: fold in the device index so that dropout differs
  between devices. Returns a function that puts the shared keys back (keeping the state
  replicated; the streams' counters advance identically everywhere)."""
  streams = [s for _, s in nnx.iter_graph(model) if isinstance(s, nnx.RngStream)]
  keys = [stream.key[...] for stream in streams]
  for stream in streams:
    stream.key[...] = jax.random.fold_in(stream.key[...], jax.lax.axis_index(axis_name))

  def restore():
    for stream, key in zip(streams, keys, strict=True):
      stream.key[...] = key

  return restore
