"""Damaged checkpoints: one that cannot be read, is not what was saved (its checksums), or holds
non-finite values is named in a warning and moved to the workdir's damaged_checkpoints/, and the
run resumes from an older one (`newest_intact`)."""

import gc
import itertools
import logging as std_logging
import os
import sys
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from ..errors import ConfigError


def leaf_name(path) -> str:
  """A state leaf's name as the checkpoint spells it: '0/convs/1/kernel/value' (0: the model)."""
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


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
  """A checkpoint's state, and what is wrong with it on any process (None: nothing): it cannot be
  read, it is not what was saved, or it holds non-finite values. A model that does not fit
  raises, as before. Every process takes the same collectives: first whether each could read
  its part, then, all having read, the checksums and whether a value is non-finite.

  Args:
    restore: step -> its state.
    step: the checkpoint's step.
    changed: (step, state) -> why it is not what was saved, or None; None: not checked.
  """
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
  if why is None and changed is not None:
    why = changed(step, state)
  if why is None and (leaf := nonfinite_leaf(state)) is not None:
    why = f"restores to non-finite values ({leaf.removesuffix('/value')})"
  return state, why


def newest_intact(steps, restore, damaged, changed=None) -> tuple[int | None, object]:
  """The first checkpoint read back intact (`damage`), and its state; (None, None): none is.

  Args:
    steps: the checkpoints' steps, newest first.
    restore: step -> its state.
    damaged: (step, why), called for each one before it that is not intact.
    changed: as `damage`'s.
  """
  for step in steps:
    state, why = damage(restore, step, changed)
    if why is None:
      return step, state
    damaged(step, why)
  return None, None


DAMAGED = "damaged_checkpoints"  # in the workdir: checkpoints that could not be restored


def put_aside(checkpoints, step: int, workdir: str) -> str:
  """Moves a checkpoint out of the checkpoints (a new one of that step will be saved) into
  the workdir's damaged_checkpoints/, where it is kept (process 0 moves it).

  Args:
    checkpoints: Orbax's manager.
    step: the checkpoint's step.
    workdir: the run's workdir.
  Returns:
    Where it is kept.
  """
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
