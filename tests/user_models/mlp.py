"""A user's model without convolutions: an MLP with LayerNorm and Dropout."""
from flax import nnx


class MLP(nnx.Module):
  def __init__(self, image_shape, num_classes, *, rngs: nnx.Rngs):
    height, width, channels = image_shape
    self.hidden = nnx.Linear(height * width * channels, 64, rngs=rngs)
    self.norm = nnx.LayerNorm(64, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)
    self.out = nnx.Linear(64, num_classes, rngs=rngs)

  def __call__(self, images_BHWC):
    x = images_BHWC.reshape(images_BHWC.shape[0], -1)
    return self.out(self.dropout(nnx.gelu(self.norm(self.hidden(x)))))


def create_model(config, image_shape, num_classes, rngs: nnx.Rngs) -> nnx.Module:
  return MLP(image_shape, num_classes, rngs=rngs)
