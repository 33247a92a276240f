"""The training state and how it is made: the model (model.py), its optimizer and learning-rate
schedule, and the moving average of its parameters; built under jit, each shard where it lives.
"""

import importlib

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ..errors import ConfigError
from ..layers import BatchNorm
from ..parallel import sharding


def model_module(config):
  """The module whose `create_model` builds the model: `config.model.module`, model.py (yours)
  unless a config names another (the tests name their own copy of the shipped models)."""
  return importlib.import_module(config.model.get("module", "model"))


def create_model(config, image_shape, num_classes, rngs: nnx.Rngs) -> nnx.Module:
  return model_module(config).create_model(config, image_shape, num_classes, rngs)


def peak_learning_rate(config) -> float:
  """`config.learning_rate`, scaled by the global batch over `config.base_batch_size`."""
  ratio = config.batch_size / config.base_batch_size
  return config.learning_rate * {"none": 1.0, "linear": ratio, "sqrt": ratio**0.5}[
      config.lr_scaling]


def warmup_steps(config, num_train_steps: int) -> int:
  """`config.warmup_steps`, or `config.warmup_epochs` of the run's steps."""
  return config.warmup_steps or round(config.warmup_epochs * num_train_steps / config.num_epochs)


def create_schedule(config, num_train_steps: int) -> optax.Schedule:
  """The learning rate of update n (n = 0, 1, ...): a linear warmup from 0 to the peak over
  `warmup_steps`, then `config.schedule` over the remaining steps (cosine and linear: to 0 at
  `num_train_steps`)."""
  peak, warmup = peak_learning_rate(config), warmup_steps(config, num_train_steps)
  decay_steps = max(num_train_steps - warmup, 1)
  decay = {"cosine": lambda: optax.cosine_decay_schedule(peak, decay_steps),
           "linear": lambda: optax.linear_schedule(peak, 0.0, decay_steps),
           "constant": lambda: optax.constant_schedule(peak)}[config.schedule]()
  if not warmup:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def create_optimizer(config, num_train_steps: int) -> optax.GradientTransformation:
  """`config.optimizer` at the schedule's rates, after clipping the gradient's global norm to
  `grad_clip_norm` (when > 0). `momentum`: sgd's momentum (0: none), adam's and adamw's b1;
  `nesterov`: Nesterov's momentum (sgd), NAdam (adam, adamw). `weight_decay` acts on the weights
  only (arrays of 2 or more dimensions: not biases, nor norms' scales). adamw's is decoupled:
  optax multiplies it by the learning rate, so a step takes lr x weight_decay x w off each
  weight, as PyTorch's AdamW (0.05-0.1 is usual). adam's and sgd's is L2: weight_decay x w is
  added to the gradient, as PyTorch's `weight_decay` (1e-4-5e-4 is usual with sgd)."""
  schedule = create_schedule(config, num_train_steps)
  weights = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)  # noqa: E731
  momentum, nesterov, decay = config.momentum, config.nesterov, config.weight_decay
  chain = [optax.clip_by_global_norm(config.grad_clip_norm)] if config.grad_clip_norm else []
  if config.optimizer == "adamw":
    chain.append(optax.adamw(schedule, b1=momentum, weight_decay=decay, mask=weights,
                             nesterov=nesterov))
  else:
    if decay:
      chain.append(optax.add_decayed_weights(decay, mask=weights))
    chain.append(optax.adam(schedule, b1=momentum, nesterov=nesterov)
                 if config.optimizer == "adam" else
                 optax.sgd(schedule, momentum=momentum or None, nesterov=nesterov))
  return optax.chain(*chain) if len(chain) > 1 else chain[0]


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
  optimizer = nnx.Optimizer(model, create_optimizer(config, num_train_steps), wrt=nnx.Param)
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
