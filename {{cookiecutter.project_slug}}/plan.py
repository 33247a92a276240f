"""What a run of a config will be, decided before anything is read, built or compiled: the
config checked against the devices it will run on, its choices made (k, the global batch),
and the FLOPs of its step. train.py and aot.py both start here, so that what aot.py compiles
for a topology is what train.py would run there.
"""

import functools
import glob
import importlib.util
import json
import os
import re

import jax
import jax.numpy as jnp
import ml_collections
from absl import app, flags
from ml_collections import config_flags

import chips
import input_pipeline
import model as models
import parallel
import runs
import steps
from runs import ConfigError, global_batch_size

OPTIMIZERS = ("adam", "adamw", "sgd")
LR_SCALINGS = ("none", "linear", "sqrt")
SCHEDULES = ("cosine", "linear", "constant")
# What a remote --workdir needs without TensorFlow: Orbax reaches it through etils' fsspec
# backend, the TensorBoard writer (tensorboardX) through the cloud's own client.
REMOTE_WORKDIRS = {"gs": (("gcsfs", "google.cloud.storage"), 'pip install -e ".[gcs]"'),
                   "s3": (("s3fs", "boto3"), "pip install s3fs boto3")}


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # its parent package is missing
    return False


def validate_config(config: ml_collections.ConfigDict, workdir: str | None = None,
                    devices=None) -> None:
  """Raises ConfigError, before any data is read, anything written or anything compiled.
  `devices`: those the run will use (default: `jax.devices()`; aot.py: a topology's)."""
  devices = devices or jax.devices()
  num_devices, num_processes = len(devices), len({d.process_index for d in devices})

  def need(ok, message):
    if not ok:
      raise ConfigError(message)

  def is_int(value, low):
    return isinstance(value, int) and not isinstance(value, bool) and value >= low

  need(config.dataset in input_pipeline.DATASETS,
       f"config.dataset={config.dataset!r} is unknown; use one of {input_pipeline.DATASETS}.")
  need(not config.data_dir or config.dataset in ("arrayrecord", "huggingface", "tfds"),
       f"config.data_dir={config.data_dir!r} is read only by config.dataset='arrayrecord', "
       f"'huggingface' or 'tfds', not {config.dataset!r}; add --config.dataset=arrayrecord (or "
       "leave data_dir empty).")
  need(config.parallelism in steps.PARALLELISMS,
       f"config.parallelism={config.parallelism!r} is unknown; use one of {steps.PARALLELISMS}.")
  need(config.optimizer in OPTIMIZERS,
       f"config.optimizer={config.optimizer!r} is unknown; use one of {OPTIMIZERS}.")
  need(config.lr_scaling in LR_SCALINGS,
       f"config.lr_scaling={config.lr_scaling!r} is unknown; use one of {LR_SCALINGS}.")
  need(config.schedule in SCHEDULES,
       f"config.schedule={config.schedule!r} is unknown; use one of {SCHEDULES}.")
  for key in ("batch_size", "base_batch_size", "grad_accum_steps", "num_epochs", "log_every_steps",
              "eval_every_steps", "checkpoint_every_steps", "max_checkpoints_to_keep",
              "cpu_sync_every_steps", "profile_num_steps"):
    need(is_int(config[key], 1), f"config.{key}={config[key]!r} must be a positive integer.")
  for key in ("augment_max_shift", "read_threads", "prefetch_batches", "prefetch_to_device",
              "profile_first_step", "seed", "per_device_batch_size", "warmup_steps"):
    need(is_int(config[key], 0), f"config.{key}={config[key]!r} must be an integer >= 0.")
  need(isinstance(config.warmup_epochs, (int, float)) and config.warmup_epochs >= 0
       and not (config.warmup_epochs and config.warmup_steps),
       f"config.warmup_epochs={config.warmup_epochs!r} must be a number >= 0, and 0 when "
       f"config.warmup_steps (={config.warmup_steps!r}) is set: give one of the two.")
  need(isinstance(config.eval_crop_ratio, (int, float)) and 0 < config.eval_crop_ratio <= 1,
       f"config.eval_crop_ratio={config.eval_crop_ratio!r} must be a number in (0, 1]: the share "
       "of the scaled photo that evaluation keeps (0.875: 224 of 256).")
  slices = parallel.num_slices(devices)
  per_slice = num_devices // slices  # fsdp groups stay within a TPU slice
  need(is_int(config.fsdp_devices, 0) and per_slice % max(config.fsdp_devices, 1) == 0,
       f"config.fsdp_devices={config.fsdp_devices!r} does not divide the {per_slice} devices"
       f"{' of a slice' if slices > 1 else ''}; use one of "
       f"{[d for d in range(1, per_slice + 1) if per_slice % d == 0]} (0: all of them).")
  need(is_int(config.fsdp_min_size, 0),
       f"config.fsdp_min_size={config.fsdp_min_size!r} must be an integer >= 0.")
  need(is_int(config.steps_per_dispatch, 0),
       f"config.steps_per_dispatch={config.steps_per_dispatch!r} must be an integer >= 0 (0: "
       "chosen per backend).")
  need(is_int(config.num_workers, -1),
       f"config.num_workers={config.num_workers!r} must be -1 (chosen from the cores), 0 or more.")
  try:
    options = steps.xla_options(config)
  except ValueError as e:
    raise ConfigError(f"config.xla_options={config.xla_options!r}: {e}; give XLA options as "
                      "'name=value,name=value', e.g. "
                      "'xla_gpu_enable_latency_hiding_scheduler=false'.") from None
  need(not options or config.parallelism != "pmap",
       f"config.xla_options={config.xla_options!r} is for the jit-compiled steps (spmd, fsdp); "
       "jax.pmap takes no compiler options: use --config.parallelism=spmd or fsdp.")
  model = config.model  # (keys that your own model.py may drop)
  for key in ("dtype", "param_dtype"):
    try:
      floating = key not in model or jnp.issubdtype(jnp.dtype(model[key]), jnp.floating)
    except TypeError:
      floating = False
    need(floating, f"config.model.{key}={model[key]!r} is not a floating-point dtype; use "
         "float32 or bfloat16.")
    need(key not in model or jnp.dtype(model[key]) != jnp.float16,
         f"config.model.{key}='float16' needs loss scaling, which the steps do not do (small "
         "gradients underflow to 0); use bfloat16, which has float32's range.")
  features = model.get("features", (1,))
  need(isinstance(features, (tuple, list)) and len(features) > 0 and all(
      is_int(f, 1) for f in features),
       f"config.model.features={features!r} must be a tuple of positive integers (one width "
       "per convolution), e.g. --config.model.features='(32,64)'.")
  known = getattr(models, "MODELS", None)  # (model.py's names, where yours keeps them)
  need(known is None or model.get("name", known[0]) in known,
       f"config.model.name={model.get('name')!r} is none of model.py's {known}; choose one.")
  need(is_int(model.get("width", 1), 1),
       f"config.model.width={model.get('width')!r} must be a positive integer (ResNet's first "
       "stage's width, 64 in the papers).")
  k = steps.steps_per_dispatch(config, devices[0].platform)
  for key in ("log_every_steps", "eval_every_steps", "checkpoint_every_steps"):
    lower = max(config[key] // k, 1) * k
    need(config[key] % k == 0,
         f"config.{key}={config[key]} is not a multiple of config.steps_per_dispatch={k}; use "
         f"{' or '.join(map(str, sorted({lower, lower + k})))}, or another steps_per_dispatch.")
  for key in ("learning_rate", "eval_fraction"):
    need(isinstance(config[key], (int, float)) and config[key] > 0,
         f"config.{key}={config[key]!r} must be a positive number.")
  for key in ("weight_decay", "peak_flops_per_device", "compilation_cache_min_seconds",
              "grad_clip_norm"):
    need(isinstance(config[key], (int, float)) and config[key] >= 0,
         f"config.{key}={config[key]!r} must be a number >= 0.")
  for key in ("label_smoothing", "ema_decay", "momentum"):
    need(isinstance(config[key], (int, float)) and 0 <= config[key] < 1,
         f"config.{key}={config[key]!r} must be a number in [0, 1); 0 turns it off.")
  need(not config.nesterov or config.momentum > 0,
       "config.nesterov=True needs momentum: set config.momentum > 0 (0.9 is usual).")
  for key in ("augment_flip", "augment_crop", "nesterov", "ema_warmup"):
    need(isinstance(config[key], bool), f"config.{key}={config[key]!r} must be True or False.")
  for key, top in (("augment_crop_scale", 1), ("augment_crop_ratio", float("inf"))):
    low_high = config[key]
    need(isinstance(low_high, (tuple, list)) and len(low_high) == 2 and all(
        isinstance(x, (int, float)) for x in low_high) and 0 < low_high[0] <= low_high[1] <= top,
         f"config.{key}={low_high!r} must be (low, high) with 0 < low <= high"
         f"{' <= 1' if top == 1 else ''}, e.g. --config.{key}='(0.5,1.0)'.")
  need(config.eval_fraction < 1, f"config.eval_fraction={config.eval_fraction} must be below 1.")
  batch_size = global_batch_size(config, num_devices)
  parts = num_devices * config.grad_accum_steps
  over = f"{num_devices} devices" + (
      f" on {num_processes} processes" if num_processes > 1 else "") + (
      f" x {config.grad_accum_steps} micro-batches" if config.grad_accum_steps > 1 else "")
  given, wanted = f"config.batch_size={batch_size}", "a multiple"
  if config.per_device_batch_size:
    given = (f"config.per_device_batch_size={config.per_device_batch_size} gives a global batch "
             f"of {batch_size}, which")
    wanted = "a global batch that is a multiple"
  need(batch_size % parts == 0, f"{given} does not divide over {over}; use {wanted} of {parts}, "
       f"e.g. {max(1, round(batch_size / parts)) * parts}.")
  if config.dataset == "synthetic":
    spec = config.synthetic
    need(len(spec.image_shape) == 3 and all(is_int(d, 1) for d in spec.image_shape),
         f"config.synthetic.image_shape={spec.image_shape!r} must be (height, width, channels).")
    for key in ("num_classes", "num_train", "num_eval"):
      need(is_int(spec[key], 1), f"config.synthetic.{key}={spec[key]!r} must be a positive "
           "integer.")
  if config.dataset == "arrayrecord":
    need(bool(config.data_dir), "config.data_dir is empty; give the directory that "
         "write_arrayrecord.py wrote: --config.data_dir=DIR.")
    need(os.path.isdir(config.data_dir),
         f"config.data_dir={config.data_dir!r} " + ("is not a directory" if os.path.exists(
             config.data_dir) else "does not exist") + "; give the directory that "
         "write_arrayrecord.py wrote.")
    for split in ("train", "eval"):
      need(bool(input_pipeline.arrayrecord_paths(config.data_dir, split)),
           f"config.data_dir={config.data_dir!r} holds no {split}-*.array_record files; write "
           "them with write_arrayrecord.py.")
    need(os.path.isfile(os.path.join(config.data_dir, "metadata.json")),
         f"config.data_dir={config.data_dir!r} has no metadata.json; write the data with "
         "write_arrayrecord.py.")
  if config.dataset in ("huggingface", "tfds"):
    package, extra = {"huggingface": ("datasets", "huggingface"),
                      "tfds": ("tensorflow_datasets", "tfds")}[config.dataset]
    need(_installed(package), f"config.dataset={config.dataset!r} needs the `{package}` "
         f"package: pip install -e '.[{extra}]'.")
    need(not config.image_size or (len(config.image_size) == 3 and all(
        is_int(d, 1) for d in config.image_size)), f"config.image_size={config.image_size!r} "
         "must be (height, width, channels), e.g. --config.image_size='(224,224,3)'.")
    need(config.dataset != "tfds" or bool(config.tfds_name), "config.dataset='tfds' needs "
         "config.tfds_name: the dataset's TFDS name, e.g. --config.tfds_name=imagenet2012.")
    import huggingface
    import tfds_data

    try:  # the data's folder, splits, image and label
      huggingface.splits(config) if config.dataset == "huggingface" else tfds_data.builder(config)
    except ValueError as e:
      need(False, str(e))
  need(not config.wandb_project or _installed("wandb"), f"config.wandb_project="
       f"{config.wandb_project!r} needs the `wandb` package: pip install -e '.[wandb]'.")
  need(not config.init_from or "://" in config.init_from or os.path.isdir(
      os.path.join(config.init_from, "checkpoints")),
       f"config.init_from={config.init_from!r} holds no checkpoints/; give the --workdir of the "
       "training run to start from.")
  if workdir is not None and "://" in workdir:  # gs://, s3://, ...
    scheme = workdir.split("://", 1)[0]
    need(scheme in REMOTE_WORKDIRS, f"--workdir={workdir!r}: {scheme}:// is not supported; use "
         f"a local directory or one of {', '.join(f'{s}://' for s in REMOTE_WORKDIRS)}.")
    modules, fix = REMOTE_WORKDIRS[scheme]
    missing = [m for m in modules if not _installed(m)]
    need(_installed("tensorflow") or not missing,  # with TensorFlow, tf.io.gfile writes it all
         f"--workdir={workdir!r} needs {' and '.join(missing)}, which are not installed; "
         f"install them: {fix}")
  if workdir is not None and "://" not in workdir:  # a local path
    need(not os.path.exists(workdir) or os.path.isdir(workdir),
         f"--workdir={workdir!r} is a file, not a directory; give a directory (created if "
         "missing).")
    existing = os.path.abspath(workdir)
    while not os.path.exists(existing):
      existing = os.path.dirname(existing)
    need(os.path.isdir(existing) and os.access(existing, os.W_OK | os.X_OK),
         f"--workdir={workdir!r} cannot be written here ({existing!r} is "
         f"{'not writable' if os.path.isdir(existing) else 'a file'}); give another directory.")


class Speed:
  """FLOP/s and model FLOP utilisation (MFU) from the FLOPs of the step's matrix products and
  convolutions, counted in its jaxpr (the same on every backend)."""

  def __init__(self, graphdef, state, image_shape, config, devices=None):
    # Under pmap, traced with its axis (of size 1: the global batch on one device), for models
    # whose layers reduce over it (BatchNorm).
    axis = parallel.PMAP_AXIS if config.parallelism == "pmap" else None
    # (The crop's resampling is left out: it is a matrix product, but not the model's.)
    step = functools.partial(steps.train_step, graphdef, **dict(
        steps.step_options(config), crop=None), axis_name=axis)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct((config.batch_size, *shape), dtype)  # noqa: E731
    batch = {"image": spec(image_shape, jnp.uint8), "label": spec((), jnp.int32),
             "mask": spec((), jnp.bool_), "position": spec((), jnp.uint32)}  # one global batch
    self.flops_per_step = steps.model_flops(
        step, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state),
        steps.TrainMetrics.empty(), batch, axis_env=[(axis, 1)] if axis else None)
    devices = devices or jax.devices()
    peak = config.peak_flops_per_device or chips.peak_flops(devices[0].device_kind)
    self.peak = peak * len(devices)

  def report(self, steps_per_sec: float) -> dict[str, float]:
    achieved = self.flops_per_step * steps_per_sec
    return {"flops_per_sec": achieved, **({"mfu": achieved / self.peak} if self.peak else {})}


def resolved(config: ml_collections.ConfigDict, devices=None) -> ml_collections.ConfigDict:
  """A copy of a valid config with the choices made for `devices` (default: `jax.devices()`):
  `steps_per_dispatch` (k) from their platform, `batch_size` the global batch."""
  devices = devices or jax.devices()
  config = config.copy_and_resolve_references()
  config.steps_per_dispatch = steps.steps_per_dispatch(config, devices[0].platform)
  config.batch_size = global_batch_size(config, len(devices))
  return config


# Keys that a resumed run may change: how it runs, not what it computes (the rest, what it
# optimises and on what data, is the run's own: `resumed`).
FREE_ON_RESUME = (
    "num_workers", "read_threads", "prefetch_batches", "prefetch_to_device", "grad_accum_steps",
    "steps_per_dispatch", "init_from", "parallelism", "fsdp_devices", "fsdp_min_size",
    "print_shardings", "xla_options", "compilation_cache_dir", "compilation_cache_min_seconds",
    "peak_flops_per_device", "profile_first_step", "profile_num_steps", "wandb_project",
    "log_every_steps", "eval_every_steps", "checkpoint_every_steps", "max_checkpoints_to_keep",
    "skip_nonfinite_steps", "cpu_sync_every_steps", "per_device_batch_size", "resume_may_change")


def flatten(tree: dict, prefix: str = "") -> dict:
  """Nested dicts as one dict of dotted keys ('model.features')."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def resumed(config: ml_collections.ConfigDict, saved: dict, workdir: str,
            num_devices: int) -> tuple[ml_collections.ConfigDict, list[str]]:
  """A resolved `config` resuming the run whose resolved config is `saved` (its config.json):
  the run's contract. A key outside `FREE_ON_RESUME` that differs raises ConfigError, unless
  `config.resume_may_change` names it; `per_device_batch_size` on another device count keeps
  the run's global batch (and so its steps and the data's order). Returns the config and the
  log lines that say what changed. Keys that one of the two configs lacks are not compared."""
  config, lines = config.copy_and_resolve_references(), []
  if config.per_device_batch_size and config.batch_size != saved["batch_size"]:
    run_batch = saved["batch_size"]
    if run_batch % num_devices:
      raise ConfigError(
          f"the run in {workdir!r} has a global batch of {run_batch}, which {num_devices} "
          f"devices do not divide (config.per_device_batch_size={config.per_device_batch_size}"
          f"); resume it on a number of devices that divides {run_batch}, or use a new "
          "--workdir.")
    lines.append(f"resumed on {num_devices} devices: per_device_batch_size "
                 f"{config.per_device_batch_size} -> {run_batch // num_devices}, keeping the "
                 f"run's global batch of {run_batch}")
    config.per_device_batch_size, config.batch_size = run_batch // num_devices, run_batch
  may_change = {key.strip() for key in config.resume_may_change.split(",") if key.strip()}
  given, saved = flatten(json.loads(config.to_json())), flatten(saved)
  for key in sorted(given.keys() & saved.keys()):
    if given[key] == saved[key] or key.split(".")[0] in FREE_ON_RESUME:
      continue
    if key not in may_change:
      raise ConfigError(
          f"config.{key}={given[key]!r} differs from the {saved[key]!r} of the run in "
          f"{workdir!r} that this resumes ({runs.CONFIG_FILE}); a resumed run keeps its config: "
          f"use a new --workdir, or --config.resume_may_change={key} to change it (logged).")
    lines.append(f"resumed with config.{key} changed: {saved[key]!r} -> {given[key]!r}")
  return config, lines


def parse_flags(argv):
  """absl's flag parsing, where a config file that is not there, or a --config.KEY that the
  config does not have, is one line too."""
  try:
    parsed = app.parse_flags_with_usage(argv)
  except AttributeError as e:  # ml_collections: KeyError("'key'\nDid you mean \"...\"?")
    cause = e.args[0] if e.args and isinstance(e.args[0], KeyError) else e
    text = str(cause.args[0] if cause.args else cause)
    key = re.match(r"\W*([\w.]*)", text)[1]
    hint = re.search(r'Did you mean "([\w.]+)"', text)
    given = [a[len("--config."):].split("=")[0] for a in argv if a.startswith("--config.")]
    key = next((name for name in given if name.rsplit(".", 1)[-1] == key), key)
    hint = hint and ".".join([*key.split(".")[:-1], hint[1]])
    raise SystemExit(f"error: the config has no key {key!r}"
                     f"{f' (did you mean {hint!r}?)' if hint else ''}; its keys are in "
                     "configs/default.py (a typo in --config.KEY=VALUE?).") from None
  path = config_flags.get_config_filename(flags.FLAGS["config"]).split(":")[0]
  if not os.path.isfile(path):
    configs = sorted(glob.glob(os.path.join(os.path.dirname(path) or ".", "*.py")))
    raise SystemExit(f"error: --config={path!r} is not a file; use one of "
                     f"{', '.join(configs) or 'configs/default.py'}.")
  return parsed
