"""A user's model of stock NNX layers alone: a small ViT (patches, a class token, pre-norm
blocks of nnx.MultiHeadAttention with attention dropout, nnx.LayerNorm, an MLP with nnx.BatchNorm
and nnx.Dropout). No convolution, no layers.BatchNorm, no example_mask, no `deterministic=` or
`use_running_average=` passed anywhere: the train step's model.train() and evaluation's
model.eval() set the modes, and the batch's mask reaches the BatchNorm (layers.masked)."""
import jax.numpy as jnp
from flax import nnx


class Block(nnx.Module):
  def __init__(self, dim: int, heads: int, dropout: float, rngs: nnx.Rngs):
    self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=dim, dropout_rate=dropout,
                                       decode=False, rngs=rngs)
    self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, 2 * dim, rngs=rngs)
    self.batch_norm = nnx.BatchNorm(2 * dim, rngs=rngs)
    self.down = nnx.Linear(2 * dim, dim, rngs=rngs)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)

  def __call__(self, x_BTD):
    x_BTD = x_BTD + self.dropout(self.attn(self.norm1(x_BTD)))
    return x_BTD + self.dropout(self.down(nnx.gelu(self.batch_norm(self.up(self.norm2(x_BTD))))))


class ViT(nnx.Module):
  def __init__(self, image_shape, num_classes, *, patch: int = 2, dim: int = 64, depth: int = 2,
               heads: int = 4, dropout: float = 0.1, rngs: nnx.Rngs):
    height, width, channels = image_shape
    self.patch = patch
    self.embed = nnx.Linear(patch * patch * channels, dim, rngs=rngs)
    num_tokens = (height // patch) * (width // patch) + 1
    self.cls = nnx.Param(jnp.zeros((1, 1, dim)))
    self.pos = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (1, num_tokens, dim)))
    self.blocks = nnx.List([Block(dim, heads, dropout, rngs) for _ in range(depth)])
    self.norm = nnx.LayerNorm(dim, rngs=rngs)
    self.head = nnx.Linear(dim, num_classes, rngs=rngs)

  def __call__(self, images_BHWC):
    b, h, w, c = images_BHWC.shape
    p = self.patch
    x = images_BHWC.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
    x_BTD = self.embed(x.reshape(b, (h // p) * (w // p), p * p * c))
    cls_B1D = jnp.broadcast_to(self.cls[...], (b, 1, x_BTD.shape[-1]))
    x_BTD = jnp.concatenate([cls_B1D, x_BTD], axis=1) + self.pos[...]
    for block in self.blocks:
      x_BTD = block(x_BTD)
    return self.head(self.norm(x_BTD)[:, 0])


def create_model(config, image_shape, num_classes, rngs: nnx.Rngs) -> nnx.Module:
  return ViT(image_shape, num_classes, rngs=rngs)
