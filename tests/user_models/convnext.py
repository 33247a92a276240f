"""A user's model not of the template's kind: a small ConvNeXt (Liu et al. 2022): a patchify stem,
blocks of a 7x7 depthwise convolution, LayerNorm, an inverted bottleneck with GELU and a layer
scale, stochastic depth by a hand-written DropPath drawing from rngs['dropout'], and Dropout
before the head."""
import jax
import jax.numpy as jnp
from flax import nnx


class DropPath(nnx.Module):
  """Drops each example's residual branch with probability `rate` (scaling the kept ones), off
  when `deterministic` (model.eval() sets it), as nnx.Dropout."""

  def __init__(self, rate: float, *, rngs: nnx.Rngs):
    self.rate, self.deterministic, self.rngs = rate, False, rngs

  def __call__(self, x):
    if self.deterministic or self.rate == 0:
      return x
    keep = jax.random.bernoulli(self.rngs.dropout(), 1 - self.rate, (x.shape[0],) + (1,) * (
        x.ndim - 1))
    return jnp.where(keep, x / (1 - self.rate), 0)


class Block(nnx.Module):
  def __init__(self, dim: int, drop_path: float, *, rngs: nnx.Rngs):
    self.depthwise = nnx.Conv(dim, dim, (7, 7), feature_group_count=dim, rngs=rngs)
    self.norm = nnx.LayerNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.down = nnx.Linear(4 * dim, dim, rngs=rngs)
    self.scale = nnx.Param(jnp.full((dim,), 0.1))  # layer scale
    self.drop_path = DropPath(drop_path, rngs=rngs)

  def __call__(self, x):
    y = self.down(nnx.gelu(self.up(self.norm(self.depthwise(x)))))
    return x + self.drop_path(self.scale * y)


class ConvNeXt(nnx.Module):
  def __init__(self, image_shape, num_classes, dims=(16, 32), *, rngs: nnx.Rngs):
    self.stem = nnx.Conv(image_shape[-1], dims[0], (2, 2), strides=2, rngs=rngs)
    self.stem_norm = nnx.LayerNorm(dims[0], rngs=rngs)
    self.stage1 = Block(dims[0], 0.1, rngs=rngs)
    self.down_norm = nnx.LayerNorm(dims[0], rngs=rngs)
    self.down = nnx.Conv(dims[0], dims[1], (2, 2), strides=2, rngs=rngs)
    self.stage2 = Block(dims[1], 0.2, rngs=rngs)
    self.head_norm = nnx.LayerNorm(dims[1], rngs=rngs)
    self.dropout = nnx.Dropout(0.2, rngs=rngs)
    self.head = nnx.Linear(dims[1], num_classes, rngs=rngs)

  def __call__(self, images_BHWC):
    x = self.stage1(self.stem_norm(self.stem(images_BHWC)))
    x = self.stage2(self.down(self.down_norm(x)))
    return self.head(self.dropout(self.head_norm(x.mean(axis=(1, 2)))))


def create_model(config, image_shape, num_classes, rngs: nnx.Rngs) -> nnx.Module:
  return ConvNeXt(image_shape, num_classes, rngs=rngs)
