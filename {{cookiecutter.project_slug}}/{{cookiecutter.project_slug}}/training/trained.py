"""A trained run, read back from its workdir: its model for predict.py, evaluate.py and export.py
(`Restored`). (A fine-tuning's start from one: finetune.py.)"""

import hashlib
import importlib.util
import json
import math
import os
import sys
import types

import jax
import ml_collections
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax import nnx

from .. import plan
from ..data import sources
from ..errors import ConfigError
from ..parallel import sharding
from . import optim
from .checkpoints import (
  absolute,
  best,
  changed_leaf,
  check_checkpoint_fits,
  checkpoint_manager,
  typed_keys,
)
from .damaged import leaf_name, newest_intact
from .runs import CONFIG_FILE, DATA_FILE, MODEL_FILE


def read_description(workdir: str):
  """The config and DatasetInfo (without split sizes) that a run wrote into `workdir`."""
  path = epath.Path(workdir)
  if not (path / CONFIG_FILE).exists():
    raise ConfigError(f"workdir {workdir!r} holds no {CONFIG_FILE}: give the --workdir of a "
                      "training run (train.py writes it at start).")
  config = ml_collections.ConfigDict(json.loads((path / CONFIG_FILE).read_text()))
  for key, name in (("model.module", config.model.get("module", "model")),
                    ("recipe", config.get("recipe", "recipe"))):
    if not project_module(name):  # (importing a module runs its code)
      raise ConfigError(f"workdir {workdir!r}: its {CONFIG_FILE} names config.{key}={name!r}, "
                        "which is not a module of this project; only the project's own are "
                        f"imported (edit {CONFIG_FILE} to name one).")
  if "run" not in config:  # (written before config.run: batch_size held the global batch)
    config.run = dict(global_batch_size=config.batch_size,
                      steps_per_dispatch=config.steps_per_dispatch)
  data = json.loads((path / DATA_FILE).read_text())
  info = sources.DatasetInfo(tuple(data["image_shape"]), data["num_classes"], {},
                                    tuple(data["class_names"]),
                                    data.get("pixel_dtype", "uint8"),  # (older runs: uint8)
                                    data.get("crops_on_host", False))
  return config, info


PROJECT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def project_module(name: str) -> bool:
  """Whether `name` is a module of this project (a file under its folder, found without
  running it), as a workdir's config may name only those."""
  try:
    spec = importlib.util.find_spec(name) if name.isidentifier() else None
  except (ImportError, ValueError):
    return False
  return bool(spec and spec.origin and os.path.abspath(spec.origin).startswith(PROJECT + os.sep))


def use_runs_model(workdir: str, config, runs_code: bool = False) -> tuple[str, str]:
  """Which code builds the run's model: today's `config.model.module` (model.py), or, where it
  differs from the copy the run kept (`MODEL_FILE`), that copy, with `runs_code` alone (it
  executes the workdir's file), loaded as a module of its own, named in `config.model.module`.

  Args:
    workdir: the run's workdir.
    config: the run's config, as read from it.
    runs_code: --use_runs_model's.
  Returns:
    That code, in a phrase, and what to add to the error of a model that does not fit the
    checkpoint.
  """
  name = config.model.get("module", "model")
  saved = epath.Path(workdir) / MODEL_FILE
  if not saved.exists():
    return f"{name}.py as it is now (the run kept no copy of its own)", ""
  kept = saved.read_text()
  try:
    today = epath.Path(plan.model_module(config).__file__).read_text()
  except Exception:  # (today's does not import: any error of its code)  # noqa: BLE001
    today = None
  if today == kept:
    return f"{name}.py, as the run trained it", ""
  if not runs_code:
    return (f"{name}.py as it is now, which differs from the run's copy {saved} (not run: "
            "--use_runs_model builds that copy, executing it)",
            f"; {name}.py differs from the run's copy, {saved}: --use_runs_model builds the "
            "model with it (that executes the file's code: a workdir you trust)")
  module = types.ModuleType(f"{name}_of_a_run_{hashlib.sha1(kept.encode()).hexdigest()[:12]}")
  if module.__name__ not in sys.modules:
    module.__file__ = str(saved)
    sys.modules[module.__name__] = module
    exec(compile(kept, str(saved), "exec"), module.__dict__)  # noqa: S102 (the run's own code)
  config.model.module = module.__name__
  return f"the run's own, {saved} (--use_runs_model; {name}.py has changed since)", ""


def center_ratio(run) -> float:
  """The share of a photo that evaluation keeps: the run's eval_crop_ratio where the photos were
  stored whole (image_files.Crops), else 1 (the image scaled to cover, its centre kept)."""
  return run.config.get("eval_crop_ratio", 1.0) if run.info.crops_on_host else 1.0


def restore_model(checkpoints, step: int, abstract, workdir: str):
  """The model of a checkpoint (its moving average, when the run kept one: what evaluation
  used); the optimizer's leaves are never read (Orbax's placeholders).

  Args:
    checkpoints: Orbax's manager.
    step: the checkpoint's step.
    abstract: a whole state's abstract value, whose shapes, dtypes and shardings it takes.
    workdir: the run's workdir (named in errors).
  """
  check_checkpoint_fits(checkpoints, step, abstract, workdir)
  keep = "2/" if len(abstract) > 2 else "0/"
  skip = lambda path, x: x if leaf_name(path).startswith(keep) else ocp.PLACEHOLDER  # noqa: E731
  item = jax.tree_util.tree_map_with_path(skip, abstract)
  restore_args = jax.tree_util.tree_map_with_path(
      skip, ocp.checkpoint_utils.construct_restore_args(abstract))
  state = checkpoints.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
      item, restore_args=restore_args)))["state"]
  return typed_keys(abstract[int(keep[0])], state[int(keep[0])])


def device_memory_bytes(device) -> int | None:
  """What `device` can hold (its allocator's limit on GPUs and TPUs); None where JAX does not
  say (the CPU)."""
  stats = device.memory_stats()
  return stats.get("bytes_limit") if stats else None


def check_fits_devices(abstract_model, mesh, config, workdir: str) -> None:
  """Raises ConfigError, before anything is read, when the model as the run placed it (split by
  fsdp, else whole) is larger than a device holds, saying what it needs.

  Args:
    abstract_model: the model's abstract state, placed.
    mesh: the devices' mesh.
    config: the run's config.
    workdir: the run's workdir (named in the error).
  """
  memory = device_memory_bytes(mesh.local_devices[0])  # only this process's report it
  need = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(abstract_model))
  if memory and need > memory:
    devices = math.ceil(need * mesh.size / memory)
    raise ConfigError(
        f"the model of {workdir!r} needs {need / 2**30:.3g} GiB a device ({config.parallelism} "
        f"over {mesh.size} devices); these hold {memory / 2**30:.3g} GiB: use "
        + (f"{devices} or more of them." if config.parallelism == "fsdp" else
           f"devices of {need / 2**30:.3g} GiB or more."))


class Restored:
  """A workdir's checkpoint: the config and data it was trained with, and its model alone
  (`graphdef`, `state`; the moving average when the run kept one), placed as the run placed it
  (split by fsdp, else whole on each device).

  Args:
    workdir: the run's workdir.
    step: the checkpoint's step (a number, or its text); None: the latest; "best": the best
      evaluation's (by the run's `config.best_metric`: checkpoints.best).
    mesh: the devices' mesh; None: every device.
    runs_model: build it by the run's own copy of model.py where the two differ
      (`use_runs_model`); else by today's.
  """

  def __init__(self, workdir: str, step: int | str | None = None, mesh=None,
               runs_model: bool = False):
    self.config, self.info = read_description(workdir)
    if isinstance(step, str) and step != "best":
      if not step.isdigit():
        raise ConfigError(f"--step={step!r} must be a checkpoint's step (a number) or 'best'.")
      step = int(step)
    self.model_code, hint = use_runs_model(workdir, self.config, runs_model)
    if self.config.parallelism == "pmap":  # the same parameters: placed as spmd places them
      self.config.parallelism = "spmd"
    self.mesh = mesh or sharding.make_mesh(self.config)
    run_plan = plan.make_plan(self.config)
    graphdef, abstract, _ = optim.initial_state(run_plan, self.info, self.mesh, 1)
    model = abstract[2 if len(abstract) > 2 else 0]
    self.bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model))
    check_fits_devices(model, self.mesh, self.config, workdir)
    checkpoints = checkpoint_manager(absolute(workdir), create=False)
    available = checkpoints.all_steps()
    if step == "best":
      if not self.config.get("best_metric"):
        raise ConfigError(f"--step=best: the run in {workdir!r} kept no best checkpoint (its "
                          "config.best_metric is ''); give a --step of "
                          f"{', '.join(map(str, available)) or 'a checkpoint'}.")
      step = best(checkpoints, self.config)[0]
      if step is None:
        raise ConfigError(f"--step=best: no evaluation of the run in {workdir!r} is saved yet.")
    if not available:
      raise ConfigError(f"workdir {workdir!r} holds no checkpoint yet; train first, or give "
                        "the --workdir of a run that saved one.")
    if step is not None and step not in available:
      raise ConfigError(f"--step={step}: workdir {workdir!r} holds the checkpoints of steps "
                        f"{', '.join(map(str, available))}.")
    def damaged(s, why):
      if not (epath.Path(checkpoints.directory) / str(s)).exists():
        raise FileNotFoundError(s)  # (deleted as it was read: a run's retention, saving anew)
      if step is not None:  # the one asked for
        raise ConfigError(f"checkpoint {step} in {workdir!r} {why}; give another --step (the "
                          f"checkpoints: {', '.join(map(str, available))}).")
      logging.warning("checkpoint %d in %s %s; using an older one", s, workdir, why)

    keep = 2 if len(abstract) > 2 else 0  # (the leaves read: the model's, or its average's)
    for attempt in range(3):  # (the steps listed again after one was deleted)
      try:
        self.step, self.state = newest_intact(
            [step] if step is not None else sorted(available, reverse=True),
            lambda s: restore_model(checkpoints, s, abstract, workdir), damaged,
            lambda s, model: changed_leaf(checkpoints, s, {keep: model}))
        break
      except ConfigError as e:  # another model: today's model.py, where the run's differs
        raise ConfigError(f"{str(e).removesuffix('.')}{hint}.") from None
      except FileNotFoundError as e:
        checkpoints.reload()
        available = checkpoints.all_steps()
        if step is not None or attempt == 2:
          raise ConfigError(f"checkpoint {e} in {workdir!r} was deleted as it was read (the run "
                            "there keeps its newest checkpoints, config.max_checkpoints_to_keep)"
                            f"; the checkpoints now: {', '.join(map(str, available))}.") from None
    if self.step is None:
      raise ConfigError(f"no checkpoint in {workdir!r} can be restored (the warnings above say "
                        "why).")
    checkpoints.close()
    self.summary = (f"model of step {self.step}: {sharding.bytes_per_device(self.state) / 1e6:.3g} "
                    f"MB a device ({self.config.parallelism}; a whole copy: {self.bytes / 1e6:.3g} "
                    f"MB); model: {self.model_code}")  # as train.py logs the state's
    self.graphdef = nnx.graphdef(nnx.merge(graphdef, abstract)[-1 if len(abstract) > 2 else 0])
