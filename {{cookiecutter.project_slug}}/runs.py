"""A run's workdir: what it says about itself, its checkpoints, and the state built from them.

Written once, used by train.py, predict.py, evaluate.py and export.py (this module defines no
flags: any script may import it). At its start a run writes into its workdir
  config.json  the resolved config (what model.py and the steps were given),
  data.json    the data's description: image shape, number of classes, class names,
so that a checkpoint can be used with nothing but the workdir (`restore`).
"""

import contextlib
import json
import math
import os

import grain
import jax
import jax.numpy as jnp
import ml_collections
import optax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax import nnx

import input_pipeline
import parallel
import steps
from model import create_model

CONFIG_FILE, DATA_FILE = "config.json", "data.json"


class ConfigError(ValueError):
  """A config that cannot work; the message names the key, the value and the fix."""


def array_handlers():
  """Orbax's writers of jax.Array leaves (its global registry is left as it is). Orbax splits
  the writing of a replicated array across its replicas on TPU (its default there); on the CPU,
  where that compiles slicing programs at the first save (2.7 s against 0.25 s on 8 devices),
  and on GPUs (Orbax's own choice for them, which it detects only from JAX_PLATFORMS), one
  replica writes it."""
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


def global_batch_size(config, num_devices: int | None = None) -> int:
  """Examples per optimizer step, over all devices and processes: `config.batch_size`, or
  `config.per_device_batch_size` x the devices (default: all of them) when that is set."""
  if config.per_device_batch_size:
    return config.per_device_batch_size * (num_devices or jax.device_count())
  return config.batch_size


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
  shardings = parallel.state_shardings(abstract, mesh, config.fsdp_min_size)
  abstract = jax.tree.map(lambda x, where: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where),
                          abstract, shardings)
  return graphdef, abstract, jax.jit(lambda: nnx.split(build())[1], out_shardings=shardings)


def leaf_name(path) -> str:
  """A state leaf's name as the checkpoint spells it: '0/convs/1/kernel/value' (0: the model)."""
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def shapes(tree) -> dict[str, tuple]:
  return {leaf_name(path): tuple(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(tree)}


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
  stored whole (input_pipeline.Crops), else 1 (the image scaled to cover, its centre kept)."""
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
    self.mesh = mesh or parallel.make_mesh(self.config)
    graphdef, abstract, _ = initial_state(self.config, self.info, self.mesh, 1)
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
    self.summary = (f"model of step {self.step}: {parallel.bytes_per_device(self.state) / 1e6:.3g} "
                    f"MB a device ({self.config.parallelism}; a whole copy: {self.bytes / 1e6:.3g} "
                    "MB)")  # as train.py logs the state's
    self.graphdef = nnx.graphdef(nnx.merge(graphdef, abstract)[-1 if len(abstract) > 2 else 0])


def probabilities(graphdef, state, images_BHWC, mask_B=None) -> jax.Array:
  """The model's class probabilities (float32 `[batch, classes]`) for stored images (uint8
  pixels divided by 255 on the device), computed as evaluation computes the logits: the model
  in eval mode, given the mask (`mask_B`, default all True) if its `__call__` takes one."""
  model = nnx.merge(graphdef, state)
  model.eval()
  mask_B = jnp.ones(images_BHWC.shape[:1], bool) if mask_B is None else mask_B
  logits_BK = steps.call_model(model, steps.prepare_images({"image": images_BHWC}), mask_B)
  return jax.nn.softmax(logits_BK.astype(jnp.float32), axis=-1)


def find_images(paths: list[str]) -> list[str]:
  """The files of `paths`, a folder meaning the .jpg, .jpeg, .png and .npy files under it
  (sorted). Raises ConfigError for a path that does not exist."""
  found = []
  for path in paths:
    if os.path.isdir(path):
      found += input_pipeline.images_under(path, (*input_pipeline.IMAGE_SUFFIXES, ".npy"))
    elif os.path.exists(path):
      found.append(path)
    else:
      raise ConfigError(f"{path!r} does not exist; give image files or folders of them.")
  return found


def sync_every(config) -> int:
  """How often, in steps, the loops wait for a result: XLA:CPU collectives abort when hundreds
  of calls are queued; other backends never need to wait (0)."""
  return config.cpu_sync_every_steps if jax.default_backend() == "cpu" else 0


def summarize(running: steps.Metrics) -> dict[str, float]:
  """The running metrics, fetched in one transfer and computed on the host."""
  running = jax.device_get(running)
  return {**{name: float(value) for name, value in running.compute().items()},
          "examples": int(running.loss.count)}


def eval_iterator(batches: grain.MapDataset, config) -> grain.DatasetIterator:
  """An endless iterator over `batches` repeated, read as training reads (worker processes for
  encoded data): `evaluate` takes len(batches) elements of it each time, so its workers start
  once and read the next evaluation's first elements ahead. Close it when done."""
  return input_pipeline.as_iterator(batches.repeat(), config)


def evaluate(compiled: steps.Steps, state, batches, config, metrics=steps.Metrics,
             iterator=None):
  """`metrics` (a collection) over the batches once; the merged metrics, on the devices. Read
  from `iterator` (an `eval_iterator` of `batches`) when given, else from a new one."""
  running, every = compiled.empty(metrics), sync_every(config)
  with contextlib.ExitStack() as stack:
    if iterator is None:
      iterator = stack.enter_context(contextlib.closing(eval_iterator(batches, config)))
    for i in range(1, len(batches) + 1):
      running = compiled.eval(state, running, compiled.put_batch(next(iterator)))
      if every and i % max(every // config.steps_per_dispatch, 1) == 0:
        jax.block_until_ready(running)
  return running


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
