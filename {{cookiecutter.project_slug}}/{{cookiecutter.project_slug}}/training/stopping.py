"""Stopping a run early. On a non-finite step (unless it may be skipped): `check_finite` raises
`NonFiniteLoss`, naming the step and the checkpoint saved before it. On a signal, on every process
after the same step, having saved: SIGTERM (a preemption, a scheduler's notice) and SIGINT
(Ctrl-C) are collected instead of ending the process (`stop_signals`); after each call the loop
asks `stop_now`, saves, and `train_and_evaluate` raises `Stopped`. JAX's preemption service,
where it runs, names the step for every process; else the processes agree through a collective,
at a step where the loop waits for results anyway."""

import contextlib
import os
import signal
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

from ..errors import NonFiniteLoss, Stopped  # noqa: F401 (raised here; Stopped by train.py)


def preemption_service() -> bool:
  """Whether JAX's preemption service takes SIGTERM: on JAX's distributed runtime, it tells every
  process, and Orbax's `reached_preemption` names the step at which all of them stop."""
  return jax.distributed.is_initialized() and jax.config.jax_enable_preemption_service


@contextlib.contextmanager
def stop_signals():
  """Collects SIGTERM and SIGINT instead of dying, so the loop can stop after a step and save.
  When JAX's preemption service takes SIGTERM (`preemption_service()`), SIGINT (Ctrl-C) is
  passed on to it as SIGTERM: every process then stops at the step it names, and saves."""
  received, service = [], preemption_service()

  def collect(signum, frame):
    received.append(signum)
    if service:
      os.kill(os.getpid(), signal.SIGTERM)

  mine = threading.current_thread() is threading.main_thread()
  previous = {sig: signal.signal(sig, collect) for sig in (
      (signal.SIGINT,) if service else (signal.SIGTERM, signal.SIGINT))} if mine else {}
  try:
    yield received
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def stop_now(received: list, checkpoints, dispatch: int, can_agree: bool):
  """What stops the loop after this call (a signal number or a name), or None. Processes stop
  together: on JAX's preemption service at the step that it names; else, with several
  processes (which the platform connects without that service), at a step where they can agree,
  through a collective.

  Args:
    received: the signals received so far.
    checkpoints: the run's checkpoints.Checkpoints (which asks the preemption service).
    dispatch: the call's number.
    can_agree: whether the processes can agree now (the loop waits for results anyway).
  """
  if preemption_service():
    if not checkpoints.reached_preemption(dispatch):
      return None
    return received[0] if received else "a preemption notice"
  if jax.process_count() == 1:
    return received[0] if received else None
  if not can_agree:
    return None
  signals = multihost_utils.process_allgather(np.int32(received[0] if received else 0))
  return int(np.max(signals)) or None


def check_finite(nonfinite, since: int, config, checkpoints) -> None:
  """Raises NonFiniteLoss if a step of the interval was not finite, unless
  `config.skip_nonfinite_steps`.

  Args:
    nonfinite: the interval's `metrics.NonFinite`.
    since: the interval's first step.
    config: the run's config.
    checkpoints: the run's checkpoints.Checkpoints, whose save in the background ends first.
  """
  if nonfinite.count and not config.skip_nonfinite_steps:
    latest, directory = checkpoints.wait()
    raise NonFiniteLoss(
        f"non-finite loss or gradient at step {since + int(nonfinite.first)}; its update was "
        f"not applied, and the latest checkpoint, step {latest} in {directory}, was saved "
        "before it. Lower the learning rate, check the data, "
        "or set --config.skip_nonfinite_steps=True.")
