"""Layers a model.py uses for the project's guarantees to hold: `BatchNorm`, whose statistics are
those of the real examples (the batch's mask: `batch_mask`, or the `example_mask` the steps pass
to a model that takes it). `masked` makes a model's plain nnx.BatchNorm layers this one."""

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from flax import nnx

PMAP_AXIS = "devices"  # pmap's axis (pmap.py maps the steps over it; BatchNorm reduces over it)


_BATCH_MASK = contextvars.ContextVar("batch_mask", default=None)


@contextlib.contextmanager
def batch_mask(mask_B):
  """Within it, `mask_B` ([batch], False on padding) is the mask of every `BatchNorm` called
  without one on a batch of that size: the steps' forward pass sets it, so that a model need not
  pass the mask on."""
  token = _BATCH_MASK.set(mask_B)
  try:
    yield
  finally:
    _BATCH_MASK.reset(token)


def masked(model):
  """`model`, each plain nnx.BatchNorm in it made a `BatchNorm` (its subclass: the same variables,
  the same checkpoint), whose statistics leave the padding out and follow
  `config.batch_norm_devices` on every path, model.py unchanged (as PyTorch's
  `SyncBatchNorm.convert_sync_batchnorm`). A subclass of your own is left as it is."""
  for _, node in nnx.iter_graph(model):
    if type(node) is nnx.BatchNorm:
      node.__class__ = BatchNorm
  return model


def unmasked(model) -> list[str]:
  """Each BatchNorm of `model` that the mask cannot reach (an nnx.BatchNorm that is not a
  `BatchNorm`: a class of your own), as "Class at a/b"."""
  return [f"{type(node).__name__} at {'/'.join(map(str, path))}"
          for path, node in nnx.iter_graph(model)
          if isinstance(node, nnx.BatchNorm) and not isinstance(node, BatchNorm)]


def bound(axis_name: str) -> bool:
  """Whether the code being traced runs under a pmap (or shard_map) axis of that name."""
  try:
    jax.lax.axis_index(axis_name)
  except NameError:  # "unbound axis name"
    return False
  return True


class BatchNorm(nnx.BatchNorm):
  """nnx.BatchNorm whose batch statistics are those of the real examples (`mask`: [batch], False on
  padding) of the global batch, or of each of `groups` equal groups of devices (the train step
  sets it from `config.batch_norm_devices`), alike on spmd, fsdp and pmap (pmap: over
  `PMAP_AXIS`).

  Sums and counts are taken per group (jit: the batch cut into `groups` contiguous slices, a
  device's each; pmap: psum over the group); the running statistics are the global batch's, so
  the state is one value on every device. A padded example comes out as the bias: a group of
  padding alone stays finite."""

  groups: int = 1  # into how many groups of devices the global batch is split for the statistics

  def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
    if use_running_average is None:
      use_running_average = self.use_running_average
    given = None if use_running_average or mask is not None else _BATCH_MASK.get()
    if given is not None and given.shape[0] == x.shape[0]:
      mask = given  # (`batch_mask`'s)
    if mask is not None:  # [batch] -> [batch, 1, ...]: one flag per example
      mask = mask.reshape(-1, *[1] * (x.ndim - 1))
    axis_name = self.axis_name or (PMAP_AXIS if bound(PMAP_AXIS) else None)
    groups = self.groups
    if use_running_average or (mask is None and axis_name is None and groups == 1):
      return super().__call__(x, use_running_average, mask=mask)
    if mask is None:
      mask = jnp.ones((x.shape[0],) + (1,) * (x.ndim - 1), bool)
    devices = jax.lax.axis_size(axis_name) if axis_name else 1
    split = f"pmap's {devices} devices" if axis_name else f"a batch of {x.shape[0]}"
    if (devices if axis_name else x.shape[0]) % groups:
      raise ValueError(f"BatchNorm cannot split {split} into {groups} equal groups: set its "
                       "groups to a divisor of the devices.")
    local = groups if axis_name is None else 1  # groups in the array this device sees
    shape = (local, x.shape[0] // local, *x.shape[1:])
    x32 = x.astype(jnp.float32).reshape(shape)
    weight = jnp.broadcast_to(mask, x.shape).astype(jnp.float32).reshape(shape)
    axes = tuple(range(1, x.ndim))  # per group and feature (the last axis)
    sums = (weight.sum(axes), (weight * x32).sum(axes), (weight * x32 * x32).sum(axes))
    everywhere = jax.tree.map(lambda s: s.sum(0), sums)  # for the running statistics
    if axis_name is not None:
      everywhere = jax.lax.psum(everywhere, axis_name)
      per_group = devices // groups
      sums = (everywhere if groups == 1 else sums if per_group == 1 else jax.lax.psum(
          sums, axis_name, axis_index_groups=[list(range(first, first + per_group))
                                              for first in range(0, devices, per_group)]))

    def statistics(count, total, squares):
      mean = total / jnp.maximum(count, 1)
      return mean, jnp.maximum(squares / jnp.maximum(count, 1) - mean * mean, 0.0)

    mean, var = statistics(*everywhere)
    self.mean[...] = self.momentum * self.mean[...] + (1 - self.momentum) * mean
    self.var[...] = self.momentum * self.var[...] + (1 - self.momentum) * var
    mean, var = (s.reshape(-1, *[1] * (x.ndim - 1), s.shape[-1]) for s in statistics(*sums))
    scale = jax.lax.rsqrt(var + self.epsilon) * (self.scale[...] if self.use_scale else 1)
    centered = jnp.where(weight > 0, x32 - mean, 0.0)  # a padded example: the bias
    y = centered * scale + (self.bias[...] if self.use_bias else 0)
    return y.reshape(x.shape).astype(self.dtype or x.dtype)
