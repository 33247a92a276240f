"""The BatchNorm behind a model.py's nnx.BatchNorm (`masked` swaps its class): its statistics are
those of the real examples (the batch's mask: `BATCH_MASK`, or the `example_mask` the steps pass
to a model that takes it), of the global batch or of groups of devices, alike on every path."""

import contextvars
import functools
import inspect
import math

import jax
import jax.numpy as jnp
from flax import nnx

# The batch's mask ([batch], False on padding) for every `BatchNorm` called without one on a batch
# of that size: the steps' forward pass sets it, so that a model need not pass the mask on.
BATCH_MASK = contextvars.ContextVar("batch_mask", default=None)


def masked(model, groups: int = 1):
  """`model`, each plain nnx.BatchNorm in it made a `BatchNorm` (its subclass: the same variables,
  the same checkpoint) of `groups` groups of devices, whose statistics leave the padding out on
  every path, model.py unchanged (as PyTorch's `SyncBatchNorm.convert_sync_batchnorm`). A
  subclass of your own is left as it is."""
  for _, node in nnx.iter_graph(model):
    if type(node) is nnx.BatchNorm:
      node.__class__ = BatchNorm
    if isinstance(node, BatchNorm):
      node.groups = groups
  return model


@functools.cache  # (a class's signature: read once, not at every trace)
def takes_mask(model_class) -> bool:
  """Whether the model class's `__call__` takes `example_mask=` (or `**kwargs`)."""
  parameters = inspect.signature(model_class.__call__).parameters.values()
  return any(p.name == "example_mask" or p.kind is p.VAR_KEYWORD for p in parameters)


def unmasked(model) -> list[str]:
  """Each BatchNorm of `model` that the mask cannot reach (an nnx.BatchNorm that is not a
  `BatchNorm`: a class of your own), as "Class at a/b"."""
  return [f"{type(node).__name__} at {'/'.join(map(str, path))}"
          for path, node in nnx.iter_graph(model)
          if isinstance(node, nnx.BatchNorm) and not isinstance(node, BatchNorm)]


class BatchNorm(nnx.BatchNorm):
  """nnx.BatchNorm whose batch statistics are those of the real examples (`mask`: [batch], False on
  padding) of the global batch, or of each of `groups` equal groups of devices (the train step
  sets it from `config.batch_norm_devices`), alike on spmd, fsdp and pmap (pmap: over its
  `axis_name`, which the pmap step sets).

  Sums and counts are taken per group (jit: the batch cut into `groups` contiguous slices, a
  device's each; pmap: psum over the group); the running statistics are the global batch's, so
  the state is one value on every device. A padded example comes out as the bias: a group of
  padding alone stays finite."""

  groups: int = 1  # into how many groups of devices the global batch is split for the statistics

  def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
    """`x` ([batch, ..., C]) normalised.

    Args:
      x: the activations.
      use_running_average: nnx.BatchNorm's; None: the module's (eval mode's: True).
      mask: [batch], False on padding; None: `BATCH_MASK`'s, where the step set one.
    """
    if use_running_average is None:
      use_running_average = self.use_running_average
    given = None if use_running_average or mask is not None else BATCH_MASK.get()
    if given is not None and given.shape[0] == x.shape[0]:
      mask = given  # (`BATCH_MASK`'s)
    if mask is not None:  # [batch] -> [batch, 1, ...]: one flag per example
      mask = mask.reshape(-1, *[1] * (x.ndim - 1))
    axis_name = self.axis_name
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
    shape = (local, x.shape[0] // local, *x.shape[1:])  # [G, N, ..., C]: G groups of N examples
    mask_GN = mask.reshape(local, -1, *[1] * (x.ndim - 1)).astype(jnp.float32)
    ones = jnp.ones(x.shape[-1:], jnp.float32)
    y, (count, total, squares) = normalize(
        x.reshape(shape), mask_GN, self.scale[...] if self.use_scale else ones,
        self.bias[...] if self.use_bias else 0 * ones, self.epsilon, axis_name, groups,
        jnp.dtype(self.dtype or x.dtype))
    mean, var = statistics(count, total, squares)  # the whole batch's, for the running ones
    self.mean[...] = self.momentum * self.mean[...] + (1 - self.momentum) * mean
    self.var[...] = self.momentum * self.var[...] + (1 - self.momentum) * var
    return y.reshape(x.shape)


def statistics(count, total, squares):
  """The mean and variance of examples.

  Args:
    count: how many.
    total: their sum.
    squares: their sum of squares.
  """
  mean = total / jnp.maximum(count, 1)
  return mean, jnp.maximum(squares / jnp.maximum(count, 1) - mean * mean, 0.0)


def sums(arrays):
  """The sums over the examples of each group ([G, N, ..., C] -> [G, C]) of several arrays of one
  shape (a GPU's train step takes them in its own form: gpu.sums)."""
  return tuple(a.sum(tuple(range(1, a.ndim - 1))) for a in arrays)


def combine(sums_G, axis_name, groups):
  """The whole batch's sums and each group's, from those of this device's groups.

  Args:
    sums_G: sums over the examples of each of this device's groups, [G, ...].
    axis_name: pmap's axis (the sums are summed over the devices of each group); None: jit's.
    groups: the groups of devices of the global batch.
  """
  everywhere = jax.tree.map(lambda s: s.sum(0), sums_G)
  if axis_name is None:
    return everywhere, sums_G
  devices = jax.lax.axis_size(axis_name)
  everywhere, per_group = jax.lax.psum(everywhere, axis_name), devices // groups
  return everywhere, (everywhere if groups == 1 else sums_G if per_group == 1 else jax.lax.psum(
      sums_G, axis_name, axis_index_groups=[list(range(first, first + per_group))
                                            for first in range(0, devices, per_group)]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def normalize(x, mask_GN, scale_C, bias_C, epsilon, axis_name, groups, dtype):
  """`x` normalised by each group's real examples, scaled and shifted. A padded example comes out
  as the bias. Its gradient is written out (`_backward`): one pass over the activations each way.

  Args:
    x: the activations, [G, N, ..., C].
    mask_GN: 1 for a real example, [G, N, 1, ...].
    scale_C: the scale.
    bias_C: the bias.
    epsilon: added to the variance.
    axis_name: as `combine`'s.
    groups: as `combine`'s.
    dtype: the output's dtype.
  Returns:
    The output, and the whole batch's count, sum and sum of squares (the running statistics').
  """
  return _forward(x, mask_GN, scale_C, bias_C, epsilon, axis_name, groups, dtype)[0]


def _per_example(s_GC, ndim):
  """[G, C] (or [C]) -> [G, 1, ..., C]: a group's figure for each of its examples' entries."""
  return s_GC.reshape(-1, *[1] * (ndim - 2), s_GC.shape[-1])


def _forward(x, mask_GN, scale_C, bias_C, epsilon, axis_name, groups, dtype):
  axes = tuple(range(1, x.ndim - 1))  # per group and feature (the last axis)
  x32 = x.astype(jnp.float32)
  count_G = mask_GN.sum(axes) * math.prod(x.shape[2:-1])
  total_GC, squares_GC = sums((mask_GN * x32, mask_GN * x32 * x32))
  everywhere, (count, total, squares) = combine((count_G, total_GC, squares_GC), axis_name, groups)
  mean, var = statistics(count, total, squares)
  rstd = jax.lax.rsqrt(var + epsilon)
  per_example = functools.partial(_per_example, ndim=x.ndim)
  centered = jnp.where(mask_GN > 0, x32 - per_example(mean), 0.0)
  y = centered * per_example(rstd * scale_C) + bias_C
  return (y.astype(dtype), everywhere), (x, mask_GN, scale_C, bias_C, mean, rstd, count)


def _backward(epsilon, axis_name, groups, dtype, residuals, cotangents):
  # The running sums' cotangents are zero: the loss never reads the running statistics.
  x, mask_GN, scale_C, bias_C, mean, rstd, count = residuals
  dy = cotangents[0].astype(jnp.float32)
  per_example = functools.partial(_per_example, ndim=x.ndim)
  normalized = jnp.where(mask_GN > 0, (x.astype(jnp.float32) - per_example(mean))
                         * per_example(rstd), 0.0)
  dbias_GC, dy_GC, dy_normalized_GC = sums((dy, mask_GN * dy, dy * normalized))
  dscale, dbias = dy_normalized_GC.sum(0), dbias_GC.sum(0)  # this device's, as autodiff's
  _, (dy_GC, dy_normalized_GC) = combine((dy_GC, dy_normalized_GC), axis_name, groups)
  n = jnp.maximum(count, 1)
  dx = jnp.where(mask_GN > 0, per_example(scale_C * rstd) * (
      dy - per_example(dy_GC / n) - normalized * per_example(dy_normalized_GC / n)), 0.0)
  return (dx.astype(x.dtype), jnp.zeros_like(mask_GN), dscale.astype(scale_C.dtype),
          dbias.astype(bias_C.dtype))


normalize.defvjp(_forward, _backward)
