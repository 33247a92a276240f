"""The model: a small NNX CNN. Replace it freely.

Contract with train.py: `create_model(config, image_shape, num_classes, rngs)` returns an
`nnx.Module` mapping images `[batch, height, width, channels]` to logits `[batch, num_classes]`.
A model whose `__call__` has an `example_mask` parameter (or `**kwargs`) also gets the mask
`[batch]` (False on padding), for layers that pool over the batch
(`parallel.BatchNorm(...)(x, mask=example_mask)`). The loss is computed in float32 whatever
the logits' dtype.
"""

import jax.numpy as jnp
from flax import nnx


class CNN(nnx.Module):
  """Conv-ReLU-pool once per entry of `features`, then a dense classifier."""

  def __init__(
      self,
      image_shape: tuple[int, int, int],
      num_classes: int,
      *,
      features: tuple[int, ...] = (32, 64),
      dtype=jnp.float32,
      param_dtype=jnp.float32,
      rngs: nnx.Rngs,
  ):
    height, width, channels = image_shape
    conv = dict(kernel_size=(3, 3), dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    widths = (channels, *features)
    self.convs = nnx.List([nnx.Conv(widths[i], widths[i + 1], **conv)
                           for i in range(len(features))])
    pooled = 2 ** len(features)  # one 2x2 pool per convolution, SAME: sizes rounded up
    flat_dim = -(-height // pooled) * -(-width // pooled) * features[-1]
    self.dense = nnx.Linear(flat_dim, num_classes, dtype=dtype, param_dtype=param_dtype,
                            rngs=rngs)

  def __call__(self, images_BHWC: jnp.ndarray) -> jnp.ndarray:
    x = images_BHWC
    for conv in self.convs:
      x = nnx.max_pool(nnx.relu(conv(x)), window_shape=(2, 2), strides=(2, 2), padding="SAME")
    return self.dense(x.reshape(x.shape[0], -1))


def create_model(config, image_shape, num_classes, rngs: nnx.Rngs) -> nnx.Module:
  return CNN(
      image_shape,
      num_classes,
      features=tuple(config.model.features),
      dtype=jnp.dtype(config.model.dtype),
      param_dtype=jnp.dtype(config.model.param_dtype),
      rngs=rngs,
  )
