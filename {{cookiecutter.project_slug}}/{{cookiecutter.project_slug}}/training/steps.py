"""The train and eval steps, how each parallelism compiles them, and the evaluation loop.

Every compiled call runs k = `config.steps_per_dispatch` steps (`lax.scan`) over k batches
stacked on a leading axis, so the host dispatches once per k steps:
  image [k, B, H, W, C] in its stored dtype (uint8 pixels are divided by 255 on the device),
  label [k, B] int32, mask [k, B] bool (False on padding), position [k, B] uint32 (each
  example's place in the stream: it keys the augmentation, so that any batching, any number
  of processes and any resume give the same shifts, flips and crops).
A step whose batch holds no real example (padding at the end of training, or before the first
batch of a resumed run) changes nothing, so k steps in one call equal k single calls.
"""

import contextlib
import functools
import inspect
from typing import NamedTuple

import grain
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from .. import layers
from ..data import input_pipeline
from ..data.augment import prepare_images
from ..parallel import pmap, sharding
from .metrics import Metrics, NonFinite, StepAverage, TrainLoss, TrainMetrics

PARALLELISMS = ("spmd", "pmap", "fsdp")
# k when `config.steps_per_dispatch` is 0, on a GPU or TPU (or the largest number below it that
# divides the log, eval and checkpoint intervals): enough steps a call to hide the host's work
# per call behind a small model's steps; the rolled loop compiles once whatever k. On the CPU k
# is 1: its steps are long, the k steps are unrolled there (see `make`), and compiling several
# of them costs more than the dispatches they save (BENCHMARKS.md).
ACCELERATOR_STEPS_PER_DISPATCH = 10


def steps_per_dispatch(config, platform: str | None = None) -> int:
  """k: `config.steps_per_dispatch`, or when it is 0, the default of `platform` (default: the
  backend's): 1 on the CPU; on a GPU or TPU, `ACCELERATOR_STEPS_PER_DISPATCH` or the largest
  number below it that divides the log, eval and checkpoint intervals (multiples of k)."""
  if config.steps_per_dispatch:
    return config.steps_per_dispatch
  if (platform or jax.default_backend()) == "cpu":
    return 1
  intervals = (config.log_every_steps, config.eval_every_steps, config.checkpoint_every_steps)
  return next(k for k in range(ACCELERATOR_STEPS_PER_DISPATCH, 0, -1)
              if all(interval % k == 0 for interval in intervals))


def takes_mask(model) -> bool:
  """Whether the model is called with `example_mask=`: when its class's `__call__` has a
  parameter of that name or takes `**kwargs`. (inspect.signature sees through a decorator that
  uses functools.wraps to the function it wraps.)"""
  parameters = inspect.signature(type(model).__call__).parameters.values()
  return any(p.name == "example_mask" or p.kind is p.VAR_KEYWORD for p in parameters)


def call_model(model, images_BHWC, mask_B) -> jax.Array:
  """The one place that calls the model: `model(images)`, with `example_mask=mask_B` when it
  takes it (`takes_mask`)."""
  return model(images_BHWC, **({"example_mask": mask_B} if takes_mask(model) else {}))


def mask_warning(model) -> str | None:
  """A warning for a model holding BatchNorm that cannot be given the mask, else None."""
  if takes_mask(model) or not any(isinstance(node, nnx.BatchNorm)
                                  for _, node in nnx.iter_graph(model)):
    return None
  return (f"warning: {type(model).__name__} holds BatchNorm but its __call__ takes no "
          "example_mask, so its batch statistics include the padding of partial batches; give "
          "__call__ an example_mask=None parameter and pass it on: "
          "layers.BatchNorm(...)(x, mask=example_mask) (model.py's docstring)")


def plain_batch_norms(model) -> list[str]:
  """Where the model holds an nnx.BatchNorm that is not a `layers.BatchNorm` (which alone
  takes the statistics of groups of devices: `config.batch_norm_devices`)."""
  return ["/".join(map(str, path)) for path, node in nnx.iter_graph(model)
          if isinstance(node, nnx.BatchNorm) and not isinstance(node, layers.BatchNorm)]


def loss_and_metrics(model, batch, collection=Metrics, label_smoothing: float = 0.0):
  """The SUM of the losses of the real examples (normalised later, by the global count), in
  float32 whatever the model's dtype. `batch["image"]` is the model's input (see
  `prepare_images`), with `batch["mask"]` (`[batch]`, False on padding) where the model takes
  it (`call_model`: BatchNorm must leave the padding out). The metrics: a `collection` of the
  step's real examples. `label_smoothing` a: the targets are (1 - a) x one-hot + a / classes.
  """
  logits_BK = call_model(model, batch["image"], batch["mask"])
  logits_BK = logits_BK.astype(jnp.float32)
  cross_entropy_B = optax.softmax_cross_entropy_with_integer_labels(logits_BK, batch["label"])
  losses_B = cross_entropy_B
  if label_smoothing:
    targets_BK = optax.smooth_labels(jax.nn.one_hot(batch["label"], logits_BK.shape[-1]),
                                     label_smoothing)
    losses_B = optax.softmax_cross_entropy(logits_BK, targets_BK)
  loss_sum = jnp.sum(jnp.where(batch["mask"], losses_B, 0.0))
  step_metrics = collection.single_from_model_output(
      loss=losses_B, cross_entropy=cross_entropy_B, logits=logits_BK, labels=batch["label"],
      mask=batch["mask"])
  return loss_sum, step_metrics


def micro_batches(batch, num: int):
  """`[batch, ...]` -> `[num, batch // num, ...]`; micro-batch j holds examples j, j + num, ...,
  so every device holds an equal share of every micro-batch."""
  return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, num, *x.shape[1:]), 0, 1), batch)


def summed_gradients(model, batch, num_micro_batches: int = 1, label_smoothing: float = 0.0,
                     axis_name=None):
  """Gradient of the summed loss, and metrics, over `batch` in `num_micro_batches` sequential
  pieces (gradient accumulation: the memory of one piece). The pieces run in one loop from
  zeros: one forward and backward pass in the compiled program. A piece without a real example
  (a last batch holding fewer than `num_micro_batches`) adds nothing and leaves the model's
  state as it was (BatchNorm's statistics, RNG counters): its values are not selected, so its
  NaNs (a mean over no example) go nowhere. Under pmap (`axis_name`) "without a real example"
  is over all devices.

  The sum equals the whole batch's for a model whose examples do not meet in the forward pass.
  BatchNorm (train mode) normalises each piece by the piece's own real examples, as a batch of
  that size would, and moves its running statistics once per piece that holds a real example."""
  grad_fn = nnx.grad(functools.partial(loss_and_metrics, collection=TrainLoss,
                                       label_smoothing=label_smoothing), has_aux=True)
  if num_micro_batches == 1:
    return grad_fn(model, batch)
  micro = micro_batches(batch, num_micro_batches)
  graphdef, state = nnx.split(model)

  def add_micro_batch(carry, micro_batch):
    state, sums = carry
    old_state = jax.tree.map(lambda x: x, state)  # its own Variables: the model's change
    model = nnx.merge(graphdef, state)
    grads_and_metrics = grad_fn(model, micro_batch)
    real = jnp.sum(micro_batch["mask"], dtype=jnp.int32)
    if axis_name is not None:
      real = jax.lax.psum(real, axis_name)
    keep = lambda new, old: jnp.where(real > 0, new, old)  # noqa: E731
    sums = jax.tree.map(lambda total, x: total + keep(x, jnp.zeros_like(x)), sums,
                        grads_and_metrics)
    return (jax.tree.map(keep, nnx.state(model), old_state), sums), None

  first = jax.tree.map(lambda x: x[0], micro)
  shapes = jax.eval_shape(lambda state, batch: grad_fn(nnx.merge(graphdef, state), batch),
                          state, first)
  zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
  (state, sums), _ = jax.lax.scan(add_micro_batch, (state, zeros), micro)
  nnx.update(model, state)
  return sums


def step_options(config) -> dict:
  """`train_step`'s keyword arguments from the config (all hashable: static arguments)."""
  crop = (tuple(config.augment_crop_scale), tuple(config.augment_crop_ratio))
  return dict(grad_accum_steps=config.grad_accum_steps, max_shift=config.augment_max_shift,
              seed=config.seed, flip=config.augment_flip,
              crop=crop if config.augment_crop else None,
              label_smoothing=config.label_smoothing, ema_decay=config.ema_decay,
              ema_warmup=config.ema_warmup)


# What the moving average of the parameters averages: every Param, and BatchNorm's statistics.
AVERAGED = (nnx.Param, nnx.BatchStat)


def train_step(graphdef, state, running, batch, *, grad_accum_steps=1, max_shift=0, seed=0,
               flip=False, crop=None, label_smoothing=0.0, ema_decay=0.0, ema_warmup=False,
               batch_norm_groups=1, axis_name=None, skip_by="select", norms_of="kept"):
  """One optimizer step on one batch (no leading k axis); `running` (TrainMetrics) comes back
  with this step's metrics merged in. Under pmap (`axis_name` set) sums are reduced across
  devices; BatchNorm's statistics are those of `batch_norm_groups` groups of devices
  (`layers.statistics_groups`; 1: the global batch). A state of (model, optimizer, average)
  also updates the average: a copy of the model (in float32) whose `AVERAGED` variables move to
  the model's by a fraction 1 - d each step, d = `ema_decay`, or with `ema_warmup`
  min(`ema_decay`, (1 + n) / (10 + n)) at update n = 0, 1, ... (TensorFlow's
  ExponentialMovingAverage with num_updates): so that a short run's average is not its
  initialisation.

  The gradient is sum(gradients of the real examples' losses) / (number of real examples),
  both summed globally: exact for any padding, on any number of devices (and micro-batches:
  see `summed_gradients`). Only gradients and metrics are reduced; the optimizer's counters are
  never averaged.

  A non-finite loss or gradient leaves the state as it was (the loop decides what to do), and so
  does a batch of padding alone. `skip_by`: 'select' updates, then keeps each leaf's old value
  (`jnp.where`): no conditional, which a GPU runs by copying its predicate to the host and
  waiting, at every one of the k steps of a call; 'cond' runs the update under `lax.cond`:
  XLA:CPU's choice, where selecting keeps a second copy of the state. The norms are those of the
  parameters and of their change (the update as applied), the same values either way but taken
  from the state `norms_of`: 'kept' (after the choice: what the TPU compiler schedules best) or
  'updated' (before it: XLA:GPU, which otherwise keeps the old parameters alive when its
  latency-hiding scheduler is off). README: Will it fit?
  """
  old_state = jax.tree.map(lambda x: x, state)  # kept for a step that changes nothing
  model, optimizer, *average = nnx.merge(graphdef, state)
  model.train()
  batch = dict(batch, image=prepare_images(batch, max_shift, seed, flip, crop))
  if axis_name is not None:
    restore_keys = pmap.fold_in_device_index(model, axis_name)
  with layers.statistics_groups(batch_norm_groups):
    grads, step_metrics = summed_gradients(model, batch, grad_accum_steps, label_smoothing,
                                           axis_name)
  if axis_name is not None:
    restore_keys()
    grads, step_metrics = jax.lax.psum((grads, step_metrics), axis_name)
  count = step_metrics.loss.count
  # One reduction for both: the squared norm of the summed gradient (for the metrics), which
  # is not finite when an entry is not (nor when it overflows float32: a gradient beyond 1e19).
  grads_squared = sum(jnp.sum(jnp.square(g), dtype=jnp.float32) for g in jax.tree.leaves(grads))
  finite = jnp.isfinite(step_metrics.loss.total) & jnp.isfinite(grads_squared)
  real = count > 0
  applied = finite & real

  def update(current, _):  # the optimizer step, on the state as the forward pass left it
    model, optimizer, *average = nnx.merge(graphdef, current)
    n = optimizer.step[...].astype(jnp.float32)  # the updates before this one
    optimizer.update(model, jax.tree.map(lambda g: g / jnp.maximum(count, 1), grads))
    decay = jnp.minimum(ema_decay, (1 + n) / (10 + n)) if ema_warmup else ema_decay
    for ema in average:
      nnx.update(ema, jax.tree.map(lambda e, m: decay * e + (1 - decay) * m.astype(e.dtype),
                                   nnx.state(ema, AVERAGED), nnx.state(model, AVERAGED)))
    return nnx.state((model, optimizer, *average))

  current = nnx.state((model, optimizer, *average))
  if skip_by == "select":
    updated = update(current, None)
    new_state = jax.tree.map(lambda new, old: jnp.where(applied, new, old), updated, old_state)
  else:
    new_state = jax.lax.cond(applied, update, lambda _, old: old, current, old_state)
  measured = updated if skip_by == "select" and norms_of == "updated" else new_state
  new_params, old_params = (nnx.state(nnx.merge(graphdef, s)[0], nnx.Param)
                            for s in (measured, old_state))
  step_metrics = TrainMetrics(
      **vars(step_metrics), nonfinite_steps=NonFinite.from_step(finite, real),
      # (of the whole gradient, on every path: under pmap, the psum'd one; before clipping)
      l2_grads=StepAverage.from_step(jnp.sqrt(grads_squared) / jnp.maximum(count, 1), applied),
      l2_params=StepAverage.from_step(optax.tree.norm(new_params).astype(jnp.float32), applied),
      l2_updates=StepAverage.from_step(optax.tree.norm(jax.tree.map(
          jnp.subtract, new_params, old_params)).astype(jnp.float32), applied))
  return new_state, running.merge(step_metrics)


def eval_step(graphdef, state, running, batch, axis_name=None):
  """Metrics of the model: the first object of the state (model, optimizer), (model,) or
  (model, optimizer, average), the moving average in the last."""
  objects = nnx.merge(graphdef, state)
  model = objects[2] if len(objects) > 2 else objects[0]
  model.eval()
  _, step_metrics = loss_and_metrics(model, dict(batch, image=prepare_images(batch)),
                                     type(running))
  if axis_name is not None:
    step_metrics = jax.lax.psum(step_metrics, axis_name)
  return running.merge(step_metrics)


def scanned(step, unroll: bool = False):
  """`step(state, running, batch)` -> `(state, running)`, made to run one step per batch of
  batches stacked on a leading axis (`lax.scan`; `unroll`: as straight-line code)."""

  def run(state, running, batches):
    if jax.tree.leaves(batches)[0].shape[0] == 1:
      return step(state, running, jax.tree.map(lambda x: x[0], batches))
    body = lambda carry, batch: (step(*carry, batch), None)  # noqa: E731
    return jax.lax.scan(body, (state, running), batches, unroll=unroll)[0]

  return run


def scanned_eval(step, unroll: bool = False):
  """`step(state, running, batch)` -> `running`, over stacked batches (the state is read only)."""
  run = scanned(lambda state, running, batch: (state, step(state, running, batch)), unroll)
  return lambda state, running, batches: run(state, running, batches)[1]


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


class Flat(NamedTuple):
  """The training state as the loop holds it between calls: its arrays, in one flat list."""

  arrays: list


class Steps(NamedTuple):
  """The compiled steps of one parallelism, and how to move state and batches to them."""

  train: callable  # (state, running TrainMetrics, k batches) -> the two updated; donates both
  eval: callable  # (state, running Metrics, k batches) -> the metrics updated; donates them
  put_state: callable  # checkpoint layout (`sharding.place_state`'s global arrays) -> the steps'
  get_state: callable  # the steps' layout (jit: a flat list; pmap: replicated) -> checkpoint's
  put_batch: callable  # this process's stacked NumPy batches -> the steps' layout
  empty: callable  # a metrics class -> its empty value, placed for the steps


def make(graphdef, config, mesh, unroll: bool | None = None, pmap_devices=None,
         crop_on_device: bool = True) -> Steps:
  """The train and eval steps of `config.parallelism`, each running stacked batches. `unroll`:
  the k steps of a call as straight-line code (True) or a rolled loop (False); None: unrolled
  on the CPU, whose XLA runs convolution gradients far slower inside a loop, rolled elsewhere
  (it compiles once, whatever k). `pmap_devices`: pmap's devices (default: the local ones;
  aot.py: a topology's). A step is skipped by selection on GPUs and TPUs, under lax.cond on the
  CPU (`train_step`'s `skip_by`, `norms_of`). `crop_on_device` False: `config.augment_crop`'s
  crops are the input pipeline's (photos stored whole: image_files.Crops)."""
  platform = (pmap_devices or mesh.devices.flat)[0].platform
  options = dict(step_options(config), skip_by="cond" if platform == "cpu" else "select",
                 norms_of="updated" if platform == "gpu" else "kept")
  if not crop_on_device:
    options["crop"] = None
  devices = (len(pmap_devices or jax.devices()) if config.parallelism == "pmap"
             else mesh.devices.size)
  options["batch_norm_groups"] = devices // (config.batch_norm_devices or devices)
  if unroll is None:
    unroll = platform == "cpu"
  if config.parallelism == "pmap":
    axis = pmap.PMAP_AXIS
    # State and batch: one slice per device (axis 0). Metrics: one value, the same everywhere.
    on_devices = functools.partial(jax.pmap, axis_name=axis, in_axes=(0, None, 0),
                                   devices=pmap_devices)
    local = sharding.replicated(pmap.local_devices_mesh())
    return Steps(
        train=on_devices(scanned(functools.partial(
            train_step, graphdef, axis_name=axis, **options), unroll), out_axes=(0, None),
            donate_argnums=(0, 1)),
        eval=on_devices(scanned_eval(functools.partial(eval_step, graphdef, axis_name=axis),
                                     unroll), out_axes=None, donate_argnums=1),
        put_state=pmap.replicate,
        get_state=lambda state: sharding.to_global(pmap.unreplicate(state), mesh),
        put_batch=pmap.pmap_batch,
        empty=lambda cls: jax.device_put(cls.empty(), local),
    )
  train = scanned(functools.partial(train_step, graphdef, **options), unroll)
  evaluate = scanned_eval(functools.partial(eval_step, graphdef), unroll)
  # The loop holds the state as a flat list of arrays (`Flat`), merged into modules only inside
  # the steps: a dispatch flattens a list in microseconds, an nnx.State's nodes in milliseconds.
  # The steps take the state itself too (evaluate.py, aot.py), and give back what they got.
  structure = {}

  def put_state(state) -> Flat:
    arrays, structure["tree"] = jax.tree.flatten(state)
    return Flat(arrays)

  def get_state(state):
    return jax.tree.unflatten(structure["tree"], state.arrays) if isinstance(state, Flat) else state

  def as_given(new_state, given):
    return Flat(jax.tree.leaves(new_state)) if isinstance(given, Flat) else new_state

  def train_in_place(given, running, batches):  # the new state where the old one was (fsdp)
    state, running = train(get_state(given), running, batches)
    where = sharding.state_shardings(state, mesh, config.fsdp_min_size)
    return as_given(jax.lax.with_sharding_constraint(state, where), given), running

  jit = functools.partial(jax.jit, compiler_options=xla_options(config) or None)
  return Steps(
      train=jit(train_in_place, donate_argnums=(0, 1)),
      eval=jit(lambda given, running, batches: evaluate(get_state(given), running, batches),
               donate_argnums=1),
      put_state=put_state,
      get_state=get_state,
      put_batch=lambda batch: sharding.global_batch(batch, mesh),
      empty=lambda cls: sharding.to_global(cls.empty(), mesh),
  )





def probabilities(graphdef, state, images_BHWC, mask_B=None) -> jax.Array:
  """The model's class probabilities (float32 `[batch, classes]`) for stored images (uint8
  pixels divided by 255 on the device), computed as evaluation computes the logits: the model
  in eval mode, given the mask (`mask_B`, default all True) if its `__call__` takes one."""
  model = nnx.merge(graphdef, state)
  model.eval()
  mask_B = jnp.ones(images_BHWC.shape[:1], bool) if mask_B is None else mask_B
  logits_BK = call_model(model, prepare_images({"image": images_BHWC}), mask_B)
  return jax.nn.softmax(logits_BK.astype(jnp.float32), axis=-1)


def sync_every(config) -> int:
  """How often, in steps, the loops wait for a result: XLA:CPU collectives abort when hundreds
  of calls are queued; other backends never need to wait (0)."""
  return config.cpu_sync_every_steps if jax.default_backend() == "cpu" else 0


def summarize(running: Metrics) -> dict[str, float]:
  """The running metrics, fetched in one transfer and computed on the host."""
  running = jax.device_get(running)
  return {**{name: float(value) for name, value in running.compute().items()},
          "examples": int(running.loss.count)}


def eval_iterator(batches: grain.MapDataset, config) -> grain.DatasetIterator:
  """An endless iterator over `batches` repeated, read as training reads (worker processes for
  encoded data): `evaluate` takes len(batches) elements of it each time, so its workers start
  once and read the next evaluation's first elements ahead. Close it when done."""
  return input_pipeline.as_iterator(batches.repeat(), config)


def evaluate(compiled: Steps, state, batches, config, metrics=Metrics,
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
