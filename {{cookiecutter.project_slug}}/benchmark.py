"""Benchmarks the train step on one device, on every device with spmd, pmap and fsdp, the input
pipeline, and the training loop; or the input pipeline alone on your own data.

  python benchmark.py --out=bench.json [--tiny]
  python benchmark.py --data_dir=DIR --out=data.json [--config=configs/imagenet.py
      --config.KEY=VALUE ... --images_per_second=2500 --seconds=20]

Your data (--data_dir, read as `config.dataset` reads it: 'arrayrecord' by default): the
training batches as train.py reads them, with the config's host-side work (decoding; crops of
photos stored whole) and its Grain workers, for `--seconds`: images_per_second, and
images_per_cpu_second (over the CPU time of this process and its workers), and from it how many
cores each accelerator needs to be fed `--images_per_second`. Beside it, in the same run, a plain
PIL loop (open, decode, resize to the image size) in this process, over the same stored images or
the image files they were written from (`--pil_image_folder`).

Steps: for two models (the config's CNN on the digits; a wider CNN on synthetic 64x64x3 images)
and each path, the compile time (ahead of time, `step.lower(...).compile()`), the median time of
the compiled single step (k = 1) on a batch already on the devices (each step waited for, the
donated state threaded through), the time to its first step (state built and placed, compiled,
one step), examples/s from it, the peak host memory, the model and optimizer state's bytes on
one device (fsdp splits it) and the step's peak device memory (XLA's memory analysis of the
compiled step: arguments + outputs + temporaries - donated buffers). The paths of a model run
in one process, taking turns of a few steps, so that a machine whose speed drifts (shared or
throttled cores) slows them alike and their ratios are fair; the peak memory
(ru_maxrss) of each path comes from a short run of that path alone in its own process.

Input pipeline: images/s of the Grain iterator alone, as the loop reads it (64x64x3 uint8
images, batch 1024, `steps_per_dispatch` batches an element, each placed on the devices).
Image decoding: the same for 64x64 JPEG files stored as they are (`write_arrayrecord.py
--keep_encoded`), decoded by the config's Grain worker processes (one per core but one).

Loop efficiency: `train_and_evaluate`'s `loop_examples_per_sec` (input pipeline, metrics,
logging, evaluation, checkpoints; `steps_per_dispatch` steps a call) over the examples/s of the
bare compiled single step (k = 1) run back to back on one batch already on the devices, as many
steps as the loop and waiting as often as it does (`cpu_sync_every_steps` on the CPU). It can
exceed 1: several steps per call beat one. Each repeat runs both in a fresh process, one right
after the other, in alternating order; the efficiency is the median of their ratios. For the
large model (one path, the config's): on an accelerator, the CNN (128, 256) in bfloat16 on
batches of 1024; on the CPU, shrunk to what 2 cores run in seconds (features (16, 32), batch
256), said in the report.

Default run: `python train.py --config=configs/default.py` as a whole process, cold (no
compilation cache): its wall time, its time to the first step, and its first calls' times, as
the backend runs it (k = 1 on the CPU); the loop efficiencies above are measured at the k of an
accelerator instead (`steps.ACCELERATOR_STEPS_PER_DISPATCH`), as a proxy for one.

Every measurement runs in a subprocess, one at a time (a GPU is never shared); on the CPU with
8 devices (forced). `single` uses device 0. --tiny (configs/tiny.py, shrunk models, few steps;
on the CPU two subprocesses at a time, so its timings mean nothing) runs every code path in
seconds, for CI. Needs the dev extra (tensorboard).
"""

import concurrent.futures
import functools
import glob
import io
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import flax
import jax
import ml_collections
import numpy as np
from absl import app, flags
from flax import nnx, serialization
from ml_collections import config_flags
from PIL import Image
from tensorboard.backend.event_processing import event_accumulator

import input_pipeline
import parallel
import plan
import runs
import steps
import write_arrayrecord
from configs import default, tiny

NUM_DEVICES = 8
MODELS = ("digits", "large")  # the config's CNN on the digits; a wider CNN on bigger images
PATHS = ("single", "spmd", "pmap", "fsdp")
LOOP_PATHS = ("spmd", "pmap")
EMA = "spmd+ema"  # the cost of the moving average of the parameters: spmd's step with it
EMA_DECAY = 0.999
WARMUP_STEPS = 2  # untimed calls of each compiled step before the timed ones
REPEATS = 3  # paired (bare step, loop) runs per path: the median of their ratios is reported
PIPELINE = dict(image_shape=(64, 64, 3), batch_size=1024)
DECODING = dict(image_shape=(64, 64, 3), batch_size=256, num_images=2048)

_OUT = flags.DEFINE_string("out", "bench.json", "Where the JSON results go.")
_TINY = flags.DEFINE_bool("tiny", False, "A smoke run of every code path in seconds (CI).")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "Time the input pipeline alone on this data.")
_SECONDS = flags.DEFINE_float("seconds", 20.0, "--data_dir: how long to read.")
_PIL_FOLDER = flags.DEFINE_string("pil_image_folder", None, "--data_dir: the plain PIL loop reads "
                                  "these image files (default: the stored images).")
_RATE = flags.DEFINE_float("images_per_second", 2500.0, "--data_dir: the rate that one "
                           "accelerator trains at (2,500: ResNet-50 on an A100, NVIDIA's figure).")
_MEASURE = flags.DEFINE_string("measure", None, "Internal: 'steps:MODEL', 'memory:MODEL:PATH', "
                               "'loop:MODEL:PATH:RUN', 'pipeline' or 'decoding', measured in this "
                               "process, printed as JSON.")


def get_config(model: str, is_tiny: bool) -> ml_collections.ConfigDict:
  """The default (or tiny) config; for 'large', a wider CNN on synthetic 64x64x3 images (see
  the module's docstring). Steps are timed in `rounds` turns of `turn_steps` steps per path."""
  config = (tiny if is_tiny else default).get_config()
  config.rounds, config.turn_steps = (1, 3) if is_tiny else (10, 20)
  # The loop as a GPU or TPU runs it (on the CPU, runs choose k = 1: see measure_default_run).
  config.steps_per_dispatch = 5 if is_tiny else steps.ACCELERATOR_STEPS_PER_DISPATCH
  if model == "large":
    accelerator = jax.default_backend() != "cpu"
    config.dataset = "synthetic"
    config.synthetic.image_shape = (16, 16, 3) if is_tiny else PIPELINE["image_shape"]
    config.model.features = (16, 32) if is_tiny or not accelerator else (128, 256)
    config.model.dtype = "bfloat16" if accelerator else "float32"
    config.batch_size = 64 if is_tiny else PIPELINE["batch_size"] if accelerator else 256
    loop_steps = 15 if is_tiny else 100 if accelerator else 40
    config.synthetic.num_train = loop_steps * config.batch_size
    config.synthetic.num_eval = 2 * config.batch_size
    config.num_epochs = 1
    config.rounds, config.turn_steps = (1, 3) if is_tiny else (10, 10) if accelerator else (4, 2)
  return config


def step_state_batch(config, path: str):
  """The single train step (k = 1) of `path`, and a state, running metrics and a batch already
  where the step wants them."""

  config = config.copy_and_resolve_references()
  config.steps_per_dispatch = 1
  splits, info = input_pipeline.get_datasets(config)
  batch = input_pipeline.train_batches(splits["train"], config)[0]  # [1, batch, ...]
  graphdef, state = nnx.split(runs.build_state(config, info.image_shape, info.num_classes, 1000))
  if path == "single":
    device = jax.devices()[0]
    step = jax.jit(functools.partial(steps.train_step, graphdef, **steps.step_options(config)),
                   donate_argnums=(0, 1))
    one_batch = jax.tree.map(lambda x: x[0], batch)
    return step, *jax.device_put((state, steps.TrainMetrics.empty(), one_batch), device)
  config.parallelism = path
  mesh = parallel.make_mesh(config)
  compiled = steps.make(graphdef, config, mesh)
  state = compiled.put_state(parallel.place_state(state, mesh, config.fsdp_min_size))
  return compiled.train, state, compiled.empty(steps.TrainMetrics), compiled.put_batch(batch)


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
    self.state_mb = parallel.bytes_per_device(self.state) / 1e6  # model and optimizer state
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


def measure_steps(config) -> dict:
  """Every path's compile time and median step time, the paths (and spmd with the moving
  average, `EMA`) taking turns."""
  with_ema = config.copy_and_resolve_references()
  with_ema.ema_decay = EMA_DECAY
  runners = {path: Runner(config, path) for path in PATHS} | {EMA: Runner(with_ema, "spmd")}
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
                         examples_per_sec=config.batch_size / step_s,
                         state_mb_per_device=runner.state_mb,
                         step_peak_mb_per_device=runner.step_peak_mb)
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
  """The loop's examples/s and the bare single step's, measured one right after the other."""
  import train  # see step_state_batch

  config.parallelism = path
  num_steps = input_pipeline.num_batches(
      config.num_epochs * input_pipeline.get_datasets(config)[1].num_examples["train"],
      config.batch_size) - config.steps_per_dispatch  # the loop's clock skips the first call

  def loop():
    with tempfile.TemporaryDirectory() as workdir:
      train.train_and_evaluate(config, workdir)
      return (read_scalar(workdir, "loop_examples_per_sec"),
              read_scalar(workdir, "loop_host_us_per_step"))

  def bare():
    runner = Runner(config, path)
    return num_steps * config.batch_size / runner.stream(num_steps, train.sync_every(config))

  if loop_first:
    (loop_rate, host_us), step_rate = loop(), bare()
  else:
    step_rate, (loop_rate, host_us) = bare(), loop()
  return dict(loop_examples_per_sec=loop_rate, step_examples_per_sec=step_rate,
              efficiency=loop_rate / step_rate, host_us_per_step=host_us,
              steps_per_dispatch=config.steps_per_dispatch)


def measure_pipeline(is_tiny: bool, seconds: float = 3.0) -> dict:
  """Images/s of the Grain iterator alone, placing each element on the devices (spmd)."""
  config = get_config("large", is_tiny)
  config.synthetic.image_shape = PIPELINE["image_shape"]
  config.batch_size = PIPELINE["batch_size"]
  config.synthetic.num_train = 8 * config.batch_size
  config.num_epochs = 1000  # never runs out
  splits, info = input_pipeline.get_datasets(config)
  mesh = parallel.make_mesh()
  put = functools.partial(parallel.global_batch, mesh=mesh)
  iterator = input_pipeline.as_iterator(input_pipeline.train_batches(splits["train"], config),
                                        config, put=put)
  jax.block_until_ready(next(iterator))  # threads started, first element read
  start, images = time.perf_counter(), 0
  while time.perf_counter() - start < (0.3 if is_tiny else seconds):
    element = next(iterator)
    images += element["mask"].size
  jax.block_until_ready(element)
  return dict(images_per_sec=images / (time.perf_counter() - start),
              steps_per_dispatch=config.steps_per_dispatch, **PIPELINE)


def write_jpeg_folder(folder: str, num_images: int, size: int, num_classes: int = 4):
  """Smooth random RGB images (a JPEG's usual content), one subfolder per class."""
  rng = np.random.default_rng(0)
  for i in range(num_images):
    os.makedirs(directory := os.path.join(folder, f"class{i % num_classes}"), exist_ok=True)
    coarse = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    coarse.resize((size, size), Image.Resampling.BICUBIC).save(f"{directory}/{i:05d}.jpg")


def measure_decoding(is_tiny: bool, seconds: float = 3.0) -> dict:
  """Images/s of the Grain iterator over JPEG files kept encoded, decoded by its workers."""
  config = get_config("digits", is_tiny)
  config.dataset, config.batch_size = "arrayrecord", DECODING["batch_size"]
  config.num_epochs = 1000  # never runs out
  num_images = DECODING["num_images"] // (8 if is_tiny else 1)
  with tempfile.TemporaryDirectory() as root:
    write_jpeg_folder(f"{root}/jpeg", num_images, DECODING["image_shape"][0])
    write_arrayrecord.write_image_folder(f"{root}/data", f"{root}/jpeg", keep_encoded=True)
    config.data_dir = f"{root}/data"
    splits, _ = input_pipeline.get_datasets(config)
    iterator = input_pipeline.as_iterator(
        input_pipeline.train_batches(splits["train"], config), config)
    next(iterator)  # workers started, first element read
    start, images = time.perf_counter(), 0
    while time.perf_counter() - start < (0.3 if is_tiny else seconds):
      images += next(iterator)["mask"].size
    images_per_sec = images / (time.perf_counter() - start)
    iterator.close()
  return dict(DECODING, images_per_sec=images_per_sec, num_images=num_images,
              workers=input_pipeline.default_workers(config))


def cpu_seconds() -> float:
  """CPU time of this process and of its children, live (from /proc, Linux) or ended."""
  own, ended = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                    resource.RUSAGE_CHILDREN))
  total = own.ru_utime + own.ru_stime + ended.ru_utime + ended.ru_stime
  for stat in glob.glob("/proc/[0-9]*/stat"):
    try:
      with open(stat) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # ended meanwhile
      continue
    if int(fields[1]) == os.getpid():  # a live child: its user and system ticks
      total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
  return total


def pil_loop(encoded, image_shape, seconds: float) -> float:
  """Images per CPU-second of PIL opening, decoding and resizing `encoded()`'s images in turn."""
  height, width, channels = image_shape
  done, start = 0, time.process_time()
  while time.process_time() - start < seconds:
    with Image.open(io.BytesIO(encoded(done))) as image:
      np.asarray(image.convert("L" if channels == 1 else "RGB").resize(
          (width, height), Image.Resampling.BILINEAR))
    done += 1
  return done / (time.process_time() - start)


def measure_data(config, seconds: float, rate: float, image_folder: str | None = None) -> dict:
  """The input pipeline alone on `config.data_dir` (see the module's docstring)."""
  config = config.copy_and_resolve_references()
  config.steps_per_dispatch = steps.steps_per_dispatch(config)
  config.num_epochs = 10**6  # never runs out
  splits, info = input_pipeline.get_datasets(config)
  iterator = input_pipeline.as_iterator(input_pipeline.train_batches(splits["train"], config),
                                        config)
  next(iterator)  # workers started, first element read
  start, cpu_start, images = time.perf_counter(), cpu_seconds(), 0
  while time.perf_counter() - start < seconds:
    images += int(next(iterator)["mask"].sum())
  wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
  iterator.close()
  result = dict(data_dir=config.data_dir, dataset=config.dataset,
                image_shape=list(info.image_shape), crops_on_host=info.crops_on_host,
                workers=input_pipeline.default_workers(config), images=images, seconds=wall,
                images_per_second=images / wall, images_per_cpu_second=images / cpu,
                target_images_per_second=rate, cores_per_accelerator=rate * cpu / images)
  source, encoded = splits["train"], None
  if image_folder:
    paths = input_pipeline.images_under(image_folder)
    encoded = lambda i: open(paths[i % len(paths)], "rb").read()  # noqa: E731, SIM115
  elif isinstance(source, input_pipeline.RecordSource) and isinstance(
      serialization.msgpack_restore(source.records[0])["image"], bytes):
    encoded = lambda i: serialization.msgpack_restore(  # noqa: E731
        source.records[i % len(source)])["image"]
  if encoded is not None:
    result["pil_loop_of"] = image_folder or "the stored images"
    result["pil_loop_images_per_cpu_second"] = pil_loop(encoded, info.image_shape,
                                                        min(seconds, 10.0))
    result["pipeline_over_pil_loop"] = (result["images_per_cpu_second"]
                                        / result["pil_loop_images_per_cpu_second"])
  return result


def measure_default_run(is_tiny: bool) -> dict:
  """`python train.py --config=configs/default.py` (tiny.py with --tiny) as a whole process,
  cold: no persistent compilation cache. Its wall time, what its log says of it, and the time
  from the start to its first-calls line (the start-up: imports, data, state, compiling)."""
  name = "tiny" if is_tiny else "default"
  env = {k: v for k, v in subprocess_env().items() if k != "JAX_COMPILATION_CACHE_DIR"}
  with tempfile.TemporaryDirectory() as workdir:
    start = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "train.py", f"--config=configs/{name}.py", f"--workdir={workdir}",
         "--config.compilation_cache_dir="], cwd=os.path.dirname(os.path.abspath(__file__)),
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log, startup_s = [], None
    for line in process.stderr:  # the log, as it comes
      log.append(line)
      if startup_s is None and "first calls (" in line:
        startup_s = time.perf_counter() - start
    wall_s = time.perf_counter() - start
  if process.wait(timeout=600):
    raise RuntimeError(f"the {name} run failed:\n{''.join(log)[-3000:]}")
  log = "".join(log)
  train_s, eval_s = map(float, re.search(r"first calls .*: train ([\d.]+) s, eval ([\d.]+) s",
                                         log).groups())
  return dict(config=f"configs/{name}.py", wall_s=wall_s, startup_s=startup_s,
              first_train_call_s=train_s, first_eval_call_s=eval_s,
              steps_per_dispatch=int(re.search(r"examples, (\d+) per call", log)[1]),
              accuracy=float(re.findall(r"Final eval: accuracy ([\d.]+)", log)[-1]))


def describe(config) -> dict:
  return dict(image_shape=list(input_pipeline.get_datasets(config)[1].image_shape),
              features=list(config.model.features), dtype=config.model.dtype,
              batch_size=config.batch_size, timed_steps=config.rounds * config.turn_steps)


def measure(what: str, is_tiny: bool) -> dict:
  """What the subprocess `--measure=what` prints."""
  kind, *rest = what.split(":")
  if kind == "steps":
    config = get_config(rest[0], is_tiny)
    paths = measure_steps(config)
    result = dict(paths=paths, ema=paths.pop(EMA), **describe(config))
  elif kind == "memory":
    Runner(get_config(rest[0], is_tiny), rest[1])  # compiled, and WARMUP_STEPS steps run
    result = {}
  elif kind == "pipeline":
    result = measure_pipeline(is_tiny)
  elif kind == "decoding":
    result = measure_decoding(is_tiny)
  else:  # loop:MODEL:PATH:RUN
    config = get_config(rest[0], is_tiny)
    result = dict(measure_loop(config, rest[1], loop_first=int(rest[2]) % 2 == 1),
                  **describe(config))
  return dict(result, peak_host_mb=peak_host_mb(), device_count=jax.device_count(),
              backend=jax.default_backend(), device_kind=jax.devices()[0].device_kind)


def subprocess_env() -> dict[str, str]:
  """This process's environment, with NUM_DEVICES devices on the CPU."""
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in xla_flags:
    xla_flags += f" --xla_force_host_platform_device_count={NUM_DEVICES}"
  return dict(os.environ, XLA_FLAGS=xla_flags.strip())


def run_in_subprocess(what: str, is_tiny: bool) -> dict:
  """`measure(what)` in a fresh process, with NUM_DEVICES devices on the CPU. This module is
  imported there, not run: the loop's measurement imports train.py, whose --config would
  clash with the one defined below."""
  here = os.path.dirname(os.path.abspath(__file__))
  command = [sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); import benchmark; "
             "benchmark.app.run(benchmark.main)", f"--measure={what}"]
  command += ["--tiny"] if is_tiny else []
  done = subprocess.run(command, capture_output=True, text=True, timeout=120 if is_tiny else 600,
                        env=subprocess_env())
  if done.returncode:
    raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
  return json.loads(done.stdout.splitlines()[-1])


def run_all(whats: list[str], is_tiny: bool) -> dict[str, dict]:
  """Two subprocesses at a time only for --tiny on the CPU: an accelerator is never shared.
  Each measurement is printed (stderr) as it ends: a run cut short still shows what it had."""
  on_cpu = os.environ.get("JAX_PLATFORMS", "") == "cpu"
  start, results = time.perf_counter(), {}
  with concurrent.futures.ThreadPoolExecutor(max_workers=2 if is_tiny and on_cpu else 1) as pool:
    for i, (what, result) in enumerate(zip(whats, pool.map(functools.partial(
        run_in_subprocess, is_tiny=is_tiny), whats), strict=True)):
      results[what] = result
      print(f"[{i + 1}/{len(whats)}, {time.perf_counter() - start:.0f} s] {what}: "
            f"{json.dumps(result)}", file=sys.stderr, flush=True)
  return results


def summarize_loop(runs: list[dict]) -> dict:
  loop = {key: statistics.median(run[key] for run in runs) for key in (
      "loop_examples_per_sec", "step_examples_per_sec", "efficiency", "host_us_per_step")}
  return dict(loop, efficiencies=[run["efficiency"] for run in runs],
              peak_host_mb=max(run["peak_host_mb"] for run in runs),
              **{key: runs[0][key] for key in ("steps_per_dispatch", "image_shape", "features",
                                                "dtype", "batch_size")})


def benchmark(is_tiny: bool) -> dict:
  config_parallelism = get_config("digits", is_tiny).parallelism
  loop_paths = sorted(LOOP_PATHS, key=lambda path: path != config_parallelism)  # the config's first
  repeats = 1 if is_tiny else REPEATS
  loops = [(model, path, i) for i in range(repeats) for model, path in
           [("digits", path) for path in loop_paths] + [("large", config_parallelism)]
           if model == "digits" or i < max(repeats - 1, 1)]
  results = run_all(["pipeline", "decoding"] + [f"steps:{model}" for model in MODELS] +
                    [f"memory:{model}:{path}" for model in MODELS for path in PATHS] +
                    [f"loop:{model}:{path}:{i}" for model, path, i in loops], is_tiny)
  default_run = measure_default_run(is_tiny)  # alone: nothing else runs beside it
  models = {}
  for model in MODELS:
    measured = results[f"steps:{model}"]
    paths = {path: dict(measured["paths"][path],
                        peak_host_mb=results[f"memory:{model}:{path}"]["peak_host_mb"])
             for path in PATHS}
    models[model] = dict(
        {key: measured[key] for key in ("image_shape", "features", "dtype", "batch_size",
                                        "timed_steps")}, paths=paths,
        pmap_over_spmd_step_time=paths["pmap"]["step_ms"] / paths["spmd"]["step_ms"],
        ema_over_spmd_step_time=measured["ema"]["step_ms"] / paths["spmd"]["step_ms"],
        ema_state_mb_per_device=measured["ema"]["state_mb_per_device"])
  loop = {f"{model}:{path}": summarize_loop([results[f"loop:{m}:{p}:{i}"]
                                             for m, p, i in loops if (m, p) == (model, path)])
          for model, path in dict.fromkeys((m, p) for m, p, _ in loops)}
  first = results["steps:digits"]
  return dict(jax=jax.__version__, flax=flax.__version__, backend=first["backend"],
              device_count=first["device_count"], device_kind=first["device_kind"], tiny=is_tiny,
              compile_time="ahead of time: step.lower(...).compile(), every path",
              config_parallelism=config_parallelism, models=models, loop=loop,
              pipeline=results["pipeline"], decoding=results["decoding"], default_run=default_run)


def report(results: dict) -> str:
  lines = [f"jax {results['jax']}, flax {results['flax']}, {results['device_count']} "
           f"{results['backend']} devices ({results['device_kind']})" +
           (" (tiny)" if results["tiny"] else ""),
           f"{'model':<8}{'shape':>10}{'batch':>7}{'path':>8}{'compile s':>11}"
           f"{'first step s':>14}{'step ms':>10}{'examples/s':>12}{'peak host MB':>14}"
           f"{'state MB/device':>17}{'step peak MB/device':>21}"]
  for name, model in results["models"].items():
    shape = "x".join(map(str, model["image_shape"]))
    for path, r in model["paths"].items():
      lines.append(f"{name:<8}{shape:>10}{model['batch_size']:>7}{path:>8}{r['compile_s']:>11.2f}"
                   f"{r['first_step_s']:>14.2f}{r['step_ms']:>10.2f}"
                   f"{r['examples_per_sec']:>12.0f}{r['peak_host_mb']:>14.0f}"
                   f"{r['state_mb_per_device']:>17.3f}{r['step_peak_mb_per_device']:>21.3f}")
  for name, model in results["models"].items():
    lines.append(f"pmap/spmd step time: {model['pmap_over_spmd_step_time']:.2f} ({name})")
    lines.append(f"moving average: spmd step time x{model['ema_over_spmd_step_time']:.2f}, state "
                 f"{model['ema_state_mb_per_device']:.3f} MB/device against "
                 f"{model['paths']['spmd']['state_mb_per_device']:.3f} ({name})")
  for key, loop in results["loop"].items():
    pairs = " ".join(f"{e:.2f}" for e in loop["efficiencies"])
    shape = "x".join(map(str, loop["image_shape"]))
    lines.append(f"loop ({key}, {shape}, batch {loop['batch_size']}, features "
                 f"{tuple(loop['features'])}, {loop['dtype']}, k={loop['steps_per_dispatch']}): "
                 f"{loop['loop_examples_per_sec']:.0f} examples/s, the bare single step "
                 f"{loop['step_examples_per_sec']:.0f}; host {loop['host_us_per_step']:.0f} "
                 f"us/step; paired ratios {pairs}")
  pipeline = results["pipeline"]
  lines.append(f"input pipeline ({'x'.join(map(str, pipeline['image_shape']))}, batch "
               f"{pipeline['batch_size']}): {pipeline['images_per_sec']:.0f} images/s")
  decoding = results["decoding"]
  lines.append(f"image decoding (JPEG {decoding['image_shape'][0]}x{decoding['image_shape'][1]}, "
               f"{decoding['workers']} workers): {decoding['images_per_sec']:.0f} images/s")
  run = results["default_run"]
  lines.append(f"default run ({run['config']}, k={run['steps_per_dispatch']}, no compilation "
               f"cache): {run['wall_s']:.1f} s as a whole process, {run['startup_s']:.1f} s to "
               f"its first step (first calls: train {run['first_train_call_s']:.2f} s, eval "
               f"{run['first_eval_call_s']:.2f} s); accuracy {run['accuracy']:.4f}")
  for key, loop in results["loop"].items():
    model, path = key.split(":")
    label = "" if model == "digits" else f" ({model})"
    label = label if path == results["config_parallelism"] else f" ({path})"
    lines.append(f"loop efficiency{label}: {loop['efficiency']:.2f}")
  return "\n".join(lines)


def main(argv):
  del argv
  if _DATA_DIR.value:
    config = _CONFIG.value
    config.data_dir = _DATA_DIR.value
    if config.dataset in ("digits", "synthetic"):
      config.dataset = "arrayrecord"
    try:
      plan.validate_config(config)
    except runs.ConfigError as e:
      raise SystemExit(f"error: {e}") from None
    result = measure_data(config, _SECONDS.value, _RATE.value, _PIL_FOLDER.value)
    print("\n".join(f"{key}: {value:,.4g}" if isinstance(value, float) else f"{key}: {value}"
                    for key, value in result.items()))
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=2)
    return
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
  _CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py",
                                            "--data_dir: the training config.")
  app.run(main, flags_parser=plan.parse_flags)
