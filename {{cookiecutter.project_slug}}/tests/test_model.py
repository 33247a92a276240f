import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from shipped_model import create_model

from {{cookiecutter.project_slug}} import layers
from {{cookiecutter.project_slug}}.training import flops, optim


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


@pytest.mark.parametrize("name, num_params, train_flops", [
    # torchvision's parameter counts; forward 1.81 and 4.1 GMACs an image at 224 x 224.
    pytest.param("resnet18", 11_689_512, 3 * 2 * 1.81e9, marks=pytest.mark.slow),
    ("resnet50", 25_557_032, 3 * 2 * 4.1e9)])
def test_resnets_have_the_papers_sizes_and_flops(tiny_config, name, num_params, train_flops):
  """The FLOPs the project reports for a training step (flops.Speed, the jaxpr's matrix
  products and convolutions) are 3 forward passes' (the backward pass twice the forward)."""
  from {{cookiecutter.project_slug}} import plan

  tiny_config.model.name, tiny_config.batch_size = name, 2
  config = plan.resolved(tiny_config)
  run_plan = plan.make_plan(config)
  objects = nnx.eval_shape(lambda: optim.build_state(run_plan, (224, 224, 3), 1000, 10))
  assert sum(p.size for p in jax.tree.leaves(nnx.state(objects[0], nnx.Param))) == num_params
  graphdef, state = nnx.split(objects)
  speed = flops.Speed(graphdef, state, (224, 224, 3), plan.make_plan(plan.resolved(tiny_config)))
  assert speed.flops_per_step / 2 == pytest.approx(train_flops, rel=0.03)


@pytest.mark.slow  # (eager)
def test_each_resnet_block_starts_as_the_identity(tiny_config):
  """The last BatchNorm scale of a block is 0: a block that keeps its input's shape passes it
  through (then ReLU) at initialisation, whatever the batch."""
  tiny_config.model.update(name="resnet18", width=8)
  model = create_model(tiny_config, (32, 32, 3), 10, nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (4, 8, 8, 8))
  block = model.blocks[1]  # (blocks[0] keeps the shape too; blocks[2] halves it)
  assert block.project is None
  assert jnp.array_equal(block(x, None), nnx.relu(x))
  assert model.blocks[2].project is not None


@pytest.mark.slow  # (eager)
def test_a_resnet_leaves_the_padding_out_of_its_batch_statistics(tiny_config):
  """Padded examples (mask False) change neither the real examples' logits nor the statistics
  (model.py's nnx.BatchNorm masked as the runs mask it: `layers.masked`)."""
  tiny_config.model.update(name="resnet18", width=8)
  model = layers.masked(create_model(tiny_config, (16, 16, 3), 10, nnx.Rngs(0)))
  images = jax.random.uniform(jax.random.key(0), (6, 16, 16, 3))
  padded = jnp.concatenate([images, 100 * jnp.ones((2, 16, 16, 3))])
  mask = jnp.arange(8) < 6
  alone, with_padding = nnx.clone(model), nnx.clone(model)
  logits = alone(images, example_mask=jnp.ones(6, bool))
  padded_logits = with_padding(padded, example_mask=mask)
  assert jnp.allclose(padded_logits[:6], logits, atol=1e-5)
  for a, b in zip(jax.tree.leaves(nnx.state(alone, nnx.BatchStat)),
                  jax.tree.leaves(nnx.state(with_padding, nnx.BatchStat)), strict=True):
    assert jnp.allclose(a, b, atol=1e-6)
