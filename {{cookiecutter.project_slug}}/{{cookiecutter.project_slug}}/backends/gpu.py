"""The GPU's forms of the train step: the same math as the stock layers and steps.py, written as
XLA:GPU compiles it leanest (BENCHMARKS.md, "The train step's forms", from aot.py's h100:8
programs). dispatch.py wraps a GPU's steps in `step`; nothing else names these forms:

- `max_pool` for nnx.max_pool: its gradient without XLA's select-and-scatter;
- `dot_product_attention` for jax.nn's: cuDNN's fused attention where it takes the inputs;
- `sums` for layers.sums: BatchNorm's sums in two stages, the second as one reduction;
- `sum_of_squares` and `state_sums_of_squares` for steps.py's: the norms over the leaves laid
  end to end.

Each is put in the stock one's place while the step is traced (`forms`, `dispatch.substituted`),
so a model.py of stock layers (nnx.max_pool, nnx.BatchNorm) gets the same GPU program as the
shipped one. A new backend's forms are a module like this one (cpu.py is another), and one line
in `dispatch.backend_forms`."""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from .. import layers
from ..training import steps

STOCK_MAX_POOL = nnx.max_pool  # (nnx.max_pool itself while substituted)
STOCK_ATTENTION = jax.nn.dot_product_attention


def forms(flat_norms: bool = True) -> list:
  """(module, name, form) for each stock function whose place this module's form takes while a
  GPU's step is traced (`dispatch.substituted`); the norms' (`flat_norms`) not where the state's
  leaves are split over the devices (fsdp: never gathered)."""
  swaps = [(nnx, "max_pool", max_pool), (layers, "sums", sums), (steps, "update_if", update_if),
           (jax.nn, "dot_product_attention", dot_product_attention)]
  if flat_norms:
    swaps += [(steps, "sum_of_squares", sum_of_squares),
              (steps, "state_sums_of_squares", state_sums_of_squares)]
  return swaps


def dot_product_attention(query, key, value, bias=None, mask=None, *, implementation=None,
                          **options):
  """jax.nn.dot_product_attention as cuDNN's fused (flash) attention where cuDNN takes the
  inputs: float16 or bfloat16, heads of at most 128 and a multiple of 8, no bias or mask, even
  sequence lengths (JAX 0.12's check for training refuses odd ones: a ViT-B/16 with its class
  token, 197, stays on XLA's); the stock choice otherwise (`implementation=None`: XLA's). It
  reaches code that looks jax.nn's up as it runs (vit.py's `attention`), not a module that holds
  a function from before the step (nnx.MultiHeadAttention's default `attention_fn`, flax's own,
  or `attention_fn=jax.nn.dot_product_attention`): wrap it as vit.py does.

  Args:
    query: [B, T, N, H], as jax.nn.dot_product_attention's.
    key: the same.
    value: the same.
    bias: jax.nn's; None for the fused kernels.
    mask: jax.nn's; None for the fused kernels.
    implementation: jax.nn's; None: cuDNN's where it takes the inputs, else XLA's.
    **options: jax.nn's others.
  """
  fused = (implementation is None and bias is None and mask is None
           and query.dtype in (jnp.bfloat16, jnp.float16)
           and query.shape[-1] <= 128 and query.shape[-1] % 8 == 0
           and query.shape[-3] % 2 == 0 and key.shape[-3] % 2 == 0)
  return STOCK_ATTENTION(query, key, value, bias, mask,
                         implementation="cudnn" if fused else implementation, **options)


def update_if(applied, update, current, old):
  """steps.update_if, the norms those `update` read from the state it made (before the select:
  with the flat norms behind their barrier, the state is read once).

  Args:
    applied: whether the step is applied (a boolean scalar).
    update: current -> (updated state, norms).
    current: the state as the forward pass left it.
    old: the state before the step.
  """
  updated, norms = update(current)
  return jax.tree.map(lambda new, old: jnp.where(applied, new, old), updated, old), norms


def sums(arrays):
  """layers.sums in two stages, as XLA:GPU splits a large reduction: sums of blocks of rows, then
  the blocks' sums stacked into one reduction (a kernel for all, where separate sums take one
  each)."""
  G, C = arrays[0].shape[0], arrays[0].shape[-1]
  rows = math.prod(arrays[0].shape[1:-1])
  blocks = max(d for d in range(1, math.isqrt(rows) + 1) if rows % d == 0)  # ~sqrt(rows)
  partial_GBC = [a.reshape(G, blocks, rows // blocks, C).sum(2) for a in arrays]
  return tuple(jnp.stack(partial_GBC).sum(2))


def _flat_sum_of_squares(tree, carried: bool) -> jax.Array:
  leaves = jax.tree.leaves(tree)
  if len(leaves) == 1:
    return jnp.sum(jnp.square(leaves[0].astype(jnp.float32)))
  leaves = jax.lax.optimization_barrier(leaves) if carried else leaves
  laid_out = [jnp.moveaxis(x, -1, 0) if x.ndim == 4 else x for x in leaves]
  return jnp.sum(jnp.square(jnp.concatenate([x.astype(jnp.float32).ravel() for x in laid_out])))


def sum_of_squares(tree) -> jax.Array:
  """steps.sum_of_squares (the gradient's) over its leaves laid end to end: one reduction, into
  which the GPU fuses the concatenation (ResNet-50 on h100:8: 2,068 -> 1,612 kernels a step)."""
  return _flat_sum_of_squares(tree, carried=False)


def state_sums_of_squares(updates, params) -> tuple:
  """steps.state_sums_of_squares, each over its leaves laid end to end, read as the update wrote
  them (behind a barrier: fused into the update, the concatenation made it write each kernel and
  momentum twice and XLA copy the carried ones, 106 copies a step; the gradient's behind one took
  55 kernels more), a convolution's kernel ([H, W, in, out]) out-channel major, as the GPU keeps
  it (read row-major, each took a transposing kernel: 159 a ResNet-50 step)."""
  return _flat_sum_of_squares(updates, True), _flat_sum_of_squares(params, True)


def max_pool(inputs, window_shape, strides=None, padding="VALID"):
  """nnx.max_pool, of images [B, H, W, C] as the maximum of the window's strided slices, each
  gradient going to its window's first maximum, as nnx.max_pool's does: without XLA's
  select-and-scatter, whose int32 indices and scatter target are 0.7 GB of a ResNet-50 step's
  memory on a GPU (aot.py configs/imagenet.py, h100:8). Other inputs: nnx.max_pool's own.

  Args:
    inputs: the images, [B, H, W, C].
    window_shape: nnx.max_pool's.
    strides: nnx.max_pool's.
    padding: nnx.max_pool's.
  """
  x_BHWC = inputs
  if not (x_BHWC.ndim == 4 and jnp.issubdtype(x_BHWC.dtype, jnp.floating)):
    return STOCK_MAX_POOL(x_BHWC, window_shape, strides, padding)
  strides = tuple(strides or (1,) * len(window_shape))  # (nnx.max_pool's default)
  pads = (jax.lax.padtype_to_pads(x_BHWC.shape[1:3], window_shape, strides, padding)
          if isinstance(padding, str) else tuple(padding))
  return _max_of_slices(x_BHWC, tuple(window_shape), strides, tuple(map(tuple, pads)))


def _slices(x_BHWC, window, strides, pads):
  """`x` padded with -inf ([B, H + pads, W + pads, C]) and its window's strided slices, one an
  offset (i, j) in the window, in row-major order: [B, H', W', C] each.

  Args:
    x_BHWC: the images.
    window: the window's (height, width).
    strides: its strides.
    pads: the padding, ((top, bottom), (left, right)).
  """
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
