"""layers.BatchNorm's written-out gradient (`layers.normalize`: one pass over the activations each
way) equals what autodiff makes of the plain formula: outputs, gradients of the input, scale and
bias, and running statistics, with padding, in groups of devices, under jit and pmap, in the
stock forms and the GPU's (gpu.py). The GPU's max pool is nnx.max_pool, its gradient too."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from {{cookiecutter.project_slug}} import layers
from {{cookiecutter.project_slug}}.backends import gpu
from {{cookiecutter.project_slug}}.parallel.pmap import PMAP_AXIS
from {{cookiecutter.project_slug}}.training.dispatch import substituted


class Plain(layers.BatchNorm):
  """The statistics as sums autodiff differentiates (layers.BatchNorm before `normalize`)."""

  def __call__(self, x, use_running_average=None, *, mask=None):
    axis_name = self.axis_name
    local = self.groups if axis_name is None else 1
    shape = (local, x.shape[0] // local, *x.shape[1:])
    x32 = x.astype(jnp.float32).reshape(shape)
    weight = jnp.broadcast_to(mask.reshape(-1, *[1] * (x.ndim - 1)), x.shape).astype(
        jnp.float32).reshape(shape)
    axes = tuple(range(1, x.ndim))
    sums_G = (weight.sum(axes), (weight * x32).sum(axes), (weight * x32 * x32).sum(axes))
    everywhere, sums = layers.combine(sums_G, axis_name, self.groups)
    mean, var = layers.statistics(*everywhere)
    self.mean[...] = self.momentum * self.mean[...] + (1 - self.momentum) * mean
    self.var[...] = self.momentum * self.var[...] + (1 - self.momentum) * var
    mean, var = (s.reshape(-1, *[1] * (x.ndim - 1), s.shape[-1])
                 for s in layers.statistics(*sums))
    scale = jax.lax.rsqrt(var + self.epsilon) * self.scale[...]
    y = jnp.where(weight > 0, x32 - mean, 0.0) * scale + self.bias[...]
    return y.reshape(x.shape).astype(self.dtype or x.dtype)


def layer(cls, groups, dtype=None, axis_name=None):
  norm = cls(6, momentum=0.9, dtype=dtype, axis_name=axis_name, rngs=nnx.Rngs(0))
  norm.groups = groups
  norm.scale[...], norm.bias[...] = jnp.linspace(0.5, 1.5, 6), jnp.linspace(-1.0, 1.0, 6)
  return norm


def loss(norm, x_BHWC, mask_B, target_BHWC):
  """A loss of the real examples that weighs each output differently (not a plain sum)."""
  y = norm(x_BHWC, mask=mask_B).astype(jnp.float32)
  return jnp.sum(jnp.where(mask_B[:, None, None, None], (y - target_BHWC) ** 2 * jnp.cos(y), 0))


def outputs(norm, x, mask, target):
  value, (grads, dx) = nnx.value_and_grad(loss, argnums=(0, 1))(norm, x, mask, target)
  return value, nnx.state(grads), dx, norm.mean[...], norm.var[...]


def assert_close(expected, got, rtol):
  for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.abs(a - b).max() <= rtol * np.abs(a).max(), (a.shape, np.abs(a - b).max())


X = jax.random.normal(jax.random.key(0), (16, 5, 5, 6)) * 3 + 1
TARGET = jax.random.normal(jax.random.key(1), (16, 5, 5, 6))
MASKS = {"full": np.ones(16, bool), "padded": np.arange(16) < 11,
         "scattered": np.arange(16) % 3 == 0}


@pytest.mark.parametrize("groups, mask", [(1, "full"), (2, "padded"),
                                          (8, "scattered")])  # (8: groups of padding alone)
def test_the_written_out_gradient_is_autodiffs_under_jit(groups, mask):
  expected = nnx.jit(outputs)(layer(Plain, groups), X, MASKS[mask], TARGET)
  for forms in (list, gpu.forms):  # XLA's sums; the GPU's (`gpu.sums`)
    with substituted(forms()):  # (a new function a form: each traced under its own)
      got = nnx.jit(lambda *args: outputs(*args))(layer(layers.BatchNorm, groups), X,
                                                   MASKS[mask], TARGET)
    assert_close(expected, got, 1e-5)


def test_bfloat16_activations_keep_their_type_and_float32_statistics():
  run = nnx.jit(outputs)
  x = X.astype(jnp.bfloat16)
  expected = run(layer(Plain, 2, jnp.bfloat16), x, MASKS["padded"], TARGET)
  got = run(layer(layers.BatchNorm, 2, jnp.bfloat16), x, MASKS["padded"], TARGET)
  assert got[2].dtype == jnp.bfloat16 and got[3].dtype == jnp.float32
  assert_close(expected, got, 2e-2)  # (bfloat16's rounding of the outputs and of dx)


@pytest.mark.parametrize("groups, gpu_forms", [(1, False), (2, True), (8, False)])
def test_the_written_out_gradient_is_autodiffs_under_pmap(groups, gpu_forms):
  """8 devices of 2 examples, 5 real in all (devices 3-7 hold padding alone)."""
  results = []
  for cls in (Plain, layers.BatchNorm):
    graphdef, state = nnx.split(layer(cls, groups, axis_name=PMAP_AXIS))
    run = jax.pmap(lambda state, *batch: outputs(nnx.merge(graphdef, state), *batch),  # noqa: B023
                   in_axes=(None, 0, 0, 0), axis_name=PMAP_AXIS)
    with substituted(gpu.forms() if gpu_forms and cls is layers.BatchNorm else []):
      results.append(run(state, X.reshape(8, 2, 5, 5, 6), (np.arange(16) < 5).reshape(8, 2),
                         TARGET.reshape(8, 2, 5, 5, 6)))
  assert_close(*results, 1e-5)


@pytest.mark.parametrize("window, strides, padding", [  # (model.py's ResNet's, its CNN's, others)
    ((3, 3), (2, 2), "SAME"), ((2, 2), (2, 2), "SAME"), ((3, 2), (2, 3), ((1, 1), (0, 2)))])
def test_max_pool_by_slices_is_nnx_max_pool(window, strides, padding):
  """nnx.max_pool in the GPU's form (`gpu.forms`, as the GPU's train step is traced):
  nnx.max_pool's output exactly, and its gradient, each window's to its first maximum, on pixels
  of 3 values (ties in every window)."""
  x = jnp.asarray(np.random.default_rng(0).integers(0, 3, (2, 9, 10, 3)), jnp.float32)
  expected, expected_vjp = jax.vjp(lambda x: nnx.max_pool(x, window, strides, padding), x)
  with substituted(gpu.forms()):
    got, got_vjp = jax.vjp(lambda x: nnx.max_pool(x, window, strides, padding), x)
    program = str(jax.make_jaxpr(lambda x: nnx.max_pool(x, window, strides, padding))(x))
  assert nnx.max_pool is gpu.STOCK_MAX_POOL  # (put back)
  assert "reduce_window" not in program and "custom_vjp" in program  # (the slices' form)
  dy = jax.random.normal(jax.random.key(2), expected.shape)
  np.testing.assert_array_equal(got, expected)
  # (a window's gradient sent elsewhere is off by about 1: this is summation order's rounding)
  np.testing.assert_allclose(got_vjp(dy)[0], expected_vjp(dy)[0], rtol=0, atol=1e-6)
