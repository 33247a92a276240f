"""A run's workdir: what it says about itself, its Orbax checkpoints, and what is restored from
them (a resume, a fine-tuning start, the model alone for predict.py, evaluate.py and export.py).

At its start a run writes into its workdir
  config.json  the resolved config (what model.py and the steps were given),
  data.json    the data's description: image shape, number of classes, class names,
so that a checkpoint can be used with nothing but the workdir (`Restored`). A run started again
in the same workdir resumes it, and keeps its config but for what `FREE_ON_RESUME` names.
This module defines no flags: any script may import it.
"""

import contextlib
import json
import math
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from ..data import input_pipeline
from ..errors import ConfigError
from ..parallel import sharding
from . import optim

CONFIG_FILE, DATA_FILE = "config.json", "data.json"


def array_handlers():
  """Orbax's writers of jax.Array leaves (its global registry is left as it is). Orbax splits
  the writing of a replicated array across its replicas on TPU (its default there); on the CPU,
  where that compiles slicing programs at the first save (slower than one replica writing), and
  on GPUs (Orbax's own choice for them, which it detects only from JAX_PLATFORMS), one replica
  writes it."""
  split = None if jax.default_backend() == "tpu" else False
  return ocp.type_handlers.create_type_handler_registry(
      (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=split)))


def checkpoint_manager(workdir: str, max_to_keep: int | None = None, create: bool = True):
  """The checkpoints of `workdir` (`create=False`: read them, never make the directory).
  Orbax writes each checkpoint to a temporary directory and renames it when complete, so a
  checkpoint cut short by a kill is never restored."""
  return ocp.CheckpointManager(
      os.path.join(workdir, "checkpoints"),
      options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create),
      item_handlers=dict(
          state=ocp.PyTreeCheckpointHandler(type_handler_registry=array_handlers())))


def leaf_name(path) -> str:
  """A state leaf's name as the checkpoint spells it: '0/convs/1/kernel/value' (0: the model)."""
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def stored_shape(x) -> tuple:
  """A leaf's shape as Orbax stores it: a typed PRNG key (a Dropout's stream, `nnx.Rngs`) as its
  raw key data (key<fry>[] is stored as uint32[2]); any other leaf as it is."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return tuple(jax.eval_shape(jax.random.key_data, x).shape)
  return tuple(x.shape)


def shapes(tree) -> dict[str, tuple]:
  """Each leaf's stored shape (`stored_shape`), by name: a checkpoint's metadata or a state."""
  return {leaf_name(path): stored_shape(x)
          for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def check_checkpoint_fits(checkpoints, step: int, abstract_state, workdir: str) -> None:
  """Raises ConfigError if the checkpoint of `step` holds a different model or optimizer."""
  saved = shapes(checkpoints.item_metadata(step)["state"])
  wanted = shapes(abstract_state)
  for name in sorted(saved.keys() | wanted.keys()):
    if saved.get(name) != wanted.get(name):
      raise ConfigError(
          f"workdir {workdir!r} holds a checkpoint (step {step}) of a different model: {name} is "
          f"{saved.get(name, 'absent')} there and {wanted.get(name, 'absent')} in this config; "
          "use a new --workdir, or the config that wrote it.")


def restore_state(checkpoints, step: int, abstract, workdir: str):
  """The state of checkpoint `step`, in the shapes, dtypes and shardings of `abstract`."""
  check_checkpoint_fits(checkpoints, step, abstract, workdir)
  return checkpoints.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
      abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))))["state"]


def write_description(workdir: str, config, info: input_pipeline.DatasetInfo) -> None:
  """config.json and data.json (process 0): what `restore` needs besides a checkpoint."""
  if jax.process_index() != 0:
    return
  names = info.class_names or tuple(str(i) for i in range(info.num_classes))
  data = dict(image_shape=list(info.image_shape), num_classes=info.num_classes,
              class_names=list(names), pixel_dtype=info.pixel_dtype,
              model_input=input_pipeline.model_input(info.pixel_dtype),
              crops_on_host=info.crops_on_host)
  (epath.Path(workdir) / CONFIG_FILE).write_text(config.to_json(indent=2))
  (epath.Path(workdir) / DATA_FILE).write_text(json.dumps(data, indent=2))


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


def read_description(workdir: str):
  """The config and DatasetInfo (without split sizes) that a run wrote into `workdir`."""
  path = epath.Path(workdir)
  if not (path / CONFIG_FILE).exists():
    raise ConfigError(f"workdir {workdir!r} holds no {CONFIG_FILE}: give the --workdir of a "
                      "training run (train.py writes it at start).")
  config = ml_collections.ConfigDict(json.loads((path / CONFIG_FILE).read_text()))
  data = json.loads((path / DATA_FILE).read_text())
  info = input_pipeline.DatasetInfo(tuple(data["image_shape"]), data["num_classes"], {},
                                    tuple(data["class_names"]),
                                    data.get("pixel_dtype", "uint8"),  # (older runs: uint8)
                                    data.get("crops_on_host", False))
  return config, info


def center_ratio(run) -> float:
  """The share of a photo that evaluation keeps: the run's eval_crop_ratio where the photos were
  stored whole (image_files.Crops), else 1 (the image scaled to cover, its centre kept)."""
  return run.config.get("eval_crop_ratio", 1.0) if run.info.crops_on_host else 1.0


def restore_model(checkpoints, step: int, abstract, workdir: str):
  """The model of checkpoint `step` (its moving average, when the run kept one: what evaluation
  used), in the shapes, dtypes and shardings of `abstract` (a whole state's); the optimizer's
  leaves are never read (Orbax's placeholders)."""
  check_checkpoint_fits(checkpoints, step, abstract, workdir)
  keep = "2/" if len(abstract) > 2 else "0/"
  skip = lambda path, x: x if leaf_name(path).startswith(keep) else ocp.PLACEHOLDER  # noqa: E731
  item = jax.tree_util.tree_map_with_path(skip, abstract)
  restore_args = jax.tree_util.tree_map_with_path(
      skip, ocp.checkpoint_utils.construct_restore_args(abstract))
  state = checkpoints.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
      item, restore_args=restore_args)))["state"]
  return state[int(keep[0])]


def device_memory_bytes(device) -> int | None:
  """What `device` can hold (its allocator's limit on GPUs and TPUs); None where JAX does not
  say (the CPU)."""
  stats = device.memory_stats()
  return stats.get("bytes_limit") if stats else None


def check_fits_devices(abstract_model, mesh, config, workdir: str) -> None:
  """Raises ConfigError, before anything is read, when the model as the run placed it (split by
  fsdp, else whole) is larger than a device of `mesh` holds, saying what it needs."""
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
  """A checkpoint of a workdir: the config and data it was trained with, and its model alone
  (`graphdef`, `state`: the moving average of the parameters, when the run kept one), never its
  optimizer, on the devices of `mesh` (default: all), placed as the run placed it: split over
  them by fsdp (its `fsdp_devices`, `fsdp_min_size`), else whole on each (a pmap run's too)."""

  def __init__(self, workdir: str, step: int | None = None, mesh=None):
    self.config, self.info = read_description(workdir)
    if self.config.parallelism == "pmap":  # the same parameters: placed as spmd places them
      self.config.parallelism = "spmd"
    self.mesh = mesh or sharding.make_mesh(self.config)
    graphdef, abstract, _ = optim.initial_state(self.config, self.info, self.mesh, 1)
    model = abstract[2 if len(abstract) > 2 else 0]
    self.bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model))
    check_fits_devices(model, self.mesh, self.config, workdir)
    checkpoints = checkpoint_manager(absolute(workdir), create=False)
    available = checkpoints.all_steps()
    if not available:
      raise ConfigError(f"workdir {workdir!r} holds no checkpoint yet; train first, or give "
                        "the --workdir of a run that saved one.")
    self.step = available[-1] if step is None else step
    if self.step not in available:
      raise ConfigError(f"--step={step}: workdir {workdir!r} holds the checkpoints of steps "
                        f"{', '.join(map(str, available))}.")
    self.state = restore_model(checkpoints, self.step, abstract, workdir)
    checkpoints.close()
    self.summary = (f"model of step {self.step}: {sharding.bytes_per_device(self.state) / 1e6:.3g} "
                    f"MB a device ({self.config.parallelism}; a whole copy: {self.bytes / 1e6:.3g} "
                    "MB)")  # as train.py logs the state's
    self.graphdef = nnx.graphdef(nnx.merge(graphdef, abstract)[-1 if len(abstract) > 2 else 0])


def init_from(source: str, abstract, init):
  """Fine-tuning: a function like `init` (the fresh state) whose model parameters and batch
  statistics are those of the latest checkpoint of workdir `source` (those of its moving
  average, when it kept one: what its evaluation used); the optimizer is fresh.
  Leaves whose shape differs there (a classifier for another number of classes) stay fresh,
  and are logged. Raises ConfigError, having read only the checkpoint's metadata, when a model
  leaf is absent on either side."""
  checkpoints = checkpoint_manager(absolute(source), create=False)
  step = checkpoints.latest_step()
  if step is None:
    raise ConfigError(f"config.init_from={source!r} holds no checkpoint yet.")
  there = shapes(checkpoints.item_metadata(step)["state"])
  # The model's leaves (0/; 1/: the optimizer's), or its moving average's (2/), named as ours.
  prefix = "2/" if any(name.startswith("2/") for name in there) else "0/"
  saved = {"0/" + n[2:]: s for n, s in there.items() if n.startswith(prefix)}
  ours = {n: s for n, s in shapes(abstract).items() if n.startswith("0/")}
  for name in sorted(saved.keys() ^ ours.keys()):
    there = "in the checkpoint but not in this model" if name in saved else (
        "in this model but not in the checkpoint")
    raise ConfigError(f"config.init_from={source!r}: {name.removesuffix('/value')[2:]} is "
                      f"{there} (a missing or extra layer); only the shapes of leaves may "
                      "differ.")
  learned = {name for path, v in jax.tree_util.tree_leaves_with_path(
      abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
      if isinstance(v, (nnx.Param, nnx.BatchStat))
      and (name := f"{leaf_name(path)}/value").startswith("0/")}
  fresh = sorted(name for name in learned if saved[name] != ours[name])
  logging.info("Fine-tuning from step %d of %s%s%s", step, source,
               " (its moving average)" if prefix == "2/" else "", "; initialised afresh "
               "(another shape): " + ", ".join(f"{n.removesuffix('/value')[2:]} {saved[n]} -> "
                                               f"{ours[n]}" for n in fresh) if fresh else "")
  copied = learned - set(fresh)
  targets = {leaf_name(path): x for path, x in jax.tree_util.tree_leaves_with_path(abstract)}

  def build():
    item, restore_args = {}, {}
    for name in copied:  # nested dicts of the leaves to read, each into its shards
      target = targets[name]
      *parents, last = (prefix + name[2:]).split("/")
      node, args = item, restore_args
      for key in parents:
        node, args = node.setdefault(key, {}), args.setdefault(key, {})
      node[last] = target
      args[last] = ocp.ArrayRestoreArgs(sharding=target.sharding, global_shape=target.shape,
                                        dtype=target.dtype)
    read = checkpoints.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item, restore_args=restore_args, partial_restore=True)))["state"]

    def take(path, x):
      name = leaf_name(path)
      if name.startswith("2/"):  # the moving average (config.ema_decay) starts as the model
        name = "0/" + name[2:]
      if name not in copied:
        return x
      leaf = read
      for key in (prefix + name[2:]).split("/"):
        leaf = leaf[key]
      return jnp.array(leaf, x.dtype)  # its own buffer (the model and its average: two)

    return jax.tree_util.tree_map_with_path(take, init())

  return build



def restore_or_init(checkpoints, abstract, init, workdir: str):
  """The step and state of the latest complete checkpoint in `workdir`, restored into the
  shapes, dtypes and shardings of `abstract`, or (0, `init()`). The data resume from the step:
  batch b is batch b whatever the steps per dispatch and the number of processes. Every
  process must see the same checkpoints (a shared workdir)."""
  step = checkpoints.latest_step()
  if jax.process_count() > 1:
    seen = multihost_utils.process_allgather(np.int32(-1 if step is None else step)).tolist()
    if len(set(seen)) > 1:
      raise ConfigError(
          f"the workdir is not shared by the processes: their latest checkpoints in {workdir!r} "
          f"are {', '.join(f'{s if s >= 0 else None} (process {i})' for i, s in enumerate(seen))}; "
          "give every process the same --workdir, on a file system that they all see (or a "
          "bucket: gs://...).")
  if step is None:
    return 0, init()
  state = restore_state(checkpoints, step, abstract, workdir)
  logging.info("Resumed from the checkpoint of step %d in %s", step, workdir)
  return step, state



# Keys that a resumed run may change: how it runs, not what it computes (the rest, what it
# optimises and on what data, is the run's own: `resumed`).
FREE_ON_RESUME = (
    "num_workers", "read_threads", "prefetch_batches", "prefetch_to_device", "grad_accum_steps",
    "steps_per_dispatch", "init_from", "parallelism", "fsdp_devices", "fsdp_min_size",
    "print_shardings", "xla_options", "compilation_cache_dir", "compilation_cache_min_seconds",
    "peak_flops_per_device", "profile_first_step", "profile_num_steps", "wandb_project",
    "log_every_steps", "eval_every_steps", "checkpoint_every_steps", "max_checkpoints_to_keep",
    "skip_nonfinite_steps", "cpu_sync_every_steps", "per_device_batch_size", "resume_may_change")


def flatten(tree: dict, prefix: str = "") -> dict:
  """Nested dicts as one dict of dotted keys ('model.features')."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def resumed(config: ml_collections.ConfigDict, saved: dict, workdir: str,
            num_devices: int) -> tuple[ml_collections.ConfigDict, list[str]]:
  """A resolved `config` resuming the run whose resolved config is `saved` (its config.json):
  the run's contract. A key outside `FREE_ON_RESUME` that differs raises ConfigError, unless
  `config.resume_may_change` names it; `per_device_batch_size` on another device count keeps
  the run's global batch (and so its steps and the data's order). Returns the config and the
  log lines that say what changed. Keys that one of the two configs lacks are not compared."""
  config, lines = config.copy_and_resolve_references(), []
  if config.per_device_batch_size and config.batch_size != saved["batch_size"]:
    run_batch = saved["batch_size"]
    if run_batch % num_devices:
      raise ConfigError(
          f"the run in {workdir!r} has a global batch of {run_batch}, which {num_devices} "
          f"devices do not divide (config.per_device_batch_size={config.per_device_batch_size}"
          f"); resume it on a number of devices that divides {run_batch}, or use a new "
          "--workdir.")
    lines.append(f"resumed on {num_devices} devices: per_device_batch_size "
                 f"{config.per_device_batch_size} -> {run_batch // num_devices}, keeping the "
                 f"run's global batch of {run_batch}")
    config.per_device_batch_size, config.batch_size = run_batch // num_devices, run_batch
  may_change = {key.strip() for key in config.resume_may_change.split(",") if key.strip()}
  given, saved = flatten(json.loads(config.to_json())), flatten(saved)
  for key in sorted(given.keys() & saved.keys()):
    if given[key] == saved[key] or key.split(".")[0] in FREE_ON_RESUME:
      continue
    if key not in may_change:
      raise ConfigError(
          f"config.{key}={given[key]!r} differs from the {saved[key]!r} of the run in "
          f"{workdir!r} that this resumes ({CONFIG_FILE}); a resumed run keeps its config: "
          f"use a new --workdir, or --config.resume_may_change={key} to change it (logged).")
    lines.append(f"resumed with config.{key} changed: {saved[key]!r} -> {given[key]!r}")
  return config, lines
