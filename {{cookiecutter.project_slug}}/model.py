"""The models: a small NNX CNN (the default) and ResNet-18/50 v1.5 (`config.model.name`).
Replace them freely.

Contract with train.py: `create_model(config, image_shape, num_classes, rngs)` returns an
`nnx.Module` mapping images `[batch, height, width, channels]` to logits `[batch, num_classes]`
(train.py checks both, abstractly, before it compiles anything). Training calls `model.train()`
and evaluation `model.eval()`, as Flax's examples do: stock layers need no `deterministic=`.
Stock NNX layers are all it takes: nnx.BatchNorm leaves the padding of partial batches out (the
project builds it as its own masked subclass, whose statistics the steps give the batch's mask),
and each backend's faster forms of nnx.max_pool or BatchNorm's sums are put in by the steps. A
model whose `__call__` has an `example_mask` parameter (or `**kwargs`) also gets the mask
`[batch]` (False on padding), for layers of its own that pool over the batch. The loss is
computed in float32 whatever the logits' dtype.
"""

import functools

import jax.numpy as jnp
from flax import nnx


class CNN(nnx.Module):
  """Conv-ReLU-pool once per entry of `features`, then a dense classifier.

  Args:
    image_shape: the input images' [H, W, C].
    num_classes: the logits' width.
    features: each 3x3 convolution's width.
    dropout: the rate of a Dropout before the classifier; 0: none.
    dtype: the computation's dtype.
    param_dtype: the parameters' dtype.
    rngs: the parameters' (and Dropout's) random streams.
  """

  def __init__(
      self,
      image_shape: tuple[int, int, int],
      num_classes: int,
      *,
      features: tuple[int, ...] = (32, 64),
      dropout: float = 0.0,
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
    self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout else None
    self.dense = nnx.Linear(flat_dim, num_classes, dtype=dtype, param_dtype=param_dtype,
                            rngs=rngs)

  def __call__(self, images_BHWC: jnp.ndarray) -> jnp.ndarray:
    x = images_BHWC
    for conv in self.convs:
      x = nnx.max_pool(nnx.relu(conv(x)), window_shape=(2, 2), strides=(2, 2), padding="SAME")
    x_BD = x.reshape(x.shape[0], -1)
    return self.dense(self.dropout(x_BD) if self.dropout else x_BD)


class ResidualBlock(nnx.Module):
  """x + F(x) (x projected by a strided 1x1 convolution where F changes its shape), then ReLU.

  F: two 3x3 convolutions (basic, ResNet-18), or 1x1, 3x3, 1x1 to 4x the width (bottleneck,
  ResNet-50), each followed by BatchNorm; v1.5 strides the 3x3. The last BatchNorm's scale
  starts at 0, so that every block starts as the identity (Goyal et al. 2017).

  Args:
    in_features: the input's channels.
    width: F's width (its last convolution's: 4x in a bottleneck).
    strides: the 3x3 convolution's (and the projection's) stride.
    bottleneck: 1x1, 3x3, 1x1 (ResNet-50) rather than two 3x3 (ResNet-18).
    conv: (in, out, kernel size, strides=) -> a convolution.
    norm: (features, scale_init=) -> a BatchNorm.
  """

  def __init__(self, in_features: int, width: int, strides: int, bottleneck: bool, conv, norm):
    if bottleneck:
      shapes = [(1, width, 1), (3, width, strides), (1, 4 * width, 1)]
    else:
      shapes = [(3, width, strides), (3, width, 1)]
    widths = [in_features] + [out for _, out, _ in shapes]
    # (padded by half the kernel on every side, as torchvision pads: its weights fit, exactly)
    self.convs = nnx.List([conv(widths[i], out, (size, size), strides=stride,
                                padding=((size // 2, size // 2),) * 2)
                           for i, (size, out, stride) in enumerate(shapes)])
    self.norms = nnx.List([norm(out) for _, out, _ in shapes[:-1]]
                          + [norm(widths[-1], scale_init=nnx.initializers.zeros)])
    projected = strides != 1 or in_features != widths[-1]
    self.project = conv(in_features, widths[-1], (1, 1), strides=strides) if projected else None
    self.project_norm = norm(widths[-1]) if projected else None

  def __call__(self, x_BHWC, mask_B):
    y = x_BHWC
    for i, (conv, norm) in enumerate(zip(self.convs, self.norms, strict=True)):
      y = norm(conv(y), mask=mask_B)
      y = nnx.relu(y) if i < len(self.convs) - 1 else y
    if self.project is not None:
      x_BHWC = self.project_norm(self.project(x_BHWC), mask=mask_B)
    return nnx.relu(x_BHWC + y)


class ResNet(nnx.Module):
  """ResNet v1.5 (He et al. 2016; torchvision's and Flax's examples/imagenet's): a 7x7 stride-2
  convolution and a 3x3 stride-2 max pool, four stages of residual blocks (the first block of
  stages 2-4 halves the resolution and doubles the width), global average pool, linear. Its
  BatchNorm takes the statistics of the real examples of the global batch
  or of each group of `config.batch_norm_devices` devices, alike on every path, padding left
  out (`example_mask`).

  Args:
    image_shape: the input images' [H, W, C].
    num_classes: the logits' width.
    stage_sizes: the number of blocks in each stage.
    bottleneck: bottleneck blocks (ResNet-50) or basic ones (ResNet-18).
    width: the first stage's width (64 in the papers).
    dtype: the computation's dtype.
    param_dtype: the parameters' dtype.
    rngs: the parameters' random streams.
  """

  def __init__(self, image_shape, num_classes: int, *, stage_sizes: tuple[int, ...],
               bottleneck: bool, width: int = 64, dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    conv = functools.partial(nnx.Conv, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                             kernel_init=nnx.initializers.variance_scaling(2.0, "fan_out",
                                                                           "normal"),
                             rngs=rngs)
    norm = functools.partial(nnx.BatchNorm, momentum=0.9, epsilon=1e-5, dtype=dtype,
                             param_dtype=param_dtype, rngs=rngs)
    self.stem = conv(image_shape[-1], width, (7, 7), strides=2, padding=((3, 3), (3, 3)))
    self.stem_norm = norm(width)
    blocks, features = [], width
    for stage, size in enumerate(stage_sizes):
      for i in range(size):
        strides = 2 if stage > 0 and i == 0 else 1
        blocks.append(ResidualBlock(features, width * 2**stage, strides, bottleneck, conv, norm))
        features = width * 2**stage * (4 if bottleneck else 1)
    self.blocks = nnx.List(blocks)
    self.head = nnx.Linear(features, num_classes, dtype=dtype, param_dtype=param_dtype,
                           rngs=rngs)

  def __call__(self, images_BHWC, example_mask=None):
    x = nnx.relu(self.stem_norm(self.stem(images_BHWC), mask=example_mask))
    x = nnx.max_pool(x, window_shape=(3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    for block in self.blocks:
      x = block(x, example_mask)
    return self.head(x.mean(axis=(1, 2)))


RESNETS = {"resnet18": dict(stage_sizes=(2, 2, 2, 2), bottleneck=False),
           "resnet50": dict(stage_sizes=(3, 4, 6, 3), bottleneck=True)}
MODELS = ("cnn", *RESNETS)


def create_model(config, image_shape, num_classes, rngs: nnx.Rngs) -> nnx.Module:
  """The model that `config.model.name` names (`MODELS`).

  Args:
    config: the run's config (`config.model`: the name, widths, dtypes).
    image_shape: the input images' [H, W, C], from the data.
    num_classes: the number of classes, from the data.
    rngs: the parameters' random streams.
  Returns:
    The model: images [B, H, W, C] -> logits [B, num_classes].
  """
  dtypes = dict(dtype=jnp.dtype(config.model.dtype),
                param_dtype=jnp.dtype(config.model.param_dtype), rngs=rngs)
  if config.model.name in RESNETS:
    return ResNet(image_shape, num_classes, **RESNETS[config.model.name],
                  width=config.model.width, **dtypes)
  return CNN(image_shape, num_classes, features=tuple(config.model.features),
             dropout=config.model.get("dropout", 0.0), **dtypes)
