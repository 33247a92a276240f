"""What a run of a config will be, decided before anything is read or compiled: the config
checked against its devices (a table of rules, each naming the key, the value and the fix) and its
choices made (k, the global batch). train.py and aot.py both start here."""

import importlib
import importlib.util
import math
import os

import jax
import jax.numpy as jnp
import ml_collections

from . import errors
from .data import batches, input_pipeline, sources
from .errors import ConfigError
from .parallel import sharding

PARALLELISMS = ("spmd", "pmap", "fsdp")
# k when `config.steps_per_dispatch` is 0, on a GPU or TPU (or the largest number below it that
# divides the log, eval and checkpoint intervals): enough steps a call to hide the host's work
# per call behind a small model's steps; the rolled loop compiles once whatever k. On the CPU k
# is 1: its steps are long, the k steps are unrolled there (see `make`), and compiling several
# of them costs more than the dispatches they save (BENCHMARKS.md).
ACCELERATOR_STEPS_PER_DISPATCH = 10


def steps_per_dispatch(config, platform: str | None = None) -> int:
  """k: `config.steps_per_dispatch`, or when 0: 1 on the CPU, else the largest number up to
  `ACCELERATOR_STEPS_PER_DISPATCH` that divides the log, eval and checkpoint intervals."""
  if config.steps_per_dispatch:
    return config.steps_per_dispatch
  if (platform or jax.default_backend()) == "cpu":
    return 1
  intervals = (config.log_every_steps, config.eval_every_steps, config.checkpoint_every_steps)
  return next(k for k in range(ACCELERATOR_STEPS_PER_DISPATCH, 0, -1)
              if all(interval % k == 0 for interval in intervals))


# What a remote --workdir needs without TensorFlow: Orbax reaches it through etils' fsspec
# backend, the TensorBoard writer (tensorboardX) through the cloud's own client.
REMOTE_WORKDIRS = {"gs": (("gcsfs", "google.cloud.storage"), 'pip install -e ".[gcs]"'),
                   "s3": (("s3fs", "boto3"), "pip install s3fs boto3")}


def global_batch_size(config, num_devices: int | None = None) -> int:
  """Examples per optimizer step, over all devices and processes: `config.batch_size`, or
  `config.per_device_batch_size` x the devices (default: all of them) when that is set."""
  if config.per_device_batch_size:
    return config.per_device_batch_size * (num_devices or jax.device_count())
  return config.batch_size


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


def model_module(config):
  """The module whose `create_model` builds the model: `config.model.module`, model.py (yours)
  unless a config names another (the tests name their own copy of the shipped models)."""
  return importlib.import_module(config.model.get("module", "model"))


def recipe_module(config):
  """The module of the loss, augmentation, metrics and optimizer: `config.recipe`, recipe.py
  (yours) unless a config names another (the tests name their own copy of the shipped one)."""
  return importlib.import_module(config.get("recipe", "recipe"))


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # its parent package is missing
    return False


def _int(low: int):
  return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def _number(test):
  return lambda v: isinstance(v, (int, float)) and test(v)


def _pair(top: float):
  return lambda v: isinstance(v, (tuple, list)) and len(v) == 2 and all(
      isinstance(x, (int, float)) for x in v) and 0 < v[0] <= v[1] <= top


def _floating(v) -> bool:
  try:
    return jnp.issubdtype(jnp.dtype(v), jnp.floating)
  except TypeError:
    return False


_ABSENT = object()  # a key that your own config (or model.py's part of it) dropped: not checked
# One rule per key: (keys, the test of a value, what the value must be). The message reads
# "config.KEY=VALUE <what>".
VALUE_RULES = (
    (("parallelism",), lambda v: v in PARALLELISMS,
     f"is unknown; use one of {PARALLELISMS}."),
    (("batch_size", "base_batch_size", "grad_accum_steps", "num_epochs", "log_every_steps",
      "eval_every_steps", "checkpoint_every_steps", "max_checkpoints_to_keep",
      "cpu_sync_every_steps", "profile_num_steps"), _int(1), "must be a positive integer."),
    (("augment_max_shift", "read_threads", "prefetch_batches", "prefetch_to_device",
      "profile_first_step", "seed", "per_device_batch_size", "warmup_steps", "fsdp_min_size",
      "batch_norm_devices", "keep_checkpoint_every_steps"),
     _int(0), "must be an integer >= 0."),
    (("steps_per_dispatch",), _int(0), "must be an integer >= 0 (0: chosen per backend)."),
    (("num_workers",), _int(-1), "must be -1 (chosen from the cores), 0 or more."),
    (("eval_crop_ratio",), _number(lambda v: 0 < v <= 1), "must be a number in (0, 1]: the "
     "share of the scaled photo that evaluation keeps (0.875: 224 of 256)."),
    (("learning_rate", "eval_fraction"), _number(lambda v: v > 0), "must be a positive number."),
    (("eval_fraction",), lambda v: v < 1, "must be below 1."),
    (("weight_decay", "peak_flops_per_device", "compilation_cache_min_seconds",
      "grad_clip_norm"), _number(lambda v: v >= 0), "must be a number >= 0."),
    (("label_smoothing", "ema_decay", "momentum"), _number(lambda v: 0 <= v < 1),
     "must be a number in [0, 1); 0 turns it off."),
    (("augment_flip", "augment_crop", "nesterov", "ema_warmup", "resize_on_device"),
     lambda v: isinstance(v, bool), "must be True or False."),
    (("augment_crop_scale",), _pair(1), "must be (low, high) with 0 < low <= high <= 1, e.g. "
     "--config.augment_crop_scale='(0.5,1.0)'."),
    (("augment_crop_ratio",), _pair(math.inf), "must be (low, high) with 0 < low <= high, "
     "e.g. --config.augment_crop_ratio='(0.5,1.0)'."),
    (("model.dtype", "model.param_dtype"), _floating,
     "is not a floating-point dtype; use float32 or bfloat16."),
    (("model.dtype", "model.param_dtype"), lambda v: jnp.dtype(v) != jnp.float16,
     "needs loss scaling, which the steps do not do (small gradients underflow to 0); use "
     "bfloat16, which has float32's range."),
    (("model.features",), lambda v: isinstance(v, (tuple, list)) and len(v) > 0 and all(
        map(_int(1), v)), "must be a tuple of positive integers (one width per convolution), "
     "e.g. --config.model.features='(32,64)'."),
    (("model.width",), _int(1), "must be a positive integer (ResNet's first stage's width, 64 "
     "in the papers)."),
)


def _value(config, key: str):
  for part in key.split("."):
    if part not in config:
      return _ABSENT
    config = config[part]
  return config


class Target:
  """What the rules check a config against: the devices the run will use, its workdir, and what
  the config comes to on those devices (`resolved`: `run.steps_per_dispatch`, the batches)."""

  def __init__(self, config, devices, workdir: str | None):
    self.devices, self.workdir, self.num_devices = devices, workdir, len(devices)
    self.num_processes = len({d.process_index for d in devices})
    self.resolved = resolved(config, devices)
    self.k = self.resolved.run.steps_per_dispatch


# The rules of several keys, of the devices and of the workdir: each returns what is wrong, or
# None. Each reads only keys that VALUE_RULES (and the rules before it) have passed.
def _dataset_name(config, target):
  if config.dataset in sources.SOURCES:
    return None
  fix = f"use one of {tuple(sources.SOURCES)}."
  if config.data_dir and _holds_image_folders(config.data_dir):
    fix = (f"config.data_dir={config.data_dir!r} holds folders of images: write them as "
           f"ArrayRecord files first (python write_arrayrecord.py --image_folder="
           f"{config.data_dir} --out_dir=data/mine), then train on them with "
           "--config.dataset=arrayrecord --config.data_dir=data/mine.")
  return f"config.dataset={config.dataset!r} is unknown; {fix}"


def _holds_image_folders(directory: str) -> bool:
  """Whether `directory` (or its train/) holds class folders with image files in them."""
  from .data.image_files import IMAGE_SUFFIXES

  train = os.path.join(directory, "train")
  root = train if os.path.isdir(train) else directory
  return os.path.isdir(root) and any(entry.is_dir() and any(name.lower().endswith(IMAGE_SUFFIXES)
                                    for name in os.listdir(entry.path))
             for entry in os.scandir(root))


def _data_dir_read(config, target):
  readers = [name for name, source in sources.SOURCES.items() if source.reads_data_dir]
  if config.data_dir and config.dataset not in readers:
    return (f"config.data_dir={config.data_dir!r} is read only by config.dataset="
            f"{', '.join(map(repr, readers[:-1]))} or {readers[-1]!r}, not {config.dataset!r}; "
            "add --config.dataset=arrayrecord, or leave data_dir empty (a source of your own "
            "that reads it says so in its line in sources.SOURCES: reads_data_dir=True).")


def _warmup(config, target):
  if not (isinstance(config.warmup_epochs, (int, float)) and config.warmup_epochs >= 0
          and not (config.warmup_epochs and config.warmup_steps)):
    return (f"config.warmup_epochs={config.warmup_epochs!r} must be a number >= 0, and 0 when "
            f"config.warmup_steps (={config.warmup_steps!r}) is set: give one of the two.")


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def _fsdp_devices(config, target):
  slices = sharding.num_slices(target.devices)
  per_slice = target.num_devices // slices  # fsdp groups stay within a TPU slice
  if not (_int(0)(config.fsdp_devices) and per_slice % max(config.fsdp_devices, 1) == 0):
    return (f"config.fsdp_devices={config.fsdp_devices!r} does not divide the {per_slice} "
            f"devices{' of a slice' if slices > 1 else ''}; use one of {_divisors(per_slice)} "
            "(0: all of them).")


def _batch_norm_devices(config, target):
  if target.num_devices % max(config.batch_norm_devices, 1):
    return (f"config.batch_norm_devices={config.batch_norm_devices} does not divide the "
            f"{target.num_devices} devices into groups for BatchNorm's statistics; use one of "
            f"{_divisors(target.num_devices)} (0: the global batch).")


def _xla_options(config, target):
  try:
    options = xla_options(config)
  except ValueError as e:
    return (f"config.xla_options={config.xla_options!r}: {e}; give XLA options as "
            "'name=value,name=value', e.g. 'xla_gpu_enable_latency_hiding_scheduler=false'.")
  if options and config.parallelism == "pmap":
    return (f"config.xla_options={config.xla_options!r} is for the jit-compiled steps (spmd, "
            "fsdp); jax.pmap takes no compiler options: use --config.parallelism=spmd or fsdp.")


def _intervals(config, target):
  k = target.k
  for key in ("log_every_steps", "eval_every_steps", "checkpoint_every_steps"):
    if config[key] % k:
      lower = max(config[key] // k, 1) * k
      return (f"config.{key}={config[key]} is not a multiple of config.steps_per_dispatch={k}; "
              f"use {' or '.join(map(str, sorted({lower, lower + k})))}, or another "
              "steps_per_dispatch.")


def _model(config, target):
  name = config.model.get("module", "model")
  try:
    module = model_module(config)
  except ModuleNotFoundError as e:
    if e.name != name:  # (a module that model.py imports: below)
      return _model_broken(name, e)
    return (f"config.model.module={name!r} cannot be imported ({e}); name a module on the path "
            "whose create_model builds the model (model.py: 'model').")
  except Exception as e:  # a SyntaxError, or anything that running the file raised
    return _model_broken(name, e)
  if not callable(getattr(module, "create_model", None)):
    return (f"config.model.module={name!r} ({module.__file__}) has no create_model(config, "
            "image_shape, num_classes, rngs); define it there (model.py's docstring).")
  names = getattr(module, "MODELS", None)
  if names is not None and config.model.get("name", names[0]) not in names:
    return f"config.model.name={config.model.name!r} is none of {name}.py's {names}; choose one."


def _model_broken(name: str, error: Exception) -> str:
  spec = importlib.util.find_spec(name)
  path = spec.origin if spec and spec.origin else f"{name}.py"
  return (f"{errors.where(error, path)}: {errors.one_line(error)} (importing "
          f"config.model.module={name!r}); fix that line.")


def _keep_every(config, target):
  every, interval = config.get("keep_checkpoint_every_steps", 0), config.checkpoint_every_steps
  if every % interval:
    return (f"config.keep_checkpoint_every_steps={every} is not a multiple of "
            f"config.checkpoint_every_steps={interval}: no checkpoint is saved at those steps; "
            f"use a multiple of {interval} (0: keep the newest max_checkpoints_to_keep alone).")


def _nesterov(config, target):
  if config.nesterov and not config.momentum > 0:
    return "config.nesterov=True needs momentum: set config.momentum > 0 (0.9 is usual)."


def _recipe(config, target):
  """recipe.py imports, and builds the config's optimizer (which names an unknown choice)."""
  try:
    recipe = recipe_module(config)
  except ImportError as e:
    return (f"config.recipe={config.get('recipe', 'recipe')!r} cannot be imported ({e}); name a "
            "module on the path with the loss, metrics and optimizer (recipe.py: 'recipe').")
  try:
    recipe.optimizer(target.resolved, 100)
  except ConfigError as e:
    return str(e)


def _batch_divides(config, target):
  batch_size = global_batch_size(config, target.num_devices)
  parts = target.num_devices * config.grad_accum_steps
  if batch_size % parts == 0:
    return None
  over = f"{target.num_devices} devices" + (
      f" on {target.num_processes} processes" if target.num_processes > 1 else "") + (
      f" x {config.grad_accum_steps} micro-batches" if config.grad_accum_steps > 1 else "")
  given, wanted = f"config.batch_size={batch_size}", "a multiple"
  if config.per_device_batch_size:
    given = (f"config.per_device_batch_size={config.per_device_batch_size} gives a global batch "
             f"of {batch_size}, which")
    wanted = "a global batch that is a multiple"
  return (f"{given} does not divide over {over}; use {wanted} of {parts}, e.g. "
          f"{max(1, round(batch_size / parts)) * parts}.")


def _dataset(config, target):  # the data source's own check (its module's `check`)
  return sources.source(config.dataset).check(config)


def _input_memory(config, target):
  """The input alone would not fit this host (aot.py's topologies are not here: not checked)."""
  if target.devices[0] not in jax.devices():
    return None
  info = sources.source(config.dataset).describe(config)
  if info is None:  # known once read (Hugging Face, TFDS): unless decoded to image_size
    if not config.get("image_size"):
      return None
    info = sources.DatasetInfo(tuple(config.image_size), 0, {})
  memory = input_pipeline.host_memory(target.resolved, info, target.num_processes)
  have = input_pipeline.available_memory()
  if memory.bytes <= have:
    return None
  fits = (have // memory.unit_bytes - memory.main) // (memory.per_worker * memory.iterators)
  return (f"the input would hold {memory.bytes / 2**30:.3g} GiB of this host's "
          f"{have / 2**30:.3g} GiB: {memory.iterators} x {memory.workers} workers x "
          f"{memory.per_worker} + {memory.main} units of {memory.unit_bytes / 2**20:.4g} MiB "
          f"(a device's share of k={target.k} batches); use "
          + (f"--config.num_workers={fits} or fewer, " if fits > 0 else "")
          + "a lower --config.prefetch_batches, or a smaller batch or steps_per_dispatch.")


def _shared_memory(config, target):
  """Grain's workers need some room in /dev/shm even when every image travels pickled."""
  workers = batches.default_workers(config)
  if not workers or target.devices[0] not in jax.devices():
    return None
  from .data import shm  # (only where workers run)

  if not shm.available():
    return None
  free, need = shm.free_bytes(), shm.fallback_bytes(workers)
  if free < need:
    return (f"{shm.DIRECTORY} has {free / 2**10:.0f} KiB free; the {workers} + {workers} Grain "
            f"worker processes of training and evaluation need {need / 2**10:.0f} KiB there at "
            "the least (their queues' semaphores): give it room (docker run --shm-size=16g; a "
            "pod: an emptyDir of medium Memory at /dev/shm, as clusters/gke-gpu-jobset.yaml), "
            "or read without workers: --config.num_workers=0.")


def _wandb(config, target):
  if config.wandb_project and not _installed("wandb"):
    return (f"config.wandb_project={config.wandb_project!r} needs the `wandb` package: pip "
            "install -e '.[wandb]'.")


def _init_from(config, target):
  source = config.init_from
  if source and "://" not in source and not os.path.isdir(os.path.join(source, "checkpoints")):
    return (f"config.init_from={source!r} holds no checkpoints/; give the --workdir of the "
            "training run to start from.")


def _remote_workdir(config, target):
  workdir = target.workdir
  if workdir is None or "://" not in workdir:  # gs://, s3://, ...
    return None
  scheme = workdir.split("://", 1)[0]
  if scheme not in REMOTE_WORKDIRS:
    return (f"--workdir={workdir!r}: {scheme}:// is not supported; use a local directory or one "
            f"of {', '.join(f'{s}://' for s in REMOTE_WORKDIRS)}.")
  modules, fix = REMOTE_WORKDIRS[scheme]
  missing = [m for m in modules if not _installed(m)]
  if missing and not _installed("tensorflow"):  # with TensorFlow, tf.io.gfile writes it all
    return (f"--workdir={workdir!r} needs {' and '.join(missing)}, which are not installed; "
            f"install them: {fix}")


def _local_workdir(config, target):
  workdir = target.workdir
  if workdir is None or "://" in workdir:
    return None
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    return (f"--workdir={workdir!r} is a file, not a directory; give a directory (created if "
            "missing).")
  existing = os.path.abspath(workdir)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not (os.path.isdir(existing) and os.access(existing, os.W_OK | os.X_OK)):
    return (f"--workdir={workdir!r} cannot be written here ({existing!r} is "
            f"{'not writable' if os.path.isdir(existing) else 'a file'}); give another directory.")


RULES = (_dataset_name, _model, _data_dir_read,
         _warmup, _fsdp_devices, _batch_norm_devices, _xla_options,
         _intervals, _keep_every, _nesterov, _recipe, _batch_divides, _dataset,
         _input_memory, _shared_memory, _wandb, _init_from, _remote_workdir, _local_workdir)


def validate_config(config: ml_collections.ConfigDict, workdir: str | None = None,
                    devices=None) -> None:
  """Raises ConfigError with the first rule that `config` breaks (VALUE_RULES, then RULES),
  before any data is read, anything written or anything compiled. `devices`: those the run will
  use (default: `jax.devices()`; aot.py: a topology's)."""
  for keys, test, must in VALUE_RULES:
    for key in keys:
      if (value := _value(config, key)) is not _ABSENT and not test(value):
        raise ConfigError(f"config.{key}={value!r} {must}")
  target = Target(config, devices or jax.devices(), workdir)
  for rule in RULES:
    if message := rule(config, target):
      raise ConfigError(message)


def resolved(config: ml_collections.ConfigDict, devices=None) -> ml_collections.ConfigDict:
  """A copy of a valid config with what it comes to on `devices` (default: `jax.devices()`)
  under names of its own, `config.run`; the keys you set keep their meaning. `run.num_devices`;
  `run.global_batch_size`, examples per optimizer step (`global_batch_size`), and
  `run.per_device_batch_size`, its share a device; `run.steps_per_dispatch`, k (`config.
  steps_per_dispatch`, or when 0 the platform's choice)."""
  devices = devices or jax.devices()
  config = config.copy_and_resolve_references()
  batch = global_batch_size(config, len(devices))
  with config.unlocked():
    config.run = ml_collections.ConfigDict(dict(
        num_devices=len(devices), global_batch_size=batch,
        per_device_batch_size=batch // len(devices),
        steps_per_dispatch=steps_per_dispatch(config, devices[0].platform)))
  return config
