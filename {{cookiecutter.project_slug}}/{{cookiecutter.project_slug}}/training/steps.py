"""The train and eval steps, how each parallelism compiles them, and the evaluation loop.

A compiled call runs k = `config.run.steps_per_dispatch` steps (`lax.scan`) over k stacked batches:
image [k, B, H, W, C] (stored dtype), label [k, B], mask [k, B] (False on padding), position
[k, B] (each example's place in the stream: it keys the augmentation), and box [k, B, 6] where
the images are photos' crops that the devices resize (`forward`). A batch of padding alone
changes nothing, so k steps in one call equal k single calls."""

import functools
import inspect
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
from clu import metrics as clu_metrics
from flax import nnx

from .. import layers, plan
from ..data import augment as augment_ops
from ..parallel import sharding
from . import metrics
from .metrics import NonFinite


@functools.cache  # (a class's signature: read once, not at every trace)
def takes_mask(model_class) -> bool:
  """Whether the model class's `__call__` takes `example_mask=` (or `**kwargs`)."""
  parameters = inspect.signature(model_class.__call__).parameters.values()
  return any(p.name == "example_mask" or p.kind is p.VAR_KEYWORD for p in parameters)


def mask_warning(model) -> str | None:
  """A warning for a model holding BatchNorm that cannot be given the mask, else None."""
  if takes_mask(type(model)) or not any(isinstance(node, nnx.BatchNorm)
                                        for _, node in nnx.iter_graph(model)):
    return None
  return (f"warning: {type(model).__name__} holds BatchNorm but its __call__ takes no "
          "example_mask, so its batch statistics include the padding of partial batches; give "
          "__call__ an example_mask=None parameter and pass it on: "
          "layers.BatchNorm(...)(x, mask=example_mask) (model.py's docstring)")


# Folded into the seed's key before the stream positions: the augmentation keys are then none of
# the keys that `nnx.Rngs(seed)` hands out (fold_in(key(seed), n), n = 0, 1, ...).
AUGMENT_STREAM = 0x61756720  # b"aug "


def forward(model, batch, config, augment=None) -> jax.Array:
  """The model's float32 logits `[B, K]` of a batch. Its input: the stored pixels as float32
  (integers divided by 255, floats as they are; photos' crops cut on the host, with a "box",
  resized first to `config.run.image_shape`), in training augmented by `augment` (the
  recipe's) with one key an example, made from the seed and its place in the data stream alone
  (so any batching, device or process count, and any resume draw the same for it). The model is
  given the mask (`batch["mask"]`) when it takes one (`takes_mask`)."""
  images_BHWC = batch["image"].astype(jnp.float32)
  if "box" in batch:  # (sources.DatasetInfo.canvas)
    images_BHWC = augment_ops.resize_crops(images_BHWC, batch["box"], config.run.image_shape[:2])
  if jnp.issubdtype(batch["image"].dtype, jnp.integer):
    images_BHWC = images_BHWC / 255.0
  if augment is not None:
    key = jax.random.fold_in(jax.random.key(config.seed), AUGMENT_STREAM)
    keys_B = jax.vmap(lambda position: jax.random.fold_in(key, position))(batch["position"])
    images_BHWC = augment(images_BHWC, keys_B, config)
  masked = {"example_mask": batch["mask"]} if takes_mask(type(model)) else {}
  return model(images_BHWC, **masked).astype(jnp.float32)


def loss_and_metrics(model, batch, config, recipe, collection, train: bool = True):
  """The SUM of the real examples' losses (the recipe's, in float32; normalised later by the
  global count), and `collection` (a CLU collection's class) of their metrics. In training
  (`train`) the images are augmented and the loss is training's. The recipe's loss of one
  example is the padding's too: masked out here, whatever it is."""
  logits_BK = forward(model, batch, config, recipe.augment if train else None)
  cross_entropy_B = recipe.loss(logits_BK, batch["label"], config, train=False)
  losses_B = (recipe.loss(logits_BK, batch["label"], config, train=True) if train
              else cross_entropy_B)
  loss_sum = jnp.sum(jnp.where(batch["mask"], losses_B, 0.0))
  step_metrics = collection.single_from_model_output(
      loss=losses_B, cross_entropy=cross_entropy_B, logits=logits_BK, labels=batch["label"],
      mask=batch["mask"])
  return loss_sum, step_metrics


def micro_batches(batch, num: int):
  """`[batch, ...]` -> `[num, batch // num, ...]`, micro-batch j holding examples j, j + num, ...
  (every device an equal share of each)."""
  return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, num, *x.shape[1:]), 0, 1), batch)


def accumulated_gradients(grad_fn, model, batch, num_micro_batches: int, axis_name=None):
  """`grad_fn(model, batch)` (the gradient of the summed loss, and metrics), summed over `batch`
  in `num_micro_batches` pieces run in one loop (gradient accumulation). A piece without a real
  example (over all devices under pmap) adds nothing and leaves the model's state (BatchNorm
  statistics, RNG counters) as it was. Under pmap (`axis_name`) the sums are those of every
  device: each piece's summed over the devices before the pieces are added up, the order in which
  XLA sums spmd's, so the two agree to the bit (summed after, they part by rounding, which
  training amplifies)."""
  micro = micro_batches(batch, num_micro_batches)
  # A forward pass changes BatchNorm's statistics and the RNG counters, never the parameters:
  # only that part of the model is carried from micro-batch to micro-batch.
  changes = nnx.Not(nnx.Param)
  graphdef, params, changing = nnx.split(model, nnx.Param, changes)

  def add_micro_batch(carry, micro_batch):
    changing, sums = carry
    model = nnx.merge(graphdef, params, changing, copy=True)  # `changing` stays as it was
    grads_and_metrics = grad_fn(model, micro_batch)
    real = jnp.sum(micro_batch["mask"], dtype=jnp.int32)
    if axis_name is not None:  # summed over the devices micro-batch by micro-batch, as spmd's
      real, grads_and_metrics = jax.lax.psum((real, grads_and_metrics), axis_name)
    keep = lambda new, old: jnp.where(real > 0, new, old)  # noqa: E731
    sums = jax.tree.map(lambda total, x: total + keep(x, jnp.zeros_like(x)), sums,
                        grads_and_metrics)
    return (jax.tree.map(keep, nnx.state(model, changes), changing), sums), None

  first = jax.tree.map(lambda x: x[0], micro)
  shapes = jax.eval_shape(lambda changing, batch: grad_fn(
      nnx.merge(graphdef, params, changing, copy=True), batch), changing, first)
  zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
  (changing, sums), _ = jax.lax.scan(add_micro_batch, (changing, zeros), micro)
  nnx.update(model, changing)
  return sums


def step_options(config, crop_on_device: bool = True, resize_to=None) -> dict:
  """The train step's keyword arguments, resolved once: `config`, frozen (hashable, read-only),
  with the recipe's crop off where the input pipeline crops (photos stored whole:
  `crop_on_device` False) and `run.image_shape` = `resize_to`, the shape that crops coming with
  their boxes are resized to (`forward`); `recipe`, the module it names (`plan.recipe_module`:
  recipe.py unless the config names another); `collection`, the class of the forward pass's
  metrics (`metrics.of(config).train_loss`). The eval step takes the first two."""
  config = ml_collections.ConfigDict(config)
  if not crop_on_device:
    config.augment_crop = False
  if resize_to is not None:
    with config.unlocked():
      config.run.image_shape = tuple(resize_to)
  return dict(config=ml_collections.FrozenConfigDict(config), recipe=plan.recipe_module(config),
              collection=metrics.of(config).train_loss)


def sum_of_squares(tree, flat: bool = False) -> jax.Array:
  """The sum of the squares of every entry of `tree`, in float32: over its leaves laid end to end
  (`flat`: one reduction, where the leaves are whole on each device), or one reduction a leaf
  (fsdp: each leaf split over the devices, never gathered)."""
  leaves = [x.astype(jnp.float32).ravel() for x in jax.tree.leaves(tree)]
  if flat and len(leaves) > 1:
    leaves = [jnp.concatenate(leaves)]
  return sum(jnp.sum(jnp.square(x)) for x in leaves)


# What the moving average of the parameters averages: every Param, and BatchNorm's statistics.
AVERAGED = (nnx.Param, nnx.BatchStat)
# The one per-backend choice of how the train step is written (`train_step`'s `skip_by`,
# `norms_of` and `flat_norms`); no form is within 5% of the best peak memory on every chip
# (aot.py: the 1.16 GB MLP of tests/test_aot.py under fsdp, 'kept' +19% on h100:8 with the
# low-memory options, 'updated' +7% on v5e:2x4). The CPU skips under lax.cond: selecting keeps a
# second state. The norms over the leaves laid end to end: one reduction where a GPU fuses the
# concatenation into it (ResNet-50 on h100:8: 2,068 -> 1,612 kernels a step, aot.py); the CPU
# writes the concatenation out (a second state), the TPU too (v5e:2x4: its memory-bound step
# bound 62 -> 66 ms). Other platforms take the TPU's.
STEP_FORMS = {
    "cpu": dict(skip_by="cond", norms_of="kept", flat_norms=False),
    "gpu": dict(skip_by="select", norms_of="updated", flat_norms=True),
    "tpu": dict(skip_by="select", norms_of="kept", flat_norms=False),
}


def train_step(graphdef, state, running, batch, *, config, recipe, collection,
               batch_norm_groups=1, axis_name=None, skip_by="select", norms_of="kept",
               flat_norms=False):
  """One optimizer step on one batch; returns the state and `running` with this step's metrics.
  The gradient is sum(real examples' gradients) / (number of real examples), both summed globally
  (pmap: `axis_name`): exact for any padding and device count; with `config.grad_accum_steps` > 1
  accumulated over that many pieces of the batch (`accumulated_gradients`). BatchNorm's
  statistics are those of `batch_norm_groups` groups of devices (the `groups` of the model's
  `layers.BatchNorm`). A non-finite step, or a batch of padding alone, leaves the state as it
  was: by selection (`skip_by='select'`: no conditional, which a GPU would sync on) or under
  `lax.cond` ('cond'); the parameters' norm is taken from the state after the choice
  (`norms_of='kept'`) or before it ('updated'), the update's from the update the optimizer
  returns; each norm one reduction (`flat_norms`, not fsdp's split leaves) or one a leaf;
  `STEP_FORMS` chooses per backend. With a moving average (state (model, optimizer, average))
  its `AVERAGED` variables move by 1 - `ema_decay`, or with `ema_warmup` by 1 - min(`ema_decay`,
  (1 + n) / (10 + n)) at update n (as TensorFlow's). `config`: the run's, frozen; `recipe`: the
  loss and augmentation; `collection`: the forward pass's metrics (`step_options`).
  The model trains in train mode, set as Flax's examples set it (`model.train()`: every layer's
  `deterministic` and `use_running_average` False, so nnx.Dropout, nnx.MultiHeadAttention and
  BatchNorm need no keyword of yours); evaluation runs in eval mode (`model.eval()`).
  Random layers draw one mask over the global batch, by row, on spmd and fsdp (the same for one
  device or many, one process or several); on pmap each device its own (`fold_in_device_index`)."""
  old_state = jax.tree.map(lambda x: x, state)  # kept for a step that changes nothing
  model, optimizer, *average = nnx.merge(graphdef, state)
  model.train()
  model.set_attributes(layers.BatchNorm, groups=batch_norm_groups, raise_if_not_found=False)
  grad_fn = nnx.grad(functools.partial(loss_and_metrics, config=config, recipe=recipe,
                                       collection=collection), has_aux=True)
  if axis_name is not None:
    from ..parallel import pmap  # (the pmap path alone)

    restore_keys = pmap.fold_in_device_index(model, axis_name)
  if config.grad_accum_steps > 1:
    grads, step_metrics = accumulated_gradients(grad_fn, model, batch, config.grad_accum_steps,
                                                axis_name)
  else:
    grads, step_metrics = grad_fn(model, batch)
    if axis_name is not None:
      grads, step_metrics = jax.lax.psum((grads, step_metrics), axis_name)
  if axis_name is not None:
    restore_keys()
  count = step_metrics.loss.count
  # One reduction for both: the squared norm of the summed gradient (for the metrics), which
  # is not finite when an entry is not (nor when it overflows float32: a gradient beyond 1e19).
  flat = flat_norms and config.parallelism != "fsdp"  # (fsdp's leaves: never gathered)
  grads_squared = sum_of_squares(grads, flat)
  finite = jnp.isfinite(step_metrics.loss.total) & jnp.isfinite(grads_squared)
  real = count > 0
  applied = finite & real

  def update(current, _):  # the optimizer step, on the state as the forward pass left it
    model, optimizer, *average = nnx.merge(graphdef, current)
    n = optimizer.step[...].astype(jnp.float32)  # the updates before this one
    updates = optimizer.update(model, jax.tree.map(lambda g: g / jnp.maximum(count, 1), grads))
    decay = config.ema_decay
    if config.ema_warmup:
      decay = jnp.minimum(decay, (1 + n) / (10 + n))
    for ema in average:
      nnx.update(ema, jax.tree.map(lambda e, m: decay * e + (1 - decay) * m.astype(e.dtype),
                                   nnx.state(ema, AVERAGED), nnx.state(model, AVERAGED)))
    return nnx.state((model, optimizer, *average)), sum_of_squares(updates, flat)

  current = nnx.state((model, optimizer, *average))
  if skip_by == "select":
    updated, updates_squared = update(current, None)
    new_state = jax.tree.map(lambda new, old: jnp.where(applied, new, old), updated, old_state)
  else:
    new_state, updates_squared = jax.lax.cond(
        applied, update, lambda _, old: (old, jnp.float32(0)), current, old_state)
  measured = updated if skip_by == "select" and norms_of == "updated" else new_state
  params_squared = sum_of_squares(nnx.state(nnx.merge(graphdef, measured)[0], nnx.Param), flat)
  # The global norms, averaged over the steps that applied their update (the gradient's: the whole
  # gradient's on every path, under pmap the psum'd one; before clipping).
  norms = dict(l2_grads=jnp.sqrt(grads_squared) / jnp.maximum(count, 1),
               l2_params=jnp.sqrt(params_squared), l2_updates=jnp.sqrt(updates_squared))
  bad = real & ~finite  # (a step of padding alone is not counted)
  step_metrics = type(running)(  # training's collection (metrics.of(config).train)
      **vars(step_metrics), nonfinite_steps=NonFinite(
          steps=jnp.where(real, 1, 0), count=jnp.where(bad, 1, 0), first=jnp.where(bad, 0, -1)),
      **{name: clu_metrics.Average(total=jnp.where(applied, norm, 0.0),
                                   count=applied.astype(jnp.int32))
         for name, norm in norms.items()})
  return new_state, running.merge(step_metrics)


def eval_step(graphdef, state, running, batch, *, config, recipe, axis_name=None):
  """Metrics of the model: the first object of the state (model, optimizer), (model,) or
  (model, optimizer, average), the moving average in the last."""
  objects = nnx.merge(graphdef, state)
  model = objects[2] if len(objects) > 2 else objects[0]
  model.eval()
  _, step_metrics = loss_and_metrics(model, batch, config, recipe, type(running), train=False)
  if axis_name is not None:
    step_metrics = jax.lax.psum(step_metrics, axis_name)
  return running.merge(step_metrics)


def k_steps(step, state, running, batches, unroll: bool = False):
  """`step(state, running, batch)` -> `(state, running)`, run once per batch of the batches
  stacked on a leading axis (`lax.scan`; `unroll`: as straight-line code)."""
  if jax.tree.leaves(batches)[0].shape[0] == 1:
    return step(state, running, jax.tree.map(lambda x: x[0], batches))
  body = lambda carry, batch: (step(*carry, batch), None)  # noqa: E731
  return jax.lax.scan(body, (state, running), batches, unroll=unroll)[0]


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
         info=None) -> Steps:
  """The train and eval steps of `config.parallelism`, each over stacked batches. `unroll` (None:
  on the CPU alone, whose convolution gradients run far slower inside a loop) writes the k steps
  out; `pmap_devices`: pmap's (aot.py: a topology's); `info`: the data's DatasetInfo (photos
  cropped on the host: the recipe's crop off; crops in a canvas resized to its image_shape)."""
  platform = (pmap_devices or mesh.devices.flat)[0].platform
  options = dict(step_options(config, not (info and info.crops_on_host),
                              info.image_shape if info else None),
                 **STEP_FORMS.get(platform, STEP_FORMS["tpu"]))
  compiler_options = plan.xla_options(config) or None  # (jit's; pmap takes none)
  devices = (len(pmap_devices or jax.devices()) if config.parallelism == "pmap"
             else mesh.devices.size)
  options["batch_norm_groups"] = devices // (config.batch_norm_devices or devices)
  unroll = platform == "cpu" if unroll is None else unroll
  pmap_axis = dict(axis_name=layers.PMAP_AXIS) if config.parallelism == "pmap" else {}
  one_step = functools.partial(train_step, graphdef, **options, **pmap_axis)
  one_eval = functools.partial(eval_step, graphdef, config=options["config"],
                               recipe=options["recipe"], **pmap_axis)
  train = functools.partial(k_steps, one_step, unroll=unroll)

  def evaluate(state, running, batches):  # (the state is read only)
    step = lambda state, running, batch: (state, one_eval(state, running, batch))  # noqa: E731
    return k_steps(step, state, running, batches, unroll)[1]

  if config.parallelism == "pmap":
    from ..parallel import pmap  # (the legacy path's pieces)

    return Steps(**pmap.compiled(train, evaluate, mesh, pmap_devices))
  jit = functools.partial(jax.jit, compiler_options=compiler_options)
  # The loop holds the state as a flat list of arrays (`Flat`), merged into modules only inside
  # the steps: a dispatch flattens a list in microseconds, an nnx.State's nodes in milliseconds.
  # The steps take the state itself too (evaluate.py, aot.py), and give back what they got.
  # The new state is laid out where the old one was (fsdp: each device's share, updated in place).
  structure = {}
  where = lambda state: sharding.state_shardings(state, mesh, config.fsdp_min_size)  # noqa: E731

  def put_state(state) -> Flat:
    arrays, structure["tree"] = jax.tree.flatten(state)
    structure["where"] = jax.tree.leaves(where(state))
    return Flat(arrays)

  def get_state(state):
    return jax.tree.unflatten(structure["tree"], state.arrays) if isinstance(state, Flat) else state

  def train_in_place(given, running, batches):
    if not isinstance(given, Flat):  # a state as it is (evaluate.py, aot.py)
      state, running = train(given, running, batches)
      return jax.lax.with_sharding_constraint(state, where(state)), running
    state, running = train(jax.tree.unflatten(structure["tree"], given.arrays), running, batches)
    arrays = jax.lax.with_sharding_constraint(jax.tree.leaves(state), structure["where"])
    return Flat(arrays), running

  return Steps(
      train=jit(train_in_place, donate_argnums=(0, 1)),
      eval=jit(lambda given, running, batches: evaluate(get_state(given), running, batches),
               donate_argnums=1),
      put_state=put_state,
      get_state=get_state,
      put_batch=lambda batch: sharding.global_batch(batch, mesh),
      empty=lambda cls: sharding.to_global(cls.empty(), mesh),
  )


def compile_eval(compiled: Steps, state, eval_batches, config) -> float:
  """Compiles the eval step now, not mid-training, for the first and the last (shorter) element;
  returns the seconds it took (a call returns once compiled and dispatched)."""
  start = time.perf_counter()
  for element in {len(e["mask"]): e for e in (eval_batches[0], eval_batches[-1])}.values():
    compiled.eval(state, compiled.empty(metrics.of(config).eval), compiled.put_batch(element))
  return time.perf_counter() - start


def probabilities(graphdef, state, images_BHWC, mask_B=None) -> jax.Array:
  """Class probabilities (float32 `[batch, classes]`) of stored images, as evaluation computes
  the logits (eval mode, the mask given when the model takes one)."""
  model = nnx.merge(graphdef, state)
  model.eval()
  mask_B = jnp.ones(images_BHWC.shape[:1], bool) if mask_B is None else mask_B
  logits_BK = forward(model, {"image": images_BHWC, "mask": mask_B}, None)
  return jax.nn.softmax(logits_BK, axis=-1)


def sync_every(config) -> int:
  """How often, in steps, the loops wait for a result: XLA:CPU's collectives abort with hundreds
  of calls queued; elsewhere never (0)."""
  return config.cpu_sync_every_steps if jax.default_backend() == "cpu" else 0


def summarize(running) -> dict[str, float]:
  """The running metrics, fetched in one transfer and computed on the host."""
  running = jax.device_get(running)
  return {**{name: float(value) for name, value in running.compute().items()},
          "examples": int(running.loss.count)}


def evaluate(compiled: Steps, state, iterator, num_batches: int, config, collection=None):
  """The metrics (`collection`, default the recipe's) over the next `num_batches` elements of
  `iterator` (`input_pipeline.as_iterator`: the eval split once), merged on the devices."""
  running = compiled.empty(collection or metrics.of(config).eval)
  every = sync_every(config)
  for i in range(1, num_batches + 1):
    running = compiled.eval(state, running, compiled.put_batch(next(iterator)))
    if every and i % max(every // config.run.steps_per_dispatch, 1) == 0:
      jax.block_until_ready(running)
  return running
