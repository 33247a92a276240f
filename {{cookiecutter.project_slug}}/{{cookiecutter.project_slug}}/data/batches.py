"""Padded-and-masked batches, k stacked an element, cut from a source's split.

An element is k = `config.run.steps_per_dispatch` batches stacked, each this process's share of
a global batch (NumPy): image [k, B, H, W, C] as stored, label, mask (False on padding), position
(the example's place in the stream); photos' crops for the devices to resize come as image
[1, devices, bytes], each device's crops end to end (`pack`), with box [k, B, 6] and offset [k, B].
A split is cut into ceil(examples / global_batch) batches: no example dropped or counted twice.
Batch b holds stream positions [b * global_batch, (b + 1) * global_batch) (`num_epochs` seeded
permutations), position b * global_batch + r in row r: a process reads its devices' rows
(`sharding.process_rows`), so the global batch (and a Dropout's draws, keyed by row) is the same
for any number of processes. The suffix _S marks a unit's rows: k batches of a share each."""

import collections
import dataclasses
import functools
import math
import os
import threading
from collections.abc import Callable

import grain
import jax
import numpy as np
from absl import logging

from ..errors import BadData
from .sources import SOURCES, Split


def num_batches(num_examples: int, global_batch_size: int) -> int:
  return math.ceil(num_examples / global_batch_size)


@dataclasses.dataclass(frozen=True)
class LoadUnit:
  """A worker's unit of work: unit u -> share u % `shares` of element u // `shares`, that slice
  of each of its k batches, `[k, local_batch // shares, ...]`, padded and masked (with workers, a
  local device's share). Batches past the stream's end or before `first_batch` (a resume) are
  padding, read from nowhere; with `trim` (evaluation) the last element holds the batches left."""

  source: Split  # (sources.Split: ArraySource, arrayrecord.RecordSource, ...)
  global_batch_size: int
  num_epochs: int = 1
  shuffle_seed: int | None = None  # None: the source's order
  steps_per_element: int = 1  # k
  first_batch: int = 0
  rows: tuple[int, ...] | None = None  # the global batch's rows this process reads; None: all
  trim: bool = False
  shares: int = 1  # units an element
  groups: int = 1  # the local devices a share spans (photos' crops: packed a device each)
  out: Callable[..., dict] | None = None  # with workers, what sends a unit (`shm.Outbox`)
  augment: Callable | None = None  # training's on the host: (images, positions) -> images

  @property
  def local_batch_size(self) -> int:
    return len(self.rows) if self.rows else self.global_batch_size

  def __len__(self) -> int:  # whole elements of k batches
    return -(-self.num_batches // self.steps_per_element) * self.shares

  @property
  def num_batches(self) -> int:
    return num_batches(self.num_epochs * len(self.source), self.global_batch_size)

  @functools.lru_cache(maxsize=4)  # noqa: B019  (a unit spans few epochs)
  def permutation(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.shuffle_seed, epoch]).permutation(len(self.source))

  def __call__(self, u: int) -> dict[str, np.ndarray]:
    element, share = divmod(u, self.shares)
    k, per_share = self.steps_per_element, self.local_batch_size // self.shares
    batch_S = np.repeat(element * k + np.arange(k), per_share)
    slot_S = np.tile(share * per_share + np.arange(per_share), k)
    positions_S = batch_S * self.global_batch_size + (np.asarray(self.rows)[slot_S]
                                                      if self.rows else slot_S)
    mask_S = (positions_S < self.num_epochs * len(self.source)) & (batch_S >= self.first_batch)
    read_S = mask_S | (np.arange(len(mask_S)) == 0)  # one example at least: the shapes
    epoch, indices = np.divmod(positions_S[read_S] * mask_S[read_S], len(self.source))
    if self.shuffle_seed is not None:
      for e in np.unique(epoch):  # a unit may straddle epochs
        indices[epoch == e] = self.permutation(e)[indices[epoch == e]]
    kept = min(k, self.num_batches - element * k) if self.trim else k  # (trim: those that fill)
    taken = self.source.take(indices, positions_S[read_S])
    failed = taken.pop("failed", None)  # records read from files: which could not be used
    if failed is not None:  # masked, and carried to `count_bad_records` with the examples read
      slots = np.flatnonzero(read_S)
      failed = {j: why for j, why in failed.items() if mask_S[slots[j]]}  # not padding's stand-in
      bad = np.empty(len(failed), object)  # (pickled, never in shared memory: shm.Outbox)
      bad[:] = [(f"{self.source.name} row {indices[j]}", why) for j, why in failed.items()]
      bad_records = {"read": np.array(int(mask_S.sum())), "bad": bad}
      mask_S[slots[list(failed)]] = False
    taken["label"] = taken["label"].astype(np.int32)
    crops = taken.pop("image") if "box" in taken else None  # each crop's own pixels
    if self.augment is not None:  # (RandAugment, of the images as the model takes them)
      taken["image"] = self.augment(taken["image"], positions_S[read_S])
    if not mask_S.all():  # padding: zeros
      for key, value in taken.items():
        taken[key] = np.zeros((len(mask_S), *value.shape[1:]), value.dtype)
        taken[key][mask_S] = value[mask_S[read_S]]
    unit = {key: value.reshape(k, per_share, *value.shape[1:])[:kept] for key, value in {
        **taken, "mask": mask_S, "position": positions_S.astype(np.uint32)}.items()}
    if crops is not None:
      used = mask_S[read_S]  # (of the rows read: those of examples, usable)
      shape = (k, per_share, *self.source.crops.canvas, crops[0].shape[-1])
      unit.update(pack(crops[used], np.flatnonzero(read_S)[used], shape, self.groups,
                       self.out and self.out.empty))
      unit["offset"] = unit["offset"][:kept]
    unit = unit if failed is None else unit | bad_records
    return unit if self.out is None else self.out(unit)


def pack(crops, slots, shape: tuple[int, ...], groups: int, empty=None) -> dict[str, np.ndarray]:
  """A unit's crops end to end, a device's of every batch in a row of bytes (room: the largest).

  Args:
    crops: the crops, [h, w, C] each.
    slots: the row of each crop.
    shape: (k batches, `share` rows, the largest crop's H, W, C).
    groups: the devices.
    empty: (shape, dtype) -> where the bytes go (a worker's shared memory); None: new.
  Returns:
    image [1, groups, bytes], offset [k, share] (where each crop, row-major, starts in its row)
    and filled [1, groups] (the bytes the crops fill).
  """
  k, share = shape[:2]
  region = k * share // groups * math.prod(shape[2:])
  image = (empty or np.zeros)((1, groups, region), np.uint8)
  offset, filled = np.zeros(k * share, np.int32), np.zeros((1, groups), np.int64)
  group_of = slots % share // (share // groups)
  for i in np.argsort(group_of, kind="stable"):  # a device's, batch after batch
    g, size = group_of[i], crops[i].size
    image[0, g, filled[0, g]:filled[0, g] + size].reshape(crops[i].shape)[:] = crops[i]
    offset[slots[i]], filled[0, g] = filled[0, g], filled[0, g] + size
  return {"image": image, "offset": offset.reshape(k, share), "filled": filled}


SIZES = 256  # the lengths crops are sent in: a 256th of a device's room at a time


def sent(shares: list[dict]) -> list[dict]:
  """Shares of an element as sent: packed crops (`pack`) cut to the fullest device's fill, rounded
  up to a `SIZES`th of the room ("packed": `sharding.padded` pads them back; views, no copy)."""
  if "filled" not in shares[0]:
    return shares
  room = shares[0]["image"].shape[2]
  step = -(-room // SIZES)
  n = min(-(-max(int(share["filled"].max()) for share in shares) // step) * step, room)
  return [{**{key: value for key, value in share.items() if key != "filled"},
           "image": share["image"][..., :n], "packed": room} for share in shares]


def sent_apart(local_batch) -> tuple[list[dict], list | None, int]:
  """`sent`'s shares of `local_batch` (a dict or a list) without packed crops, each local device's
  bytes in order ([n]; None: no packed crops), and the room they are padded back to."""
  shares = sent([local_batch] if isinstance(local_batch, dict) else local_batch)
  if "packed" not in shares[0]:
    return shares, None, 0
  images, rooms = zip(*[(share.pop("image"), share.pop("packed")) for share in shares], strict=True)
  return shares, [image[0, g] for image in images for g in range(image.shape[1])], rooms[0]


# A record that cannot be used (unreadable, not an example) is masked and named in the log; a
# process stops once more than MAX_BAD_SHARE of the records it read, and more than MAX_BAD_RECORDS,
# failed: counted in the main process, in the stream's order (`count_bad_records`), the same
# verdict at the same element for any number of workers.
MAX_BAD_SHARE, MAX_BAD_RECORDS = 0.01, 10
_records, _records_lock = collections.Counter(), threading.Lock()  # this process's


def count_bad_records(units: list[dict], count: bool = True) -> list[dict]:
  """In the main process, each element once, in order (`units`: its shares): its bad records
  named in a warning and counted with the records read; raises BadData once too many failed.
  Returns the units without what they carried for this (all that happens without `count`)."""
  carried = [unit for unit in units if "bad" in unit]
  units = [{key: value for key, value in unit.items() if key not in ("read", "bad")}
           for unit in units]
  if not carried or not count:
    return units
  bad_records = [record for unit in carried for record in unit["bad"]]
  with _records_lock:
    _records["read"] += sum(int(unit["read"]) for unit in carried)
    _records["failed"] += len(bad_records)
    read, bad = _records["read"], _records["failed"]
  for where, why in bad_records:
    logging.warning("skipped %s, unreadable (%s): %d of %d records read here so far", where, why,
                    bad, read)
  if bad_records and bad > MAX_BAD_RECORDS and bad > MAX_BAD_SHARE * read:
    where, why = bad_records[-1]
    share = format(MAX_BAD_SHARE, ".0%")
    raise BadData(f"{bad} of the {read} records read in this process could not be read, more "
                  f"than {share} (batches.MAX_BAD_SHARE); the last: {where}: {why}")
  return units


@dataclasses.dataclass(frozen=True)
class Elements:
  """A stream's elements, made of `units` (a Grain MapDataset of `load`'s units, `load.shares` an
  element, from `first_element` on, without end where it `repeats`): `as_iterator` reads them;
  iteration reads them here, stacked, as the input does (bad records counted); indexing, for a
  look (not counted)."""

  load: LoadUnit
  first_element: int = 0
  repeats: bool = False

  @property
  def shares(self) -> int:  # units an element
    return self.load.shares

  @functools.cached_property
  def units(self) -> grain.MapDataset:
    units = grain.MapDataset.range(len(self.load)).map(self.load)[
        self.first_element * self.shares:]
    return units.repeat() if self.repeats else units

  def __len__(self) -> int:
    return len(self.units) // self.shares

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    return self.element(i, count=False)

  def __iter__(self):
    return (self.element(i) for i in range(len(self)))

  def element(self, i: int, count: bool = True) -> dict[str, np.ndarray]:
    start = range(len(self))[i] * self.shares
    return self.stack(count_bad_records([self.units[u] for u in range(start, start + self.shares)],
                                        count))

  def repeat(self) -> "Elements":
    return dataclasses.replace(self, repeats=True)

  def sent_by(self, out: Callable[..., dict]) -> "Elements":
    """These elements, each unit sent by `out` as it is made (`LoadUnit.out`)."""
    return dataclasses.replace(self, load=dataclasses.replace(self.load, out=out))

  @staticmethod
  def stack(shares: list[dict]) -> dict[str, np.ndarray]:
    """An element's shares as `[k, local_batch, ...]` (a copy, for a look: the devices take the
    shares as they are)."""
    if len(shares) == 1:
      return shares[0]
    return {key: np.concatenate([share[key] for share in shares], axis=1) for key in shares[0]}


def split(config, local_batch_size: int) -> dict[str, int]:
  """LoadUnit's `shares`, the units of an element (with workers, one a local device where they
  divide the batch, placed on it as it is; without, one: a gather from memory, or this process's
  threads), and `groups`, the local devices a share spans."""
  devices = jax.local_device_count()
  n = devices if default_workers(config) and local_batch_size % devices == 0 else 1
  return dict(shares=n, groups=devices // n if local_batch_size % devices == 0 else 1)


def train_batches(source, config, first_step: int = 0, rows=None) -> Elements:
  """`num_epochs` passes over a split, reshuffled each epoch, in batches (the last alone partial).

  Args:
    source: the split.
    config: the run's config, resolved.
    first_step: the stream starts at the element holding this batch (a resume's).
    rows: this process's rows of each global batch (`sharding.process_rows`); None: all.
  """
  k, batch = config.run.steps_per_dispatch, config.run.global_batch_size
  load = LoadUnit(source, batch, config.num_epochs, config.seed, k, first_step, rows=rows,
                  **split(config, len(rows) if rows else batch))
  if config.get("randaugment"):  # (asked for: loaded now)
    from .randaugment import RandAugment
    load = dataclasses.replace(load, augment=RandAugment.of(config))
  return Elements(load, first_step // k)


def eval_batches(source, config, rows=None) -> Elements:
  """A split once, in its order, k batches an element, the last one only those left.

  Args:
    source: the split.
    config: the run's config, resolved.
    rows: this process's rows of each global batch (`sharding.process_rows`); None: all.
  """
  k, batch = config.run.steps_per_dispatch, config.run.global_batch_size
  return Elements(LoadUnit(source, batch, steps_per_element=k, trim=True, rows=rows,
                           **split(config, len(rows) if rows else batch)))


def available_cpus() -> int:
  """The cores this process may run on (its affinity: SLURM's, taskset's, a container's)."""
  if hasattr(os, "sched_getaffinity"):  # Linux (os.process_cpu_count: Python 3.13 on)
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def default_workers(config) -> int:
  """`config.num_workers`, or when it is -1: none for data held in memory (a batch is a gather,
  which workers would only copy again) unless the host augments it (RandAugment), else one a
  core of this process's but one."""
  if config.num_workers >= 0:
    return config.num_workers
  in_memory = SOURCES[config.dataset].in_memory and not config.get("randaugment")
  return 0 if in_memory else max(available_cpus() - 1, 1)
