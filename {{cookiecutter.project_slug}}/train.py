"""Data-parallel training and evaluation.

  python train.py --config=configs/default.py --workdir=/tmp/run [--config.batch_size=256 ...]

The logic is in `train_and_evaluate(config, workdir)`; the absl entry point is at the bottom.
"""

import contextlib
import functools
import os
import signal
import threading
import time
from typing import NamedTuple

# isort: split
import writers  # first: lets CLU write TensorBoard files without TensorFlow

# isort: split

import flax
import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import app, flags, logging
from clu import metrics
from flax import nnx
from ml_collections import config_flags

import input_pipeline
import parallel
from model import create_model

PARALLELISMS = ("spmd", "pmap")
# Replicated arrays are written by one replica. (Orbax's default on CPU and TPU splits the
# writing across replicas, which compiles slicing programs at the first save: seconds here.)
ocp.type_handlers.register_type_handler(
    jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
OPTIMIZERS = ("adam", "adamw", "sgd")


@flax.struct.dataclass
class Metrics(metrics.Collection):
  """Sums over real examples only (padding is masked out), merged across steps and devices."""

  loss: metrics.Average.from_output("loss")
  accuracy: metrics.Accuracy


@flax.struct.dataclass
class NonFinite(metrics.Metric):
  """Training steps with a non-finite loss or gradient (their updates were not applied): how
  many of the merged steps, and the index among them of the first, or -1."""

  steps: jax.Array
  count: jax.Array
  first: jax.Array

  @classmethod
  def empty(cls):
    return cls(steps=jnp.array(0), count=jnp.array(0), first=jnp.array(-1))

  @classmethod
  def from_step(cls, finite):
    return cls(steps=jnp.array(1), count=jnp.where(finite, 0, 1), first=jnp.where(finite, -1, 0))

  def merge(self, other):
    first = jnp.where(self.first >= 0, self.first,
                      jnp.where(other.first >= 0, self.steps + other.first, -1))
    return type(self)(self.steps + other.steps, self.count + other.count, first)

  def compute(self):
    return self.count


@flax.struct.dataclass
class TrainMetrics(metrics.Collection):
  """Metrics, and the steps that were skipped. (CLU reads only a class's own fields.)"""

  loss: metrics.Average.from_output("loss")
  accuracy: metrics.Accuracy
  nonfinite_steps: NonFinite


class ConfigError(ValueError):
  """A config that cannot work; the message names the key, the value and the fix."""


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError, before any data is read or anything compiled."""

  def need(ok, message):
    if not ok:
      raise ConfigError(message)

  need(config.dataset in input_pipeline.DATASETS,
       f"config.dataset={config.dataset!r} is unknown; use one of {input_pipeline.DATASETS}.")
  need(config.parallelism in PARALLELISMS,
       f"config.parallelism={config.parallelism!r} is unknown; use one of {PARALLELISMS}.")
  need(config.optimizer in OPTIMIZERS,
       f"config.optimizer={config.optimizer!r} is unknown; use one of {OPTIMIZERS}.")
  for key in ("batch_size", "grad_accum_steps", "num_epochs", "log_every_steps", "eval_every_steps",
              "checkpoint_every_steps", "max_checkpoints_to_keep", "cpu_sync_every_steps"):
    need(isinstance(config[key], int) and config[key] > 0,
         f"config.{key}={config[key]!r} must be a positive integer.")
  for key in ("learning_rate", "eval_fraction"):
    need(isinstance(config[key], (int, float)) and config[key] > 0,
         f"config.{key}={config[key]!r} must be a positive number.")
  need(config.eval_fraction < 1, f"config.eval_fraction={config.eval_fraction} must be below 1.")
  parts = jax.device_count() * config.grad_accum_steps
  over = f"{jax.device_count()} devices" + (
      f" on {jax.process_count()} processes" if jax.process_count() > 1 else "") + (
      f" x {config.grad_accum_steps} micro-batches" if config.grad_accum_steps > 1 else "")
  need(config.batch_size % parts == 0,
       f"config.batch_size={config.batch_size} does not divide over {over}; use a multiple of "
       f"{parts}, e.g. {max(1, round(config.batch_size / parts)) * parts}.")
  if config.dataset == "arrayrecord":
    for split in ("train", "eval"):
      need(bool(input_pipeline.arrayrecord_paths(config.data_dir, split)),
           f"config.data_dir={config.data_dir!r} holds no {split}-*.array_record files; write "
           "them with write_arrayrecord.py.")
    need(os.path.isfile(os.path.join(config.data_dir, "metadata.json")),
         f"config.data_dir={config.data_dir!r} has no metadata.json; write the data with "
         "write_arrayrecord.py.")


def check_checkpoint_fits(checkpoints, step: int, abstract_state, workdir: str) -> None:
  """Raises ConfigError if the checkpoint of `step` holds a different model or optimizer."""

  def shapes(tree):  # {"0/conv1/kernel/value": (3, 3, 1, 32), ...}
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                     for k in path): tuple(x.shape) for path, x in leaves}

  saved = shapes(checkpoints.item_metadata(step)["state"])
  wanted = shapes(abstract_state)
  for name in sorted(saved.keys() | wanted.keys()):
    if saved.get(name) != wanted.get(name):
      raise ConfigError(
          f"workdir {workdir!r} holds a checkpoint (step {step}) of a different model: {name} is "
          f"{saved.get(name, 'absent')} there and {wanted.get(name, 'absent')} in this config; "
          "use a new --workdir, or the config that wrote it.")


def create_optimizer(config, num_train_steps: int) -> optax.GradientTransformation:
  schedule = optax.cosine_decay_schedule(config.learning_rate, num_train_steps)
  if config.optimizer == "adamw":
    return optax.adamw(schedule, weight_decay=config.weight_decay)
  return {"adam": optax.adam, "sgd": optax.sgd}[config.optimizer](schedule)


def loss_and_metrics(model, batch):
  """The SUM of the losses of the real examples (normalised later, by the global count)."""
  logits_BK = model(batch["image"])
  losses_B = optax.softmax_cross_entropy_with_integer_labels(logits_BK, batch["label"])
  loss_sum = jnp.sum(jnp.where(batch["mask"], losses_B, 0.0))
  step_metrics = Metrics.single_from_model_output(
      loss=losses_B, logits=logits_BK, labels=batch["label"], mask=batch["mask"])
  return loss_sum, step_metrics


def micro_batches(batch, num: int):
  """`[batch, ...]` -> `[num, batch // num, ...]`; micro-batch j holds examples j, j + num, ...,
  so every device holds an equal share of every micro-batch."""
  return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, num, *x.shape[1:]), 0, 1), batch)


def summed_gradients(model, batch, num_micro_batches: int = 1):
  """Gradient of the summed loss, and metrics, over `batch` in `num_micro_batches` sequential
  pieces (gradient accumulation: the memory of one piece, the result of the whole batch)."""
  grad_fn = nnx.grad(loss_and_metrics, has_aux=True)
  if num_micro_batches == 1:
    return grad_fn(model, batch)
  micro = micro_batches(batch, num_micro_batches)
  sums = grad_fn(model, jax.tree.map(lambda x: x[0], micro))
  graphdef, state = nnx.split(model)

  def add_micro_batch(carry, micro_batch):
    state, sums = carry
    model = nnx.merge(graphdef, state)
    sums = jax.tree.map(jnp.add, sums, grad_fn(model, micro_batch))
    return (nnx.state(model), sums), None

  rest = jax.tree.map(lambda x: x[1:], micro)
  (state, sums), _ = jax.lax.scan(add_micro_batch, (state, sums), rest)
  nnx.update(model, state)
  return sums


def fold_in_device_index(model, axis_name):
  """pmap gives every device the same RNG keys: fold in the device index so that dropout differs
  between devices. Returns a function that puts the shared keys back (keeping the state
  replicated; the streams' counters advance identically everywhere)."""
  streams = [s for _, s in nnx.iter_graph(model) if isinstance(s, nnx.RngStream)]
  keys = [stream.key[...] for stream in streams]
  for stream in streams:
    stream.key[...] = jax.random.fold_in(stream.key[...], jax.lax.axis_index(axis_name))

  def restore():
    for stream, key in zip(streams, keys, strict=True):
      stream.key[...] = key

  return restore


def train_step(graphdef, state, running, batch, grad_accum_steps=1, axis_name=None):
  """One optimizer step; `running` (TrainMetrics) comes back with this step's metrics merged in.
  Under pmap (`axis_name` set) sums are reduced across devices.

  The gradient is sum(gradients of the real examples' losses) / (number of real examples),
  both summed globally: exact for any padding, on any number of devices and micro-batches.
  Only gradients and metrics are reduced; the optimizer's counters are never averaged.
  """
  old_state = jax.tree.map(lambda x: x, state)  # kept for a step that is not finite
  model, optimizer = nnx.merge(graphdef, state)
  model.train()
  if axis_name is not None:
    restore_keys = fold_in_device_index(model, axis_name)
  grads, step_metrics = summed_gradients(model, batch, grad_accum_steps)
  if axis_name is not None:
    restore_keys()
    grads, step_metrics = jax.lax.psum((grads, step_metrics), axis_name)
  count = jnp.maximum(step_metrics.loss.count, 1)
  optimizer.update(model, jax.tree.map(lambda g: g / count, grads))
  # A non-finite loss or gradient leaves the state as it was; the loop decides what to do.
  finite = jnp.isfinite(step_metrics.loss.total) & jnp.all(
      jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
  new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                           nnx.state((model, optimizer)), old_state)
  step_metrics = TrainMetrics(**vars(step_metrics), nonfinite_steps=NonFinite.from_step(finite))
  return new_state, running.merge(step_metrics)


def eval_step(graphdef, state, running, batch, axis_name=None):
  model, _ = nnx.merge(graphdef, state)
  model.eval()
  _, step_metrics = loss_and_metrics(model, batch)
  if axis_name is not None:
    step_metrics = jax.lax.psum(step_metrics, axis_name)
  return running.merge(step_metrics)


class Steps(NamedTuple):
  """The compiled steps of one parallelism, and how to move state and batches to them."""

  train: callable  # (state, running TrainMetrics, batch) -> the two updated; donates both
  eval: callable  # (state, running Metrics, batch) -> the metrics updated; donates them
  put_state: callable  # checkpoint layout (replicated global arrays) -> the steps' layout
  get_state: callable  # the steps' layout -> checkpoint layout
  put_batch: callable  # this process's NumPy batch -> the steps' layout
  empty: callable  # a metrics class -> its empty value, placed for the steps


def make_steps(graphdef, config, mesh) -> Steps:
  accum = config.grad_accum_steps
  if config.parallelism == "pmap":
    axis = parallel.PMAP_AXIS
    # State and batch: one slice per device (axis 0). Metrics: one value, the same everywhere.
    pmap = functools.partial(jax.pmap, axis_name=axis, in_axes=(0, None, 0))
    local = parallel.replicated(parallel.local_devices_mesh())
    return Steps(
        train=pmap(functools.partial(train_step, graphdef, grad_accum_steps=accum,
                                     axis_name=axis), out_axes=(0, None), donate_argnums=(0, 1)),
        eval=pmap(functools.partial(eval_step, graphdef, axis_name=axis), out_axes=None,
                  donate_argnums=1),
        put_state=parallel.replicate,
        get_state=lambda state: parallel.to_global(parallel.unreplicate(state), mesh),
        put_batch=parallel.pmap_batch,
        empty=lambda cls: jax.device_put(cls.empty(), local),
    )
  return Steps(
      train=jax.jit(functools.partial(train_step, graphdef, grad_accum_steps=accum),
                    donate_argnums=(0, 1)),
      eval=jax.jit(functools.partial(eval_step, graphdef), donate_argnums=1),
      put_state=lambda state: state,
      get_state=lambda state: state,
      put_batch=lambda batch: parallel.global_batch(batch, mesh),
      empty=lambda cls: parallel.to_global(cls.empty(), mesh),
  )


def flatten(tree: dict, prefix: str = "") -> dict:
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def summarize(running: Metrics) -> dict[str, float]:
  """The running metrics, fetched in one transfer and computed on the host."""
  running = jax.device_get(running)
  return {**{name: float(value) for name, value in running.compute().items()},
          "examples": int(running.loss.count)}


def sync_every(config) -> int:
  """How often the loops wait for a result: XLA:CPU collectives abort when hundreds of steps
  are queued; other backends never need to wait (0)."""
  return config.cpu_sync_every_steps if jax.default_backend() == "cpu" else 0


def evaluate(steps: Steps, state, eval_batches, config) -> dict[str, float]:
  running, every = steps.empty(Metrics), sync_every(config)
  for i, batch in enumerate(input_pipeline.as_iterator(eval_batches, config,
                                                         put=steps.put_batch), start=1):
    running = steps.eval(state, running, batch)
    if every and i % every == 0:
      jax.block_until_ready(running)
  return summarize(running)


# Peak dense bf16 FLOP/s of one device, by a part of its `device_kind` (first match wins).
PEAK_FLOPS = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "B200": 2250e12,
              "A100": 312e12, "L40S": 362e12, "L4": 121e12, "TPU v4": 275e12,
              "TPU v5 lite": 197e12, "TPU v5p": 459e12, "TPU v5": 459e12,
              "TPU v6 lite": 918e12, "TPU7x": 2307e12}


class Speed:
  """FLOP/s and model FLOP utilisation (MFU), from XLA's cost analysis of the train step."""

  def __init__(self, steps, state, host_batch, config):
    cost = steps.train.lower(state, steps.empty(TrainMetrics),
                             steps.put_batch(host_batch)).cost_analysis()
    flops = (cost or {}).get("flops", 0.0)  # pmap's is of one device; spmd's, of all
    self.flops_per_step = flops * (jax.device_count() if config.parallelism == "pmap" else 1)
    kind = jax.devices()[0].device_kind
    peak = config.peak_flops_per_device or next(
        (f for name, f in PEAK_FLOPS.items() if name in kind), 0.0)
    self.peak = peak * jax.device_count()
    logging.info("Train step: %.3g FLOPs; peak of the %d %s devices: %s", self.flops_per_step,
                 jax.device_count(), kind, f"{self.peak:.3g} FLOP/s" if self.peak else "unknown")

  def report(self, steps_per_sec: float) -> dict[str, float]:
    achieved = self.flops_per_step * steps_per_sec
    return {"flops_per_sec": achieved, **({"mfu": achieved / self.peak} if self.peak else {})}


class NonFiniteLoss(FloatingPointError):
  """A training step had a non-finite loss or gradient (its update was not applied)."""


@contextlib.contextmanager
def stop_signals():
  """Collects SIGTERM and SIGINT instead of dying, so the loop can stop after a step and save.

  With several processes, JAX's preemption service handles SIGTERM instead (the loop asks Orbax
  whether a preemption sync point is reached), so that every process stops at the same step.
  """
  received = []
  mine = jax.process_count() == 1 and threading.current_thread() is threading.main_thread()
  previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
              for sig in (signal.SIGTERM, signal.SIGINT)} if mine else {}
  try:
    yield received
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def restore_or_init(checkpoints, state, train_batches, config, put, workdir: str):
  """The latest complete checkpoint in `workdir` and the training iterator positioned after it,
  or a fresh start. Returns (step, state, iterator of batches placed by `put`)."""
  step = checkpoints.latest_step()
  if step is None:
    return 0, state, input_pipeline.as_iterator(train_batches, config, put=put)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  check_checkpoint_fits(checkpoints, step, abstract, workdir)
  state = checkpoints.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract)))["state"]
  saved_iterator = os.path.join(checkpoints.directory, str(step), "data_iter",
                                f"process_{jax.process_index()}-of-{jax.process_count()}.json")
  if os.path.exists(saved_iterator):
    train_iter = input_pipeline.as_iterator(train_batches, config, put=put)
    checkpoints.restore(step, args=ocp.args.Composite(
        data_iter=grain.checkpoint.CheckpointRestore(train_iter)))
  else:  # saved by another number of processes: batch k is still batch k, so start at `step`
    logging.info("The data iterator was saved by another number of processes; batches resume "
                 "from batch %d.", step)
    train_iter = input_pipeline.as_iterator(train_batches, config, start=step, put=put)
  logging.info("Resumed from the checkpoint of step %d in %s", step, workdir)
  return step, state, train_iter


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float] | None:
  """Trains, resuming from the latest checkpoint in `workdir`; returns the final eval metrics,
  or None when SIGTERM/SIGINT (or a preemption notice) stopped it after saving a checkpoint."""
  validate_config(config)
  workdir = os.path.abspath(workdir)
  process = dict(process_index=jax.process_index(), process_count=jax.process_count())
  splits, info = input_pipeline.get_datasets(config)
  train_batches = input_pipeline.train_batches(splits["train"], config, **process)
  eval_batches = input_pipeline.eval_batches(splits["eval"], config, **process)
  num_train_steps = len(train_batches)
  logging.info("%s: %s, %d train steps of %d examples over %d devices",
               config.dataset, info, num_train_steps, config.batch_size, jax.device_count())

  model = create_model(config, info.image_shape, info.num_classes, nnx.Rngs(config.seed))
  optimizer = nnx.Optimizer(model, create_optimizer(config, num_train_steps), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))
  mesh = parallel.make_mesh()
  steps = make_steps(graphdef, config, mesh)

  # One manager for the model and optimizer state and the position of the data iterator.
  # Orbax writes each checkpoint to a temporary directory and renames it when complete, so a
  # checkpoint cut short by a kill is never restored.
  checkpoints = ocp.CheckpointManager(
      os.path.join(workdir, "checkpoints"),
      options=ocp.CheckpointManagerOptions(max_to_keep=config.max_checkpoints_to_keep),
      item_handlers=dict(state=ocp.StandardCheckpointHandler(),
                         data_iter=grain.checkpoint.CheckpointHandler()))
  first_step, state, train_iter = restore_or_init(
      checkpoints, parallel.to_global(state, mesh), train_batches, config, steps.put_batch,
      workdir)
  state = steps.put_state(state)
  local_batch_size = config.batch_size // jax.process_count()
  zeros_batch = {"image": np.zeros((local_batch_size, *info.image_shape), np.float32),
                 "label": np.zeros(local_batch_size, np.int32),
                 "mask": np.zeros(local_batch_size, bool)}  # the shapes of every batch
  if config.print_shardings:
    logging.info("%s\n%s", parallel.describe(state, "state"),
                 parallel.describe(steps.put_batch(zeros_batch), "batch"))

  writer = writers.metric_writers.create_default_writer(
      workdir, just_logging=jax.process_index() > 0)
  if first_step == 0:
    writer.write_hparams(flatten(config.to_dict()))
  report_progress = writers.periodic_actions.ReportProgress(
      num_train_steps=num_train_steps, writer=writer, every_steps=config.log_every_steps)
  # Compile the eval step now, not mid-training.
  steps.eval(state, steps.empty(Metrics), steps.put_batch(zeros_batch))
  hooks = [report_progress]
  if config.profile_first_step and jax.process_index() == 0:
    hooks.append(writers.periodic_actions.Profile(
        logdir=workdir, first_profile=config.profile_first_step,
        num_profile_steps=config.profile_num_steps, profile_duration_ms=None, every_secs=None))
  speed = Speed(steps, state, zeros_batch, config)

  def save(step):
    with report_progress.timed("checkpoint"):
      checkpoints.save(step, force=True, args=ocp.args.Composite(
          state=ocp.args.StandardSave(steps.get_state(state)),
          data_iter=grain.checkpoint.CheckpointSave(train_iter)))

  def check_finite(nonfinite: NonFinite, since: int):
    """Raises if a step from `since` on was not finite, unless such steps may be skipped."""
    if nonfinite.count and not config.skip_nonfinite_steps:
      checkpoints.wait_until_finished()
      raise NonFiniteLoss(
          f"non-finite loss or gradient at step {since + int(nonfinite.first)}; its update was "
          f"not applied, and the last good checkpoint is step {checkpoints.latest_step()} in "
          f"{checkpoints.directory}. Lower the learning rate, check the data, or set "
          "--config.skip_nonfinite_steps=True.")

  # `running` merges the metrics of the training steps from `since` on, on the devices.
  running, since, every = steps.empty(TrainMetrics), first_step + 1, sync_every(config)
  last_log, eval_metrics, stopped_by = time.perf_counter(), None, None
  with stop_signals() as received:
    for step in range(first_step + 1, num_train_steps + 1):  # `step` counts finished updates
      with jax.profiler.StepTraceAnnotation("train", step_num=step):
        state, running = steps.train(state, running, next(train_iter))
      for hook in hooks:
        hook(step)
      if step == first_step + 1:  # the loop's clock starts once the step is compiled
        jax.block_until_ready(running)
        loop_start = time.perf_counter()
      is_last = step == num_train_steps
      if every and step % every == 0:
        jax.block_until_ready(running)
      stopped_by = received[0] if received else (
          "a preemption notice" if checkpoints.reached_preemption(step) else None)
      if step % config.log_every_steps == 0 or step % config.checkpoint_every_steps == 0 or (
          is_last or stopped_by):
        fetched = jax.device_get(running)  # one transfer, for the check and the summary
        check_finite(fetched.nonfinite_steps, since)
      if step % config.log_every_steps == 0 or is_last:
        summary = summarize(fetched)
        now = time.perf_counter()
        summary["examples_per_sec"] = summary["examples"] / (now - last_log)
        summary.update(speed.report((step - since + 1) / (now - last_log)))
        writer.write_scalars(step, {f"train_{k}": v for k, v in summary.items()})
        if summary["nonfinite_steps"]:
          logging.warning("Skipped %d of steps %d-%d: non-finite loss or gradient.",
                          int(summary["nonfinite_steps"]), since, step)
        running, since, last_log = steps.empty(TrainMetrics), step + 1, now
      if step % config.eval_every_steps == 0 or is_last:
        with report_progress.timed("eval"):
          eval_metrics = evaluate(steps, state, eval_batches, config)
        writer.write_scalars(step, {f"eval_{k}": v for k, v in eval_metrics.items()})
      if step % config.checkpoint_every_steps == 0 or is_last or stopped_by:
        save(step)
      if stopped_by:
        break
  checkpoints.close()  # waits for the last asynchronous save
  if stopped_by:
    name = signal.Signals(stopped_by).name if isinstance(stopped_by, int) else stopped_by
    logging.warning("Stopped by %s after step %d of %d; saved checkpoint %d in %s. Run the same "
                    "command again to resume.", name, step, num_train_steps, step, workdir)
    writer.close()
    return None
  if num_train_steps > first_step + 1:
    # Training throughput of the whole loop (input pipeline, logging, evaluation, checkpoints).
    loop_rate = (num_train_steps - first_step - 1) * config.batch_size / (
        time.perf_counter() - loop_start)
    writer.write_scalars(num_train_steps, {"loop_examples_per_sec": loop_rate})
  if eval_metrics is None:  # nothing left to train: report the restored state
    eval_metrics = evaluate(steps, state, eval_batches, config)
  writer.close()
  logging.info("Final eval: accuracy %.4f, loss %.4f, on %d examples", eval_metrics["accuracy"],
               eval_metrics["loss"], eval_metrics["examples"])
  return eval_metrics


_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.", lock_config=True)
flags.mark_flag_as_required("config")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints and metrics go.", required=True)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0, to run several processes without a "
    "cluster that JAX detects by itself (SLURM, Open MPI, Cloud TPU pods).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "With --coordinator_address.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "With --coordinator_address.")
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout_seconds", 100, "After this long without news of a process, the others "
    "stop with an error instead of waiting for it.")

def cluster_detected() -> bool:
  """A multi-process job that jax.distributed.initialize() configures from the environment."""
  env = os.environ
  return (int(env.get("SLURM_NTASKS", 1)) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", 1)) > 1
          or "," in env.get("TPU_WORKER_HOSTNAMES", "") or "JAX_COORDINATOR_ADDRESS" in env)


def initialize_distributed() -> None:
  """Joins JAX's distributed runtime when this is one of several processes; else does nothing."""
  timeouts = dict(heartbeat_timeout_seconds=_HEARTBEAT.value, initialization_timeout=300)
  if _COORDINATOR.value:
    host = _COORDINATOR.value.rsplit(":", 1)[0]
    bind = _COORDINATOR.value if host in ("127.0.0.1", "localhost") else None  # loopback only
    jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                               coordinator_bind_address=bind, **timeouts)
  elif cluster_detected():
    jax.distributed.initialize(**timeouts)  # JAX reads the cluster's environment
  else:
    return
  logging.info("Process %d of %d, %d local devices of %d", jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count())
  if jax.process_index() > 0:
    logging.set_verbosity(logging.WARNING)  # process 0 logs progress and metrics


class _QuietLibraries(logging.logging.Filter):
  """Keeps the log to progress and metrics: drops INFO lines from inside JAX and Orbax."""

  def filter(self, record):
    return record.levelno >= logging.logging.WARNING or not any(
        f"{os.sep}{lib}{os.sep}" in record.pathname for lib in ("jax", "orbax"))


def main(argv):
  del argv
  logging.get_absl_handler().addFilter(_QuietLibraries())
  initialize_distributed()
  try:
    result = train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except (ConfigError, NonFiniteLoss) as e:
    raise SystemExit(f"error: {e}") from None
  if result is None:  # stopped by a signal, after saving: the conventional 128 + SIGTERM
    raise SystemExit(128 + signal.SIGTERM)


if __name__ == "__main__":
  app.run(main)
