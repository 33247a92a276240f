"""A run's config (`prepare`) and its workdir: config.json (the run's config), data.json (the data's
description), a copy of its model.py, its checkpoints (checkpoints.py), and resuming: a run
started again in its workdir resumes it and keeps its config but for what `FREE_ON_RESUME` names.
(Reading a trained run back: trained.py.)"""

import contextlib
import json
import os
import sys

import jax
import ml_collections
from absl import logging
from etils import epath

from .. import plan, rules
from ..data import sources
from ..errors import ConfigError
from .checkpoints import checkpoint_manager

CONFIG_FILE, DATA_FILE = "config.json", "data.json"
MODEL_FILE = "model.py"  # the source of the run's model module (config.model.module), as trained


def prepare(config: ml_collections.ConfigDict, workdir: str) -> tuple[plan.Plan, str]:
  """The run's plan (`plan.make_plan`: the modules its config names, made once) and workdir. Its
  config is `config` checked and frozen, with what it comes to on these devices under
  `config.run` (`plan.resolved`: k, the global batch and a device's share) and, when `workdir`
  holds a run, that run's own config (`resumed`; changes logged); the workdir an absolute path
  (a bucket's as it is)."""
  rules.validate_config(config, workdir)
  config, workdir = plan.resolved(config), absolute(workdir)
  if (saved := saved_config(workdir)) is not None:  # a resume
    config, changes = resumed(config, saved, workdir)
    for line in changes:
      logging.warning("%s", line)
  return plan.make_plan(ml_collections.FrozenConfigDict(config)), workdir


def write_description(workdir: str, config, info: sources.DatasetInfo) -> None:
  """config.json, data.json and a copy of the model's source, `MODEL_FILE` (process 0): what
  `trained.Restored` needs besides a checkpoint, whatever model.py comes to hold."""
  if jax.process_index() != 0:
    return
  names = info.class_names or tuple(str(i) for i in range(info.num_classes))
  data = dict(image_shape=list(info.image_shape), num_classes=info.num_classes,
              class_names=list(names), pixel_dtype=info.pixel_dtype,
              model_input=sources.model_input(info.pixel_dtype),
              crops_on_host=info.crops_on_host)
  (epath.Path(workdir) / CONFIG_FILE).write_text(config.to_json(indent=2))
  (epath.Path(workdir) / DATA_FILE).write_text(json.dumps(data, indent=2))
  module = sys.modules[config.model.get("module", "model")]  # (imported: the model is built)
  source, copy = epath.Path(module.__file__).read_text(), epath.Path(workdir) / MODEL_FILE
  if copy.exists() and copy.read_text() != source:  # a resume, its leaves the same
    logging.warning("%s has changed since this run last started; it goes on with it as it is "
                    "now (its leaves are the same), and %s now holds it", module.__file__, copy)
  copy.write_text(source)


def saved_config(workdir: str) -> dict | None:
  """The resolved config (a dict) of the run that a start in `workdir` resumes: that of its
  config.json when the workdir holds a checkpoint, else None (a new run)."""
  path = epath.Path(workdir)
  if not (path / CONFIG_FILE).exists() or not (path / "checkpoints").exists():
    return None
  with contextlib.closing(checkpoint_manager(workdir, create=False)) as checkpoints:
    if checkpoints.latest_step() is None:
      return None
  return json.loads((path / CONFIG_FILE).read_text())


def absolute(path: str) -> str:
  """A local path made absolute (Orbax reads only those); a bucket's (gs://...) as it is."""
  return path if "://" in path else os.path.abspath(path)


# Keys that a resumed run may change: how it runs, not what it computes (the rest, what it
# optimises and on what data, is the run's own: `resumed`).
FREE_ON_RESUME = (
    "num_workers", "read_threads", "prefetch_batches", "prefetch_to_device", "grad_accum_steps",
    "steps_per_dispatch", "init_from", "parallelism", "fsdp_devices", "fsdp_min_size",
    "print_shardings", "xla_options", "compilation_cache_dir", "compilation_cache_min_seconds",
    "peak_flops_per_device", "profile_first_step", "profile_num_steps", "wandb_project",
    "log_every_steps", "eval_every_steps", "checkpoint_every_steps", "max_checkpoints_to_keep",
    "skip_nonfinite_steps", "cpu_sync_every_steps", "per_device_batch_size", "resume_may_change",
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
  """A resolved `config` (`plan.resolved`) resuming the run whose config.json is `saved`: a
  differing key outside `FREE_ON_RESUME` raises ConfigError unless `config.resume_may_change`
  names it; `per_device_batch_size` on another device count keeps the run's global batch
  (`run.per_device_batch_size` changes). Returns the config and the log lines of what changed."""
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
