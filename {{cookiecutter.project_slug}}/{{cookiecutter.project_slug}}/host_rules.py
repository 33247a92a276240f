"""The rules of the host and the workdir (rules.py runs them last): the input's host memory and
/dev/shm, W&B, config.init_from, RandAugment's string, a bucket's or a local workdir. Each takes
the config and the run's `rules.Target`, and returns what is wrong, or None."""

import importlib.util
import os

import jax

from .data import batches, input_pipeline, sources
from .errors import ConfigError

# What a remote --workdir needs without TensorFlow: Orbax reaches it through etils' fsspec
# backend, the TensorBoard writer (tensorboardX) through the cloud's own client.
REMOTE_WORKDIRS = {"gs": (("gcsfs", "google.cloud.storage"), 'pip install -e ".[gcs]"'),
                   "s3": (("s3fs", "boto3"), "pip install s3fs boto3")}


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # its parent package is missing
    return False


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
  if not source:
    return None
  from .training.pretrained import HUB, is_weights  # (asked for: loaded now)

  if is_weights(source):
    if not source.startswith(HUB) and not os.path.isfile(source):
      return (f"config.init_from={source!r}: no such file; give a .safetensors or .pth file of "
              "pretrained weights, hf-hub:ORG/NAME, or a run's workdir.")
  elif "://" not in source and not os.path.isdir(os.path.join(source, "checkpoints")):
    return (f"config.init_from={source!r} holds no checkpoints/; give the --workdir of the "
            "training run to start from, a .safetensors or .pth file, or hf-hub:ORG/NAME.")


def _randaugment(config, target):
  """timm's RandAugment string (data/randaugment.py)."""
  if not config.get("randaugment"):
    return None
  from .data.randaugment import RandAugment  # (asked for: loaded now)

  try:
    RandAugment.of(target.resolved)
  except ConfigError as e:
    return str(e)


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
  if missing and not _installed("tensorflow"):  # (tf.io.gfile would write it all)
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


RULES = (_input_memory, _shared_memory, _wandb, _init_from, _randaugment, _remote_workdir,
         _local_workdir)
