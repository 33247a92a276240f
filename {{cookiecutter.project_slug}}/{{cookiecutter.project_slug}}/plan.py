"""What a run of a config will be, decided before anything is read or compiled: its choices made
on its devices (`resolved`: k, the global batch), the user's modules it names, the compiler's
options. (The config checked first, against a table of rules: rules.py.) train.py and aot.py
both start here."""

import importlib
import importlib.util
import types
from typing import NamedTuple

import jax
import ml_collections

from .training import metrics

PARALLELISMS = ("spmd", "pmap", "fsdp")
# k when `config.steps_per_dispatch` is 0, on a GPU or TPU (or the largest number below it that
# divides the log, eval and checkpoint intervals): enough steps a call to hide the host's work
# per call behind a small model's steps; the rolled loop compiles once whatever k. On the CPU k
# is 1: its steps are long, the k steps are unrolled there (dispatch.make), and compiling several
# of them costs more than the dispatches they save (BENCHMARKS.md).
ACCELERATOR_STEPS_PER_DISPATCH = 10


def steps_per_dispatch(config, platform: str | None = None) -> int:
  """k: `config.steps_per_dispatch`, or when 0: 1 on the CPU, else the largest number up to
  `ACCELERATOR_STEPS_PER_DISPATCH` that divides the log, eval and checkpoint intervals."""
  if config.steps_per_dispatch:
    return config.steps_per_dispatch
  if (platform or jax.default_backend()) == "cpu":
    return 1
  intervals = (config.log_every_steps, config.eval_every_steps, config.checkpoint_every_steps)
  return next(k for k in range(ACCELERATOR_STEPS_PER_DISPATCH, 0, -1)
              if all(interval % k == 0 for interval in intervals))


# What a remote --workdir needs without TensorFlow: Orbax reaches it through etils' fsspec
# backend, the TensorBoard writer (tensorboardX) through the cloud's own client.
REMOTE_WORKDIRS = {"gs": (("gcsfs", "google.cloud.storage"), 'pip install -e ".[gcs]"'),
                   "s3": (("s3fs", "boto3"), "pip install s3fs boto3")}


def global_batch_size(config, num_devices: int | None = None) -> int:
  """Examples per optimizer step, over all devices and processes: `config.batch_size`, or
  `config.per_device_batch_size` x the devices (default: all of them) when that is set."""
  if config.per_device_batch_size:
    return config.per_device_batch_size * (num_devices or jax.device_count())
  return config.batch_size


def xla_options(config) -> dict[str, bool | int | float | str]:
  """`config.xla_options` ('name=value,...') as XLA's compiler options; {} when empty. Raises
  ValueError for text that is not of that form."""
  options = {}
  for item in filter(None, (part.strip() for part in config.get("xla_options", "").split(","))):
    name, equals, value = item.partition("=")
    if not (equals and name.strip().isidentifier() and value.strip()):
      raise ValueError(f"{item!r} is not name=value")
    value = value.strip()
    lowered = value.lower()
    for parse in (int, float):
      try:
        value = parse(value)
        break
      except ValueError:
        pass
    options[name.strip()] = {"true": True, "false": False}.get(lowered, value)
  return options


def model_module(config):
  """The module whose `create_model` builds the model: `config.model.module`, model.py (yours)
  unless a config names another (the tests name their own copy of the shipped models)."""
  return importlib.import_module(config.model.get("module", "model"))


def recipe_module(config):
  """The module of the loss, augmentation, metrics and optimizer: `config.recipe`, recipe.py
  (yours) unless a config names another (the tests name their own copy of the shipped one)."""
  return importlib.import_module(config.get("recipe", "recipe"))


class Plan(NamedTuple):
  """A run's config and what it names, made once (`make_plan`) and handed down to what builds the
  state (optim.py), the steps (dispatch.py) and the metrics (metrics.py)."""

  config: ml_collections.ConfigDict  # the run's (`resolved`, where a run made it)
  model: types.ModuleType  # config.model.module (model.py): its create_model builds the model
  recipe: types.ModuleType  # config.recipe (recipe.py): loss, augment, METRICS, optimizer, ...
  metrics: metrics.Collections  # the recipe's METRICS as CLU collections (`metrics.of`)
  xla_options: dict  # config.xla_options, parsed: jit's compiler options


def make_plan(config) -> Plan:
  """`config`'s plan: the modules it names imported, its compiler options parsed."""
  recipe = recipe_module(config)
  return Plan(config, model_module(config), recipe, metrics.of(recipe), xla_options(config))


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # its parent package is missing
    return False


def resolved(config: ml_collections.ConfigDict, devices=None) -> ml_collections.ConfigDict:
  """A copy of a valid config with what it comes to on `devices` (default: `jax.devices()`)
  under names of its own, `config.run`; the keys you set keep their meaning. `run.num_devices`;
  `run.global_batch_size`, examples per optimizer step (`global_batch_size`), and
  `run.per_device_batch_size`, its share a device; `run.steps_per_dispatch`, k (`config.
  steps_per_dispatch`, or when 0 the platform's choice)."""
  devices = devices or jax.devices()
  config = config.copy_and_resolve_references()
  batch = global_batch_size(config, len(devices))
  with config.unlocked():
    config.run = ml_collections.ConfigDict(dict(
        num_devices=len(devices), global_batch_size=batch,
        per_device_batch_size=batch // len(devices),
        steps_per_dispatch=steps_per_dispatch(config, devices[0].platform)))
  return config
