"""Images from the Grain workers to the main process in shared memory, touched there by no one:
a worker writes a unit's image into a file of /dev/shm and sends its name (`Shared`); the main
process maps it and unlinks the name at once, and the devices take the array from that mapping
(on the CPU, without a copy). Each worker keeps its last units mapped (`Outbox`), so that the
memory of a unit is freed by the worker that made it, not by the main process. Names are
`<prefix>-<main process id>-<iterator>-<worker>-<n>`: what the workers leave when an iterator is
closed (units never received) is removed by `remove_unreceived`; what a killed run left is said
(`warn_of_leftovers`)."""

import collections
import dataclasses
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


def iterator_prefix() -> str:
  """Names for one iterator's units (the main process's id, then this iterator's)."""
  return f"{PREFIX}-{os.getpid()}-{os.urandom(4).hex()}"


@dataclasses.dataclass(frozen=True)
class Shared:
  """An array in /dev/shm: what travels through Grain's queues instead of its bytes."""

  name: str
  shape: tuple[int, ...]
  dtype: str


class Outbox:
  """In a worker: `__call__` moves a unit's large arrays into shared memory, keeping the last
  `keep` mapped (the main process holds a few elements; the one who unmaps last frees)."""

  def __init__(self, prefix: str, keep: int):
    self.prefix, self.keep = prefix, keep
    self.mapped, self.count, self.warned = None, itertools.count(), False

  def __call__(self, unit: dict) -> dict:
    if self.mapped is None:  # in the worker: the deque is not pickled with the Outbox
      self.mapped = collections.deque(maxlen=self.keep)
      self.prefix = f"{self.prefix}-{os.getpid()}"
    return {key: self.share(value) if value.nbytes >= MIN_BYTES else value
            for key, value in unit.items()}

  def share(self, array: np.ndarray) -> Shared | np.ndarray:
    path = os.path.join(DIRECTORY, f"{self.prefix}-{next(self.count)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
      os.posix_fallocate(fd, 0, array.nbytes)  # a full /dev/shm: an error here, not a SIGBUS
      mapped = mmap.mmap(fd, array.nbytes)
    except OSError as e:
      os.unlink(path)
      if not self.warned:
        self.warned = True
        logging.warning("%s is full (%s): units travel pickled, slower; give it more room "
                        "(Docker: --shm-size=16g or --ipc=host)", DIRECTORY, e)
      return array
    finally:
      os.close(fd)
    np.frombuffer(mapped, array.dtype).reshape(array.shape)[...] = array
    self.mapped.append(mapped)  # the oldest unmapped (and freed, if the main process is done)
    return Shared(os.path.basename(path), array.shape, array.dtype.str)

  def __getstate__(self):  # sent to the workers without their mappings
    return {"prefix": self.prefix, "keep": self.keep}

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
def warn_of_leftovers() -> None:
  """Says what units of main processes not running here (killed runs') hold in /dev/shm. They
  are not removed: a run in another container that shares this /dev/shm looks dead from here."""
  paths = [path for path in glob.glob(os.path.join(DIRECTORY, f"{PREFIX}-*"))
           if not os.path.exists(f"/proc/{os.path.basename(path).split('-')[1]}")]
  if paths:
    size = sum(os.path.getsize(path) for path in paths if os.path.exists(path))
    logging.warning("%s holds %d unit%s (%.3g MiB) of runs not running here (killed?); if no "
                    "other run of this project shares it, remove them: rm %s", DIRECTORY,
                    len(paths), "s" * (len(paths) != 1), size / 2**20,
                    os.path.join(DIRECTORY, f"{PREFIX}-*"))
