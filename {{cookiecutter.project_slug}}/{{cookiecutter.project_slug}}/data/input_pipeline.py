"""A run's input (`Input`): its data read (sources.py) and cut into batches (batches.py), and the
loader: Grain worker processes read a split's elements and hand them over in shared memory
(shm.py, where workers run); the main process places each device's share on its device as it is
(`sharding.global_batch`), touching no pixel. A worker gathers a device's share of an element at
a time with NumPy (Grain's per-example path costs more than a small step). `host_memory` says
what all this holds."""

import contextlib
import dataclasses
import functools
import math
import os
import signal
import threading
import time

import grain
import jax
import numpy as np
from absl import logging

from ..errors import ConfigError
from . import batches, sources
from .batches import Elements, count_bad_records, default_workers, split
from .sources import DatasetInfo


class Input:
  """A run's data, on this process: both splits read and described (`info`), training's
  length in steps, evaluation's elements (`eval_batches`), the host memory the loader will hold
  (`memory`), and once started (`start`) the iterators that read them, `train` and `eval`;
  `close` stops them. `rows`: this process's rows of each global batch (`sharding.process_rows`;
  None: one process)."""

  def __init__(self, config, rows=None):
    self.config, self.rows, self.train, self.eval = config, rows, None, None
    self.splits, self.info = sources.get_datasets(config)
    if config.get("randaugment") and self.info.pixel_dtype != "uint8":  # (PIL's operations)
      raise ConfigError(f"config.randaugment={config.randaugment!r} works on 8-bit images; "
                        f"these are {self.info.pixel_dtype}: store them as uint8, or use --config."
                        "randaugment='' (and your own augmentation in recipe.augment).")
    num_train, batch = self.info.num_examples["train"], config.run.global_batch_size
    self.num_train_steps = batches.num_batches(config.num_epochs * num_train, batch)
    if num_train < batch and jax.process_index() == 0:  # (a step spans several epochs)
      logging.warning("the global batch of %d is larger than the training set's %d examples: a "
                      "step holds each about %.1f times (%d steps in all); --config.batch_size=%d "
                      "fits it", batch, num_train, batch / num_train, self.num_train_steps, max(
                          num_train // config.run.num_devices, 1) * config.run.num_devices)
    self.eval_batches = batches.eval_batches(self.splits["eval"], config, rows)
    self.memory = host_memory(config, self.info, jax.process_count())

  def train_iterator(self, first_step: int, put) -> "Iterator":
    """Training's batches from the element holding step `first_step` on, placed by `put`."""
    return as_iterator(batches.train_batches(self.splits["train"], self.config, first_step,
                                             self.rows), self.config, put=put)

  def eval_iterator(self) -> "Iterator":
    """The eval split, repeated without end: its workers start once."""
    return as_iterator(self.eval_batches.repeat(), self.config)

  def start(self, first_step: int, put) -> None:
    """Starts the workers: `train`, training's elements from the one holding step `first_step`
    on, placed by `put`; `eval`, the eval split repeated (`eval_iterator`)."""
    self.train, self.eval = self.train_iterator(first_step, put), self.eval_iterator()

  def close(self) -> None:
    """Stops the iterators' workers (both, whatever the first one's close raises)."""
    with contextlib.ExitStack() as iterators:
      for iterator in (self.train, self.eval):
        if iterator is not None:
          iterators.callback(iterator.close)


@dataclasses.dataclass(frozen=True)
class HostMemory:
  """What the pipeline holds in host memory, in units (a device's share of an element, with
  workers), for training and evaluation: each worker's read-ahead, the units its threads build and
  the one queued; the main process's elements received, and training's placed ahead."""

  unit_bytes: int
  workers: int  # an iterator's
  per_worker: int  # units
  main: int  # units
  iterators: int = 2

  @property
  def bytes(self) -> int:
    return self.unit_bytes * (self.iterators * self.workers * self.per_worker + self.main)


def host_memory(config, info: DatasetInfo, num_processes: int = 1,
                iterators: int = 2) -> HostMemory:
  """The input's expected host memory on each process: its buffers, not the process's own
  runtime (Python, JAX, Grain: ~0.5 GiB a process). Crops sent packed count as their expected
  pixels (`info.crop_pixels`; unknown: the canvas, the most); the elements placed ahead on the
  devices as their rooms where the devices are this host's CPU, elsewhere as what is sent (the
  rooms are then the devices' memory).

  Args:
    config: the run's config, resolved (k, the batch).
    info: the data's DatasetInfo.
    num_processes: the processes the global batch is read by.
    iterators: the iterators open at once (training's and evaluation's).
  """
  room = math.prod(info.canvas or info.image_shape[:2])  # (packed crops: room for the largest)
  pixel = info.image_shape[2] * np.dtype(info.pixel_dtype).itemsize
  box = 6 * 4 + 4 if info.canvas else 0  # (and its offset)
  local_batch_size = config.run.global_batch_size // num_processes
  element, placed = (config.run.steps_per_dispatch * local_batch_size * (
      pixels * pixel + box + 4 + 1 + 4) for pixels in (info.crop_pixels or room, room))
  if jax.default_backend() != "cpu":
    placed = element
  unit = element // split(config, local_batch_size)["shares"]
  workers = default_workers(config)
  ahead = config.prefetch_batches + config.read_threads + 1
  main = (unit * (0 if workers else ahead) * iterators + element * (iterators + 1)
          + placed * config.prefetch_to_device)
  return HostMemory(unit, workers, ahead, main // unit, iterators)


def available_memory() -> int:
  """This host's memory, or its container's limit (cgroup v2) when lower."""
  total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  try:
    with open("/sys/fs/cgroup/memory.max") as f:
      limit = f.read().strip()
  except OSError:
    return total
  return min(total, int(limit)) if limit.isdigit() else total


def start_worker(worker_index: int, num_workers: int, main: int) -> None:
  """Run in each Grain worker as it starts (Grain's `worker_init_fn`).

  Ctrl-C (SIGINT, sent to the whole process group) is left to the main process (it saves, then
  stops the workers), so no worker prints a traceback; and the worker ends within a second of
  its main process, however that ended (SIGKILL, the OOM killer), even before the worker
  started: a thread watches its parent.

  Args:
    worker_index: Grain's (unused).
    num_workers: Grain's (unused).
    main: the main process's id.
  """
  del worker_index, num_workers
  signal.signal(signal.SIGINT, signal.SIG_IGN)

  def end_with_the_parent():
    while os.getppid() == main:
      time.sleep(0.5)
    os._exit(1)

  threading.Thread(target=end_with_the_parent, daemon=True, name="end-with-the-run").start()


class Iterator:
  """Elements from Grain's iterator; `close` stops its workers and removes what they made that
  was never received (`shm.remove_unreceived`)."""

  def __init__(self, elements: grain.DatasetIterator, prefix: str | None = None):
    self.elements, self.prefix = elements, prefix

  def __iter__(self):
    return self

  def __next__(self):
    return next(self.elements)

  def close(self) -> None:
    self.elements.close()
    if self.prefix:
      from . import shm

      shm.remove_unreceived(self.prefix)


def as_iterator(elements: Elements, config, put=None, num_workers: int | None = None,
                shared_memory: bool = True) -> Iterator:
  """An iterator over `elements`; close it to stop its workers.

  Args:
    elements: the elements (`batches.train_batches`, `batches.eval_batches`).
    config: the run's config (`read_threads`, `prefetch_batches`, `prefetch_to_device`).
    put: places an element's shares (a list) on the devices, from a background thread,
      `config.prefetch_to_device` ahead; None: the elements are stacked on the host.
    num_workers: the worker processes that read them; None: `default_workers`.
    shared_memory: whether the workers hand their images over in shared memory (`shm`); else,
      or where there is none, pickled.
  """
  read_options = grain.ReadOptions(num_threads=config.read_threads,
                                   prefetch_buffer_size=config.prefetch_batches)
  workers = default_workers(config) if num_workers is None else num_workers
  prefix = receive = None
  if workers and shared_memory:
    from . import shm  # (only where workers run)

    if shm.available():
      shm.remove_leftovers()
      elements = elements.sent_by(shm.Outbox(prefix := shm.iterator_prefix(),
                                             reserve=shm.fallback_bytes(workers)))
      receive = shm.receive
  dataset = elements.units.to_iter_dataset(read_options)
  if workers:
    # What is left (labels, masks, small images) travels pickled, not in Grain's shared memory.
    pickled = grain.experimental.DatasetOptions(min_shm_size=2**62)
    dataset = grain.experimental.WithOptionsIterDataset(dataset, pickled)
    dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers),
                                  worker_init_fn=functools.partial(start_worker, main=os.getpid()))
  place = elements.stack if put is None else put
  receive = receive or (lambda unit: unit)
  dataset = dataset.batch(elements.shares, batch_fn=lambda units: place(
      count_bad_records([receive(unit) for unit in units])))
  if put is not None and config.prefetch_to_device:
    dataset = grain.experimental.ThreadPrefetchIterDataset(
        dataset, prefetch_buffer_size=config.prefetch_to_device)
  return Iterator(iter(dataset), prefix)
