"""Images from the Grain workers to the main process in shared memory, touched there by no one:
a worker writes a unit's image into a file of /dev/shm and sends its name (`Shared`); the main
process maps it, and the devices take the array from that mapping (on the CPU, without a copy).
Once nothing maps it any more the main process gives the file back (renamed `...-free<n>`), and
its worker packs its next unit's crops there (`Outbox.empty`), or copies a unit there: into
pages already allocated and mapped, without the kernel's allocation and zeroing of fresh ones.
Names are `<prefix>-<run>-<iterator>-<worker>-<n>`, `<run>` the main process's id and a random
tag: what an iterator's workers leave when it is closed (units given back or never received) is
removed by `remove_unreceived`; what a killed run left, by the next run (`remove_leftovers`),
which knows it dead by its lock (`<prefix>-<run>.lock`, held for the run's life: freed by the
kernel when it dies, in any container that shares this /dev/shm)."""

import atexit
import contextlib
import dataclasses
import fcntl
import functools
import glob
import itertools
import math
import mmap
import os
import threading
import weakref

import numpy as np
from absl import logging

DIRECTORY = "/dev/shm"  # Linux; elsewhere units travel pickled (`available`)
PREFIX = __name__.split(".")[0]  # the package's name
# Smaller arrays travel pickled. What a unit sends through the pipe stays under the pipe's
# buffer (64 KiB), so a worker told to stop never waits on a pipe nobody reads any more.
MIN_BYTES = 2**12
GIVEN_BACK = "free"  # a unit's name once the main process is done with it: `-free<n>`


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
  """In a worker: `__call__` moves a unit's large arrays into shared memory, into a file the main
  process gave back where there is one, else a new one, keeping `reserve` bytes free there (for
  the semaphores of workers that start later: `fallback_bytes`); where there is no room, the
  arrays travel pickled. An array built in what `empty` lent is sent as it is, without a copy.
  Grain's threads call it at once."""

  def __init__(self, prefix: str, reserve: int = 0):
    self.prefix, self.reserve = prefix, reserve
    self.count, self.warned, self.lock = itertools.count(), False, threading.Lock()
    self.mapped = {}  # inode -> this worker's mapping of a file it wrote
    self.lent = {}  # address -> (path, inode, mapping) of each array `empty` lent, not yet sent

  def __call__(self, unit: dict) -> dict:
    # Packed crops (`batches.pack`): only the bytes they fill are written (the rest of a new
    # file left a hole: no pages).
    one = "filled" in unit and unit["filled"].size == 1  # (a worker's unit: one device's)
    used = {"image": int(unit["filled"].max())} if one else {}
    return {key: self.share(value, used.get(key)) if value.nbytes >= MIN_BYTES
            and value.dtype != object else value for key, value in unit.items()}

  def empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
    """An array to build a unit's array in, holding whatever it held: a file given back, of its
    size, mapped here (its pages in place: no page faults), which `__call__` then sends as it
    is; where there is none, new zeros (sent as any array)."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if (taken := self.take_given_back(nbytes)) is None:
      return np.zeros(shape, dtype)
    array = np.frombuffer(taken[2], dtype).reshape(shape)
    self.lent[array.__array_interface__["data"][0]] = taken
    return array

  def take_given_back(self, nbytes: int | None = None) -> tuple[str, int, mmap.mmap | None] | None:
    """A file the main process gave back (with `nbytes`: one this worker mapped at that size),
    renamed as this worker's next unit: (its path, inode, this worker's mapping or None)."""
    names = f"{self.prefix}-{os.getpid()}"  # (this worker's)
    with self.lock:
      for given_back in glob.glob(os.path.join(DIRECTORY, f"{names}-{GIVEN_BACK}*")):
        try:
          inode = os.stat(given_back).st_ino
          mapped = self.mapped.get(inode)
          if nbytes is not None and (mapped is None or len(mapped) != nbytes):
            continue
          os.rename(given_back, path := os.path.join(DIRECTORY, f"{names}-{next(self.count)}"))
        except OSError:  # (removed: its iterator closed)
          continue
        return path, inode, self.mapped.pop(inode, None)  # (the main process never touches it)
    return None

  def share(self, array: np.ndarray, used: int | None = None) -> Shared | np.ndarray:
    if (lent := self.lent.pop(array.__array_interface__["data"][0], None)) is not None:
      path, inode, self.mapped[inode] = lent
      if array.flags.c_contiguous and array.nbytes == len(self.mapped[inode]):  # all of it
        return Shared(os.path.basename(path), array.shape, array.dtype.str)
      give_back(path)  # (a part of it: copied below, into another file)
    if (taken := self.take_given_back()) is not None:
      path, inode, mapped = taken
      fd = os.open(path, os.O_RDWR)
    elif self.reserve and free_bytes() < array.nbytes + self.reserve:
      return self.pickled(array, f"{self.reserve / 2**20:.3g} MiB kept free for the workers' "
                                 "semaphores")
    else:
      path = os.path.join(DIRECTORY, f"{self.prefix}-{os.getpid()}-{next(self.count)}")
      fd, mapped = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600), None
    data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    written = data[:used]  # (None: all of it)
    try:
      inode = os.fstat(fd).st_ino
      if mapped is not None and len(mapped) == data.size:
        # A file given back, the size it was: copied through this worker's mapping of it (its
        # pages in place and mapped here: 0.9 ms for 11 MiB here, against 2.9 with os.write).
        np.copyto(np.frombuffer(mapped, np.uint8)[:written.size], written)
      else:
        # Written, not copied into a fresh mapping: 2.5x fewer CPU-seconds a byte here (no page
        # faults), and a full /dev/shm is an error here (ENOSPC), not a SIGBUS.
        chunk = memoryview(written)
        while chunk:
          chunk = chunk[os.write(fd, chunk):]
        os.ftruncate(fd, data.size)  # (a file given back may have been longer)
        mapped = mmap.mmap(fd, data.size)  # (for its next use)
    except OSError as e:
      os.unlink(path)
      return self.pickled(array, e)
    finally:
      os.close(fd)
    self.mapped[inode] = mapped
    return Shared(os.path.basename(path), array.shape, array.dtype.str)

  def pickled(self, array: np.ndarray, why) -> np.ndarray:
    if not self.warned:
      self.warned = True
      logging.warning("%s is full (%s): units travel pickled, slower; give it more room "
                      "(Docker: --shm-size=16g or --ipc=host)", DIRECTORY, why)
    return array

  def __getstate__(self):  # sent to the workers without their mappings and count
    return {"prefix": self.prefix, "reserve": self.reserve}

  def __setstate__(self, state):
    self.__init__(**state)


def receive(unit: dict) -> dict:
  """In the main process: a unit's `Shared` arrays mapped (read-only), each file given back to
  its worker once nothing maps it (`give_back`)."""
  return {key: _open(value) if isinstance(value, Shared) else value
          for key, value in unit.items()}


def _open(shared: Shared) -> np.ndarray:
  path = os.path.join(DIRECTORY, shared.name)
  fd = os.open(path, os.O_RDONLY)
  try:
    mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
  finally:
    os.close(fd)
  array = np.frombuffer(mapped, shared.dtype)
  # Its views, and the devices' arrays made from it (the CPU's share its memory), hold it.
  weakref.finalize(array, give_back, path).atexit = False
  return array.reshape(shared.shape)


# The iterators whose units were removed (`remove_unreceived`): nothing of theirs is given back
# after, not even by an array let go while they were being removed (reentrant: the garbage
# collector may let one go in the thread that removes them).
_removed, _removing = set(), threading.RLock()


def give_back(path: str) -> None:
  """Renames a received unit's file `...-free<n>`, for its worker to write its next unit in,
  unless its iterator was closed (its units removed)."""
  head, n = path.rsplit("-", 1)
  with _removing, contextlib.suppress(OSError):
    if not any(os.path.basename(path).startswith(f"{prefix}-") for prefix in _removed):
      os.rename(path, f"{head}-{GIVEN_BACK}{n}")


def remove_unreceived(prefix: str) -> int:
  """Unlinks what is left of an iterator's units (`prefix`): those its workers made that were
  never received, those in use (their mappings stay) and those given back. Returns how many."""
  removed = 0
  with _removing:
    _removed.add(os.path.basename(prefix))
    for path in glob.glob(os.path.join(DIRECTORY, f"{prefix}-*")):
      try:
        os.unlink(path)
        removed += 1
      except FileNotFoundError:  # renamed meanwhile (by its worker)
        pass
  return removed


@functools.cache  # once a process
def remove_leftovers() -> None:
  """Removes what runs that are certainly dead left in /dev/shm: the units of each run whose
  lock nobody holds (the kernel frees a lock when its process dies, whatever killed it), and the
  lock; and where there was one, the semaphores of multiprocessing (`sem.mp-*`: Grain's queues',
  which a run killed whole leaves, its resource tracker killed with it) of this user that no
  process maps. Says so in one line."""
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
  semaphores = remove_unmapped_semaphores() if runs else 0
  if units or semaphores:  # (a run killed before it made any leaves its lock alone: no news)
    logging.warning("removed %d unit%s (%.3g MiB)%s that %d run%s no longer running left in %s",
                    units, "s" * (units != 1), size / 2**20,
                    f" and {semaphores} semaphore{'s' * (semaphores != 1)}" if semaphores else "",
                    runs, "s" * (runs != 1), DIRECTORY)


def remove_unmapped_semaphores() -> int:
  """Unlinks this user's `sem.mp-*` files of /dev/shm that no process maps (a live one's are
  mapped by every process using it from before its name appears: glibc's sem_open); returns
  how many."""
  mapped = set()
  for maps in glob.glob("/proc/[0-9]*/maps"):
    with contextlib.suppress(OSError), open(maps) as f:  # (another user's: unreadable, kept)
      mapped.update(line.split(None, 5)[-1].strip() for line in f if "/sem.mp-" in line)
  removed = 0
  for path in glob.glob(os.path.join(DIRECTORY, "sem.mp-*")):
    with contextlib.suppress(OSError):
      if path not in mapped and os.stat(path).st_uid == os.getuid():
        os.unlink(path)
        removed += 1
  return removed
