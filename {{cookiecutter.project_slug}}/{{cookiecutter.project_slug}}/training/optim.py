"""The training state and how it is made: the model (model.py), its optimizer (recipe.py), and
the moving average of its parameters; built under jit, each shard where it lives."""

import jax
import jax.numpy as jnp
from flax import nnx

from .. import plan
from ..errors import ConfigError
from ..layers import BatchNorm
from ..parallel import sharding


def create_model(config, image_shape, num_classes, rngs: nnx.Rngs) -> nnx.Module:
  return plan.model_module(config).create_model(config, image_shape, num_classes, rngs)


def build_state(config, image_shape, num_classes, num_train_steps: int) -> tuple:
  """The training state's objects: (model, optimizer), and with `config.ema_decay` a third, the
  moving average of the model (a copy of it, which the train step moves and evaluation uses)."""
  model = create_model(config, image_shape, num_classes, nnx.Rngs(config.seed))
  if config.get("batch_norm_devices") and (plain := [
      "/".join(map(str, path)) for path, node in nnx.iter_graph(model)
      if isinstance(node, nnx.BatchNorm) and not isinstance(node, BatchNorm)]):
    raise ConfigError(f"config.batch_norm_devices={config.batch_norm_devices} is for "
                      f"layers.BatchNorm; {type(model).__name__} holds nnx.BatchNorm at "
                      f"{', '.join(plain)}, which takes the global batch's statistics: use "
                      "layers.BatchNorm in model.py (or batch_norm_devices=0).")
  optimizer = nnx.Optimizer(model, plan.recipe_module(config).optimizer(config, num_train_steps),
                            wrt=nnx.Param)
  if not config.ema_decay:
    return model, optimizer
  average = nnx.clone(model)  # its own buffers, its floats in float32 (steps.train_step)
  nnx.update(average, jax.tree.map(  # (jnp.array copies)
      lambda x: jnp.array(x, jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype),
      nnx.state(average)))
  return model, optimizer, average


def initial_state(config, info, mesh, num_train_steps: int):
  """The model and optimizer's graph (`build_state`), their state's abstract value (shapes,
  dtypes, shardings; fsdp splits the average like the parameters) and a function that builds
  the state: under jit, each shard where it lives, so that no host and no device ever holds more
  of it than its share (the same values as built eagerly)."""

  def build():
    return build_state(config, info.image_shape, info.num_classes, num_train_steps)

  graphdef, abstract = nnx.split(nnx.eval_shape(build))
  shardings = sharding.state_shardings(abstract, mesh, config.fsdp_min_size)
  abstract = jax.tree.map(lambda x, where: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where),
                          abstract, shardings)
  return graphdef, abstract, jax.jit(lambda: nnx.split(build())[1], out_shardings=shardings)
