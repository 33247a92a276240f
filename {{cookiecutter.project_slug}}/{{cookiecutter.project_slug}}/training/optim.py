"""The training state and how it is made: the model (model.py), its optimizer (recipe.py), and
the moving average of its parameters; built under jit, each shard where it lives."""

import inspect
import re

import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx

from .. import errors
from ..errors import ConfigError
from ..layers import masked, takes_mask, unmasked
from ..parallel import sharding


def create_model(run_plan, image_shape, num_classes, rngs: nnx.Rngs) -> nnx.Module:
  """The model that the plan's model module (model.py) builds for this data, its plain
  nnx.BatchNorm layers masked (`layers.masked`), in groups of `config.batch_norm_devices`
  devices. Raises ConfigError for a BatchNorm the mask cannot reach where that is set.

  Args:
    run_plan: the run's plan (its config and model module).
    image_shape: the input images' [H, W, C].
    num_classes: the number of classes.
    rngs: the parameters' random streams.
  """
  config = run_plan.config
  devices = config.run.num_devices if "run" in config else jax.device_count()
  groups = devices // (config.get("batch_norm_devices") or devices)
  model = masked(run_plan.model.create_model(config, image_shape, num_classes, rngs), groups)
  if config.get("batch_norm_devices") and (own := unmasked(model)):
    raise ConfigError(f"config.batch_norm_devices={config.batch_norm_devices} is for "
                      f"layers.BatchNorm; {type(model).__name__} holds {', '.join(own)}, which "
                      "takes the global batch's statistics: use layers.BatchNorm in model.py "
                      "(or batch_norm_devices=0).")
  return model


def check_model(run_plan, info) -> None:
  """model.py checked before anything compiles, abstractly (`jax.eval_shape`: no array made):
  `create_model(config, image_shape, num_classes, rngs)` builds the model, which in train mode
  maps float32 images `[B, H, W, C]` to floating logits `[B, K]`, K the data's classes. Raises
  ConfigError, one line naming model.py's line (or the shape returned and the one wanted)."""
  config, module = run_plan.config, run_plan.model
  shown, signature = errors.shown(module.__file__), inspect.signature(module.create_model)
  try:
    signature.bind(config, info.image_shape, info.num_classes, None)
  except TypeError as e:
    line = inspect.getsourcelines(module.create_model)[1]
    raise ConfigError(f"{shown}:{line}: create_model{signature} cannot be called as "
                      f"create_model(config, image_shape, num_classes, rngs) ({e}); keep that "
                      "signature (model.py's docstring).") from None
  batch, classes = (config.run.global_batch_size if "run" in config else 2), info.num_classes
  images_BHWC = jax.ShapeDtypeStruct((batch, *info.image_shape), jnp.float32)
  failed = [f"create_model(config, image_shape={info.image_shape}, num_classes={classes}, "
            "rngs) failed"]

  def build_and_call(images_BHWC):
    model = create_model(run_plan, info.image_shape, classes, nnx.Rngs(config.seed))
    failed[0] = f"the model failed on a batch of images {list(images_BHWC.shape)} float32"
    model.train()
    masked = {"example_mask": jnp.ones(len(images_BHWC), bool)} if takes_mask(type(model)) else {}
    return model(images_BHWC, **masked)

  if config.parallelism == "pmap":  # (under pmap's axis, as the step runs: a layer may name it)
    from ..parallel import pmap

    build_and_call = pmap.under_axis(build_and_call, config.run.num_devices if "run" in config
                                      else 1)
  try:
    traced, logits = jax.make_jaxpr(build_and_call, return_shape=True)(images_BHWC)
  except ConfigError:  # (create_model's own: said as it is)
    raise
  except Exception as e:
    where, fix = model_fix(e, config, info.image_shape, module)
    raise ConfigError(f"{where}: {failed[0]}{fix}") from None
  shape = getattr(logits, "shape", None)
  if shape == (batch, classes) and jnp.issubdtype(logits.dtype, jnp.floating):
    if made := probabilities(traced.jaxpr, traced.jaxpr.outvars[0]):
      logging.warning("%s: the model returns probabilities (a %s of its logits); the loss and "
                      "predictions take logits (and apply the softmax themselves): return the "
                      "logits, without the %s", shown, made, made)
    return
  got = (f"{list(shape)} {logits.dtype}" if shape is not None else
         f"a {type(logits).__name__} of {jax.tree.map(lambda x: list(x.shape), logits)}")
  hint = ""
  if shape is not None and len(shape) == 2 and shape[0] == batch and shape[1] != classes:
    names = f" ({', '.join(info.class_names[:10])}{', ...' if classes > 10 else ''})" if (
        info.class_names) else ""
    hint = (f"; the data has {classes} classes{names}: build the head with create_model's "
            f"num_classes, not {shape[1]}")
  elif shape is not None and len(shape) > 2:
    hint = "; reduce the other axes (pool, or take the class token) before the head"
  raise ConfigError(f"{shown}: the model returned {got} for a batch of {batch} images; expected "
                    f"logits [{batch}, {classes}] of a floating dtype{hint}.")


def probabilities(jaxpr, var) -> str | None:
  """Whether `var` (a model's output, in the `jaxpr` of its call) is made by a softmax (exp over
  its sum) or a sigmoid: the name, else None; log_softmax's log-probabilities are logits."""
  made = {id(v): eqn for eqn in jaxpr.eqns for v in eqn.outvars}

  def source(v):  # the equation that computes v, through reshapes and casts, and its output
    while (eqn := made.get(id(v))) and eqn.primitive.name in (
        "broadcast_in_dim", "reshape", "convert_element_type", "squeeze", "copy", "copy_p"):
      v = eqn.invars[0]
    return eqn, v

  eqn, var = source(var)
  name = eqn and eqn.primitive.name
  if inner := eqn and (eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")):  # (jit, ...)
    inner = getattr(inner, "jaxpr", inner)
    return probabilities(inner, inner.outvars[eqn.outvars.index(var)])
  if name == "div" and [getattr(source(v)[0], "primitive", None) and source(v)[0].primitive.name
                        for v in eqn.invars] == ["exp", "reduce_sum"]:
    return "softmax"
  return "sigmoid" if name == "logistic" else None


def model_fix(error: Exception, config, image_shape, module) -> tuple[str, str]:
  """Where in model.py `check_model` says the model's error was, and what it says of it, with
  NNX's convention where one was missed: an axis that the path does not have, a mode given as
  an argument, the images' layout.

  Args:
    error: what the model raised.
    config: the run's config.
    image_shape: the input images' [H, W, C].
    module: the model's module.
  Returns:
    (the file and line, what follows it in the one-line message).
  """
  where, said = errors.where(error, module.__file__), errors.one_line(error)
  if "unbound axis name" in said:
    axis = said.rsplit(":", 1)[-1].strip()
    if config.parallelism == "pmap":  # (its axis: 'batch', as Flax's pmap examples name it)
      return where, (f": a layer names the axis {axis!r}; pmap's is 'batch' (as in Flax's "
                     "examples): name that, or drop its axis_name= (the steps give nnx.BatchNorm "
                     "pmap's axis)")
    return where, (
        f": a layer names the axis {axis!r}, which config.parallelism={config.parallelism!r} "
        "does not have (pmap's alone names one): drop its axis_name= (spmd and fsdp take the "
        "global batch's statistics without it) or train with --config.parallelism=pmap")
  missing = re.search(r"(\w+)\.__call__\(\) missing \d+ required (?:positional|keyword-only) "
                      r"arguments?: (.+)", said)
  if isinstance(error, TypeError) and missing:
    if inspect.isclass(model_class := getattr(module, missing.group(1), None)):  # its line
      line = inspect.getsourcelines(model_class.__call__)[1]
      where = f"{errors.shown(module.__file__)}:{line}"
    return where, (
        f": {said}: the steps call model(images) (and example_mask= where __call__ takes it); "
        "NNX models take their mode from model.train() / model.eval(), which the steps call "
        "(nnx.Dropout's deterministic and nnx.BatchNorm's use_running_average follow it), not "
        f"from an argument: drop {missing.group(2)} or give it a default")
  if any(word in said for word in ("shape", "dimension", " != ", "ncompatible")):
    return where, (f": {said} (images arrive as [B, H, W, C] float32, uint8 pixels scaled to "
                   f"[0, 1]; H, W, C = image_shape = {tuple(image_shape)})")
  return where, f": {said}"


def build_state(run_plan, image_shape, num_classes, num_train_steps: int) -> tuple:
  """The training state's objects: (model, optimizer), and with `config.ema_decay` a third, the
  moving average of the model (a copy of it, which the train step moves and evaluation uses).

  Args:
    run_plan: the run's plan.
    image_shape: the input images' [H, W, C].
    num_classes: the number of classes.
    num_train_steps: the run's steps (the optimizer's schedule).
  """
  config = run_plan.config
  model = create_model(run_plan, image_shape, num_classes, nnx.Rngs(config.seed))
  optimizer = nnx.Optimizer(model, run_plan.recipe.optimizer(config, num_train_steps),
                            wrt=nnx.Param)
  if not config.ema_decay:
    return model, optimizer
  average = nnx.clone(model)  # its own buffers, its floats in float32 (steps.train_step)
  nnx.update(average, jax.tree.map(  # (jnp.array copies)
      lambda x: jnp.array(x, jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype),
      nnx.state(average)))
  return model, optimizer, average


def initial_state(run_plan, info, mesh, num_train_steps: int):
  """How the state is built: under jit, each shard where it lives, so that no host and no
  device ever holds more of it than its share (the same values as built eagerly).

  Args:
    run_plan: the run's plan.
    info: the data's DatasetInfo (its image shape and classes).
    mesh: the devices' mesh.
    num_train_steps: the run's steps.
  Returns:
    The objects' graph (`build_state`), their state's abstract value (shapes, dtypes,
    shardings; fsdp splits the average like the parameters), and a function that builds it.
  """

  def build():
    return build_state(run_plan, info.image_shape, info.num_classes, num_train_steps)

  graphdef, abstract = nnx.split(nnx.eval_shape(build))
  shardings = sharding.state_shardings(abstract, mesh, run_plan.config.fsdp_min_size)
  abstract = jax.tree.map(lambda x, where: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where),
                          abstract, shardings)
  return graphdef, abstract, jax.jit(lambda: nnx.split(build())[1], out_shardings=shardings)
