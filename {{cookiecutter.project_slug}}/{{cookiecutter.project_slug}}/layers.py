"""Layers a model.py uses for the project's guarantees to hold: `BatchNorm`, whose statistics are
those of the real examples (the batch's mask: `batch_mask`, or the `example_mask` the steps pass
to a model that takes it). `masked` makes a model's plain nnx.BatchNorm layers this one.
`max_pool` is nnx.max_pool, with the GPU's gradient in the train step (`pooling_by_slices`)."""

import contextlib
import contextvars
import functools
import inspect
import math

import jax
import jax.numpy as jnp
from flax import nnx

PMAP_AXIS = "devices"  # pmap's axis (pmap.py maps the steps over it; BatchNorm reduces over it)


_BATCH_MASK = contextvars.ContextVar("batch_mask", default=None)
_BY_SLICES = contextvars.ContextVar("pooling_by_slices", default=False)


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


@contextlib.contextmanager
def pooling_by_slices(on: bool = True):
  """Within it, `max_pool` takes the maximum of its window's strided slices (the GPU's train
  step sets it: dispatch.STEP_FORMS' `max_pool_by_slices`)."""
  token = _BY_SLICES.set(on)
  try:
    yield
  finally:
    _BY_SLICES.reset(token)


def masked(model):
  """`model`, each plain nnx.BatchNorm in it made a `BatchNorm` (its subclass: the same variables,
  the same checkpoint), whose statistics leave the padding out and follow
  `config.batch_norm_devices` on every path, model.py unchanged (as PyTorch's
  `SyncBatchNorm.convert_sync_batchnorm`). A subclass of your own is left as it is."""
  for _, node in nnx.iter_graph(model):
    if type(node) is nnx.BatchNorm:
      node.__class__ = BatchNorm
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
  one_pass: bool = False  # the GPU's sums (`normalize`; the train step sets both)

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
    shape = (local, x.shape[0] // local, *x.shape[1:])  # [G, N, ..., C]: G groups of N examples
    mask_GN = mask.reshape(local, -1, *[1] * (x.ndim - 1)).astype(jnp.float32)
    ones = jnp.ones(x.shape[-1:], jnp.float32)
    y, (count, total, squares) = normalize(
        x.reshape(shape), mask_GN, self.scale[...] if self.use_scale else ones,
        self.bias[...] if self.use_bias else 0 * ones, self.epsilon, axis_name, groups,
        jnp.dtype(self.dtype or x.dtype), self.one_pass)
    mean, var = statistics(count, total, squares)  # the whole batch's, for the running ones
    self.mean[...] = self.momentum * self.mean[...] + (1 - self.momentum) * mean
    self.var[...] = self.momentum * self.var[...] + (1 - self.momentum) * var
    return y.reshape(x.shape)


def statistics(count, total, squares):
  """The mean and variance of the examples whose `count`, sum and sum of squares these are."""
  mean = total / jnp.maximum(count, 1)
  return mean, jnp.maximum(squares / jnp.maximum(count, 1) - mean * mean, 0.0)


def sums(arrays, one: bool = False):
  """The sums over the examples of each group ([G, N, ..., C] -> [G, C]) of several arrays of one
  shape: XLA's own reductions, or (`one`) in two stages as XLA:GPU splits a large one, sums of
  blocks of rows, then the blocks' sums stacked into one reduction (a kernel for all, where
  separate sums take one each)."""
  if not one:
    return tuple(a.sum(tuple(range(1, a.ndim - 1))) for a in arrays)
  G, C = arrays[0].shape[0], arrays[0].shape[-1]
  rows = math.prod(arrays[0].shape[1:-1])
  blocks = max(d for d in range(1, math.isqrt(rows) + 1) if rows % d == 0)  # ~sqrt(rows)
  partial_GBC = [a.reshape(G, blocks, rows // blocks, C).sum(2) for a in arrays]
  return tuple(jnp.stack(partial_GBC).sum(2))


def combine(sums_G, axis_name, groups):
  """Sums over the examples of each of this device's groups ([G, ...]) -> the whole batch's and
  each group's (under pmap, summed over the devices of its group)."""
  everywhere = jax.tree.map(lambda s: s.sum(0), sums_G)
  if axis_name is None:
    return everywhere, sums_G
  devices = jax.lax.axis_size(axis_name)
  everywhere, per_group = jax.lax.psum(everywhere, axis_name), devices // groups
  return everywhere, (everywhere if groups == 1 else sums_G if per_group == 1 else jax.lax.psum(
      sums_G, axis_name, axis_index_groups=[list(range(first, first + per_group))
                                            for first in range(0, devices, per_group)]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def normalize(x, mask_GN, scale_C, bias_C, epsilon, axis_name, groups, dtype, one_pass=False):
  """`x` ([G, N, ..., C]) normalised by each group's real examples (`mask_GN`: [G, N, 1, ...],
  1 for a real one), scaled and shifted; and the whole batch's count, sum and sum of squares
  (for the running statistics). A padded example comes out as the bias. Its gradient is written
  out (`_backward`): one pass over the activations each way; `one_pass`: the GPU's sums (`sums`),
  else XLA's own."""
  return _forward(x, mask_GN, scale_C, bias_C, epsilon, axis_name, groups, dtype, one_pass)[0]


def _per_example(s_GC, ndim):
  """[G, C] (or [C]) -> [G, 1, ..., C]: a group's figure for each of its examples' entries."""
  return s_GC.reshape(-1, *[1] * (ndim - 2), s_GC.shape[-1])


def _forward(x, mask_GN, scale_C, bias_C, epsilon, axis_name, groups, dtype, one_pass):
  axes = tuple(range(1, x.ndim - 1))  # per group and feature (the last axis)
  x32 = x.astype(jnp.float32)
  count_G = mask_GN.sum(axes) * math.prod(x.shape[2:-1])
  total_GC, squares_GC = sums((mask_GN * x32, mask_GN * x32 * x32), one_pass)
  everywhere, (count, total, squares) = combine((count_G, total_GC, squares_GC), axis_name, groups)
  mean, var = statistics(count, total, squares)
  rstd = jax.lax.rsqrt(var + epsilon)
  per_example = functools.partial(_per_example, ndim=x.ndim)
  centered = jnp.where(mask_GN > 0, x32 - per_example(mean), 0.0)
  y = centered * per_example(rstd * scale_C) + bias_C
  return (y.astype(dtype), everywhere), (x, mask_GN, scale_C, bias_C, mean, rstd, count)


def _backward(epsilon, axis_name, groups, dtype, one_pass, residuals, cotangents):
  # The running sums' cotangents are zero: the loss never reads the running statistics.
  x, mask_GN, scale_C, bias_C, mean, rstd, count = residuals
  dy = cotangents[0].astype(jnp.float32)
  per_example = functools.partial(_per_example, ndim=x.ndim)
  normalized = jnp.where(mask_GN > 0, (x.astype(jnp.float32) - per_example(mean))
                         * per_example(rstd), 0.0)
  dbias_GC, dy_GC, dy_normalized_GC = sums((dy, mask_GN * dy, dy * normalized), one_pass)
  dscale, dbias = dy_normalized_GC.sum(0), dbias_GC.sum(0)  # this device's, as autodiff's
  _, (dy_GC, dy_normalized_GC) = combine((dy_GC, dy_normalized_GC), axis_name, groups)
  n = jnp.maximum(count, 1)
  dx = jnp.where(mask_GN > 0, per_example(scale_C * rstd) * (
      dy - per_example(dy_GC / n) - normalized * per_example(dy_normalized_GC / n)), 0.0)
  return (dx.astype(x.dtype), jnp.zeros_like(mask_GN), dscale.astype(scale_C.dtype),
          dbias.astype(bias_C.dtype))


normalize.defvjp(_forward, _backward)


def max_pool(x_BHWC, window_shape, strides=None, padding="VALID"):
  """nnx.max_pool of images [B, H, W, C]. Under `pooling_by_slices`, as the maximum of the
  window's strided slices, each gradient going to its window's first maximum, as nnx.max_pool's
  does: without XLA's select-and-scatter, whose int32 indices and scatter target are 0.7 GB of a
  ResNet-50 step's memory on a GPU (aot.py configs/imagenet.py, h100:8)."""
  if not (_BY_SLICES.get() and x_BHWC.ndim == 4 and jnp.issubdtype(x_BHWC.dtype, jnp.floating)):
    return nnx.max_pool(x_BHWC, window_shape, strides, padding)
  strides = tuple(strides or (1,) * len(window_shape))  # (nnx.max_pool's default)
  pads = (jax.lax.padtype_to_pads(x_BHWC.shape[1:3], window_shape, strides, padding)
          if isinstance(padding, str) else tuple(padding))
  return _max_of_slices(x_BHWC, tuple(window_shape), strides, tuple(map(tuple, pads)))


def _slices(x_BHWC, window, strides, pads):
  """`x` padded with -inf ([B, H + pads, W + pads, C]) and its window's strided slices, one an
  offset (i, j) in the window, in row-major order: [B, H', W', C] each."""
  padded = jnp.pad(x_BHWC, ((0, 0), *pads, (0, 0)), constant_values=-jnp.inf)
  out = [(n - k) // s + 1 for n, k, s in zip(padded.shape[1:3], window, strides, strict=True)]
  return padded, [padded[:, i:i + strides[0] * (out[0] - 1) + 1:strides[0],
                         j:j + strides[1] * (out[1] - 1) + 1:strides[1]]
                  for i in range(window[0]) for j in range(window[1])]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _max_of_slices(x_BHWC, window, strides, pads):
  return functools.reduce(jnp.maximum, _slices(x_BHWC, window, strides, pads)[1])


def _max_of_slices_forward(x_BHWC, window, strides, pads):
  return _max_of_slices(x_BHWC, window, strides, pads), x_BHWC


def _max_of_slices_backward(window, strides, pads, x_BHWC, dy):
  padded, slices = _slices(x_BHWC, window, strides, pads)
  y = functools.reduce(jnp.maximum, slices)
  taken, dx_padded = jnp.zeros(y.shape, bool), jnp.zeros(padded.shape, dy.dtype)
  for n, entries in enumerate(slices):  # each slice's gradient put back where it was read
    first = (entries == y) & ~taken
    taken = taken | first
    offsets = divmod(n, window[1])
    spread = [(o, size - o - (s * (m - 1) + 1), s - 1)
              for o, size, s, m in zip(offsets, padded.shape[1:3], strides, y.shape[1:3],
                                       strict=True)]
    dx_padded = dx_padded + jax.lax.pad(jnp.where(first, dy, 0), jnp.zeros((), dy.dtype),
                                        ((0, 0, 0), *spread, (0, 0, 0)))
  (top, _), (left, _) = pads
  return (dx_padded[:, top:top + x_BHWC.shape[1], left:left + x_BHWC.shape[2]],)


_max_of_slices.defvjp(_max_of_slices_forward, _max_of_slices_backward)
