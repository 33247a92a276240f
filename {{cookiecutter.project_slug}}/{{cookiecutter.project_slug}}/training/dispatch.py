"""How the steps (steps.py) are compiled and dispatched for each parallelism, and the loops' use of
them (`evaluate`, `summarize`).

A compiled call runs k = `config.run.steps_per_dispatch` steps (`lax.scan`) over k batches
stacked on a leading axis ([k, B, ...]): k steps in one call equal k single calls."""

import contextlib
import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections

from ..data import augment
from ..parallel import sharding
from .steps import eval_step, train_step


def step_options(run_plan, crop_on_device: bool = True) -> dict:
  """The train step's keyword arguments, resolved once from the run's plan (`plan.make_plan`): its
  config, frozen (hashable, read-only), with the recipe's crop off where the input pipeline crops
  (photos stored whole: `crop_on_device` False); `recipe`, the plan's recipe module;
  `collection`, the class of the forward pass's metrics (the plan's `metrics.train_loss`). The
  eval step takes the first two."""
  config = ml_collections.ConfigDict(run_plan.config)
  if not crop_on_device:
    config.augment_crop = False
  return dict(config=ml_collections.FrozenConfigDict(config), recipe=run_plan.recipe,
              collection=run_plan.metrics.train_loss)


def backend_forms(step, platform: str, config):
  """A step traced in the platform's own forms of the same math, where it has any.

  The one place a backend's module is chosen (BENCHMARKS.md, "The train step's forms").

  Args:
    step: the train step on one batch.
    platform: "gpu", "cpu" or "tpu" (the TPU's forms are the stock ones).
    config: the run's config.
  Returns:
    `step`, traced with the platform's forms in place of the stock ones.
  """
  if platform == "gpu":
    from ..backends import gpu

    swaps = gpu.forms(flat_norms=config.parallelism != "fsdp")  # (fsdp's leaves: split)
  elif platform == "cpu":
    from ..backends import cpu

    swaps = cpu.forms()
  else:  # (the TPU's are the stock ones)
    return step

  @functools.wraps(step)
  def in_backend_forms(*args, **kwargs):
    with substituted(swaps):
      return step(*args, **kwargs)

  return in_backend_forms


@contextlib.contextmanager
def substituted(swaps):
  """Within it, each (module, name, form) of `swaps` has the form in the module's `name` (a stock
  function's place: nnx.max_pool's, say), put back after. A step is traced in one thread."""
  stock = [getattr(module, name) for module, name, _ in swaps]
  try:
    for module, name, form in swaps:
      setattr(module, name, form)
    yield
  finally:
    for (module, name, _), original in zip(swaps, stock, strict=True):
      setattr(module, name, original)


def on_resized(step, image_shape, canvas):
  """A step whose batch's crops are first resized on the devices: a stage before the step.

  Args:
    step: a train or eval step on one batch.
    image_shape: the model's input [H, W, C].
    canvas: the largest crop [H, W], that the crops sent end to end (`batches.pack`, with their
      "offset" and "box") are unpacked into.
  Returns:
    `step` on the crops resized to `image_shape` and scaled as the model takes pixels
    (steps.forward).
  """

  def resized_step(graphdef, state, running, batch, **kwargs):
    batch = dict(batch)
    crops_BHWC = augment.unpacked(batch.pop("image"), batch.pop("offset"), batch["box"],
                                  (*canvas, image_shape[2]))
    images_BHWC = augment.resize_crops(crops_BHWC.astype(jnp.float32), batch.pop("box"),
                                       tuple(image_shape[:2])) / 255.0
    return step(graphdef, state, running, dict(batch, image=images_BHWC), **kwargs)

  return resized_step


def one_batch_steps(run_plan, platform: str, info=None):
  """The train and eval steps on one batch, composed for the platform, parallelism and data.

  Args:
    run_plan: the run's plan (`plan.make_plan`).
    platform: the devices' platform (`backend_forms`).
    info: the data's DatasetInfo (photos' crops: `on_resized`); None: the images as stored.
  Returns:
    steps.py's train and eval steps, as partials of everything but the graphdef, state, metrics
    and batch (pmap: `pmap.on_devices`).
  """
  options = step_options(run_plan, not (info and info.crops_on_host))
  train = backend_forms(functools.partial(train_step, **options), platform, run_plan.config)
  evaluate = functools.partial(eval_step, config=options["config"], recipe=options["recipe"])
  if run_plan.config.parallelism == "pmap":
    from ..parallel import pmap

    train, evaluate = pmap.on_devices(train), pmap.on_devices(evaluate)
  if info and info.canvas:
    train, evaluate = (on_resized(step, info.image_shape, info.canvas)
                       for step in (train, evaluate))
  return train, evaluate


def k_steps(step, state, running, batches, unroll: bool = False):
  """A step run once per batch of batches stacked on a leading axis (`lax.scan`).

  Photos' crops packed (`batches.pack`: "offset"): the one "image" holds every batch's, given to
  each.

  Args:
    step: (state, running, batch) -> (state, running).
    state: the state.
    running: the metrics so far.
    batches: k batches stacked, [k, B, ...].
    unroll: whether the k steps are written out as straight-line code.
  Returns:
    (state, running) after the k steps.
  """
  if "offset" in batches:
    packed, batches, one = batches["image"][0], dict(batches), step
    del batches["image"]
    step = lambda state, running, batch: one(state, running, dict(batch, image=packed))  # noqa: E731
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


def make(graphdef, run_plan, mesh, unroll: bool | None = None, pmap_devices=None,
         info=None) -> Steps:
  """The train and eval steps of the plan's `config.parallelism`, each over stacked batches.

  Args:
    graphdef: the graph of the state's objects.
    run_plan: the run's plan (`plan.make_plan`).
    mesh: the devices' mesh (jit's).
    unroll: whether the k steps are written out; None: on the CPU alone, whose convolution
      gradients run far slower inside a loop.
    pmap_devices: pmap's devices (aot.py: a topology's); None: the mesh's.
    info: the data's DatasetInfo (photos cropped on the host: the recipe's crop off; crops sent
      packed: resized on the devices to its image_shape).
  Returns:
    The compiled `Steps`.
  """
  config, platform = run_plan.config, (pmap_devices or mesh.devices.flat)[0].platform
  compiler_options = run_plan.xla_options or None  # (jit's; pmap takes none)
  unroll = platform == "cpu" if unroll is None else unroll
  one_step, one_eval = (functools.partial(step, graphdef)
                        for step in one_batch_steps(run_plan, platform, info))
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


def compile_eval(compiled: Steps, state, eval_batches, collection) -> float:
  """Compiles the eval step now, not mid-training, for the first and the last (shorter) element.

  Args:
    compiled: the steps.
    state: the state, in the steps' layout.
    eval_batches: the eval split's elements.
    collection: the eval metrics' class.
  Returns:
    The seconds it took (a call returns once compiled and dispatched).
  """
  start = time.perf_counter()
  for element in {len(e["mask"]): e for e in (eval_batches[0], eval_batches[-1])}.values():
    compiled.eval(state, compiled.empty(collection), compiled.put_batch(element))
  return time.perf_counter() - start


def sync_every(config) -> int:
  """How often, in steps, the loops wait for a result: XLA:CPU's collectives abort with hundreds
  of calls queued; elsewhere never (0)."""
  return config.cpu_sync_every_steps if jax.default_backend() == "cpu" else 0


def summarize(running) -> dict[str, float]:
  """The running metrics, fetched in one transfer and computed on the host."""
  running = jax.device_get(running)
  return {**{name: float(value) for name, value in running.compute().items()
             if name != "confusion"},  # (the final evaluation's matrix: report.py writes it)
          "examples": int(running.loss.count)}


def evaluate(compiled: Steps, state, iterator, num_batches: int, config, collection):
  """The eval metrics over the next elements of an iterator, merged on the devices.

  Args:
    compiled: the steps.
    state: the state, in the steps' layout.
    iterator: the elements (`input_pipeline.as_iterator`: the eval split once).
    num_batches: how many elements to take.
    config: the run's config.
    collection: the metrics' class (the plan's `metrics.eval`, or more).
  Returns:
    The running metrics, on the devices.
  """
  running = compiled.empty(collection)
  every = sync_every(config)
  for i in range(1, num_batches + 1):
    running = compiled.eval(state, running, compiled.put_batch(next(iterator)))
    if every and i % max(every // config.run.steps_per_dispatch, 1) == 0:
      jax.block_until_ready(running)
  return running
