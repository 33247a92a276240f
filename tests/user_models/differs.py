"""A model that is NOT the same on every path (for the test of the your-model tier): a layer of
the user's own that centres each feature on the mean over the batch it sees, which under pmap is
one device's slice of the batch, and on one device the whole batch."""
import jax.numpy as jnp
from flax import nnx


class MLP(nnx.Module):
  def __init__(self, image_shape, num_classes, *, rngs: nnx.Rngs):
    height, width, channels = image_shape
    self.hidden = nnx.Linear(height * width * channels, 64, rngs=rngs)
    self.scale = nnx.Param(jnp.ones(64))
    self.hidden2 = nnx.Linear(64, 32, rngs=rngs)
    self.out = nnx.Linear(32, num_classes, rngs=rngs)

  def __call__(self, images_BHWC):
    x = self.hidden(images_BHWC.reshape(images_BHWC.shape[0], -1))
    x = (x - x.mean(axis=0)) * self.scale[...]  # a statistic over the batch
    return self.out(nnx.relu(self.hidden2(nnx.relu(x))))


def create_model(config, image_shape, num_classes, rngs: nnx.Rngs) -> nnx.Module:
  return MLP(image_shape, num_classes, rngs=rngs)
