"""Benchmarks the train step on one device, on every device with spmd and with pmap, and the loop.

  python benchmark.py --out=bench.json [--tiny]

Steps: for two models (the config's CNN on the digits; a wider CNN on synthetic 32x32x3 images)
and each path, the compile time (ahead of time, `step.lower(...).compile()`), the median time of
the compiled step on a batch already on the devices (each step waited for, the donated state
threaded through), examples/s from it, and the peak host memory. The three paths of a model run
in one process, taking turns of a few steps, so that a machine whose speed drifts (shared or
throttled cores) slows them alike and their ratios are fair; the peak memory (ru_maxrss) of each
path comes from a short run of that path alone in its own process.

Loop efficiency: `train_and_evaluate`'s `loop_examples_per_sec` for the config (input pipeline,
metrics, logging, evaluation, checkpoints) over the examples/s of the bare compiled step run
back to back on one batch already on the devices, as many steps as the loop and waiting as
often as it does (`cpu_sync_every_steps` on the CPU). Each repeat runs both in a fresh process,
one right after the other, in alternating order; the efficiency is the median of their ratios.

Every measurement runs in a subprocess with 8 devices (forced on the CPU); `single` uses device 0.
--tiny (configs/tiny.py, shrunk models, few steps; two subprocesses at a time, so its timings mean
nothing) runs every code path in seconds, for CI. Needs the dev extra (tensorboard).
"""

import concurrent.futures
import functools
import glob
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import flax
import jax
import ml_collections
from absl import app, flags
from flax import nnx
from tensorboard.backend.event_processing import event_accumulator

import input_pipeline
import parallel
from configs import default, tiny
from model import create_model

NUM_DEVICES = 8
MODELS = ("digits", "large")  # the config's CNN on the digits; a wider CNN on bigger images
PATHS = ("single", "spmd", "pmap")
LOOP_PATHS = ("spmd", "pmap")
WARMUP_STEPS = 2  # untimed calls of each compiled step before the timed ones
REPEATS = 3  # paired (bare step, loop) runs per path: the median of their ratios is reported

_OUT = flags.DEFINE_string("out", "bench.json", "Where the JSON results go.")
_TINY = flags.DEFINE_bool("tiny", False, "A smoke run of every code path in seconds (CI).")
_MEASURE = flags.DEFINE_string("measure", None, "Internal: 'steps:MODEL', 'memory:MODEL:PATH' "
                               "or 'loop:PATH:RUN', measured in this process, printed as JSON.")


def get_config(model: str, is_tiny: bool) -> ml_collections.ConfigDict:
  """The default (or tiny) config; for 'large', the CNN widened, on synthetic images. Steps are
  timed in `rounds` turns of `turn_steps` steps per path."""
  config = (tiny if is_tiny else default).get_config()
  config.rounds, config.turn_steps = (1, 3) if is_tiny else (10, 20)
  if model == "large":
    config.dataset = "synthetic"
    config.synthetic.image_shape = (16, 16, 3) if is_tiny else (32, 32, 3)
    config.model.features = (16, 32) if is_tiny else (64, 128)
    config.batch_size = 64 if is_tiny else 256
    config.synthetic.num_train = config.synthetic.num_eval = config.batch_size  # one batch
    config.rounds, config.turn_steps = (1, 3) if is_tiny else (8, 4)  # ~0.5 s a step here
  return config


def step_state_batch(config, path: str):
  """The train step of `path`, and a state, running metrics and a batch already where the step
  wants them."""
  import train  # not at the top: it marks train.py's own flags (--config, ...) required

  splits, info = input_pipeline.get_datasets(config)
  batch = input_pipeline.train_batches(splits["train"], config)[0]
  model = create_model(config, info.image_shape, info.num_classes, nnx.Rngs(config.seed))
  optimizer = nnx.Optimizer(model, train.create_optimizer(config, 1000), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))
  if path == "single":
    device = jax.devices()[0]
    step = jax.jit(functools.partial(train.train_step, graphdef,
                                     grad_accum_steps=config.grad_accum_steps),
                   donate_argnums=(0, 1))
    placed = jax.device_put((state, train.TrainMetrics.empty(), batch), device)
    return step, *placed
  config = config.copy_and_resolve_references()
  config.parallelism = path
  mesh = parallel.make_mesh()
  steps = train.make_steps(graphdef, config, mesh)
  state = steps.put_state(jax.device_put(state, parallel.replicated(mesh)))
  return steps.train, state, steps.empty(train.TrainMetrics), steps.put_batch(batch)


def peak_host_mb() -> float:
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
  return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


class Runner:
  """A compiled step with its state, running metrics and batch: times steps and streams."""

  def __init__(self, config, path: str):
    step, self.state, self.running, self.batch = step_state_batch(config, path)
    start = time.perf_counter()
    self.step = step.lower(self.state, self.running, self.batch).compile()
    self.compile_s = time.perf_counter() - start
    self.times(WARMUP_STEPS)

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


def measure_steps(config) -> dict:
  """Every path's compile time and median step time, the paths taking turns."""
  runners = {path: Runner(config, path) for path in PATHS}
  seconds = {path: [] for path in PATHS}
  for turn in range(config.rounds):
    for path in PATHS[turn % len(PATHS):] + PATHS[:turn % len(PATHS)]:  # rotate who goes first
      seconds[path] += runners[path].times(config.turn_steps)
  results = {}
  for path, runner in runners.items():
    step_s = statistics.median(seconds[path])
    results[path] = dict(compile_s=runner.compile_s, step_ms=1e3 * step_s,
                         examples_per_sec=config.batch_size / step_s)
  return results


def read_scalar(workdir: str, tag: str) -> float:
  """The last value of a scalar in the TensorBoard event files of `workdir`."""
  for path in glob.glob(os.path.join(workdir, "events.out.tfevents.*")):
    events = event_accumulator.EventAccumulator(path)
    events.Reload()
    if tag in events.Tags()["scalars"]:
      return events.Scalars(tag)[-1].value
  raise LookupError(f"no scalar {tag!r} in the event files of {workdir}")


def measure_loop(config, path: str, loop_first: bool) -> dict:
  """The loop's examples/s and the bare step's, measured one right after the other."""
  import train  # see step_state_batch

  config.parallelism = path
  num_steps = len(input_pipeline.train_batches(input_pipeline.get_datasets(config)[0]["train"],
                                               config)) - 1  # the loop's clock skips step 1

  def loop():
    with tempfile.TemporaryDirectory() as workdir:
      train.train_and_evaluate(config, workdir)
      return read_scalar(workdir, "loop_examples_per_sec")

  def bare():
    runner = Runner(config, path)
    return num_steps * config.batch_size / runner.stream(num_steps, train.sync_every(config))

  if loop_first:
    loop_rate, step_rate = loop(), bare()
  else:
    step_rate, loop_rate = bare(), loop()
  return dict(loop_examples_per_sec=loop_rate, step_examples_per_sec=step_rate,
              efficiency=loop_rate / step_rate)


def measure(what: str, is_tiny: bool) -> dict:
  """What the subprocess `--measure=what` prints."""
  kind, name, *rest = what.split(":")
  if kind == "steps":
    result = measure_steps(get_config(name, is_tiny))
  elif kind == "memory":
    Runner(get_config(name, is_tiny), rest[0])  # compiled, and WARMUP_STEPS steps run
    result = {}
  else:  # loop:PATH:RUN
    result = measure_loop(get_config("digits", is_tiny), name, loop_first=int(rest[0]) % 2 == 1)
  return dict(result, peak_host_mb=peak_host_mb(), device_count=jax.device_count(),
              backend=jax.default_backend())


def run_in_subprocess(what: str, is_tiny: bool) -> dict:
  """`measure(what)` in a fresh process with NUM_DEVICES devices."""
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in xla_flags:
    xla_flags += f" --xla_force_host_platform_device_count={NUM_DEVICES}"
  command = [sys.executable, os.path.abspath(__file__), f"--measure={what}"]
  command += ["--tiny"] if is_tiny else []
  done = subprocess.run(command, capture_output=True, text=True, timeout=120 if is_tiny else 300,
                        env=dict(os.environ, XLA_FLAGS=xla_flags.strip()))
  if done.returncode:
    raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
  return json.loads(done.stdout.splitlines()[-1])


def run_all(whats: list[str], is_tiny: bool) -> dict[str, dict]:
  with concurrent.futures.ThreadPoolExecutor(max_workers=2 if is_tiny else 1) as pool:
    results = pool.map(functools.partial(run_in_subprocess, is_tiny=is_tiny), whats)
    return dict(zip(whats, results, strict=True))


def benchmark(is_tiny: bool) -> dict:
  config_parallelism = get_config("digits", is_tiny).parallelism
  loop_paths = sorted(LOOP_PATHS, key=lambda path: path != config_parallelism)  # the config's first
  repeats = 1 if is_tiny else REPEATS
  results = run_all([f"steps:{model}" for model in MODELS] +
                    [f"memory:{model}:{path}" for model in MODELS for path in PATHS] +
                    [f"loop:{path}:{i}" for i in range(repeats) for path in loop_paths], is_tiny)
  models = {}
  for model in MODELS:
    config = get_config(model, is_tiny)
    paths = {path: dict(results[f"steps:{model}"][path],
                        peak_host_mb=results[f"memory:{model}:{path}"]["peak_host_mb"])
             for path in PATHS}
    models[model] = dict(
        image_shape=list(input_pipeline.get_datasets(config)[1].image_shape),
        features=list(config.model.features), batch_size=config.batch_size,
        timed_steps=config.rounds * config.turn_steps, paths=paths,
        pmap_over_spmd_step_time=paths["pmap"]["step_ms"] / paths["spmd"]["step_ms"])
  loop = {}
  for path in loop_paths:
    runs = [results[f"loop:{path}:{i}"] for i in range(repeats)]
    loop[path] = {key: statistics.median(run[key] for run in runs) for key in (
        "loop_examples_per_sec", "step_examples_per_sec", "efficiency")}
    loop[path].update(efficiencies=[run["efficiency"] for run in runs],
                      peak_host_mb=max(run["peak_host_mb"] for run in runs))
  first = results[f"steps:{MODELS[0]}"]
  return dict(jax=jax.__version__, flax=flax.__version__, backend=first["backend"],
              device_count=first["device_count"], tiny=is_tiny,
              compile_time="ahead of time: step.lower(...).compile(), every path",
              config_parallelism=config_parallelism, models=models, loop=loop)


def report(results: dict) -> str:
  lines = [f"jax {results['jax']}, flax {results['flax']}, {results['device_count']} "
           f"{results['backend']} devices" + (" (tiny)" if results["tiny"] else ""),
           f"{'model':<8}{'shape':>10}{'batch':>7}{'path':>8}{'compile s':>11}{'step ms':>10}"
           f"{'examples/s':>12}{'peak host MB':>14}"]
  for name, model in results["models"].items():
    shape = "x".join(map(str, model["image_shape"]))
    for path, r in model["paths"].items():
      lines.append(f"{name:<8}{shape:>10}{model['batch_size']:>7}{path:>8}{r['compile_s']:>11.2f}"
                   f"{r['step_ms']:>10.2f}{r['examples_per_sec']:>12.0f}{r['peak_host_mb']:>14.0f}")
  for name, model in results["models"].items():
    lines.append(f"pmap/spmd step time: {model['pmap_over_spmd_step_time']:.2f} ({name})")
  for path, loop in results["loop"].items():
    pairs = " ".join(f"{e:.2f}" for e in loop["efficiencies"])
    lines.append(f"loop ({path}): {loop['loop_examples_per_sec']:.0f} examples/s, the bare step "
                 f"{loop['step_examples_per_sec']:.0f}; paired ratios {pairs}")
  for path, loop in results["loop"].items():
    label = "" if path == results["config_parallelism"] else f" ({path})"
    lines.append(f"loop efficiency{label}: {loop['efficiency']:.2f}")
  return "\n".join(lines)


def main(argv):
  del argv
  if _MEASURE.value:
    print(json.dumps(measure(_MEASURE.value, _TINY.value)))
    return
  start = time.perf_counter()
  results = benchmark(_TINY.value)
  results["wall_s"] = time.perf_counter() - start
  print(report(results))
  with open(_OUT.value, "w") as f:
    json.dump(results, f, indent=2)
  print(f"wrote {_OUT.value} in {results['wall_s']:.0f} s")


if __name__ == "__main__":
  app.run(main)
