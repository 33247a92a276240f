"""A run's Orbax checkpoints, behind one small interface (`Checkpoints`: restore or init, save,
close): each checkpoint holds the training state and a checksum of each leaf; a restore takes the
newest intact one (damaged.py puts aside those that are not)."""

import contextlib
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from .. import errors
from ..errors import ConfigError, SaveFailed
from .damaged import DAMAGED, leaf_name, newest_intact, put_aside


class Checkpoints:
  """A run's checkpoints in `workdir`, as its `config` says (`checkpoint_manager`); any error of
  a save, whenever Orbax reports it, raised as SaveFailed. `claim`: the run's hold on the
  workdir (runs.Claim, renewed as saves are checked), or None."""

  def __init__(self, workdir: str, config, claim=None):
    self.workdir, self.claim = workdir, claim
    self.manager = checkpoint_manager(workdir, config)
    self.every = config.checkpoint_every_steps

  def restore_or_init(self, abstract, init):
    """The step and state of the latest intact checkpoint in the workdir (into `abstract`'s
    shapes, dtypes and shardings), or (0, `init()`). Each newer one that cannot be read, or holds
    non-finite values, is named in a warning and put aside (`put_aside`). Every process must see
    the same checkpoints."""
    workdir, step = self.workdir, self.manager.latest_step()
    if jax.process_count() > 1:
      seen = multihost_utils.process_allgather(np.int32(-1 if step is None else step)).tolist()
      if len(set(seen)) > 1:
        latest = ", ".join(f"{s if s >= 0 else None} (process {i})" for i, s in enumerate(seen))
        raise ConfigError(
            f"the workdir is not shared by the processes: their latest checkpoints in {workdir!r} "
            f"are {latest}; give every process the same --workdir, on a file system that they "
            "all see (or a bucket: gs://...).")
    if step is None:
      if (damaged := epath.Path(workdir) / DAMAGED).exists() and any(damaged.iterdir()):
        raise ConfigError(
            f"workdir {workdir!r} holds no checkpoint but those put aside as damaged in {damaged} "
            "(the log of the run that put them aside said why): this run would start over from "
            f"step 0. To start over here, remove or rename {damaged}; or use a new --workdir.")
      return 0, init()

    def restore(step):  # in `abstract`'s shapes, dtypes and shardings, once it fits
      check_checkpoint_fits(self.manager, step, abstract, workdir)
      return typed_keys(abstract, self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(abstract, restore_args=ocp.checkpoint_utils
                                       .construct_restore_args(abstract))))["state"])

    step, state = newest_intact(
        sorted(self.manager.all_steps(), reverse=True), restore,
        lambda s, why: logging.warning("checkpoint %d in %s %s: kept in %s; resuming from an "
                                       "older one", s, workdir, why, self.put_aside(s, why)),
        functools.partial(changed_leaf, self.manager))
    if step is not None:
      if not checksums_file(self.manager, step).exists():
        logging.warning("checkpoint %d in %s holds no checksums (an older version saved it): "
                        "restored unchecked", step, self.manager.directory)
      logging.info("Resumed from the checkpoint of step %d in %s", step, workdir)
      return step, state
    raise ConfigError(f"no checkpoint in {workdir!r} can be restored (each is in "
                      f"{os.path.join(workdir, DAMAGED)}, the log says why); start again in a new "
                      "--workdir.")

  def put_aside(self, step: int, why: str) -> str:
    """`damaged.put_aside`; where it cannot be (a read-only folder), a ConfigError naming both."""
    try:
      return put_aside(self.manager, step, self.workdir)
    except OSError as e:
      where = os.path.join(self.manager.directory, str(step))
      raise ConfigError(
          f"checkpoint {step} in {self.workdir} {why}, and it cannot be put aside "
          f"({errors.one_line(e, 200)}): move {where} out of the checkpoints (or give write "
          "access), then run the same command.") from None

  def save(self, step: int, state, metrics: dict | None = None) -> None:
    """Starts saving `state` and its `checksums` as checkpoint `step`, in the background, with a
    new best evaluation's `metrics` where the run keeps its best (`best`). A save off the interval
    (the last step's, a stop's, a best's) may wait for the one before it without Orbax's advice
    to checkpoint less often: no interval would avoid that wait."""
    off_interval = step % self.every != 0
    with (saving(self.workdir),
          _without(ORBAX_WAIT_ADVICE) if off_interval else contextlib.nullcontext()):
      self.manager.save(step, force=True, metrics=dict(metrics or {}), args=ocp.args.Composite(
          state=ocp.args.PyTreeSave(state), checksums=ocp.args.JsonSave(checksums(state))))

  def check(self) -> None:
    """Raises SaveFailed if a save in the background has failed since the last call."""
    with saving(self.workdir):
      self.manager.check_for_errors()
    if self.claim:
      self.claim.renew()

  def close(self) -> None:  # (the last save waited for)
    with saving(self.workdir):
      self.manager.close()

  def wait(self) -> tuple[int | None, str]:
    """Waits for the save in the background; returns the latest checkpoint's step, and where."""
    with saving(self.workdir):
      self.manager.wait_until_finished()
    return self.manager.latest_step(), str(self.manager.directory)


def typed_keys(abstract, state):
  """`state` with each leaf that `abstract` holds as a typed PRNG key (a Dropout's stream) one
  again: Orbax restores its raw data (uint32[..., 2]), which pmap's keys cannot take."""
  is_key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)  # noqa: E731
  return jax.tree.map(lambda a, x: jax.random.wrap_key_data(x) if is_key(a) and not is_key(x)
                      else x, abstract, state)


def best(manager, config) -> tuple[int | None, float | None]:
  """The step and value of the best evaluation saved by `config.best_metric` (`Checkpoints.save`'s
  metrics; the earliest of equals) among Orbax's `manager`'s; (None, None) before one."""
  metric, sign = config.best_metric.removeprefix("eval_"), 1 if config.best_mode == "max" else -1
  scored = [(sign * metrics[metric], -step) for step in manager.all_steps()
            if metric in (metrics := manager.metrics(step) or {})]
  value, step = max(scored, default=(None, None))
  return (None, None) if step is None else (-step, sign * value)


def absolute(path: str) -> str:
  """A local path made absolute (Orbax reads only those); a bucket's (gs://...) as it is."""
  return path if "://" in path else os.path.abspath(path)


def array_handlers():
  """Orbax's writers of jax.Array leaves: a replicated array written by its replicas together on
  TPU (Orbax's default), by one replica elsewhere (on the CPU splitting it compiles slicing
  programs at the first save; on GPUs Orbax's own choice, detected only from JAX_PLATFORMS)."""
  split = None if jax.default_backend() == "tpu" else False
  return ocp.type_handlers.create_type_handler_registry(
      (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=split)))


def checkpoint_manager(workdir: str, config=None, create: bool = True):
  """Orbax's manager of a workdir's checkpoints, each the state and its `checksums`, written to a
  temporary directory and renamed when complete: one cut short by a kill is never restored. With
  the run's `config`, written as it says (kept: the newest `max_checkpoints_to_keep`, each of a
  step that `keep_checkpoint_every_steps` divides, the `best`); without, read, all kept; the
  directory made where `create` (a reader's: never)."""
  policy, best = None, {}  # (read: every one kept)
  if config and (metric := config.get("best_metric", "").removeprefix("eval_")):  # (Orbax then
    worst = -math.inf if config.best_mode == "max" else math.inf  # writes each save's metrics)
    best = dict(best_fn=lambda metrics: metrics.get(metric, worst), best_mode=config.best_mode)
  if config:
    every = config.get("keep_checkpoint_every_steps", 0)
    policy = ocp.checkpoint_managers.AnyPreservationPolicy([
        ocp.checkpoint_managers.LatestN(n=config.max_checkpoints_to_keep),
        *[ocp.checkpoint_managers.EveryNSteps(interval_steps=every)] * bool(every),
        *[ocp.checkpoint_managers.BestN(
            get_metric_fn=best["best_fn"], n=1, reverse=config.best_mode == "min",
            keep_checkpoints_without_metrics=False) for _ in [best] if best]])
  handlers = ocp.handlers.DefaultCheckpointHandlerRegistry()
  state = ocp.PyTreeCheckpointHandler(type_handler_registry=array_handlers())
  checksums = ocp.JsonCheckpointHandler()
  for item, handler, args in (("state", state, (ocp.args.PyTreeSave, ocp.args.PyTreeRestore)),
                              ("checksums", checksums, (ocp.args.JsonSave, ocp.args.JsonRestore))):
    for arg in args:
      handlers.add(item, arg, handler)
  return ocp.CheckpointManager(
      os.path.join(workdir, "checkpoints"), handler_registry=handlers,
      options=ocp.CheckpointManagerOptions(preservation_policy=policy, create=create, **best))


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


# Orbax's warning when a save first waited over a second for the one before it.
ORBAX_WAIT_ADVICE = "consider checkpointing less frequently"


@contextlib.contextmanager
def _without(message: str):
  """absl's log records that contain `message` are dropped inside."""
  keep = lambda record: message not in record.getMessage()  # noqa: E731
  logger = logging.get_absl_logger()
  logger.addFilter(keep)
  try:
    yield
  finally:
    logger.removeFilter(keep)


def checksums_file(checkpoints, step: int) -> epath.Path:
  return epath.Path(checkpoints.directory) / str(step) / "checksums" / "metadata"  # (Orbax's)


def changed_leaf(checkpoints, step: int, state) -> str | None:
  """Why a checkpoint is not what it saved, by its checksums: a leaf that differs, or its
  checksum file damaged; else None (also for one saved without checksums, by an older version:
  said, restored unchecked), of checkpoint `step` of Orbax's manager `checkpoints` restored as
  `state` (or a part of it: those leaves alone). The processes sum together; each reads the
  saved sums itself."""
  path = checksums_file(checkpoints, step)
  if not path.exists():
    return None
  try:
    saved = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    saved = errors.one_line(e, 120)
  if not isinstance(saved, dict):
    return (f"has a damaged checksum file (checksums/metadata: "
            f"{saved if isinstance(saved, str) else 'a ' + type(saved).__name__})")
  leaf = next((name for name, value in checksums(state).items() if saved.get(name) != value),
              None)
  return leaf and f"is not what was saved ({leaf.removesuffix('/value')} differs from its checksum)"


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


def shapes(tree) -> dict[str, tuple]:
  """Each leaf's shape as Orbax stores it, by name (of a checkpoint's metadata or a state): a
  typed PRNG key (a Dropout's stream, `nnx.Rngs`) as its raw key data (key<fry>[] is stored as
  uint32[2]); any other leaf as it is."""
  key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)  # noqa: E731
  return {leaf_name(path): tuple(jax.eval_shape(jax.random.key_data, x).shape if key(x)
                                 else x.shape)
          for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def check_checkpoint_fits(checkpoints, step: int, abstract_state, workdir: str) -> None:
  """Raises ConfigError (naming `workdir`) if checkpoint `step` of Orbax's manager `checkpoints`
  holds another model or optimizer than `abstract_state` (this config's and model's); without
  its metadata, FileNotFoundError (damage)."""
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
        f"config and model that wrote it (model.py in the workdir is a copy of the run's "
        "model).")
