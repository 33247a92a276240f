"""Benchmarks the train step on one device and on every device with spmd, pmap and fsdp, the
training loop, the input pipeline and a default run; or the input pipeline alone on your data.
Prints its tables and writes them to --out (JSON) and --markdown (BENCHMARKS.md).

  python benchmark.py [--tiny] [--out=bench.json] [--markdown=BENCHMARKS.md]
  python benchmark.py --resnet  # on a GPU: ResNet-50 against timm's, eager and torch.compile
  python benchmark.py --kernels  # on a GPU: where the ResNet-50 step's time goes, by kernel
  python benchmark.py --randaugment  # RandAugment's cost an image at 224: host against devices
  python benchmark.py --data_dir=DIR --out=data.json [--config=configs/imagenet.py
      --config.KEY=VALUE ... --images_per_second=2500 --batches=20 --pil_image_folder=DIR]

- Train step, for two models (the config's CNN on the digits; a wider CNN on synthetic 64x64x3
  images, see get_config) and each path (`single`: device 0): the compile time (ahead of time,
  `step.lower(...).compile()`); the median time of the compiled single step (k = 1) on a batch
  already on the devices, each step waited for, and examples/s from it; the time to the first
  step (state built and placed, compiled, one step); the peak host memory (ru_maxrss) of a short
  run of that path alone in its own process; the model and optimizer state's bytes on one device
  (fsdp splits it); the step's peak device memory (XLA's memory analysis: arguments + outputs +
  temporaries - donated buffers). A model's paths take turns of a few steps in one process, so
  that a machine whose speed drifts (shared or throttled cores) slows them alike. Then pmap's
  step time over spmd's, and the moving average's (`ema_decay`) cost in step time and state.
- Loop: `train_and_evaluate`'s examples/s (input, metrics, logging, evaluation, checkpoints) over
  the bare compiled single step's, run back to back as many steps as the loop, waiting as often;
  each pair in fresh processes, one right after the other, their order alternating; the
  efficiency is the median of the pairs' ratios (above 1 where k steps a call beat one). The
  loop runs an accelerator's k (`plan.ACCELERATOR_STEPS_PER_DISPATCH`) even on the CPU. Also
  ResNet-50 training (configs/imagenet.py, synthetic images: `resnet_config`): images/s a
  device and MFU (where the chip's peak is known), the loop against the bare step; with
  --resnet, that row alone beside timm's ResNet-50 in PyTorch, eager and under torch.compile
  (benchmark_torch.py, the same batch a GPU), in BENCHMARKS.md's section of its own.
- Input (benchmark_data.py): the Grain iterator alone, JPEG files decoded by its workers, and
  224x224x3 arrays read by its workers and placed on the devices: the main process's CPU-seconds
  per GB delivered, and the images/s one core of it feeds at that size.
- Kernels (--kernels, on a GPU; benchmark_kernels.py): the ResNet-50 bare step profiled
  (`jax.profiler`) over a few steps: the GPU's kernels a step, summed by kind (convolutions,
  reductions, selections, ...), how busy the GPU was, and the kernels too short to be more than
  their launch.
- RandAugment (--randaugment; benchmark_randaugment.py): DeiT's, an image at 224x224, on the
  host (PIL, one core, and the resize of the crop that the host then does) against the same
  operations in JAX, under jit on this backend and, compiled for a TPU v5e, its compiler's bound.
- Dispatch: the host time of handing the ResNet-50 state to a compiled call, as an nnx.State and
  as the loop's flat list of arrays (`benchmark_host.measure_dispatch`).
- Default run: `python train.py --config=configs/default.py` as a whole process, cold (no
  compilation cache), at the backend's k: its wall time, time to first step, first calls.

Every measurement runs in a subprocess, one at a time (a GPU is never shared), with 8 devices on
the CPU (forced). --tiny (configs/tiny.py, shrunk models, a few steps; on the CPU two at a time,
so its timings mean nothing) runs every code path in seconds, for CI. Needs the dev extra.
"""

import concurrent.futures
import functools
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import flax
import jax
import ml_collections
from absl import flags
from ml_collections import config_flags
from tensorboard.backend.event_processing import event_accumulator

from configs import default, imagenet, tiny

from {{cookiecutter.project_slug}} import plan, process
from {{cookiecutter.project_slug}}.tools import (
  benchmark_data,
  benchmark_host,
  benchmark_kernels,
  benchmark_report,
  benchmark_steps,
)
from {{cookiecutter.project_slug}}.tools.benchmark_data import PIPELINE

NUM_DEVICES = 8
MODELS = ("digits", "large")  # the config's CNN on the digits; a wider CNN on bigger images
PATHS = ("single", "spmd", "pmap", "fsdp")
LOOP_PATHS = ("spmd", "pmap")
EMA = "spmd+ema"  # the cost of the moving average of the parameters: spmd's step with it
EMA_DECAY = 0.999
REPEATS = 3  # paired (bare step, loop) runs per path: the median of their ratios is reported

_OUT = flags.DEFINE_string("out", "bench.json", "Where the JSON results go.")
_MARKDOWN = flags.DEFINE_string("markdown", "BENCHMARKS.md", "Where the tables go, as Markdown, "
                                "with the machine, versions and date; '': nowhere.")
_TINY = flags.DEFINE_bool("tiny", False, "A smoke run of every code path in seconds (CI).")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "Time the input pipeline alone on this data.")
_BATCHES = flags.DEFINE_integer("batches", 20, "--data_dir: how many training batches to read "
                                "(each way; half as many again with the staging copy).")
_PIL_FOLDER = flags.DEFINE_string("pil_image_folder", None, "--data_dir: the plain PIL loop reads "
                                  "these image files (default: the stored images).")
_RATE = flags.DEFINE_float("images_per_second", 2500.0, "--data_dir: the rate that one "
                           "accelerator trains at (2,500: ResNet-50 on an A100, NVIDIA's figure).")
_RESNET = flags.DEFINE_bool("resnet", False, "On a GPU: the ResNet-50 row alone, beside timm's "
                            "ResNet-50 in PyTorch at its batch (benchmark_torch.py: eager and "
                            "torch.compile); the comparison replaces its section of --markdown.")
_KERNELS = flags.DEFINE_bool("kernels", False, "On a GPU: where the ResNet-50 bare step's time "
                             "goes, its kernels by kind (a profile of a few steps).")
_RANDAUGMENT = flags.DEFINE_bool("randaugment", False, "RandAugment's cost an image at 224 on the "
                                 "host against the devices (benchmark_randaugment.py).")
_REPEATS = flags.DEFINE_integer("repeats", REPEATS, "--resnet: pairs of runs of the loop and the "
                                "bare step.")
_MEASURE = flags.DEFINE_string("measure", None, "Internal: 'steps:MODEL', 'memory:MODEL:PATH', "
                               "'loop:MODEL:PATH:RUN', 'pipeline' or 'decoding', measured in this "
                               "process, printed as JSON.")


def get_config(model: str, is_tiny: bool) -> ml_collections.ConfigDict:
  """The default (or tiny) config; for 'large', a wider CNN on synthetic 64x64x3 images (see
  the module's docstring); for 'resnet', configs/imagenet.py on synthetic images (`resnet_config`).
  Steps are timed in `rounds` turns of `turn_steps` steps per path."""
  if model == "resnet":
    return resnet_config(is_tiny)
  config = (tiny if is_tiny else default).get_config()
  config.rounds, config.turn_steps = (1, 3) if is_tiny else (10, 20)
  # The loop as a GPU or TPU runs it (on the CPU, runs choose k = 1: see the default run).
  config.steps_per_dispatch = 5 if is_tiny else plan.ACCELERATOR_STEPS_PER_DISPATCH
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


def resnet_config(is_tiny: bool) -> ml_collections.ConfigDict:
  """configs/imagenet.py (ResNet-50, bfloat16) on synthetic ImageNet-shaped images, at the
  recipe's image size, 256 a device (benchmark_torch.py's batch) where an accelerator is present;
  on the CPU the ResNet-50 at 64 x 64, 8 a device, in float32; with --tiny the ResNet-18 at
  32 x 32."""
  config = imagenet.get_config()
  accelerator = jax.default_backend() != "cpu"
  size, per_device = (224, 256) if accelerator else (32, 2) if is_tiny else (64, 8)
  config.dataset, config.model.name = "synthetic", "resnet18" if is_tiny else "resnet50"
  config.model.dtype = "bfloat16" if accelerator else "float32"
  config.batch_size = per_device * jax.device_count()
  config.steps_per_dispatch = 1 if is_tiny else plan.ACCELERATOR_STEPS_PER_DISPATCH
  loop_steps = 4 if is_tiny else 100 if accelerator else 20  # an epoch's
  config.synthetic.update(image_shape=(size, size, 3), num_classes=1000,
                          num_train=loop_steps * config.batch_size, num_eval=config.batch_size)
  config.num_epochs = 3 if accelerator else 1  # (an accelerator's 300 steps: the loop's clock)
  config.warmup_epochs, config.compilation_cache_dir = 0.0, ""
  config.log_every_steps = config.eval_every_steps = config.checkpoint_every_steps = (
      loop_steps * config.num_epochs)
  config.rounds, config.turn_steps = 1, 2
  return config


def read_scalar(workdir: str, tag: str) -> float:
  """The last value of a scalar in the TensorBoard event files of `workdir`."""
  for path in glob.glob(os.path.join(workdir, "events.out.tfevents.*")):
    events = event_accumulator.EventAccumulator(path)
    events.Reload()
    if tag in events.Tags()["scalars"]:
      return events.Scalars(tag)[-1].value
  raise LookupError(f"no scalar {tag!r} in the event files of {workdir}")


def measure_loop(config, path: str, loop_first: bool) -> dict:
  """The loop's examples/s and the bare single step's, measured one right after the other.

  Args:
    config: the run's config.
    path: the parallelism measured (spmd, pmap or fsdp).
    loop_first: whether the loop is measured first.
  """
  import train  # (here: train.py's --config flag would clash with this module's; see below)

  config.parallelism = path

  def loop():
    with tempfile.TemporaryDirectory() as workdir:
      train.train_and_evaluate(config, workdir)
      try:
        mfu = read_scalar(workdir, "train_mfu")
      except LookupError:  # a chip whose peak is unknown (the CPU)
        mfu = None
      return (read_scalar(workdir, "loop_examples_per_sec"),
              read_scalar(workdir, "loop_host_us_per_step"), mfu)

  if loop_first:
    (loop_rate, host_us, mfu), step_rate = loop(), benchmark_steps.streamed(config, path)
  else:
    step_rate, (loop_rate, host_us, mfu) = benchmark_steps.streamed(config, path), loop()
  return dict(loop_examples_per_sec=loop_rate, step_examples_per_sec=step_rate,
              efficiency=loop_rate / step_rate, host_us_per_step=host_us, mfu=mfu,
              steps_per_dispatch=config.steps_per_dispatch)


def measure(what: str, is_tiny: bool) -> dict:
  """What the subprocess `--measure=what` prints."""
  kind, *rest = what.split(":")
  if kind == "steps":
    config = get_config(rest[0], is_tiny)
    paths = benchmark_steps.measure_steps(config, PATHS, EMA, EMA_DECAY)
    result = dict(paths=paths, ema=paths.pop(EMA), **benchmark_steps.describe(config))
  elif kind == "memory":
    benchmark_steps.Runner(get_config(rest[0], is_tiny), rest[1])  # compiled, steps run
    result = {}
  elif kind == "pipeline":
    result = benchmark_data.measure_pipeline(get_config("large", is_tiny), is_tiny)
  elif kind == "decoding":
    result = benchmark_data.measure_decoding(get_config("digits", is_tiny), is_tiny)
  elif kind == "workers":
    result = benchmark_data.measure_workers(get_config("digits", is_tiny), is_tiny)
  elif kind == "dispatch":
    result = benchmark_host.measure_dispatch(imagenet.get_config(), is_tiny, EMA_DECAY)
  else:  # loop:MODEL:PATH:RUN
    config = get_config(rest[0], is_tiny)
    result = dict(measure_loop(config, rest[1], loop_first=int(rest[2]) % 2 == 1),
                  **benchmark_steps.describe(config))
  return dict(result, peak_host_mb=benchmark_steps.peak_host_mb(), device_count=jax.device_count(),
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
             "from absl import app; app.run(benchmark.main)", f"--measure={what}"]
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
              peak_host_mb=max(run["peak_host_mb"] for run in runs), mfu=runs[0]["mfu"],
              device_count=runs[0]["device_count"], device_kind=runs[0]["device_kind"],
              **{key: runs[0][key] for key in ("steps_per_dispatch", "image_shape", "model",
                                                "dtype", "batch_size")})


def benchmark(is_tiny: bool) -> dict:
  config_parallelism = get_config("digits", is_tiny).parallelism
  loop_paths = sorted(LOOP_PATHS, key=lambda path: path != config_parallelism)  # the config's first
  repeats = 1 if is_tiny else REPEATS
  loops = [(model, path, i) for i in range(repeats) for model, path in
           [("digits", path) for path in loop_paths] + [("large", config_parallelism)] +
           [("resnet", "spmd")] if model == "digits" or i < max(repeats - 1, 1)]
  results = run_all(["pipeline", "decoding", "workers", "dispatch"] +
                    [f"steps:{model}" for model in MODELS] +
                    [f"memory:{model}:{path}" for model in MODELS for path in PATHS] +
                    [f"loop:{model}:{path}:{i}" for model, path, i in loops], is_tiny)
  default_run = benchmark_host.measure_default_run(  # alone: nothing else runs beside it
      is_tiny, os.path.dirname(os.path.abspath(__file__)), subprocess_env())
  models = {}
  for model in MODELS:
    measured = results[f"steps:{model}"]
    paths = {path: dict(measured["paths"][path],
                        peak_host_mb=results[f"memory:{model}:{path}"]["peak_host_mb"])
             for path in PATHS}
    models[model] = dict(
        {key: measured[key] for key in ("image_shape", "model", "dtype", "batch_size",
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
              pipeline=results["pipeline"], decoding=results["decoding"],
              workers=results["workers"], dispatch=results["dispatch"], default_run=default_run)


def compare_resnet() -> dict:
  """The ResNet row (`--repeats` pairs of the loop and the bare step, each in its own process),
  then benchmark_torch.py at the same batch a GPU, one after the other (a GPU is never shared)."""
  repeats = _REPEATS.value
  loop = summarize_loop(list(run_all([f"loop:resnet:spmd:{i}" for i in range(repeats)],
                                     False).values()))
  here = os.path.dirname(os.path.abspath(__file__))
  command = [sys.executable, os.path.join(here, "benchmark_torch.py"),
             f"--batch_size={loop['batch_size'] // loop['device_count']}"]
  done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
  if done.returncode:
    raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
  return dict(loop=loop, torch=json.loads(done.stdout.splitlines()[-1]), jax=jax.__version__,
              repeats=repeats)


def write_markdown(path: str, text: str | None = None, section: str | None = None):
  """Writes BENCHMARKS.md, keeping the sections of their own commands (--resnet's, --data_dir's).

  Args:
    path: the file.
    text: the whole benchmark's; None: the file's own (or a new header).
    section: one of those sections, in place of the file's; None: the file's kept.
  """
  old = open(path).read() if os.path.exists(path) else ""
  text = text or old or benchmark_report.markdown_header()
  for title in benchmark_report.OWN_SECTIONS:
    kept = section if section and section.startswith(title) else benchmark_report.section(
        old, title)
    if kept:
      text = benchmark_report.with_section(text, kept)
  with open(path, "w") as f:
    f.write(text)


def main(argv):
  del argv
  process.cpu_where_no_accelerator()
  if _RESNET.value:
    comparison = compare_resnet()
    section = benchmark_report.resnet_section(comparison)
    print(section)
    with open(_OUT.value, "w") as f:
      json.dump(comparison, f, indent=2)
    if _MARKDOWN.value:
      write_markdown(_MARKDOWN.value, section=section)
    return
  if _KERNELS.value:
    if jax.default_backend() != "gpu":
      raise SystemExit(f"error: --kernels profiles a GPU's kernels; JAX's backend here is "
                       f"{jax.default_backend()}.")
    runner = benchmark_steps.Runner(resnet_config(_TINY.value), "spmd")
    result = benchmark_kernels.profile(runner, num_steps=5)
    print(benchmark_kernels.report(result))
    with open(_OUT.value, "w") as f:
      json.dump(dict(result, device_kind=jax.devices()[0].device_kind, jax=jax.__version__), f,
                indent=2)
    return
  if _RANDAUGMENT.value:  # (asked for: loaded now)
    from {{cookiecutter.project_slug}}.tools import benchmark_randaugment

    result = benchmark_randaugment.measure(8 if _TINY.value else 64)
    print(benchmark_randaugment.describe(result))
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=2)
    return
  if _DATA_DIR.value:
    result = benchmark_data.main(_CONFIG.value, _DATA_DIR.value, _BATCHES.value, _RATE.value,
                                 _PIL_FOLDER.value, _OUT.value)
    if _MARKDOWN.value:
      write_markdown(_MARKDOWN.value, section=benchmark_report.photos_section(result))
    return
  if _MEASURE.value:
    print(json.dumps(measure(_MEASURE.value, _TINY.value)))
    return
  start = time.perf_counter()
  results = benchmark(_TINY.value)
  results["wall_s"] = time.perf_counter() - start
  print(benchmark_report.report(results))
  with open(_OUT.value, "w") as f:
    json.dump(results, f, indent=2)
  if _MARKDOWN.value:
    write_markdown(_MARKDOWN.value, benchmark_report.markdown(results))
  print(f"wrote {' and '.join(filter(None, (_OUT.value, _MARKDOWN.value)))} in "
        f"{results['wall_s']:.0f} s")


if __name__ == "__main__":
  _CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py",
                                            "--data_dir: the training config.")
  process.run(main)
