"""Grain input pipeline: sources, a seeded shuffle, and padded-and-masked batches.

Every batch is a dict of NumPy arrays holding this process's share of one global batch:
  image [local_batch, H, W, C] float32, label [local_batch] int32, mask [local_batch] bool.
`mask` is False on padding. A split is cut into exactly ceil(examples / global_batch) batches
on every process, so all processes run the same number of steps and every real example is seen
exactly once per epoch: nothing is dropped, nothing is counted twice.

One Grain element is one batch, gathered with NumPy fancy indexing: Grain's per-example path
costs tens of microseconds per example, more than a training step of a small model. Batch k
holds the examples at positions [k * global_batch, (k + 1) * global_batch) of the stream
(`num_epochs` passes, each a fresh seeded permutation); process p takes positions p, p + P, ...
of it, so the global batch is the same whatever the number of processes P.
"""

import dataclasses
import functools
import glob
import json
import math
import os

import grain
import numpy as np
from flax import serialization

DATASETS = ("digits", "arrayrecord", "synthetic")


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  image_shape: tuple[int, int, int]  # (height, width, channels)
  num_classes: int
  num_examples: dict[str, int]  # split name -> number of examples


class ArraySource:
  """Examples held in memory: `take` gathers a batch of them at once."""

  def __init__(self, images: np.ndarray, labels: np.ndarray):
    self.images, self.labels = images, labels

  def __len__(self) -> int:
    return len(self.labels)

  def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    return {"image": self.images[indices], "label": self.labels[indices]}


class RecordSource:
  """Examples in ArrayRecord files, one msgpack-encoded example per record."""

  def __init__(self, paths: list[str]):
    self.records = grain.sources.ArrayRecordDataSource(paths)

  def __len__(self) -> int:
    return len(self.records)

  def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    examples = [serialization.msgpack_restore(self.records[int(i)]) for i in indices]
    return {"image": np.stack([ex["image"] for ex in examples]),
            "label": np.array([ex["label"] for ex in examples], np.int32)}


def _digits(config) -> dict[str, ArraySource]:
  """The UCI handwritten digits that scikit-learn ships on disk (1797 images, 8x8, 10 classes)."""
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split

  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]
  labels = digits.target.astype(np.int32)
  train_x, eval_x, train_y, eval_y = train_test_split(
      images, labels, test_size=config.eval_fraction, random_state=0, stratify=labels)
  return {"train": ArraySource(train_x, train_y), "eval": ArraySource(eval_x, eval_y)}


def _synthetic(config) -> dict[str, ArraySource]:
  """Random images and labels of any shape: for benchmarks and tests, not for learning."""
  spec = config.synthetic
  rng = np.random.default_rng(0)

  def split(n):
    images = rng.random((n, *spec.image_shape), dtype=np.float32)
    return ArraySource(images, rng.integers(0, spec.num_classes, n, dtype=np.int32))

  return {"train": split(spec.num_train), "eval": split(spec.num_eval)}


def arrayrecord_paths(data_dir: str, split: str) -> list[str]:
  return sorted(glob.glob(os.path.join(data_dir, f"{split}-*.array_record")))


def get_datasets(config) -> tuple[dict[str, ArraySource | RecordSource], DatasetInfo]:
  """The 'train' and 'eval' sources, and what the model needs to know about them."""
  if config.dataset == "arrayrecord":
    with open(os.path.join(config.data_dir, "metadata.json")) as f:
      meta = json.load(f)
    sources = {split: RecordSource(arrayrecord_paths(config.data_dir, split))
               for split in ("train", "eval")}
    image_shape, num_classes = meta["image_shape"], meta["num_classes"]
  elif config.dataset == "synthetic":
    sources = _synthetic(config)
    image_shape, num_classes = config.synthetic.image_shape, config.synthetic.num_classes
  else:
    sources = _digits(config)
    image_shape = sources["train"].images.shape[1:]
    num_classes = int(sources["train"].labels.max()) + 1
  info = DatasetInfo(tuple(image_shape), int(num_classes),
                     {split: len(source) for split, source in sources.items()})
  return sources, info


def num_batches(num_examples: int, global_batch_size: int) -> int:
  return math.ceil(num_examples / global_batch_size)


def _mix(x: np.ndarray) -> np.ndarray:
  """splitmix64: well-spread 64-bit hashes of integers, vectorised (wrapping arithmetic)."""
  x = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


def random_shift(images_BHWC: np.ndarray, max_shift: int, keys_B: np.ndarray) -> np.ndarray:
  """Shifts each image by up to `max_shift` pixels each way (zero fill); the shift of an image
  is a function of its key alone, so it does not depend on how examples are batched."""
  batch, height, width, _ = images_BHWC.shape
  size = 2 * max_shift + 1
  bits = _mix(keys_B)
  dy = (bits % np.uint64(size)).astype(int)
  dx = (bits // np.uint64(size) % np.uint64(size)).astype(int)
  padded = np.pad(images_BHWC, ((0, 0), (max_shift, max_shift), (max_shift, max_shift), (0, 0)))
  rows = dy[:, None] + np.arange(height)  # [B, H]
  cols = dx[:, None] + np.arange(width)  # [B, W]
  return padded[np.arange(batch)[:, None, None], rows[:, :, None], cols[:, None, :]]


@dataclasses.dataclass(frozen=True)
class LoadBatch:
  """Batch number -> this process's padded, masked batch (the map of the Grain pipeline)."""

  source: ArraySource | RecordSource
  global_batch_size: int
  num_epochs: int = 1
  shuffle_seed: int | None = None  # None: the source's order
  max_shift: int = 0  # random shifts (training augmentation); 0: none
  process_index: int = 0
  process_count: int = 1

  def __len__(self) -> int:
    return num_batches(self.num_epochs * len(self.source), self.global_batch_size)

  @functools.lru_cache(maxsize=4)  # noqa: B019  (a batch spans at most two epochs)
  def permutation(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.shuffle_seed, epoch]).permutation(len(self.source))

  def __call__(self, batch_number: int) -> dict[str, np.ndarray]:
    local_batch_size = self.global_batch_size // self.process_count
    start = batch_number * self.global_batch_size + self.process_index
    positions = start + self.process_count * np.arange(local_batch_size)
    mask = positions < self.num_epochs * len(self.source)
    epoch, offset = np.divmod(np.where(mask, positions, 0), len(self.source))
    indices = offset
    if self.shuffle_seed is not None:
      indices = np.empty_like(offset)
      for e in range(epoch.min(), epoch.max() + 1):  # a batch may straddle two epochs
        indices[epoch == e] = self.permutation(e)[offset[epoch == e]]
    batch = self.source.take(indices)
    image = batch["image"]
    if np.issubdtype(image.dtype, np.integer):
      image = image.astype(np.float32) / 255.0
    if self.max_shift:
      image = random_shift(image, self.max_shift, positions + (self.shuffle_seed or 0) * 2**40)
    image = np.where(mask[:, None, None, None], image, 0).astype(np.float32)
    label = np.where(mask, batch["label"], 0).astype(np.int32)
    return {"image": image, "label": label, "mask": mask}


def train_batches(source, config, **process) -> grain.MapDataset:
  """`num_epochs` passes over `source`, reshuffled every epoch, as one stream of batches.

  Only the very last batch can be partial; it is padded and masked.
  """
  load = LoadBatch(source, config.batch_size, config.num_epochs, config.seed,
                   config.augment_max_shift, **process)
  return grain.MapDataset.range(len(load)).map(load)


def eval_batches(source, config, **process) -> grain.MapDataset:
  load = LoadBatch(source, config.batch_size, **process)
  return grain.MapDataset.range(len(load)).map(load)


def as_iterator(batches: grain.MapDataset, config, start: int = 0,
                put=None) -> grain.DatasetIterator:
  """An iterator over `batches[start:]`, read with `config.num_workers` worker processes.

  With `put` (a function placing a batch on the devices), batches are placed by a background
  thread, `config.prefetch_to_device` ahead of the step. The iterator's state (for checkpoints)
  is the position of the batch last taken from it, whatever was prefetched.
  """
  read_options = grain.ReadOptions(num_threads=config.read_threads,
                                   prefetch_buffer_size=config.prefetch_batches)
  dataset = batches[start:].to_iter_dataset(read_options)
  if config.num_workers:
    dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=config.num_workers))
  if put is not None:
    dataset = dataset.map(put)
    if config.prefetch_to_device:
      dataset = grain.experimental.ThreadPrefetchIterDataset(
          dataset, prefetch_buffer_size=config.prefetch_to_device)
  return iter(dataset)
