"""What an entry point (train.py, evaluate.py, predict.py, export.py) does as a process, around its
work: the flags of a job of several processes and joining it (`initialize`); for a run, its log,
its compilation cache (`start`) and how its errors end the process (`exits`).

  python launch.py --num_processes=2 --devices_per_process=4 --script=evaluate.py -- \
      --workdir=/tmp/run   # this machine; adds the three flags below to each process

Under SLURM, Open MPI 4 and on Cloud TPU pods (GKE's too) JAX finds the job by itself (see
distributed.py, loaded only here); elsewhere give each process --coordinator_address (or
JAX_COORDINATOR_ADDRESS), --num_processes and --process_id. Whatever prints or writes a file
does it on process 0 alone (`is_first`).
"""

import contextlib
import functools
import glob
import os
import sys
import threading
import time
import traceback

import jax
from absl import app, flags, logging

from . import errors

_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0, to run several processes without a "
    "cluster that JAX detects by itself (SLURM, Open MPI, Cloud TPU pods).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "With --coordinator_address, or "
                                      "JAX_COORDINATOR_ADDRESS (a Kubernetes job).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "With --coordinator_address, or "
                                   "JAX_COORDINATOR_ADDRESS.")
_JOIN_TIMEOUT = flags.DEFINE_integer(
    "join_timeout_seconds", 300, "How long a process waits for the job's coordinator (process "
    "0) and the other processes to join, then stops with one line naming the address.")
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout_seconds", 100, "After this long without news of a process, the others "
    "stop with an error instead of waiting for it.")


def run(main) -> None:
  """absl's `app.run(main)`, a missing config file or --config.KEY said in one line."""
  app.run(main, flags_parser=errors.parse_flags)


# The jaxlib releases on which a process of several hangs at the first program with a collective
# that it loads from the persistent compilation cache (measured on the CPU: BENCHMARKS.md, "Known
# problems"); there such a run compiles every program instead.
CACHE_HANGS_WITH_SEVERAL_PROCESSES = ("0.12.1",)


def start(config) -> None:
  """A run's process, before anything is compiled: its log kept to progress and metrics; JAX's
  compilation cache in `config.compilation_cache_dir`; the job joined (one of several)."""
  logging.get_absl_handler().addFilter(_QuietLibraries())
  sys.unraisablehook = functools.partial(_quiet_unraisable, sys.unraisablehook)
  threading.excepthook = functools.partial(_quiet_thread, threading.excepthook)
  if config.compilation_cache_dir and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    jax.config.update("jax_compilation_cache_dir",
                      os.path.expanduser(config.compilation_cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      config.compilation_cache_min_seconds)
  initialize()


def no_cache_where_it_hangs() -> None:
  """For a process of several on a jaxlib that hangs loading programs from the compilation cache
  (`CACHE_HANGS_WITH_SEVERAL_PROCESSES`): the cache off (any entry point's, and
  JAX_COMPILATION_CACHE_DIR's), said in one line."""
  if jax.config.jax_compilation_cache_dir and (
      jaxlib_version() in CACHE_HANGS_WITH_SEVERAL_PROCESSES):
    jax.config.update("jax_enable_compilation_cache", False)
    if _PROCESS_ID.value in (None, 0):  # (once: process 0 logs)
      logging.warning("The compilation cache is off for this run: on jaxlib %s a process of "
                      "several hangs at the first program it loads from it (BENCHMARKS.md: "
                      "Known problems). Every program compiles anew.", jaxlib_version())


def jaxlib_version() -> str:
  from jaxlib import version

  return version.__version__


# Where a GPU's or TPU's device files are (NVIDIA; WSL's; AMD's; Cloud TPU's).
ACCELERATOR_FILES = ("/dev/nvidia[0-9]*", "/dev/dxg", "/dev/kfd", "/dev/accel[0-9]*",
                     "/dev/vfio/[0-9]*")


def cpu_where_no_accelerator() -> None:
  """JAX's CPU backend alone on a Linux machine without a GPU's or TPU's device file, unless
  JAX_PLATFORMS says otherwise: there the GPU and TPU plugins (the cuda12 and tpu extras: aot.py's
  compilers) would each print a traceback at every start before JAX fell back to the CPU."""
  if sys.platform.startswith("linux") and not os.environ.get("JAX_PLATFORMS") and not any(
      glob.glob(pattern) for pattern in ACCELERATOR_FILES):
    jax.config.update("jax_platforms", "cpu")


def initialize() -> None:
  """Joins JAX's distributed runtime when this is one of several processes (joined.py); else does
  nothing. A launcher that JAX does not find ends the process in one line naming the fix. First,
  the CPU alone where there is no accelerator (`cpu_where_no_accelerator`); before it joins, the
  compilation cache made safe for a job (`no_cache_where_it_hangs`)."""
  cpu_where_no_accelerator()
  if address := _COORDINATOR.value:
    host = address.rsplit(":", 1)[0]
    bind = address if host in ("127.0.0.1", "localhost") else None  # loopback only
    joining = dict(coordinator_address=address, coordinator_bind_address=bind)
  else:
    from .parallel import distributed

    try:
      joining = distributed.cluster()
    except ValueError as e:
      raise SystemExit(f"error: {e}") from None
    if joining is None:
      return
    address = distributed.coordinator()
  no_cache_where_it_hangs()
  from .parallel import joined

  joined.join(address, joining, _PROCESS_ID.value, _NUM_PROCESSES.value, _JOIN_TIMEOUT.value,
              _HEARTBEAT.value)


def is_first() -> bool:
  """Whether this is process 0: the one that prints, logs and writes files."""
  return jax.process_index() == 0


@contextlib.contextmanager
def exits():
  """A run's end by an error, as the process's: a config, data or loss that cannot work in one
  `error:` line; a failed save too, Orbax's threads left behind (`exit_leaving_threads`); a
  stopped run (saved, and said) with its own status."""
  try:
    yield
  except (errors.BadData, errors.ConfigError, errors.NonFiniteLoss) as e:
    raise SystemExit(f"error: {e}") from None
  except errors.SaveFailed as e:
    exit_leaving_threads(f"error: {e}")
  except errors.Stopped as e:
    raise SystemExit(e.exit_code) from None


def exit_leaving_threads(message: str, wait_s: float = 10.0):
  """Ends the process with `message` on stderr once the libraries' threads have ended, or after
  `wait_s` at once (os._exit), abandoning them: a save that failed leaves Orbax's (and the event
  writer's) behind, which the interpreter would wait for forever."""
  deadline = time.monotonic() + wait_s
  for thread in threading.enumerate():
    if thread is not threading.current_thread() and not thread.daemon:  # (Thread's own join:
      threading.Thread.join(thread, max(deadline - time.monotonic(), 0))  # Orbax's raises)
  if any(t.is_alive() and not t.daemon for t in threading.enumerate()
         if t is not threading.current_thread()):
    print(message, file=sys.stderr, flush=True)
    logging.flush()
    os._exit(1)
  raise SystemExit(message)


class _QuietLibraries(logging.logging.Filter):
  """Keeps the log to progress and metrics: drops INFO lines from inside the libraries, and
  Orbax's errors with their tracebacks (each reaches the run as an exception: a failed save is
  said in one line, training/checkpoints.py's `saving`)."""

  def filter(self, record):
    if f"{os.sep}orbax{os.sep}" in record.pathname and record.levelno >= logging.logging.ERROR:
      return False
    return record.levelno >= logging.logging.WARNING or not any(
        f"{os.sep}{lib}{os.sep}" in record.pathname
        for lib in ("jax", "orbax", "gcsfs", "datasets"))


def _quiet_unraisable(previous, unraisable) -> None:
  """sys.unraisablehook, less TensorStore's callbacks into the asyncio loop of an Orbax save that
  failed and closed it (`RuntimeError: Event loop is closed`, a traceback each, all within
  asyncio): the failure is said in one line (checkpoints.saving)."""
  frames = traceback.extract_tb(unraisable.exc_traceback)
  if not (unraisable.exc_type is RuntimeError and frames and f"{os.sep}asyncio{os.sep}" in
          frames[0].filename and str(unraisable.exc_value) == "Event loop is closed"):
    previous(unraisable)


def _quiet_thread(previous, args) -> None:
  """threading.excepthook, a TensorBoard event writer's OSError (a full disk) said in one warning
  line, not a traceback: its curves end there; the run's saves say the rest."""
  frames = traceback.extract_tb(args.exc_traceback)
  if issubclass(args.exc_type, OSError) and any(
      f"{os.sep}tensorboardX{os.sep}" in frame.filename for frame in frames):
    logging.warning("TensorBoard's event file could not be written (%s): the curves end here",
                    errors.one_line(args.exc_value, 200))
  else:
    previous(args)
