"""Benchmarks the train step on one device, on every device with spmd and with pmap, and the loop.

  python benchmark.py --out=bench.json [--tiny]

For two models (the config's CNN on the digits; a wider CNN on synthetic 32x32x3 images) and each
path: compile time (ahead of time, `step.lower(state, batch).compile()`, pmap too), the median
time of the compiled step on a batch already on the devices (each step waited for, the donated
state threaded through), examples/s from it, and peak host memory (ru_maxrss). Every (model, path)
runs in its own subprocess (this script with --measure) with 8 devices (forced on the CPU), so the
peak is its own; `single` uses device 0 only.
Loop efficiency: `train_and_evaluate`'s `loop_examples_per_sec` for the config (input pipeline,
metrics, logging, evaluation, checkpoints) over the bare compiled step's examples/s when run back
to back on one batch already on the devices, waiting as often as the loop does
(`cpu_sync_every_steps` on the CPU; the median step time above waits on every step).
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
WARMUP_STEPS = 2  # untimed calls of the compiled step before the timed ones
REPEATS = 3  # loop runs and back-to-back step runs per path: their median is reported

_OUT = flags.DEFINE_string("out", "bench.json", "Where the JSON results go.")
_TINY = flags.DEFINE_bool("tiny", False, "A smoke run of every code path in seconds (CI).")
_MEASURE = flags.DEFINE_string("measure", None, "Internal: 'MODEL:PATH' or 'loop:PATH:RUN', "
                               "measured in this process, printed as JSON.")


def get_config(model: str, is_tiny: bool) -> ml_collections.ConfigDict:
  """The default (or tiny) config; for 'large', the CNN widened, on synthetic images."""
  config = (tiny if is_tiny else default).get_config()
  config.timed_steps = 3 if is_tiny else 100
  config.stream_repeats = 1 if is_tiny else REPEATS  # the loop efficiency's denominator
  if model == "large":
    config.dataset = "synthetic"
    config.synthetic.image_shape = (16, 16, 3) if is_tiny else (32, 32, 3)
    config.model.features = (16, 32) if is_tiny else (64, 128)
    config.batch_size = 64 if is_tiny else 256
    config.synthetic.num_train = config.synthetic.num_eval = config.batch_size  # one batch
    config.timed_steps = 3 if is_tiny else 30  # ~1 s a step on 2 CPU cores
    config.stream_repeats = 1
  return config


def step_state_batch(config, path: str):
  """The train step of `path`, and a state and a batch already where the step wants them."""
  import train  # not at the top: it marks train.py's own flags (--config, ...) required

  splits, info = input_pipeline.get_datasets(config)
  batch = input_pipeline.train_batches(splits["train"], config)[0]
  model = create_model(config, info.image_shape, info.num_classes, nnx.Rngs(config.seed))
  optimizer = nnx.Optimizer(model, train.create_optimizer(config, 1000), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))
  if path == "single":
    device = jax.devices()[0]
    step = jax.jit(functools.partial(train.train_step, graphdef,
                                     grad_accum_steps=config.grad_accum_steps), donate_argnums=0)
    return step, jax.device_put(state, device), jax.device_put(batch, device)
  config.parallelism = path
  mesh = parallel.make_mesh()
  steps = train.make_steps(graphdef, config, mesh)
  state = steps.put_state(jax.device_put(state, parallel.replicated(mesh)))
  return steps.train, state, steps.put_batch(batch)


def peak_host_mb() -> float:
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
  return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def measure_step(config, path: str) -> dict:
  step, state, batch = step_state_batch(config, path)
  start = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  compile_s = time.perf_counter() - start
  step_times_s = []
  for _ in range(WARMUP_STEPS + config.timed_steps):
    start = time.perf_counter()
    state, step_metrics = compiled(state, batch)
    jax.block_until_ready((state, step_metrics))
    step_times_s.append(time.perf_counter() - start)
  step_s = statistics.median(step_times_s[WARMUP_STEPS:])
  # Back to back, waiting as often as the training loop does: the rate the loop could reach
  # (the median of REPEATS runs of timed_steps steps).
  sync_every = config.cpu_sync_every_steps if jax.default_backend() == "cpu" else 0
  stream_times_s = []
  for _ in range(config.stream_repeats):
    start = time.perf_counter()
    for i in range(1, config.timed_steps + 1):
      state, step_metrics = compiled(state, batch)
      if sync_every and i % sync_every == 0:
        jax.block_until_ready(step_metrics)
    jax.block_until_ready(state)
    stream_times_s.append((time.perf_counter() - start) / config.timed_steps)
  stream_s = statistics.median(stream_times_s)
  return dict(compile_s=compile_s, step_ms=1e3 * step_s,
              examples_per_sec=config.batch_size / step_s,
              stream_examples_per_sec=config.batch_size / stream_s, peak_host_mb=peak_host_mb())


def read_scalar(workdir: str, tag: str) -> float:
  """The last value of a scalar in the TensorBoard event files of `workdir`."""
  for path in glob.glob(os.path.join(workdir, "events.out.tfevents.*")):
    events = event_accumulator.EventAccumulator(path)
    events.Reload()
    if tag in events.Tags()["scalars"]:
      return events.Scalars(tag)[-1].value
  raise LookupError(f"no scalar {tag!r} in the event files of {workdir}")


def measure_loop(config, path: str) -> dict:
  import train  # see step_state_batch

  config.parallelism = path
  with tempfile.TemporaryDirectory() as workdir:
    train.train_and_evaluate(config, workdir)
    rate = read_scalar(workdir, "loop_examples_per_sec")
  return dict(examples_per_sec=rate, peak_host_mb=peak_host_mb())


def measure(what: str, is_tiny: bool) -> dict:
  """What the subprocess `--measure=what` prints: 'MODEL:PATH' or 'loop:PATH:RUN'."""
  model, path = what.split(":")[:2]
  if model == "loop":
    result = measure_loop(get_config("digits", is_tiny), path)
  else:
    result = measure_step(get_config(model, is_tiny), path)
  return dict(result, device_count=jax.device_count(), backend=jax.default_backend())


def run_in_subprocess(what: str, is_tiny: bool) -> dict:
  """`measure(what)` in a fresh process with NUM_DEVICES devices; its peak memory is its own."""
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
  results = run_all([f"{model}:{path}" for model in MODELS for path in PATHS] +
                    [f"loop:{path}:{i}" for path in loop_paths for i in range(repeats)], is_tiny)
  models = {}
  for model in MODELS:
    config = get_config(model, is_tiny)
    paths = {path: results[f"{model}:{path}"] for path in PATHS}
    models[model] = dict(
        image_shape=list(input_pipeline.get_datasets(config)[1].image_shape),
        features=list(config.model.features), batch_size=config.batch_size,
        timed_steps=config.timed_steps, paths=paths,
        pmap_over_spmd_step_time=paths["pmap"]["step_ms"] / paths["spmd"]["step_ms"])
  loop = {}
  for path in loop_paths:
    runs = [results[f"loop:{path}:{i}"] for i in range(repeats)]
    loop_rate = statistics.median(run["examples_per_sec"] for run in runs)
    step_rate = models["digits"]["paths"][path]["stream_examples_per_sec"]
    loop[path] = dict(loop_examples_per_sec=loop_rate, step_examples_per_sec=step_rate,
                      efficiency=loop_rate / step_rate,
                      peak_host_mb=max(run["peak_host_mb"] for run in runs),
                      loop_runs_examples_per_sec=[run["examples_per_sec"] for run in runs])
  first = results[f"{MODELS[0]}:{PATHS[0]}"]
  return dict(jax=jax.__version__, flax=flax.__version__, backend=first["backend"],
              device_count=first["device_count"], tiny=is_tiny,
              compile_time="ahead of time: step.lower(state, batch).compile(), every path",
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
    lines.append(f"loop ({path}): {loop['loop_examples_per_sec']:.0f} examples/s, the bare step "
                 f"{loop['step_examples_per_sec']:.0f}")
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
