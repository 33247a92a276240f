"""benchmark.py's train steps: each path's compiled single step (k = 1) on a batch already on the
devices, timed step by step or streamed (`Runner`), the paths taking turns (`measure_steps`)."""

import functools
import resource
import statistics
import sys
import time

import jax
from flax import nnx

from .. import plan
from ..data import batches, sources
from ..parallel import sharding
from ..training import dispatch, optim

WARMUP_STEPS = 2  # untimed calls of each compiled step before the timed ones


def step_state_batch(config, path: str):
  """The single train step (k = 1) of `path`, and a state, running metrics and a batch already
  where the step wants them."""

  config = config.copy_and_resolve_references()
  config.steps_per_dispatch = 1
  config = plan.resolved(config)
  splits, info = sources.get_datasets(config)
  batch = batches.train_batches(splits["train"], config)[0]  # [1, batch, ...]
  run_plan = plan.make_plan(config)
  graphdef, state = nnx.split(optim.build_state(run_plan, info.image_shape, info.num_classes,
                                                1000))
  running = run_plan.metrics.train.empty()
  if path == "single":
    device = jax.devices()[0]
    train, _ = dispatch.one_batch_steps(run_plan, device.platform)  # (the backend's forms)
    step = jax.jit(functools.partial(train, graphdef), donate_argnums=(0, 1))
    one_batch = jax.tree.map(lambda x: x[0], batch)
    return step, *jax.device_put((state, running, one_batch), device)
  config.parallelism = path
  mesh = sharding.make_mesh(config)
  compiled = dispatch.make(graphdef, run_plan, mesh)
  state = compiled.put_state(sharding.place_state(state, mesh, config.fsdp_min_size))
  return compiled.train, state, compiled.empty(type(running)), compiled.put_batch(batch)


def peak_host_mb() -> float:
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
  return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


class Runner:
  """A compiled step with its state, running metrics and batch: times steps and streams."""

  def __init__(self, config, path: str):
    begin = time.perf_counter()
    step, self.state, self.running, self.batch = step_state_batch(config, path)
    start = time.perf_counter()
    self.step = step.lower(self.state, self.running, self.batch).compile()
    self.compile_s = time.perf_counter() - start
    self.state_mb = sharding.bytes_per_device(self.state) / 1e6  # model and optimizer state
    memory = self.step.memory_analysis()  # one device's: the state donated, updated in place
    self.step_peak_mb = (memory.argument_size_in_bytes + memory.output_size_in_bytes +
                         memory.temp_size_in_bytes - memory.alias_size_in_bytes) / 1e6
    self.times(1)
    self.first_step_s = time.perf_counter() - begin  # state built, placed, compiled, one step
    self.times(WARMUP_STEPS - 1)

  def times(self, num_steps: int) -> list[float]:
    """Seconds of each of `num_steps` steps, each waited for."""
    seconds = []
    for _ in range(num_steps):
      start = time.perf_counter()
      self.state, self.running = self.step(self.state, self.running, self.batch)
      jax.block_until_ready((self.state, self.running))
      seconds.append(time.perf_counter() - start)
    return seconds

  def stream(self, num_steps: int, sync_every: int) -> float:
    """Seconds for `num_steps` steps back to back, waiting every `sync_every` (0: never)."""
    start = time.perf_counter()
    for i in range(1, num_steps + 1):
      self.state, self.running = self.step(self.state, self.running, self.batch)
      if sync_every and i % sync_every == 0:
        jax.block_until_ready(self.running)
    jax.block_until_ready((self.state, self.running))
    return time.perf_counter() - start


def measure_steps(config, paths, ema: str, ema_decay: float) -> dict:
  """Every path's compile time and median step time, the paths taking turns.

  Args:
    config: the run's config.
    paths: the parallelisms measured.
    ema: the name of spmd with the moving average, measured too.
    ema_decay: its decay.
  """
  with_ema = config.copy_and_resolve_references()
  with_ema.ema_decay = ema_decay
  runners = {path: Runner(config, path) for path in paths} | {ema: Runner(with_ema, "spmd")}
  names = list(runners)
  seconds = {name: [] for name in names}
  for turn in range(config.rounds):
    for name in names[turn % len(names):] + names[:turn % len(names)]:  # rotate who goes first
      seconds[name] += runners[name].times(config.turn_steps)
  results = {}
  for path, runner in runners.items():
    step_s = statistics.median(seconds[path])
    results[path] = dict(compile_s=runner.compile_s, first_step_s=runner.first_step_s,
                         step_ms=1e3 * step_s,
                         examples_per_sec=plan.global_batch_size(config) / step_s,
                         state_mb_per_device=runner.state_mb,
                         step_peak_mb_per_device=runner.step_peak_mb)
  return results


def streamed(config, path: str) -> float:
  """Examples/s of `path`'s single step streamed over as many steps as train.py's loop times (its
  clock skips the first call's k)."""
  num_steps = batches.num_batches(
      config.num_epochs * sources.get_datasets(config)[1].num_examples["train"],
      config.batch_size) - config.steps_per_dispatch
  runner = Runner(config, path)
  return num_steps * config.batch_size / runner.stream(num_steps, dispatch.sync_every(config))


def describe(config) -> dict:
  """What benchmark.py's figures were measured on: the images, the model, the batch."""
  return dict(image_shape=list(sources.get_datasets(config)[1].image_shape),
              model=(f"cnn {tuple(config.model.features)}" if config.model.name == "cnn"
                     else config.model.name), dtype=config.model.dtype,
              batch_size=config.batch_size, timed_steps=config.rounds * config.turn_steps)
