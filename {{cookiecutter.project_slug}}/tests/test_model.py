import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from model import create_model


@pytest.mark.parametrize("image_shape, num_classes", [((8, 8, 1), 10), ((32, 32, 3), 7)])
def test_logits_shape_follows_the_data(tiny_config, image_shape, num_classes):
  model = create_model(tiny_config, image_shape, num_classes, nnx.Rngs(0))
  logits = model(jnp.zeros((5, *image_shape)))
  assert logits.shape == (5, num_classes)
  assert logits.dtype == jnp.float32


def test_bfloat16_compute_with_float32_params(tiny_config):
  tiny_config.model.dtype = "bfloat16"
  model = create_model(tiny_config, (8, 8, 1), 10, nnx.Rngs(0))
  param_dtypes = {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))}
  assert param_dtypes == {jnp.dtype(jnp.float32)}
  images = jax.random.uniform(jax.random.key(0), (4, 8, 8, 1))
  assert model.convs[0](images).dtype == jnp.bfloat16
  logits = model(images)  # bfloat16: the loss casts them to float32 (steps.loss_and_metrics)
  assert logits.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(logits)))
  tiny_config.model.dtype = "float32"
  reference = create_model(tiny_config, (8, 8, 1), 10, nnx.Rngs(0))(images)
  assert jnp.allclose(logits.astype(jnp.float32), reference, atol=0.05)  # bf16 rounding only
