"""Grain input pipeline: sources, a seeded shuffle, and padded-and-masked batches.

Every batch is a dict of NumPy arrays holding this process's share of one global batch:
  image [local_batch, H, W, C] float32, label [local_batch] int32, mask [local_batch] bool.
`mask` is False on padding. Every split is cut into exactly ceil(examples / global_batch)
batches on every process, so all processes run the same number of steps and every real example
is seen exactly once per epoch: nothing is dropped, nothing is counted twice.
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
  """A random-access Grain source over in-memory arrays."""

  def __init__(self, images: np.ndarray, labels: np.ndarray):
    self.images, self.labels = images, labels

  def __len__(self) -> int:
    return len(self.labels)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return {"image": self.images[index], "label": self.labels[index]}


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


def decode_record(record: bytes) -> dict[str, np.ndarray]:
  example = serialization.msgpack_restore(record)
  return {"image": example["image"], "label": np.int32(example["label"])}


def arrayrecord_paths(data_dir: str, split: str) -> list[str]:
  return sorted(glob.glob(os.path.join(data_dir, f"{split}-*.array_record")))


def _arrayrecord(config) -> dict[str, grain.MapDataset]:
  """ArrayRecord shards written by write_arrayrecord.py: `{split}-NNNNN-of-NNNNN.array_record`."""
  return {
      split: grain.MapDataset.source(
          grain.sources.ArrayRecordDataSource(arrayrecord_paths(config.data_dir, split))
      ).map(decode_record)
      for split in ("train", "eval")
  }


def get_datasets(config) -> tuple[dict[str, grain.MapDataset], DatasetInfo]:
  """Returns the unbatched, unshuffled splits ('train', 'eval') and what the model needs to know."""
  if config.dataset == "arrayrecord":
    with open(os.path.join(config.data_dir, "metadata.json")) as f:
      meta = json.load(f)
    splits = _arrayrecord(config)
    image_shape, num_classes = meta["image_shape"], meta["num_classes"]
  else:
    sources = {"digits": _digits, "synthetic": _synthetic}[config.dataset](config)
    splits = {name: grain.MapDataset.source(src) for name, src in sources.items()}
    image_shape = sources["train"].images.shape[1:]
    num_classes = int(sources["train"].labels.max()) + 1
    if config.dataset == "synthetic":
      num_classes = config.synthetic.num_classes
  info = DatasetInfo(tuple(image_shape), int(num_classes),
                     {name: len(ds) for name, ds in splits.items()})
  return splits, info


class RandomShift(grain.transforms.RandomMap):
  """Shifts an image by up to `max_shift` pixels in each direction, filling with zeros."""

  def __init__(self, max_shift: int):
    self.max_shift = max_shift

  def random_map(self, example, rng: np.random.Generator):
    image, s = example["image"], self.max_shift
    height, width = image.shape[:2]
    dy, dx = rng.integers(0, 2 * s + 1, size=2)
    padded = np.pad(image, ((s, s), (s, s), (0, 0)))
    return {**example, "image": padded[dy:dy + height, dx:dx + width]}


def _to_model_input(example):
  image = example["image"]
  if np.issubdtype(image.dtype, np.integer):
    image = image.astype(np.float32) / 255.0
  return {"image": image.astype(np.float32), "label": np.int32(example["label"]), "mask": True}


def num_batches(num_examples: int, global_batch_size: int) -> int:
  return math.ceil(num_examples / global_batch_size)


def batched(
    dataset: grain.MapDataset,
    *,
    global_batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.MapDataset:
  """This process's padded, masked batches of `dataset`: the same count on every process.

  Process p takes examples p, p + P, p + 2P, ...; so global batch k is examples
  [k * global_batch_size, (k + 1) * global_batch_size) of `dataset`, whatever P is.
  """
  local_batch_size = global_batch_size // process_count
  count = num_batches(len(dataset), global_batch_size)
  local = dataset[process_index::process_count].map(_to_model_input)
  pad = functools.partial(grain.experimental.batch_and_pad, batch_size=local_batch_size)
  batches = local.batch(local_batch_size, batch_fn=pad)
  if len(batches) < count:  # this process ran out of examples: add fully masked batches
    empty = pad([{**local[0], "mask": False}])
    batches = grain.MapDataset.concatenate(
        [batches, grain.MapDataset.source([empty] * (count - len(batches)))])
  return batches


def train_batches(dataset: grain.MapDataset, config, **process) -> grain.MapDataset:
  """`num_epochs` passes over `dataset`, reshuffled every epoch, as one stream of batches.

  Only the very last batch can be partial; it is padded and masked.
  """
  dataset = dataset.shuffle(seed=config.seed).repeat(config.num_epochs)
  if config.augment_max_shift:
    dataset = dataset.random_map(RandomShift(config.augment_max_shift), seed=config.seed)
  return batched(dataset, global_batch_size=config.batch_size, **process)


def eval_batches(dataset: grain.MapDataset, config, **process) -> grain.MapDataset:
  return batched(dataset, global_batch_size=config.batch_size, **process)


def as_iterator(batches: grain.MapDataset, config, start: int = 0) -> grain.DatasetIterator:
  """An iterator over `batches[start:]`, with `config.num_workers` worker processes."""
  read_options = grain.ReadOptions(num_threads=config.read_threads,
                                   prefetch_buffer_size=config.prefetch_batches)
  dataset = batches[start:].to_iter_dataset(read_options)
  if config.num_workers:
    dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=config.num_workers))
  return iter(dataset)
