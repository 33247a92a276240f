"""A user's model: a small residual CNN with the project's masked BatchNorm and Dropout."""
import jax.numpy as jnp
from flax import nnx

from nnx_data_parallel import layers


class Block(nnx.Module):
  def __init__(self, features, rngs):
    self.conv = nnx.Conv(features, features, (3, 3), use_bias=False, rngs=rngs)
    self.norm = layers.BatchNorm(features, rngs=rngs)

  def __call__(self, x, mask):
    return nnx.relu(x + self.norm(self.conv(x), mask=mask))


class Net(nnx.Module):
  def __init__(self, image_shape, num_classes, *, rngs: nnx.Rngs):
    self.stem = nnx.Conv(image_shape[-1], 16, (3, 3), rngs=rngs)
    self.blocks = nnx.List([Block(16, rngs) for _ in range(2)])
    self.dropout = nnx.Dropout(0.3, rngs=rngs)
    self.head = nnx.Linear(16, num_classes, rngs=rngs)

  def __call__(self, images_BHWC, example_mask=None):
    x = nnx.relu(self.stem(images_BHWC.astype(jnp.float32)))
    for block in self.blocks:
      x = block(x, example_mask)
    return self.head(self.dropout(x.mean(axis=(1, 2))))


def create_model(config, image_shape, num_classes, rngs: nnx.Rngs) -> nnx.Module:
  return Net(image_shape, num_classes, rngs=rngs)
