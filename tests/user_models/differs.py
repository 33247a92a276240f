"""A model that is NOT the same on every path (for the test of the your-model tier): plain
nnx.BatchNorm without the mask or an axis name takes the statistics of the array it sees, which
under pmap is one device's slice of the batch, and on one device the whole batch."""
from flax import nnx


class MLP(nnx.Module):
  def __init__(self, image_shape, num_classes, *, rngs: nnx.Rngs):
    height, width, channels = image_shape
    self.hidden = nnx.Linear(height * width * channels, 64, rngs=rngs)
    self.norm = nnx.BatchNorm(64, rngs=rngs)
    self.out = nnx.Linear(64, num_classes, rngs=rngs)

  def __call__(self, images_BHWC):
    x = images_BHWC.reshape(images_BHWC.shape[0], -1)
    return self.out(nnx.relu(self.norm(self.hidden(x))))


def create_model(config, image_shape, num_classes, rngs: nnx.Rngs) -> nnx.Module:
  return MLP(image_shape, num_classes, rngs=rngs)
