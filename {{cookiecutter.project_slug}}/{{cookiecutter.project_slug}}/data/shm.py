"""Images from the Grain workers to the main process in shared memory, touched there by no one:
a worker writes a unit's image into a file of /dev/shm and sends its name (`Shared`); the main
process maps it and unlinks the name at once, and the devices take the array from that mapping
(on the CPU, without a copy). Each worker keeps its last units mapped (`Outbox`), so that the
memory of a unit is freed by the worker that made it, not by the main process. Names are
`<prefix>-<run>-<iterator>-<worker>-<n>`, `<run>` the main process's id and a random tag: what
the workers leave when an iterator is closed (units never received) is removed by
`remove_unreceived`; what a killed run left, by the next run (`remove_leftovers`), which knows
it dead by its lock (`<prefix>-<run>.lock`, held for the run's life: freed by the kernel when it
dies, in any container that shares this /dev/shm)."""

import atexit
import collections
import contextlib
import dataclasses
import fcntl
import functools
import glob
import itertools
import mmap
import os

import numpy as np
from absl import logging

DIRECTORY = "/dev/shm"  # Linux; elsewhere units travel pickled (`available`)
PREFIX = __name__.split(".")[0]  # the package's name
# Smaller arrays travel pickled. What a unit sends through the pipe stays under the pipe's
# buffer (64 KiB), so a worker told to stop never waits on a pipe nobody reads any more.
MIN_BYTES = 2**12


def available() -> bool:
  return os.path.isdir(DIRECTORY) and os.access(DIRECTORY, os.W_OK)


# What Grain's worker processes need in /dev/shm even when every unit travels pickled: the
# semaphores of their queues and events, a page each (measured: 25 a worker and iterator).
SEMAPHORES_A_WORKER = 25


def fallback_bytes(workers: int, iterators: int = 2) -> int:
  """The room in /dev/shm that `workers` worker processes of each of `iterators` (training's and
  evaluation's) need at the least."""
  return workers * iterators * SEMAPHORES_A_WORKER * mmap.PAGESIZE


def free_bytes() -> int:
  room = os.statvfs(DIRECTORY)
  return room.f_bavail * room.f_frsize


RUN = f"{os.getpid()}.{os.urandom(3).hex()}"  # this main process's tag in the names


def iterator_prefix() -> str:
  """Names for one iterator's units (the run's tag, then this iterator's), the run's lock held
  (`hold_run_lock`) before any is made."""
  hold_run_lock()
  return f"{PREFIX}-{RUN}-{os.urandom(4).hex()}"


@functools.cache  # once a process
def hold_run_lock() -> None:
  """`<prefix>-<run>.lock`, locked (flock) until this process ends, however it ends; removed
  when it ends normally. Made under another name and renamed once locked: a run that looks for
  dead runs' locks never sees one not yet locked."""
  making = os.path.join(DIRECTORY, f".{PREFIX}-{RUN}.lock")  # (hidden: no glob finds it)
  try:
    fd = os.open(making, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(making, lock := os.path.join(DIRECTORY, f"{PREFIX}-{RUN}.lock"))
  except OSError as e:  # (units are still removed at close; a kill's, not by the next run)
    logging.warning("cannot lock %s (%s): what this run leaves if it is killed stays there",
                    making, e)
    return
  atexit.register(release_run_lock, lock, fd)


def release_run_lock(lock: str, fd: int) -> None:
  with contextlib.suppress(OSError):
    os.unlink(lock)
  os.close(fd)


@dataclasses.dataclass(frozen=True)
class Shared:
  """An array in /dev/shm: what travels through Grain's queues instead of its bytes."""

  name: str
  shape: tuple[int, ...]
  dtype: str


class Outbox:
  """In a worker: `__call__` moves a unit's large arrays into shared memory, keeping the last
  `keep` mapped (the main process holds a few elements; the one who unmaps last frees), and
  `reserve` bytes free there (for the semaphores of workers that start later: `fallback_bytes`);
  where there is no room, the arrays travel pickled."""

  def __init__(self, prefix: str, keep: int, reserve: int = 0):
    self.prefix, self.keep, self.reserve = prefix, keep, reserve
    self.mapped, self.count, self.warned = None, itertools.count(), False

  def __call__(self, unit: dict) -> dict:
    if self.mapped is None:  # in the worker: the deque is not pickled with the Outbox
      self.mapped = collections.deque(maxlen=self.keep)
      self.prefix = f"{self.prefix}-{os.getpid()}"
    return {key: self.share(value) if value.nbytes >= MIN_BYTES and value.dtype != object
            else value for key, value in unit.items()}

  def share(self, array: np.ndarray) -> Shared | np.ndarray:
    if self.reserve and free_bytes() < array.nbytes + self.reserve:
      return self.pickled(array, f"{self.reserve / 2**20:.3g} MiB kept free for the workers' "
                                 "semaphores")
    path = os.path.join(DIRECTORY, f"{self.prefix}-{next(self.count)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
      # Written, not copied into a mapping: 2.5x fewer CPU-seconds a byte here (no page faults),
      # and a full /dev/shm is an error here (ENOSPC), not a SIGBUS.
      data = memoryview(np.ascontiguousarray(array)).cast("B")
      while data:
        data = data[os.write(fd, data):]
      mapped = mmap.mmap(fd, array.nbytes)  # (its pages untouched here)
    except OSError as e:
      os.unlink(path)
      return self.pickled(array, e)
    finally:
      os.close(fd)
    self.mapped.append(mapped)  # the oldest unmapped (and freed, if the main process is done)
    return Shared(os.path.basename(path), array.shape, array.dtype.str)

  def pickled(self, array: np.ndarray, why) -> np.ndarray:
    if not self.warned:
      self.warned = True
      logging.warning("%s is full (%s): units travel pickled, slower; give it more room "
                      "(Docker: --shm-size=16g or --ipc=host)", DIRECTORY, why)
    return array

  def __getstate__(self):  # sent to the workers without their mappings
    return {"prefix": self.prefix, "keep": self.keep, "reserve": self.reserve}

  def __setstate__(self, state):
    self.__init__(**state)


def receive(unit: dict) -> dict:
  """In the main process: a unit's `Shared` arrays mapped (read-only) and their names unlinked."""
  return {key: _open(value) if isinstance(value, Shared) else value
          for key, value in unit.items()}


def _open(shared: Shared) -> np.ndarray:
  path = os.path.join(DIRECTORY, shared.name)
  fd = os.open(path, os.O_RDONLY)
  try:
    mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
  finally:
    os.close(fd)
    os.unlink(path)  # the mapping stays; the memory goes with its last mapping
  return np.frombuffer(mapped, shared.dtype).reshape(shared.shape)


def remove_unreceived(prefix: str) -> int:
  """Unlinks what is left of an iterator's units (`prefix`): those its workers made that were
  never received. Returns how many."""
  removed = 0
  for path in glob.glob(os.path.join(DIRECTORY, f"{prefix}-*")):
    try:
      os.unlink(path)
      removed += 1
    except FileNotFoundError:  # received meanwhile
      pass
  return removed


@functools.cache  # once a process
def remove_leftovers() -> None:
  """Removes what runs that are certainly dead left in /dev/shm: the units of each run whose
  lock nobody holds (the kernel frees a lock when its process dies, whatever killed it), and the
  lock; says so in one line."""
  runs, units, size = 0, 0, 0
  for lock in glob.glob(os.path.join(DIRECTORY, f"{PREFIX}-*.lock")):
    run = os.path.basename(lock)[len(PREFIX) + 1:-len(".lock")]
    try:
      fd = os.open(lock, os.O_RDWR)
    except OSError:  # removed meanwhile
      continue
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: the run is alive
      for path in glob.glob(os.path.join(DIRECTORY, f"{PREFIX}-{run}-*")):
        with contextlib.suppress(OSError):
          size += os.path.getsize(path)
          os.unlink(path)
          units += 1
      os.unlink(lock)
      runs += 1
    except OSError:
      pass
    finally:
      os.close(fd)
  if runs:
    logging.warning("removed %d unit%s (%.3g MiB) that %d run%s no longer running left in %s",
                    units, "s" * (units != 1), size / 2**20, runs, "s" * (runs != 1), DIRECTORY)
