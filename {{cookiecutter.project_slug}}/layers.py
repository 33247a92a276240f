"""Layers that a model.py uses for the project's paths to hold: `BatchNorm`, whose batch
statistics are those of the real examples of the global batch on every path (spmd, fsdp and
pmap). Give it the `[batch]` example mask that the steps pass to a model whose `__call__` takes
`example_mask` (model.py's docstring).
"""

import jax
import jax.numpy as jnp
from flax import nnx

PMAP_AXIS = "devices"  # pmap's axis (pmap.py maps the steps over it; BatchNorm reduces over it)


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
