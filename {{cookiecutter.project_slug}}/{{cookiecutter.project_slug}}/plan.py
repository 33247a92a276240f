"""What a run of a config will be, decided before anything is read or compiled: its choices made
on its devices (`resolved`: k, the global batch), a resumed run's own config (`resumed`), the
user's modules it names, the compiler's options. (The config checked first, against a table of
rules: rules.py.) train.py and aot.py both start here."""

import importlib
import json
import types
from typing import NamedTuple

import jax
import ml_collections
from absl import logging

from .errors import ConfigError
from .training import metrics

CONFIG_FILE = "config.json"  # in a run's workdir: its resolved config (runs.write_description)

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
  return Plan(config, model_module(config), recipe,
              metrics.of(recipe, weighted=bool(config.get("class_weights"))), xla_options(config))


def resolved(config: ml_collections.ConfigDict, devices=None,
             resuming: tuple[dict | None, str] = (None, "")) -> ml_collections.ConfigDict:
  """A copy of a valid config with what it comes to on the devices under names of its own,
  `config.run`; the keys you set keep their meaning. `run.num_devices`; `run.global_batch_size`,
  examples per optimizer step (`global_batch_size`), and `run.per_device_batch_size`, its share
  a device; `run.steps_per_dispatch`, k (`config.steps_per_dispatch`, or when 0 the platform's);
  `run.input_mean` and `input_std` (`input_statistics`).

  Args:
    config: a valid config.
    devices: the devices the run will use; None: `jax.devices()`.
    resuming: the config (a dict) of the run in the workdir (a path) that this run resumes, if
      any (`resumed`; its changes logged).
  """
  devices = devices or jax.devices()
  config = config.copy_and_resolve_references()
  batch = global_batch_size(config, len(devices))
  with config.unlocked():
    config.run = ml_collections.ConfigDict(dict(
        num_devices=len(devices), global_batch_size=batch,
        per_device_batch_size=batch // len(devices),
        steps_per_dispatch=steps_per_dispatch(config, devices[0].platform),
        **input_statistics(config, resuming[0])))
  saved, workdir = resuming
  if saved is not None:  # a resume
    config, changes = resumed(config, saved, workdir)
    for line in changes:
      logging.warning("%s", line)
  return config


def input_statistics(config, saved: dict | None) -> dict:
  """`run.input_mean` and `input_std` (steps.forward; (): none): the config's where set, else a
  resumed run's own, else pretrained weights' (`config.init_from`: pretrained.py)."""
  keys = ("input_mean", "input_std")
  if not config.get("input_mean") and saved is not None:
    return {key: tuple(saved.get("run", {}).get(key, ())) for key in keys}
  if not config.get("input_mean") and config.get("init_from"):
    from .training import pretrained  # (asked for: loaded now)

    if pretrained.is_weights(config.init_from):
      return pretrained.input_statistics(config.init_from)
  return {key: tuple(config.get(key, ())) for key in keys}


# Keys that a resumed run may change: how it runs, not what it computes (the rest, what it
# optimises and on what data, is the run's own: `resumed`).
FREE_ON_RESUME = (
    "num_workers", "read_threads", "prefetch_batches", "prefetch_to_device", "grad_accum_steps",
    "steps_per_dispatch", "init_from", "parallelism", "fsdp_devices", "fsdp_min_size",
    "print_shardings", "xla_options", "compilation_cache_dir", "compilation_cache_min_seconds",
    "watchdog_compile_s", "watchdog_floor_s", "watchdog_factor",
    "peak_flops_per_device", "profile_first_step", "profile_num_steps", "wandb_project",
    "log_every_steps", "eval_every_steps", "checkpoint_every_steps", "max_checkpoints_to_keep",
    "skip_nonfinite_steps", "cpu_sync_every_steps", "per_device_batch_size", "resume_may_change",
    "remat", "model.scan",  # (the same parameters either way)
    "run")  # (what the config comes to on the devices: its global batch is kept above)


def flatten(tree: dict, prefix: str = "") -> dict:
  """Nested dicts as one dict of dotted keys ('model.features')."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def resumed(config: ml_collections.ConfigDict, saved: dict,
            workdir: str) -> tuple[ml_collections.ConfigDict, list[str]]:
  """A resolved config resuming a run: a differing key outside `FREE_ON_RESUME` raises
  ConfigError unless `config.resume_may_change` names it; `per_device_batch_size` on another
  device count keeps the run's global batch (`run.per_device_batch_size` changes).

  Args:
    config: the config, resolved (`resolved`).
    saved: the run's config.json.
    workdir: the run's workdir (named in errors).
  Returns:
    The config, and the log lines of what changed.
  """
  config, lines = config.copy_and_resolve_references(), []
  num_devices, per_device = config.run.num_devices, config.per_device_batch_size
  # (A config.json from before `config.run` held the global batch in batch_size.)
  run_batch = saved.get("run", {}).get("global_batch_size", saved["batch_size"])
  if per_device and config.run.global_batch_size != run_batch:
    if run_batch % num_devices:
      raise ConfigError(
          f"the run in {workdir!r} has a global batch of {run_batch}, which {num_devices} "
          f"devices do not divide (config.per_device_batch_size={config.per_device_batch_size}"
          f"); resume it on a number of devices that divides {run_batch}, or use a new "
          "--workdir.")
    lines.append(f"resumed on {num_devices} devices: per_device_batch_size "
                 f"{config.per_device_batch_size} -> {run_batch // num_devices}, keeping the "
                 f"run's global batch of {run_batch}")
    config.run.per_device_batch_size = run_batch // num_devices
    config.run.global_batch_size = run_batch
  may_change = {key.strip() for key in config.resume_may_change.split(",") if key.strip()}
  given, saved = flatten(json.loads(config.to_json())), flatten(saved)
  for key in sorted(given.keys() & saved.keys()):
    if (given[key] == saved[key] or key.split(".")[0] in FREE_ON_RESUME
        or key == "batch_size" and per_device):  # (then not what the run uses)
      continue
    if key not in may_change:
      raise ConfigError(
          f"config.{key}={given[key]!r} differs from the {saved[key]!r} of the run in "
          f"{workdir!r} that this resumes ({CONFIG_FILE}); a resumed run keeps its config: "
          f"use a new --workdir, or --config.resume_may_change={key} to change it (logged).")
    lines.append(f"resumed with config.{key} changed: {saved[key]!r} -> {given[key]!r}")
  return config, lines
