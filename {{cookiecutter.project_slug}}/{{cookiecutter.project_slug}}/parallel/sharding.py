"""Where arrays live under jit: the device mesh and the shardings of state and batches.

spmd: batches (`[k, batch, ...]`) split over the mesh axis 'data', the state replicated.
fsdp: a mesh ('data', 'fsdp'); batches split over both axes, each large leaf of the state split
over 'fsdp' along its largest dimension that 'fsdp' divides (ZeRO-3), copied over 'data'. XLA
inserts the collectives (on GPUs and TPUs the gradient's all-reduce becomes a reduce-scatter)."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..data import batches

DATA_AXIS = "data"  # the spmd mesh axis
FSDP_AXIS = "fsdp"  # fsdp: the mesh axis that the state is split over


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
  'fsdp' axis, split along its largest dimension that the axis divides. Shapes are all it
  reads: it works on traced and abstract values.

  Args:
    state: the state (or its shapes).
    mesh: the devices' mesh.
    min_size: the fewest elements of a leaf that is split (`config.fsdp_min_size`).
  Returns:
    A NamedSharding for each leaf.
  """
  size = dict(mesh.shape).get(FSDP_AXIS, 1)

  def where(x):
    if size > 1 and x.size >= min_size:
      for dim in sorted(range(x.ndim), key=lambda d: -x.shape[d]):
        if x.shape[dim] % size == 0:
          return NamedSharding(mesh, P(*[None] * dim, FSDP_AXIS))
    return replicated(mesh)

  return jax.tree.map(where, state)


def place_state(state, mesh: Mesh, min_size: int = 0):
  """Global arrays of a state that every process holds in full (the same values everywhere),
  placed as `state_shardings` says: each device receives only its own slice.

  Args:
    state: the state, in host or device memory.
    mesh: the devices' mesh.
    min_size: as `state_shardings`'.
  """

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
  `[k, batch, ...]`, each batch split over the mesh. `local_batch`: one dict, or its local
  devices' shares in order (a list: `input_pipeline`'s units, from the workers' shared memory),
  each sent to its own device as it is, in one call, without joining them on the host. Photos'
  crops packed a device each (`batches.pack`): each device's bytes sent alone (`batches.sent`)."""
  sharding = data_sharded(mesh)
  shares, pieces, nbytes = batches.sent_apart(local_batch)
  if len(shares) == 1:
    placed = (jax.device_put(shares[0], sharding) if jax.process_count() == 1 else
              jax.make_array_from_process_local_data(sharding, shares[0]))
  else:
    first = shares[0]["mask"]
    shape = (first.shape[0], first.shape[1] * mesh.devices.size)
    devices, share_of = _shares(sharding, shape)
    on_devices = jax.device_put([shares[share_of[d]] for d in devices], devices)
    placed = {key: jax.make_array_from_single_device_arrays(
        shape + shares[0][key].shape[2:], sharding, [share[key] for share in on_devices])
              for key in shares[0]}
  if pieces:  # (each local device's bytes: [1, 1, n], strides of its own: taken in place)
    shape = (1, len(pieces) * jax.process_count())
    devices, share_of = _shares(sharding, shape)
    on_devices = jax.device_put([pieces[share_of[d]].reshape(1, 1, -1) for d in devices],
                                devices)
    placed["image"] = jax.make_array_from_single_device_arrays(
        (*shape, nbytes), sharding, padded(on_devices, devices, nbytes, axis=1))
  return placed


@functools.lru_cache(maxsize=8)
def _shares(sharding: NamedSharding, shape: tuple[int, int]):
  """This process's devices, and the share of its local batch that each holds: their slices of
  the batch axis in order (as `jax.make_array_from_process_local_data` maps them)."""
  indices = sharding.addressable_devices_indices_map(shape)
  starts = sorted({index[1].start or 0 for index in indices.values()})
  return list(indices), {d: starts.index(index[1].start or 0) for d, index in indices.items()}


def padded(pieces: list, devices: list, nbytes: int, axis: int) -> list:
  """Each device's bytes of `batches.sent` padded back, there, to the shape the steps were
  compiled for: one program over this process's devices (compiled once a length: `batches.SIZES`
  at most).

  Args:
    pieces: the bytes, one array a device.
    devices: the devices they are on.
    nbytes: the length they are padded to.
    axis: the axis of the bytes.
  Returns:
    The padded arrays, one a device.
  """
  mesh = Mesh(np.array(devices), ("pieces",))
  where = NamedSharding(mesh, P(*[None] * axis, "pieces"))
  shape = list(pieces[0].shape)
  shape[axis] *= len(pieces)
  stacked = jax.make_array_from_single_device_arrays(tuple(shape), where, pieces)
  by_device = {shard.device: shard.data for shard in _pad_to(nbytes, where)(stacked)
               .addressable_shards}
  return [by_device[device] for device in devices]


@functools.lru_cache(maxsize=8)
def _pad_to(nbytes: int, where):
  return jax.jit(lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nbytes - x.shape[-1])]),
                 out_shardings=where)


def process_rows(mesh: Mesh, batch_size: int) -> tuple[int, ...] | None:
  """The rows of a global batch that this process's devices hold, in the order of its local batch
  (as `jax.make_array_from_process_local_data` fills them); None with one process."""
  if jax.process_count() == 1:
    return None
  indices = data_sharded(mesh).addressable_devices_indices_map((1, batch_size))
  return tuple(sorted({row for index in indices.values()
                       for row in range(*index[1].indices(batch_size))}))


def describe_run(state, batches) -> str:
  """Where the state and a placed batch live (`config.print_shardings`)."""
  return describe(state, "state") + "\n" + describe(batches, "batches (the first eval call's)")


def describe(tree, name: str) -> str:
  """One line per leaf: shape, dtype and sharding, to see where the state and batch live."""
  lines = [f"{name}:"]
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    where = x.sharding
    if isinstance(where, NamedSharding):
      where = f"{where.spec} over mesh {dict(where.mesh.shape)}"
    lines.append(f"  {jax.tree_util.keystr(path)} {x.dtype}{list(x.shape)}: {where}")
  return "\n".join(lines)


