"""Stopping a run early. On a non-finite step (unless it may be skipped): `check_finite` raises
`NonFiniteLoss`, naming the step and the checkpoint saved before it. On a signal, on every process
after the same step, having saved: SIGTERM (a preemption, a scheduler's notice) and SIGINT
(Ctrl-C) are collected instead of ending the process (`stop_signals`); after each call the loop
asks `stop_now`, saves, and `train_and_evaluate` raises `Stopped`; several processes agree on the
step through a collective, at a step where the loop waits for results anyway. What the loop
cannot reach, the `Watchdog` does: a wait past its bound, a signal during set-up or a compile, a
second signal, each ends the process in one line. Early stopping: `Best`."""

import contextlib
import os
import select
import signal
import sys
import threading
import time

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from ..errors import NonFiniteLoss, Stopped  # noqa: F401 (raised here; Stopped by train.py)
from . import checkpoints

# A run that waited past the watchdog's bound ends with EX_TEMPFAIL (sysexits.h: "try again"):
# clusters/slurm.sbatch requeues it, as it does a run stopped by SIGTERM (143).
HUNG_EXIT = 75
SIGNALS = (signal.SIGTERM, signal.SIGINT)
_watchdog = None  # the process's `Watchdog`, while one runs


class Watchdog:
  """No wait of a run lasts forever, and a stop is honoured in every phase (train.py's `main`:
  from before the job is joined to the end). The main thread names what it waits for (`phase`);
  a thread of this class's, "watchdog" (a daemon: it ends with the process), wakes at that
  phase's deadline and at every SIGTERM or SIGINT (through `signal.set_wakeup_fd`: at once, even
  while the main thread is inside XLA, where Python's handlers cannot run), and ends the process
  (`end`: the workdir's claim released first, `at_exit`) in one line:
  - a phase past its bound: exit 75 (`HUNG_EXIT`). Set-up, compiles and the first call (its
    collectives wait for every process's compile) may take `config.watchdog_compile_s`; a later
    call of the loop, an evaluation or a save `config.watchdog_factor` times the slowest of its
    kind so far, at least `config.watchdog_floor_s` (0: no bound);
  - a signal in set-up or a compile (nothing new to save): at once, exit 128 + the signal;
  - a signal in the loop is the loop's (it stops after the call, having saved), but a call or
    an evaluation then has `GRACE_S` (or 3 times the slowest of its kind) more, at most;
  - a second signal: at once, without saving.

  Args:
    config: the run's config (its `watchdog_*` keys).
  """

  GRACE_S = 30

  def __init__(self, config):
    self.compile_s, self.floor_s = config.watchdog_compile_s, config.watchdog_floor_s
    self.factor = config.watchdog_factor
    self.received, self.seen, self.exits = [], [], []
    self.lock, self.slowest = threading.Lock(), {}
    self.what, self.kind, self.since = None, None, time.monotonic()

  def __enter__(self):
    global _watchdog
    self.read, write = os.pipe()
    os.set_blocking(write, False)
    self.previous = {sig: signal.signal(sig, lambda signum, _: self.received.append(signum))
                     for sig in SIGNALS}
    self.previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    self.write = write
    threading.Thread(target=self.watch, name="watchdog", daemon=True).start()
    _watchdog = self
    return self

  def __exit__(self, *exc):
    global _watchdog
    _watchdog = None
    signal.set_wakeup_fd(self.previous_fd)
    for sig, handler in self.previous.items():
      signal.signal(sig, handler)
    os.close(self.write)  # (the thread sees the pipe's end, and ends)

  def phase(self, what: str | None, kind: str | None = None) -> None:
    """The main thread now waits for `what` (None: for nothing that may hang); `kind`: 'call',
    'evaluation' or 'save' (bounded by the slowest of its kind so far), or None (set-up, a compile:
    `watchdog_compile_s`; a signal ends it at once)."""
    with self.lock:
      now = time.monotonic()
      if self.kind and self.what:
        self.slowest[self.kind] = max(self.slowest.get(self.kind, 0.0), now - self.since)
      self.what, self.kind, self.since = what, kind, now

  def bound(self, kind: str | None) -> float:
    """The seconds a phase of `kind` may take (0: no bound)."""
    if kind is None:
      return self.compile_s
    return self.floor_s and max(self.floor_s, self.factor * self.slowest.get(kind, 0.0))

  def deadline(self) -> float | None:
    """When the phase under way ends the run (None: never)."""
    bound = self.bound(self.kind)
    deadline = self.since + bound if self.what and bound else None
    if self.what and self.seen and self.kind in ("call", "evaluation"):  # a stop waits for it
      grace = max(self.GRACE_S, 3 * self.slowest.get(self.kind, 0.0))
      cut = max(self.since, self.seen[0][1]) + grace
      deadline = cut if deadline is None else min(deadline, cut)
    return deadline

  def watch(self) -> None:
    """The thread: ends the process when the phase under way passes its deadline, or a signal
    cannot wait for the loop."""
    while True:
      with self.lock:
        deadline = self.deadline()
      # (once a second at least: the phase may have changed since)
      timeout = min(1.0 if deadline is None else max(deadline - time.monotonic(), 0) + 0.01, 1.0)
      if select.select([self.read], [], [], timeout)[0]:
        signums = os.read(self.read, 64)
        if not signums:  # (`__exit__`)
          os.close(self.read)
          return
        with self.lock:
          self.seen += [(signal.Signals(n), time.monotonic()) for n in signums if n in SIGNALS]
          self.on_signal()
        continue
      with self.lock:
        if (deadline := self.deadline()) is not None and time.monotonic() >= deadline:
          self.expired()

  def on_signal(self) -> None:
    if not self.seen:
      return
    name = self.seen[-1][0].name
    where = f"while {self.what}" if self.what else "at once"
    if len(self.seen) > 1:
      end(f"error: a second {name}: ended {where}, without saving; the same command resumes "
          "from the latest checkpoint.", 128 + self.seen[-1][0])
    if self.what and self.kind is None:
      end(f"Stopped by {name} {where}: nothing new to save; the same command resumes from the "
          "latest checkpoint.", 128 + self.seen[-1][0])

  def expired(self) -> None:
    waited, who = time.monotonic() - self.since, _process()
    if self.seen and self.kind in ("call", "evaluation"):
      end(f"Stopped by {self.seen[0][0].name}: {who}{self.what} had not finished "
          f"{time.monotonic() - self.seen[0][1]:.0f} s after it; ended without saving: the same "
          "command resumes from the latest checkpoint.", 128 + self.seen[0][0])
    how = (f"--config.watchdog_compile_s={self.compile_s:g}" if self.kind is None else
           f"the larger of --config.watchdog_floor_s={self.floor_s:g} and "
           f"--config.watchdog_factor={self.factor:g} times the slowest {self.kind} so far, "
           f"{self.slowest.get(self.kind, 0.0):.1f} s")
    several = (", or a process of the job stopped, lost or waiting elsewhere holds up its "
               "collective" if who else "")
    end(f"error: {who}{self.what} has not finished after {waited:.0f} s (its bound: {how}): "
        f"ended, exit {HUNG_EXIT}, for the same command to resume from the latest checkpoint. "
        f"A hang{several}: README, Never stuck.", HUNG_EXIT)


def _process() -> str:
  """'process I of N: ' in a job of several (joined), else ''."""
  if not jax.distributed.is_initialized():
    return ""
  return f"process {jax.process_index()} of {jax.process_count()}: "


def phase(what: str | None, kind: str | None = None) -> None:
  """`Watchdog.phase` of the process's watchdog; nothing without one (a run called in place)."""
  if _watchdog is not None:
    _watchdog.phase(what, kind)


def at_exit(release) -> None:
  """`release()` before the watchdog ends the process (a claim on the workdir)."""
  if _watchdog is not None:
    _watchdog.exits.append(release)


def end(line: str, status: int) -> None:
  """Ends the process at once, from any thread, with `line`: what `at_exit` named released first
  (the input's workers end with it, shm.py)."""
  print(line, file=sys.stderr, flush=True)
  for release in _watchdog.exits if _watchdog is not None else ():
    with contextlib.suppress(Exception):
      release()
  logging.flush()
  os._exit(status)


@contextlib.contextmanager
def stop_signals():
  """Collects SIGTERM and SIGINT instead of dying, so the loop can stop after a step and save:
  the watchdog's (`Watchdog.received`), else handlers of its own while it runs."""
  if _watchdog is not None:
    yield _watchdog.received
    return
  received = []
  mine = threading.current_thread() is threading.main_thread()
  previous = {sig: signal.signal(sig, lambda signum, _: received.append(signum))
              for sig in SIGNALS} if mine else {}
  try:
    yield received
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def stop_now(received: list, can_agree: bool):
  """What stops the loop after this call (a signal number), or None. With several processes
  they stop together, at a step where they can agree (through a collective); JAX's preemption
  service, which would take SIGTERM from the watchdog, is off (process.start).

  Args:
    received: the signals received so far.
    can_agree: whether the processes can agree now (the loop waits for results anyway).
  """
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
    saved = (f"the latest checkpoint, step {latest} in {directory}, was saved before it" if
             latest is not None else f"no checkpoint was saved before it (in {directory})")
    raise NonFiniteLoss(
        f"non-finite loss or gradient at step {since + int(nonfinite.first)}; its update was "
        f"not applied, and {saved}. Lower the learning rate, check the data, "
        "or set --config.skip_nonfinite_steps=True.")


class Best:
  """The run's best evaluation by `config.best_metric` (its `best_mode`), read from its
  checkpoints as it starts, then followed (`improves`); `config.early_stopping_evals` says when
  the run ends (`stops`), the same on a resume."""

  def __init__(self, config, saved):
    self.config, self.step, self.value = config, None, None
    if config.best_metric:
      self.step, self.value = checkpoints.best(saved.manager, config)

  def improves(self, step: int, metrics: dict[str, float]) -> bool:
    """Whether an evaluation's `metrics` are the best so far (strictly), taking them if so."""
    if not self.config.best_metric:
      return False
    value = metrics[self.config.best_metric.removeprefix("eval_")]
    sign = 1 if self.config.best_mode == "max" else -1
    if self.step is None or sign * value > sign * self.value:
      self.step, self.value = step, value
      return True
    return False

  def stops(self, step: int) -> str | None:
    """Why the run ends at `step`: `early_stopping_evals` evaluations without improvement (the
    evaluations every `eval_every_steps`); None while it goes on."""
    config, evals = self.config, self.config.early_stopping_evals
    if evals and self.step is not None and (
        step // config.eval_every_steps - self.step // config.eval_every_steps >= evals):
      return (f"Early stopping at step {step}: {config.best_metric} has not improved for "
              f"{evals} evaluations (config.early_stopping_evals); its best, {self.value:.4f} at "
              f"step {self.step}, is checkpoint {self.step} (evaluate.py --step=best)")
    return None
