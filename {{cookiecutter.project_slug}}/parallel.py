"""Where arrays live: the device mesh and shardings (spmd), and pmap's replicated layout.

spmd: one global array per leaf. Batches (stacked `[k, batch, ...]`, see steps.py) are split
  over the mesh axis 'data'; the model and optimizer state are replicated (PartitionSpec()).
fsdp: the same over a mesh ('data', 'fsdp') of (devices // fsdp_devices, fsdp_devices). Batches
  are split over both axes; each large leaf of the state is split over 'fsdp' along its largest
  dimension that 'fsdp' divides (ZeRO-3), and copied over 'data'. XLA inserts the collectives:
  on XLA:CPU, all-gathers of the parameters and an all-reduce of the whole gradients, each
  device keeping its slice (no reduce-scatter); on GPU and TPU XLA turns that all-reduce and
  slice into a reduce-scatter (unverified here: tests/test_accelerator.py checks it).
pmap: every leaf has a leading axis of one entry per local device; `replicate` makes it,
  `unreplicate` takes it away, `shard_batch` splits a batch into per-device pieces.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"  # the spmd mesh axis
FSDP_AXIS = "fsdp"  # fsdp: the mesh axis that the state is split over
PMAP_AXIS = "devices"  # the pmap axis name (use it for BatchNorm(axis_name=...))


def num_slices(devices=None) -> int:
  """How many TPU slices `devices` (default: all) span; 1 on other platforms."""
  return len({getattr(d, "slice_index", 0) for d in devices or jax.devices()})


def device_grid(shape: tuple[int, ...], devices) -> np.ndarray:
  """`devices` as an array of `shape`, in jax.make_mesh's order within each slice. Devices on
  several TPU slices (multi-slice: only the data-center network joins them) are laid out with
  the first axis ('data') split across the slices, the others within each
  (`mesh_utils.create_hybrid_device_mesh`): only the gradient all-reduce crosses slices."""
  slices = num_slices(devices)
  if slices == 1:
    return jax.make_mesh(shape, [f"axis{i}" for i in range(len(shape))], devices=devices).devices
  per_slice = (shape[0] // slices, *shape[1:])
  return mesh_utils.create_hybrid_device_mesh(per_slice, (slices, *[1] * (len(shape) - 1)),
                                              devices)


def make_mesh(config=None, devices=None) -> Mesh:
  """A 1-D mesh ('data') over every device of every process; for `config.parallelism='fsdp'`,
  ('data', 'fsdp') of (devices // f, f), f = `config.fsdp_devices` (0: all of them; on several
  TPU slices, those of one slice). Auto axes: XLA inserts the collectives. `devices`: default
  `jax.devices()` (aot.py: a topology's)."""
  devices = devices or jax.devices()
  if config is None or config.parallelism != "fsdp":
    shape, names = (len(devices),), (DATA_AXIS,)
  else:
    f = config.fsdp_devices or len(devices) // num_slices(devices)
    shape, names = (len(devices) // f, f), (DATA_AXIS, FSDP_AXIS)
  return Mesh(device_grid(shape, devices), names, axis_types=(AxisType.Auto,) * len(shape))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def data_sharded(mesh: Mesh) -> NamedSharding:
  """Stacked batches `[k, batch, ...]`: each batch split over every mesh axis."""
  return NamedSharding(mesh, P(None, mesh.axis_names))


def state_shardings(state, mesh: Mesh, min_size: int = 0):
  """Where each leaf of the model and optimizer state lives: replicated, or, on a mesh with an
  'fsdp' axis, split along its largest dimension that the axis divides (leaves of at least
  `min_size` elements: `config.fsdp_min_size`). Shapes are all it reads: it works on traced
  and abstract values."""
  size = dict(mesh.shape).get(FSDP_AXIS, 1)

  def where(x):
    if size > 1 and x.size >= min_size:
      for dim in sorted(range(x.ndim), key=lambda d: -x.shape[d]):
        if x.shape[dim] % size == 0:
          return NamedSharding(mesh, P(*[None] * dim, FSDP_AXIS))
    return replicated(mesh)

  return jax.tree.map(where, state)


def place_state(state, mesh: Mesh, min_size: int = 0):
  """A state that every process holds in full (the same values everywhere) -> global arrays
  placed as `state_shardings` says: each device receives only its own slice."""

  def place(x, sharding):
    if sharding.spec == P():
      return jax.make_array_from_process_local_data(sharding, x)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

  return jax.tree.map(place, state, state_shardings(state, mesh, min_size))


def bytes_per_device(tree) -> int:
  """The most bytes that the arrays of `tree` hold on one of this process's devices."""
  held = collections.Counter()
  for x in jax.tree.leaves(tree):
    for shard in x.addressable_shards:
      held[shard.device] += shard.data.nbytes
  return max(held.values())


def to_global(tree, mesh: Mesh):
  """Arrays every process holds in full (the same values everywhere) -> global arrays
  replicated over the mesh."""
  sharding = replicated(mesh)
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), tree)


def global_batch(local_batch, mesh: Mesh):
  """This process's part of stacked batches `[k, local_batch, ...]` -> global arrays
  `[k, batch, ...]`, each batch split over 'data'; every leaf placed in one call."""
  sharding = data_sharded(mesh)
  if jax.process_count() == 1:
    return jax.device_put(local_batch, sharding)
  return jax.make_array_from_process_local_data(sharding, local_batch)


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


def describe(tree, name: str) -> str:
  """One line per leaf: shape, dtype and sharding, to see where the state and batch live."""
  lines = [f"{name}:"]
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    where = x.sharding
    if isinstance(where, NamedSharding):
      where = f"{where.spec} over mesh {dict(where.mesh.shape)}"
    lines.append(f"  {jax.tree_util.keystr(path)} {x.dtype}{list(x.shape)}: {where}")
  return "\n".join(lines)


class BatchNorm(nnx.BatchNorm):
  """nnx.BatchNorm whose batch statistics are those of the real examples of the global batch on
  every path: give `mask` (`[batch]`, False on padding: the `example_mask` that the steps pass
  to the model) and, under pmap, `axis_name=PMAP_AXIS`. Features on the last axis.

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
    if self.axis_name is None or mask is None or use_running_average:
      return super().__call__(x, use_running_average, mask=mask)
    axes = tuple(range(x.ndim - 1))  # statistics per feature (the last axis)
    weight = jnp.broadcast_to(mask, x.shape).astype(jnp.float32)
    x32 = x.astype(jnp.float32)
    count, total, squares = jax.lax.psum(
        (weight.sum(axes), (weight * x32).sum(axes), (weight * x32 * x32).sum(axes)),
        self.axis_name)
    mean = total / jnp.maximum(count, 1)
    var = jnp.maximum(squares / jnp.maximum(count, 1) - mean * mean, 0.0)
    self.mean[...] = self.momentum * self.mean[...] + (1 - self.momentum) * mean
    self.var[...] = self.momentum * self.var[...] + (1 - self.momentum) * var
    scale = jax.lax.rsqrt(var + self.epsilon) * (self.scale[...] if self.use_scale else 1)
    y = (x32 - mean) * scale + (self.bias[...] if self.use_bias else 0)
    return y.astype(self.dtype or x.dtype)
