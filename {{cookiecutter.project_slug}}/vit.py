"""A Vision Transformer (Dosovitskiy et al. 2021, as big_vision's ViT): `config.model.module =
"vit"` (configs/vit.py). Stock NNX layers, like model.py; replace or change it freely.

The image is cut into `patch` x `patch` patches, each embedded by one strided convolution; a class
token and learned position embeddings are added; `depth` pre-norm encoder blocks follow
(x + attention(LayerNorm(x)), x + MLP(LayerNorm(x))); the class token's final LayerNorm feeds a
zero-initialised linear head. Sizes (`config.model.name`): ViT-Ti, S and B, of any patch.

Large-model options (config keys):
- `model.scan`: the blocks' parameters are always stacked ([depth, ...]: one checkpoint for
  both); True runs them under `nnx.scan` (one block compiled), False unrolls the loop (`depth`
  blocks compiled: XLA may schedule across them).
- `remat`: 'none'; 'block' (each block's activations recomputed in the backward pass, only its
  input kept); or the name of a `jax.checkpoint_policies` policy (what the recomputation keeps,
  e.g. 'dots_with_no_batch_dims_saveable': the matmuls' outputs). For a model of your own, wrap
  its repeated block's call in `nnx.remat(policy=...)` as `__call__` does here.
- Precision: `model.dtype` computes (bfloat16 in configs/vit.py) with `model.param_dtype`
  parameters; the LayerNorms, the attention's softmax (jax.nn.dot_product_attention computes it
  in float32) and the head's logits stay float32 whatever the dtype.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

SIZES = {  # width, depth, heads, MLP width (big_vision's and DeiT's)
    "vit_ti": (192, 12, 3, 768),
    "vit_s": (384, 12, 6, 1536),
    "vit_b": (768, 12, 12, 3072),
}
MODELS = tuple(SIZES)
REMAT = ("none", "block")  # or a name in jax.checkpoint_policies


def attention(query_BTNH, key_BTNH, value_BTNH, *, dropout_rate=0.0, deterministic=True,
              **unused):
  """nnx.MultiHeadAttention's `attention_fn`: jax.nn.dot_product_attention.

  XLA's; a GPU's step takes cuDNN's fused kernels where they take the inputs (gpu.py). It has no
  dropout of the attention weights: the blocks drop their outputs.

  Args:
    query_BTNH: the queries, [B, T, heads, head width].
    key_BTNH: the keys, the same.
    value_BTNH: the values, the same.
    dropout_rate: must be 0 where not `deterministic`.
    deterministic: MultiHeadAttention's.
    **unused: MultiHeadAttention's other arguments (no mask, no bias here).
  Returns:
    The attention's output, [B, T, heads, head width].
  """
  del unused
  if dropout_rate and not deterministic:
    raise ValueError("vit.attention drops no attention weights: keep MultiHeadAttention's "
                     "dropout_rate at 0 (the blocks' Dropout acts on their outputs)")
  return jax.nn.dot_product_attention(query_BTNH, key_BTNH, value_BTNH)


class Block(nnx.Module):
  """x + Dropout(attention(LayerNorm(x))), then x + Dropout(MLP(LayerNorm(x))).

  MLP = Linear, GELU, Dropout, Linear.

  Args:
    width: the tokens' width.
    heads: the attention's heads.
    mlp_width: the MLP's hidden width.
    dropout: the Dropouts' rate.
    dtype: the computation's dtype (the LayerNorms': float32).
    param_dtype: the parameters' dtype.
    rngs: the parameters' and Dropout's random streams.
  """

  def __init__(self, width: int, heads: int, mlp_width: int, dropout: float, dtype, param_dtype,
               rngs: nnx.Rngs):
    dense = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                 kernel_init=nnx.initializers.xavier_uniform(),
                 bias_init=nnx.initializers.normal(1e-6))
    norm = functools.partial(nnx.LayerNorm, width, epsilon=1e-6, dtype=jnp.float32,
                             param_dtype=param_dtype, rngs=rngs)
    self.attention_norm, self.mlp_norm = norm(), norm()
    self.attention = nnx.MultiHeadAttention(
        num_heads=heads, in_features=width, attention_fn=attention, decode=False,
        **dense)
    self.mlp_in = nnx.Linear(width, mlp_width, **dense)
    self.mlp_out = nnx.Linear(mlp_width, width, **dense)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)

  def __call__(self, x_BTD):
    x_BTD = x_BTD + self.dropout(self.attention(self.attention_norm(x_BTD)))
    # (GELU exact, with erf, as timm's and PyTorch's: their weights fit, exactly)
    y_BTF = self.dropout(nnx.gelu(self.mlp_in(self.mlp_norm(x_BTD)), approximate=False))
    return x_BTD + self.dropout(self.mlp_out(y_BTF))


class ViT(nnx.Module):
  """Patches, class token, position embeddings, `depth` Blocks (stacked), LayerNorm, head.

  Args:
    image_shape: the input images' [H, W, C].
    num_classes: the logits' width.
    width: the tokens' width.
    depth: the number of Blocks.
    heads: each Block's attention heads.
    mlp_width: each Block's MLP hidden width.
    patch: the patches' side, a divisor of H and W.
    dropout: the Dropouts' rate.
    scan: the Blocks run in a loop (`nnx.scan`); False: written out.
    remat: "none", "block" (each Block's activations recomputed in the backward pass) or a
      jax.checkpoint_policies name.
    dtype: the computation's dtype.
    param_dtype: the parameters' dtype.
    rngs: the parameters' and Dropout's random streams.
  """

  def __init__(self, image_shape, num_classes: int, *, width: int, depth: int, heads: int,
               mlp_width: int, patch: int = 16, dropout: float = 0.0, scan: bool = True,
               remat: str = "none", dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    height, width_px, channels = image_shape
    if height % patch or width_px % patch:
      raise ValueError(f"images {height}x{width_px} are not cut into whole {patch}x{patch} "
                       "patches: set config.model.patch to a divisor of both")
    self.scan, self.remat, self.dtype = scan, remat, dtype
    self.embed = nnx.Conv(channels, width, (patch, patch), strides=patch, padding="VALID",
                          dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    tokens = (height // patch) * (width_px // patch) + 1
    self.cls_embedding = nnx.Param(jnp.zeros((1, 1, width), param_dtype))
    self.position_embedding = nnx.Param(nnx.initializers.normal(width ** -0.5)(
        rngs.params(), (1, tokens, width), param_dtype))

    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=0, out_axes=0)
    def blocks(rngs):
      return Block(width, heads, mlp_width, dropout, dtype, param_dtype, rngs)

    self.blocks = blocks(rngs)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)
    self.norm = nnx.LayerNorm(width, epsilon=1e-6, dtype=jnp.float32, param_dtype=param_dtype,
                              rngs=rngs)
    self.head = nnx.Linear(width, num_classes, dtype=jnp.float32, param_dtype=param_dtype,
                           kernel_init=nnx.initializers.zeros, rngs=rngs)

  def __call__(self, images_BHWC):
    x_BhwD = self.embed(images_BHWC)
    batch, _, _, width = x_BhwD.shape
    cls_B1D = jnp.broadcast_to(self.cls_embedding[...], (batch, 1, width)).astype(x_BhwD.dtype)
    x_BTD = jnp.concatenate([cls_B1D, x_BhwD.reshape(batch, -1, width)], axis=1)
    x_BTD = self.dropout(x_BTD + self.position_embedding[...].astype(x_BhwD.dtype))

    def block(x_BTD, block: Block):
      return block(x_BTD)

    if self.remat != "none":
      policy = None if self.remat == "block" else getattr(jax.checkpoint_policies, self.remat)
      block = nnx.remat(block, policy=policy, prevent_cse=not self.scan)
    x_BTD = nnx.scan(block, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry,
                     unroll=1 if self.scan else True)(x_BTD, self.blocks)
    return self.head(self.norm(x_BTD[:, 0]))


def create_model(config, image_shape, num_classes, rngs: nnx.Rngs) -> nnx.Module:
  """`config.model.name`'s ViT (`SIZES`; `model.depth` > 0 overrides its depth).

  Args:
    config: the run's config (`config.model`, `config.remat`).
    image_shape: the input images' [H, W, C], from the data.
    num_classes: the number of classes, from the data.
    rngs: the parameters' random streams.
  Returns:
    The ViT.
  """
  width, depth, heads, mlp_width = SIZES[config.model.name]
  return ViT(image_shape, num_classes, width=width, depth=config.model.get("depth") or depth,
             heads=heads, mlp_width=mlp_width, patch=config.model.get("patch", 16),
             dropout=config.model.get("dropout", 0.0), scan=config.model.get("scan", True),
             remat=config.get("remat", "none"), dtype=jnp.dtype(config.model.dtype),
             param_dtype=jnp.dtype(config.model.param_dtype), rngs=rngs)
