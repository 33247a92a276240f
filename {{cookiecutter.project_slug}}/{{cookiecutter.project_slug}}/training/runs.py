"""A run's workdir: config.json (the run's config, `plan.resolved`), data.json (the data's
description), its Orbax checkpoints, and resuming: a run started again in its workdir resumes it
and keeps its config but for what `FREE_ON_RESUME` names.
(Reading a trained run back: trained.py.)"""

import contextlib
import functools
import gc
import itertools
import json
import logging as std_logging
import os
import sys
import traceback
import warnings

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from .. import errors
from ..data import input_pipeline
from ..errors import ConfigError

CONFIG_FILE, DATA_FILE = "config.json", "data.json"
MODEL_FILE = "model.py"  # the source of the run's model module (config.model.module), as trained


def array_handlers():
  """Orbax's writers of jax.Array leaves: a replicated array written by its replicas together on
  TPU (Orbax's default), by one replica elsewhere (on the CPU splitting it compiles slicing
  programs at the first save; on GPUs Orbax's own choice, detected only from JAX_PLATFORMS)."""
  split = None if jax.default_backend() == "tpu" else False
  return ocp.type_handlers.create_type_handler_registry(
      (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=split)))


def checkpoint_manager(workdir: str, config=None, create: bool = True):
  """The checkpoints of `workdir`: with the run's `config`, written as it says (kept: the newest
  `max_checkpoints_to_keep`, and each of a step that `keep_checkpoint_every_steps` divides);
  without, read (`create=False`: never make the directory). Each holds the state and its
  `checksums`. Orbax writes each checkpoint to a temporary directory and renames it when
  complete, so a checkpoint cut short by a kill is never restored."""
  policy = None  # (read: every one kept)
  if config:
    every = config.get("keep_checkpoint_every_steps", 0)
    policy = ocp.checkpoint_managers.AnyPreservationPolicy([
        ocp.checkpoint_managers.LatestN(n=config.max_checkpoints_to_keep),
        *[ocp.checkpoint_managers.EveryNSteps(interval_steps=every)] * bool(every)])
  handlers = ocp.handlers.DefaultCheckpointHandlerRegistry()
  state = ocp.PyTreeCheckpointHandler(type_handler_registry=array_handlers())
  checksums = ocp.JsonCheckpointHandler()
  for item, handler, args in (("state", state, (ocp.args.PyTreeSave, ocp.args.PyTreeRestore)),
                              ("checksums", checksums, (ocp.args.JsonSave, ocp.args.JsonRestore))):
    for arg in args:
      handlers.add(item, arg, handler)
  return ocp.CheckpointManager(
      os.path.join(workdir, "checkpoints"), handler_registry=handlers,
      options=ocp.CheckpointManagerOptions(preservation_policy=policy, create=create))


@jax.jit
def _sums(leaves: list) -> list:
  words = []
  for x in leaves:  # each leaf's bits as unsigned words, then sum(word_i x (2i + 1)) mod 2^32
    x = jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    if x.dtype.itemsize in (2, 4):
      x = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    words.append(x.ravel().astype(jnp.uint32))
  return [jnp.sum(w * (2 * jnp.arange(w.size, dtype=jnp.uint32) + 1), dtype=jnp.uint32)
          for w in words]


def checksums(state) -> dict[str, int]:
  """A checksum of each leaf's bits (`leaf_name`: uint32): any one bit changed changes it (the
  word's change, a power of two, times an odd weight, is never 0 mod 2^32). Saved with each
  checkpoint; a restore compares (`changed_leaf`)."""
  named = jax.tree_util.tree_leaves_with_path(state)
  sums = _sums([x for _, x in named])  # (replicated: each process reads its own copy)
  return {leaf_name(path): int(np.asarray(value.addressable_data(0)))
          for (path, _), value in zip(named, sums, strict=True)}


def save(checkpoints, step: int, state) -> None:
  """Saves `state` (in the background) with its `checksums`."""
  checkpoints.save(step, force=True, args=ocp.args.Composite(
      state=ocp.args.PyTreeSave(state), checksums=ocp.args.JsonSave(checksums(state))))


def changed_leaf(checkpoints, step: int, state) -> str | None:
  """The first leaf of `state` (or of a part of it: those leaves alone) that is not what
  checkpoint `step` saved by its checksums, or None (also for a checkpoint saved without them).
  Every process computes the sums together; each reads the saved ones from the file itself."""
  path = epath.Path(checkpoints.directory) / str(step) / "checksums" / "metadata"  # (Orbax's)
  if not path.exists():
    return None
  saved = json.loads(path.read_text())
  return next((name for name, value in checksums(state).items() if saved.get(name) != value),
              None)


class SaveFailed(Exception):
  """A checkpoint could not be written; the message names the directory, the error and the fix."""


@contextlib.contextmanager
def saving(workdir: str):
  """Raises SaveFailed, in one line, for an error of Orbax's saves under way inside (a save, the
  check for an asynchronous save that failed since, the wait for the last one)."""
  try:
    yield
  except Exception as e:  # noqa: BLE001  (whatever the storage raised: said, the run stopped)
    said, where = errors.one_line(e, 300), os.path.join(workdir, "checkpoints")
    if jax.process_count() > 1 and any(mark in said for mark in LOST_PEER):
      raise SaveFailed(f"the job lost a process while saving a checkpoint in {where} ({said}); "
                       "training stopped there. Once every process can run, the same command "
                       "on each resumes from the newest checkpoint saved.") from None
    raise SaveFailed(
        f"a checkpoint could not be written in {where} ({said}); training stopped there. Give "
        "it room or write access, then run the same command: it resumes from the newest "
        "checkpoint saved.") from None


# How the processes' agreement on a save fails when one of them is gone (gloo's collectives on
# the CPU, JAX's distributed service elsewhere): not the storage's fault.
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Barrier timed out",
             "stopped sending heartbeats")


def leaf_name(path) -> str:
  """A state leaf's name as the checkpoint spells it: '0/convs/1/kernel/value' (0: the model)."""
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def stored_shape(x) -> tuple:
  """A leaf's shape as Orbax stores it: a typed PRNG key (a Dropout's stream, `nnx.Rngs`) as its
  raw key data (key<fry>[] is stored as uint32[2]); any other leaf as it is."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return tuple(jax.eval_shape(jax.random.key_data, x).shape)
  return tuple(x.shape)


def shapes(tree) -> dict[str, tuple]:
  """Each leaf's stored shape (`stored_shape`), by name: a checkpoint's metadata or a state."""
  return {leaf_name(path): stored_shape(x)
          for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def check_checkpoint_fits(checkpoints, step: int, abstract_state, workdir: str) -> None:
  """Raises ConfigError if the checkpoint of `step` holds a different model or optimizer; a
  checkpoint without its metadata is damage (FileNotFoundError), not another model."""
  if not (epath.Path(checkpoints.directory) / str(step) / "state" / "_METADATA").exists():
    raise FileNotFoundError("its metadata, state/_METADATA, is missing")  # (Orbax's file)
  saved = shapes(checkpoints.item_metadata(step)["state"])
  wanted = shapes(abstract_state)
  # Named first: a parameter or statistic (a shape, a layer); an RNG stream's key or count only
  # where nothing else differs (a random layer added or removed changes those too).
  differ = sorted((name for name in saved.keys() | wanted.keys()
                   if saved.get(name) != wanted.get(name)),
                  key=lambda name: ("/rngs/" in name, name))
  if differ:
    name, more = differ[0], len(differ) - 1
    raise ConfigError(
        f"workdir {workdir!r} holds a checkpoint (step {step}) of a different model: {name} is "
        f"{saved.get(name, 'absent')} there and {wanted.get(name, 'absent')} in this config and "
        f"model{f' ({more} more leaves differ)' if more else ''}; use a new --workdir, or the "
        f"config and model that wrote it ({MODEL_FILE} in the workdir is a copy of the run's "
        "model).")


def restore_state(checkpoints, step: int, abstract, workdir: str):
  """The state of checkpoint `step`, in the shapes, dtypes and shardings of `abstract`."""
  check_checkpoint_fits(checkpoints, step, abstract, workdir)
  return checkpoints.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
      abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))))["state"]


def write_description(workdir: str, config, info: input_pipeline.DatasetInfo) -> None:
  """config.json, data.json and a copy of the model's source, `MODEL_FILE` (process 0): what
  `trained.Restored` needs besides a checkpoint, whatever model.py comes to hold."""
  if jax.process_index() != 0:
    return
  names = info.class_names or tuple(str(i) for i in range(info.num_classes))
  data = dict(image_shape=list(info.image_shape), num_classes=info.num_classes,
              class_names=list(names), pixel_dtype=info.pixel_dtype,
              model_input=input_pipeline.model_input(info.pixel_dtype),
              crops_on_host=info.crops_on_host)
  (epath.Path(workdir) / CONFIG_FILE).write_text(config.to_json(indent=2))
  (epath.Path(workdir) / DATA_FILE).write_text(json.dumps(data, indent=2))
  module = sys.modules[config.model.get("module", "model")]  # (imported: the model is built)
  source, copy = epath.Path(module.__file__).read_text(), epath.Path(workdir) / MODEL_FILE
  if copy.exists() and copy.read_text() != source:  # a resume, its leaves the same
    logging.warning("%s has changed since this run last started; it goes on with it as it is "
                    "now (its leaves are the same), and %s now holds it", module.__file__, copy)
  copy.write_text(source)


def saved_config(workdir: str) -> dict | None:
  """The resolved config (a dict) of the run that a start in `workdir` resumes: that of its
  config.json when the workdir holds a checkpoint, else None (a new run)."""
  path = epath.Path(workdir)
  if not (path / CONFIG_FILE).exists() or not (path / "checkpoints").exists():
    return None
  with contextlib.closing(checkpoint_manager(workdir, create=False)) as checkpoints:
    if checkpoints.latest_step() is None:
      return None
  return json.loads((path / CONFIG_FILE).read_text())


def absolute(path: str) -> str:
  """A local path made absolute (Orbax reads only those); a bucket's (gs://...) as it is."""
  return path if "://" in path else os.path.abspath(path)


def nonfinite_leaf(state) -> str | None:
  """The name of the first floating leaf of `state` that holds a NaN or an infinity, or None."""
  named = [(leaf_name(path), x) for path, x in jax.tree_util.tree_leaves_with_path(state)
           if jnp.issubdtype(x.dtype, jnp.inexact)]
  if not named:
    return None
  finite = jax.jit(lambda xs: jnp.stack([jnp.isfinite(x).all() for x in xs]))([x for _, x in named])
  bad = np.flatnonzero(~np.asarray(multihost_utils.process_allgather(finite, tiled=True)))
  return named[bad[0]][0] if len(bad) else None


class _UnretrievedReads(std_logging.Filter):
  """Drops asyncio's 'exception was never retrieved' for Orbax's reads of a damaged checkpoint:
  the first failure is the one `damage` names; the others of the same read are reported by
  asyncio whenever their futures are collected, a traceback each."""

  def filter(self, record):
    error = record.exc_info[1] if record.exc_info else None
    return not (error is not None and "never retrieved" in str(record.msg) and any(
        f"{os.sep}orbax{os.sep}" in frame.filename
        for frame in traceback.extract_tb(error.__traceback__)))


std_logging.getLogger("asyncio").addFilter(_UnretrievedReads())


def unreadable(error: Exception) -> str:
  """Why a checkpoint could not be read, in a line: the first line of the innermost error (Orbax
  wraps TensorStore's: 'FAILED_PRECONDITION: Error reading ... ZSTD_decompressStream() ...')."""
  while error.__cause__ or error.__context__:
    error = error.__cause__ or error.__context__
  return f"cannot be read ({type(error).__name__}: {str(error).strip().splitlines()[0][:300]})"


# The barrier that ends Orbax's restore on every process (Checkpointer.restore's, named with the
# AsyncCheckpointer's empty prefix): a process whose read failed has skipped it while the others
# wait there, so it joins them before anything else (pinned by tests/test_multiprocess.py).
ORBAX_RESTORE_BARRIER = "_Checkpointer:restore"


def damage(restore, step: int, changed=None) -> tuple[object, str | None]:
  """`restore(step)`, and what is wrong with checkpoint `step` (None: nothing) on any process: it
  cannot be read, it is not what was saved (`changed(step, state)`: a leaf whose checksum
  differs), or it holds non-finite values. A model that does not fit raises, as before. Every
  process takes the same collectives: first whether each could read its part, then, all having
  read, the checksums and whether a value is non-finite."""
  state, why = None, None
  try:
    state = restore(step)
  except ConfigError:
    raise
  except Exception as e:  # noqa: BLE001  (anything that stops a read: named, then an older one)
    why = unreadable(e)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(ORBAX_RESTORE_BARRIER)
  if state is None:  # the read's other coroutines, abandoned with their errors: ended silently
    hook, sys.unraisablehook = sys.unraisablehook, lambda unraisable: None
    try:
      with warnings.catch_warnings(action="ignore", category=RuntimeWarning):  # never awaited
        gc.collect()
    finally:
      sys.unraisablehook = hook
  if jax.process_count() > 1:  # the same verdict everywhere: damaged if any process found it
    whys = multihost_utils.process_allgather(np.int32(why is not None)).tolist()
    why = why or (f"cannot be read on process {whys.index(1)}" if any(whys) else None)
  if why is None and changed is not None and (leaf := changed(step, state)) is not None:
    why = f"is not what was saved ({leaf.removesuffix('/value')} differs from its checksum)"
  if why is None and (leaf := nonfinite_leaf(state)) is not None:
    why = f"restores to non-finite values ({leaf.removesuffix('/value')})"
  return state, why


def newest_intact(steps, restore, damaged, changed=None) -> tuple[int | None, object]:
  """The first of `steps` (newest first) that `restore(step)` reads back intact (`damage`), and
  its state; `damaged(step, why)` is called for each one before it that is not. (None, None):
  none is."""
  for step in steps:
    state, why = damage(restore, step, changed)
    if why is None:
      return step, state
    damaged(step, why)
  return None, None


DAMAGED = "damaged_checkpoints"  # in the workdir: checkpoints that could not be restored


def put_aside(checkpoints, step: int, workdir: str) -> str:
  """Moves checkpoint `step` out of the checkpoints (a new one of that step will be saved) into
  `workdir`/damaged_checkpoints/, where it is kept. Returns where (process 0 moves it)."""
  aside = epath.Path(workdir) / DAMAGED / str(step)
  for n in itertools.count(2):  # a step put aside before (saved again since, damaged again)
    if not aside.exists():
      break
    aside = aside.with_name(f"{step}.{n}")
  if jax.process_index() == 0:
    aside.parent.mkdir(parents=True, exist_ok=True)
    (epath.Path(checkpoints.directory) / str(step)).rename(aside)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f"put aside checkpoint {step}")
  checkpoints.reload()
  return str(aside)


def restore_or_init(checkpoints, abstract, init, workdir: str):
  """The step and state of the latest intact checkpoint in `workdir` (into `abstract`'s shapes,
  dtypes and shardings), or (0, `init()`). Each newer one that cannot be read, or holds non-finite
  values, is named in a warning and put aside (`put_aside`). Every process must see the same
  checkpoints."""
  step = checkpoints.latest_step()
  if jax.process_count() > 1:
    seen = multihost_utils.process_allgather(np.int32(-1 if step is None else step)).tolist()
    if len(set(seen)) > 1:
      raise ConfigError(
          f"the workdir is not shared by the processes: their latest checkpoints in {workdir!r} "
          f"are {', '.join(f'{s if s >= 0 else None} (process {i})' for i, s in enumerate(seen))}; "
          "give every process the same --workdir, on a file system that they all see (or a "
          "bucket: gs://...).")
  if step is None:
    if (damaged := epath.Path(workdir) / DAMAGED).exists() and any(damaged.iterdir()):
      raise ConfigError(
          f"workdir {workdir!r} holds no checkpoint but those put aside as damaged in {damaged} "
          "(the log of the run that put them aside said why): this run would start over from "
          f"step 0. To start over here, remove or rename {damaged}; or use a new --workdir.")
    return 0, init()
  step, state = newest_intact(
      sorted(checkpoints.all_steps(), reverse=True),
      lambda s: restore_state(checkpoints, s, abstract, workdir),
      lambda s, why: logging.warning("checkpoint %d in %s %s: kept in %s; resuming from an older "
                                     "one", s, workdir, why, put_aside(checkpoints, s, workdir)),
      functools.partial(changed_leaf, checkpoints))
  if step is not None:
    logging.info("Resumed from the checkpoint of step %d in %s", step, workdir)
    return step, state
  raise ConfigError(f"no checkpoint in {workdir!r} can be restored (each is in "
                    f"{os.path.join(workdir, DAMAGED)}, the log says why); start again in a new "
                    "--workdir.")


# Keys that a resumed run may change: how it runs, not what it computes (the rest, what it
# optimises and on what data, is the run's own: `resumed`).
FREE_ON_RESUME = (
    "num_workers", "read_threads", "prefetch_batches", "prefetch_to_device", "grad_accum_steps",
    "steps_per_dispatch", "init_from", "parallelism", "fsdp_devices", "fsdp_min_size",
    "print_shardings", "xla_options", "compilation_cache_dir", "compilation_cache_min_seconds",
    "peak_flops_per_device", "profile_first_step", "profile_num_steps", "wandb_project",
    "log_every_steps", "eval_every_steps", "checkpoint_every_steps", "max_checkpoints_to_keep",
    "skip_nonfinite_steps", "cpu_sync_every_steps", "per_device_batch_size", "resume_may_change",
    "run")  # (what the config comes to on the devices: its global batch is kept above)


def flatten(tree: dict, prefix: str = "") -> dict:
  """Nested dicts as one dict of dotted keys ('model.features')."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def resumed(config: ml_collections.ConfigDict, saved: dict,
            workdir: str) -> tuple[ml_collections.ConfigDict, list[str]]:
  """A resolved `config` (`plan.resolved`) resuming the run whose config.json is `saved`: a
  differing key outside `FREE_ON_RESUME` raises ConfigError unless `config.resume_may_change`
  names it; `per_device_batch_size` on another device count keeps the run's global batch
  (`run.per_device_batch_size` changes). Returns the config and the log lines of what changed."""
  config, lines = config.copy_and_resolve_references(), []
  num_devices, per_device = config.run.num_devices, config.per_device_batch_size
  # (A config.json from before `config.run` held the global batch in batch_size.)
  run_batch = saved.get("run", {}).get("global_batch_size", saved["batch_size"])
  if per_device and config.run.global_batch_size != run_batch:
    if run_batch % num_devices:
      raise ConfigError(
          f"the run in {workdir!r} has a global batch of {run_batch}, which {num_devices} "
          f"devices do not divide (config.per_device_batch_size={config.per_device_batch_size}"
          f"); resume it on a number of devices that divides {run_batch}, or use a new "
          "--workdir.")
    lines.append(f"resumed on {num_devices} devices: per_device_batch_size "
                 f"{config.per_device_batch_size} -> {run_batch // num_devices}, keeping the "
                 f"run's global batch of {run_batch}")
    config.run.per_device_batch_size = run_batch // num_devices
    config.run.global_batch_size = run_batch
  may_change = {key.strip() for key in config.resume_may_change.split(",") if key.strip()}
  given, saved = flatten(json.loads(config.to_json())), flatten(saved)
  for key in sorted(given.keys() & saved.keys()):
    if (given[key] == saved[key] or key.split(".")[0] in FREE_ON_RESUME
        or key == "batch_size" and per_device):  # (then not what the run uses)
      continue
    if key not in may_change:
      raise ConfigError(
          f"config.{key}={given[key]!r} differs from the {saved[key]!r} of the run in "
          f"{workdir!r} that this resumes ({CONFIG_FILE}); a resumed run keeps its config: "
          f"use a new --workdir, or --config.resume_may_change={key} to change it (logged).")
    lines.append(f"resumed with config.{key} changed: {saved[key]!r} -> {given[key]!r}")
  return config, lines
