"""The config checked before anything is read, written or compiled (`validate_config`): a table of
rules, each naming the key, the value and the fix. VALUE_RULES test one value each; RULES several
keys together, the devices, the data (each source's own `check`), the model and recipe modules;
host_rules.py those of the host (memory, /dev/shm) and the workdir."""

import importlib.util
import math
import re

import jax
import jax.numpy as jnp
import ml_collections

from . import errors, host_rules, plan
from .data import sources
from .errors import ConfigError
from .parallel import sharding
from .plan import PARALLELISMS

_int = lambda low: lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low  # noqa
_number = lambda test: lambda v: isinstance(v, (int, float)) and test(v)  # noqa: E731


_pair = lambda top: lambda v: isinstance(v, (tuple, list)) and len(v) == 2 and all(  # noqa
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
      "batch_norm_devices", "keep_checkpoint_every_steps", "early_stopping_evals"),
     _int(0), "must be an integer >= 0."),
    (("steps_per_dispatch",), _int(0), "must be an integer >= 0 (0: chosen per backend)."),
    (("num_workers",), _int(-1), "must be -1 (chosen from the cores), 0 or more."),
    (("eval_crop_ratio",), _number(lambda v: 0 < v <= 1), "must be a number in (0, 1]: the "
     "share of the scaled photo that evaluation keeps (0.875: 224 of 256)."),
    (("learning_rate", "eval_fraction", "watchdog_factor"), _number(lambda v: v > 0),
     "must be a positive number."),
    (("eval_fraction",), lambda v: v < 1, "must be below 1."),
    (("weight_decay", "peak_flops_per_device", "compilation_cache_min_seconds",
      "grad_clip_norm", "watchdog_compile_s", "watchdog_floor_s", "mixup_alpha", "cutmix_alpha"),
     _number(lambda v: v >= 0),
     "must be a number >= 0."),
    (("label_smoothing", "ema_decay", "momentum"), _number(lambda v: 0 <= v < 1),
     "must be a number in [0, 1); 0 turns it off."),
    (("head_lr_multiplier",), _number(lambda v: v >= 0), "must be a number >= 0."),
    (("best_mode",), lambda v: v in ("max", "min"), "must be 'max' or 'min'."),
    (("class_weights",), lambda v: v in ("", "balanced") or re.fullmatch(r"[\d.e+-]+(,[\d.e+-]+)*",
     v), "must be '', 'balanced' or a weight a class, comma-separated (e.g. '1,1,4')."),
    (("mix_prob", "mix_switch_prob"), _number(lambda v: 0 <= v <= 1),
     "must be a number in [0, 1]."),
    (("layer_decay",), _number(lambda v: 0 <= v <= 1), "must be a number in [0, 1] (0.65-0.75 "
     "for ViT-B, BEiT's); 0 turns it off."),
    (("augment_flip", "augment_crop", "nesterov", "ema_warmup", "resize_on_device",
      "freeze_backbone", "freeze_batch_norm"),
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
    (("mu_dtype",), lambda v: v == "" or _floating(v),
     "is not a floating-point dtype; use '' (the parameters') or bfloat16."),
    (("remat",), lambda v: v in ("none", "block") or callable(
        getattr(jax.checkpoint_policies, str(v), None)),
     "is unknown; use 'none', 'block' or a jax.checkpoint_policies name, e.g. "
     "'dots_with_no_batch_dims_saveable'."),
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
  """What the rules check a config against (the devices the run will use; its workdir, None: not
  checked), and what the config comes to on them (`resolved`: `run.steps_per_dispatch`, ...)."""

  def __init__(self, config, devices, workdir: str | None):
    self.devices, self.workdir, self.num_devices = devices, workdir, len(devices)
    self.num_processes = len({d.process_index for d in devices})
    self.resolved = plan.resolved(config, devices)
    self.k = self.resolved.run.steps_per_dispatch


# The rules of several keys, of the devices and of the workdir: each returns what is wrong, or
# None. Each reads only keys that VALUE_RULES (and the rules before it) have passed.
def _dataset_name(config, target):
  if config.dataset in sources.SOURCES:
    return None
  from .data.image_files import holds_image_folders

  fix = f"use one of {tuple(sources.SOURCES)}."
  if config.data_dir and holds_image_folders(config.data_dir):
    fix = (f"config.data_dir={config.data_dir!r} holds folders of images: write them as "
           f"ArrayRecord files first (python write_arrayrecord.py --image_folder="
           f"{config.data_dir} --out_dir=data/mine), then train on them with "
           "--config.dataset=arrayrecord --config.data_dir=data/mine.")
  return f"config.dataset={config.dataset!r} is unknown; {fix}"


def _data_dir_read(config, target):
  readers = [name for name, source in sources.SOURCES.items() if source.reads_data_dir]
  if config.data_dir and config.dataset not in readers:
    return (f"config.data_dir={config.data_dir!r} is read only by config.dataset="
            f"{', '.join(map(repr, readers[:-1]))} or {readers[-1]!r}, not {config.dataset!r}; "
            "add --config.dataset=arrayrecord, or leave data_dir empty (a source of your own "
            "that reads it says so in its line in sources.SOURCES: reads_data_dir=True).")


def _input_statistics(config, target):
  mean, std = config.get("input_mean", ()), config.get("input_std", ())
  if not (all(isinstance(v, (tuple, list)) and all(map(_number(test), v))
              for v, test in ((mean, math.isfinite), (std, lambda x: x > 0)))
          and len(mean) == len(std) in (0, 1, 3)):
    return (f"config.input_mean={mean!r} and config.input_std={std!r} must be () and (), or as "
            "many numbers as channels (std positive), e.g. --config.input_mean='(0.485,0.456,"
            "0.406)' --config.input_std='(0.229,0.224,0.225)'.")


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
    options = plan.xla_options(config)
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
    module = plan.model_module(config)
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
    recipe = plan.recipe_module(config)
  except ImportError as e:
    return (f"config.recipe={config.get('recipe', 'recipe')!r} cannot be imported ({e}); name a "
            "module on the path with the loss, metrics and optimizer (recipe.py: 'recipe').")
  try:
    recipe.optimizer(target.resolved, 100)
  except ConfigError as e:
    return str(e)
  metrics, best = tuple(f"eval_{name}" for name in recipe.METRICS), config.get("best_metric", "")
  if best and best not in metrics:
    return (f"config.best_metric={best!r} is not an evaluation's metric; use one of {metrics} "
            "(recipe.py's METRICS), or '' to keep no best checkpoint.")
  if config.get("early_stopping_evals") and not best:
    return ("config.early_stopping_evals counts the evaluations that do not improve "
            "config.best_metric, which is ''; set it too, e.g. --config.best_metric=eval_accuracy.")


def _batch_divides(config, target):
  batch_size = plan.global_batch_size(config, target.num_devices)
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

RULES = (_dataset_name, _model, _data_dir_read,
         _input_statistics, _warmup, _fsdp_devices, _batch_norm_devices, _xla_options,
         _intervals, _keep_every, _nesterov, _recipe, _batch_divides, _dataset,
         *host_rules.RULES)


def validate_config(config: ml_collections.ConfigDict, workdir: str | None = None,
                    devices=None) -> None:
  """Raises ConfigError with the first rule that `config` breaks (VALUE_RULES, then RULES),
  before any data is read, anything written or anything compiled: of `workdir` too (the run's;
  None: not checked), on `devices` (the run's; None: `jax.devices()`; aot.py: a topology's)."""
  for keys, test, must in VALUE_RULES:
    for key in keys:
      if (value := _value(config, key)) is not _ABSENT and not test(value):
        raise ConfigError(f"config.{key}={value!r} {must}")
  target = Target(config, devices or jax.devices(), workdir)
  for rule in RULES:
    if message := rule(config, target):
      raise ConfigError(message)


