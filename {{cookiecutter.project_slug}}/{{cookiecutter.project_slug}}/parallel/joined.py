"""A process joining a job of several (process.initialize decides that it is one): JAX's
distributed runtime joined within --join_timeout_seconds or one line naming the address, the
CPU's collectives connected while the processes are in step, the gloo chatter kept out of
stdout, and the log left to process 0."""

import atexit
import contextlib
import os
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import sharding


def join(address: str, joining: dict, process_id: int | None, num_processes: int | None,
         join_timeout: int, heartbeat: int) -> None:
  """Joins the job (jax.distributed.initialize).

  Args:
    address: the coordinator's.
    joining: jax.distributed.initialize's arguments beyond the process id and count.
    process_id: this process's; None: the cluster's.
    num_processes: the job's; None: the cluster's.
    join_timeout: the seconds it waits for the others.
    heartbeat: the seconds after which a silent process is lost.
  """
  # (JAX's own timeout a little later than ours: at its own it aborts, with a C++ stack dump.)
  # SIGTERM stays the run's (stopping.Watchdog: honoured in every phase, a hung one too), not
  # JAX's preemption service's, which would take it from Python and act only between steps.
  jax.config.update("jax_enable_preemption_service", False)
  with joining_said(address, process_id, num_processes, join_timeout):
    jax.distributed.initialize(num_processes=num_processes, process_id=process_id, **joining,
                               heartbeat_timeout_seconds=heartbeat,
                               initialization_timeout=join_timeout + 30)
  logging.info("Process %d of %d drives %s (%d devices in all)", jax.process_index(),
               jax.process_count(), ", ".join(map(str, jax.local_devices())), jax.device_count())
  if jax.default_backend() == "cpu":
    if logging.get_verbosity() < logging.DEBUG:  # (--verbosity=1 keeps them)
      # Gloo's 'Rank 1 is connected to 1 peer ranks. Expected ...': a line a device and group,
      # from as many threads at once, their pieces mixed.
      drop_from_stdout((b"[Gloo]", b"peer ranks", b" is connected to "))
    connect_cpu_collectives()
  if jax.process_index() > 0:
    logging.set_verbosity(logging.WARNING)  # process 0 logs progress and metrics


@contextlib.contextmanager
def joining_said(address: str, process_id: int | None, num_processes: int | None, seconds: int):
  """Says at once that this process waits for the job's coordinator; if the job has not formed
  in time, ends the process with one line naming the address.

  Args:
    address: the coordinator's.
    process_id: this process's; None: the cluster's.
    num_processes: the job's; None: the cluster's.
    seconds: the time it waits (--join_timeout_seconds).
  """
  who = ("a process" if process_id is None else f"process {process_id}") + (
      "" if num_processes is None else f" of {num_processes}")
  logging.info("Joining the job at %s as %s; waiting up to %d s for the others "
               "(--join_timeout_seconds)", address, who, seconds)

  def give_up():
    print(f"error: the job at {address} did not form within {seconds} s ({who} waited): start "
          f"every process, process 0 (which hosts the coordinator) among them, and check that "
          f"this host reaches that address and port.", file=sys.stderr, flush=True)
    os._exit(1)

  timer = threading.Timer(seconds, give_up)
  timer.daemon = True
  timer.start()
  try:
    yield
  finally:
    timer.cancel()


def drop_from_stdout(marks: tuple[bytes, ...]) -> None:
  """Leaves out of this process's standard output the lines that hold one of `marks`, or a bare
  number (a piece of one of them; written there by C++ libraries too, so filtered at the file
  descriptor, by a thread, until exit)."""
  original, (read, write) = os.dup(1), os.pipe()
  sys.stdout.flush()
  os.dup2(write, 1)
  os.close(write)

  def forward():
    with os.fdopen(read, "rb") as lines, os.fdopen(os.dup(original), "wb", buffering=0) as out:
      for line in lines:
        if not (any(mark in line for mark in marks) or line.strip().isdigit()):
          out.write(line)

  thread = threading.Thread(target=forward, daemon=True)
  thread.start()

  def restore():  # at exit: the pipe closed (fd 1 back), what is in it written, then done
    sys.stdout.flush()
    os.dup2(original, 1)
    thread.join(timeout=5)

  atexit.register(restore)


def connect_cpu_collectives() -> None:
  """Connects XLA:CPU's collectives (gloo) between the processes now, while they are in step:
  gloo connects a group of devices at its first collective, and fails there when one process
  comes 30 s after another (still reading or compiling, under load); a collective of a group
  already connected waits as long as XLA lets it. The groups the programs use: one device of
  each process (Orbax's barriers, multihost_utils) and every device (the steps' mesh)."""
  multihost_utils.sync_global_devices("distributed.connect_cpu_collectives")
  mesh = sharding.make_mesh()
  ones = jax.make_array_from_process_local_data(
      NamedSharding(mesh, P(sharding.DATA_AXIS)),
      np.ones(jax.local_device_count(), np.float32))
  jax.jit(jnp.sum, out_shardings=sharding.replicated(mesh))(ones).block_until_ready()


