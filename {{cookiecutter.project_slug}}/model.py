"""The model: a small NNX CNN. Replace it freely.

Contract with train.py: `create_model(config, image_shape, num_classes, rngs)` returns an
`nnx.Module` mapping images `[batch, height, width, channels]` to logits `[batch, num_classes]`.
"""

import jax.numpy as jnp
from flax import nnx


class CNN(nnx.Module):
  """Conv-ReLU-pool twice, then a dense classifier."""

  def __init__(
      self,
      image_shape: tuple[int, int, int],
      num_classes: int,
      *,
      features: tuple[int, int] = (32, 64),
      dtype=jnp.float32,
      param_dtype=jnp.float32,
      rngs: nnx.Rngs,
  ):
    height, width, channels = image_shape
    conv = dict(kernel_size=(3, 3), dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.conv1 = nnx.Conv(channels, features[0], **conv)
    self.conv2 = nnx.Conv(features[0], features[1], **conv)
    flat_dim = (height // 4) * (width // 4) * features[1]  # two 2x2 pools
    self.dense = nnx.Linear(flat_dim, num_classes, dtype=dtype, param_dtype=param_dtype,
                            rngs=rngs)

  def __call__(self, images_BHWC: jnp.ndarray) -> jnp.ndarray:
    x = nnx.max_pool(nnx.relu(self.conv1(images_BHWC)), window_shape=(2, 2), strides=(2, 2))
    x = nnx.max_pool(nnx.relu(self.conv2(x)), window_shape=(2, 2), strides=(2, 2))
    logits_BK = self.dense(x.reshape(x.shape[0], -1))
    return logits_BK.astype(jnp.float32)  # the loss is always computed in float32


def create_model(config, image_shape, num_classes, rngs: nnx.Rngs) -> nnx.Module:
  return CNN(
      image_shape,
      num_classes,
      features=tuple(config.model.features),
      dtype=jnp.dtype(config.model.dtype),
      param_dtype=jnp.dtype(config.model.param_dtype),
      rngs=rngs,
  )
