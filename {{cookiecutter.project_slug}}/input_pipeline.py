"""Grain input pipeline: sources, a seeded shuffle, and padded-and-masked batches.

Every element is k = `config.steps_per_dispatch` batches stacked, each holding this process's
share of one global batch, as NumPy arrays (see steps.py for what the device does with them):
  image [k, local_batch, H, W, C] as stored (uint8 pixels stay uint8 up to the device),
  label [k, local_batch] int32, mask [k, local_batch] bool (False on padding),
  position [k, local_batch] uint32 (the example's place in the stream; keys its augmentation).
A split is cut into exactly ceil(examples / global_batch) batches on every process, so all
processes run the same number of steps and every real example is seen exactly once per epoch:
nothing is dropped, nothing is counted twice.

One Grain element is gathered with NumPy fancy indexing: Grain's per-example path costs tens of
microseconds per example, more than a training step of a small model. Batch b holds the
examples at positions [b * global_batch, (b + 1) * global_batch) of the stream (`num_epochs`
passes, each a fresh seeded permutation); process p takes positions p, p + P, ... of it, so the
global batch is the same whatever the number of processes P.
"""

import dataclasses
import functools
import glob
import json
import math
import os
import signal

import grain
import numpy as np
from flax import serialization

from image_files import Crops, decode_batch

DATASETS = ("digits", "arrayrecord", "huggingface", "tfds", "synthetic")


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  image_shape: tuple[int, int, int]  # (height, width, channels)
  num_classes: int
  num_examples: dict[str, int]  # split name -> number of examples
  class_names: tuple[str, ...] = ()  # when the data name them (write_arrayrecord --image_folder)
  # As stored: integer pixels reach the model divided by 255, floats as they are (model_input).
  pixel_dtype: str = "uint8"
  # Photos stored whole (write_arrayrecord --resize_shorter), cropped to `image_shape` here.
  crops_on_host: bool = False


def model_input(pixel_dtype: str) -> str:
  """What the model is given of stored pixels of `pixel_dtype` (augment.prepare_images)."""
  return "pixels / 255" if np.issubdtype(pixel_dtype, np.integer) else "pixels as stored"


class ArraySource:
  """Examples held in memory: `take` gathers a batch of them at once."""

  def __init__(self, images: np.ndarray, labels: np.ndarray):
    self.images, self.labels = images, labels

  def __len__(self) -> int:
    return len(self.labels)

  def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    return {"image": self.images[indices], "label": self.labels[indices]}


class RecordSource:
  """Examples in ArrayRecord files, one msgpack-encoded example per record. Images stored
  encoded (`write_arrayrecord.py --keep_encoded`) are decoded here, to `image_shape`: in the
  Grain worker processes, or Grain's threads, that read the batches; photos stored whole
  (`--resize_shorter`) are cropped by `crops`, each by its stream position (`take`)."""

  def __init__(self, paths: list[str], image_shape: tuple[int, int, int],
               crops: Crops | None = None):
    self.records = grain.sources.ArrayRecordDataSource(paths)
    self.image_shape = tuple(image_shape)
    self.crops = crops

  def __len__(self) -> int:
    return len(self.records)

  def take(self, indices: np.ndarray, positions: np.ndarray | None = None
           ) -> dict[str, np.ndarray]:
    examples = [serialization.msgpack_restore(self.records[int(i)]) for i in indices]
    return {"image": decode_batch([ex["image"] for ex in examples], self.image_shape,
                                  self.crops, positions),
            "label": np.array([ex["label"] for ex in examples], np.int32)}


def _digits(config) -> dict[str, ArraySource]:
  """The UCI handwritten digits that scikit-learn ships on disk (1797 images, 8x8, 10 classes)."""
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split

  digits = load_digits()
  images = np.round(digits.images * (255 / 16)).astype(np.uint8)[..., None]  # 0..16 -> 0..255
  labels = digits.target.astype(np.int32)
  train_x, eval_x, train_y, eval_y = train_test_split(
      images, labels, test_size=config.eval_fraction, random_state=0, stratify=labels)
  return {"train": ArraySource(train_x, train_y), "eval": ArraySource(eval_x, eval_y)}


def _synthetic(config) -> dict[str, ArraySource]:
  """Random images and labels of any shape: for benchmarks and tests, not for learning."""
  spec = config.synthetic
  rng = np.random.default_rng(0)

  def split(n):
    images = rng.integers(0, 256, (n, *spec.image_shape), dtype=np.uint8)
    return ArraySource(images, rng.integers(0, spec.num_classes, n, dtype=np.int32))

  return {"train": split(spec.num_train), "eval": split(spec.num_eval)}


def arrayrecord_paths(data_dir: str, split: str) -> list[str]:
  return sorted(glob.glob(os.path.join(data_dir, f"{split}-*.array_record")))


def host_crops(config) -> dict[str, Crops]:
  """How the host cuts photos kept whole (stored whole by write_arrayrecord.py --resize_shorter,
  or in a Hugging Face or TFDS dataset when the run crops): training's random-resized crop
  (`augment_crop`: from the whole photo), else, and in evaluation, the `eval_crop_ratio` centre."""
  return {"eval": Crops(center_ratio=config.eval_crop_ratio),
          "train": Crops(config.seed, tuple(config.augment_crop_scale)
                         if config.augment_crop else None, tuple(config.augment_crop_ratio),
                         config.eval_crop_ratio)}


def get_datasets(config) -> tuple[dict[str, ArraySource | RecordSource], DatasetInfo]:
  """The 'train' and 'eval' sources, and what the model needs to know about them."""
  crops_on_host = False
  if config.dataset == "arrayrecord":
    with open(os.path.join(config.data_dir, "metadata.json")) as f:
      meta = json.load(f)
    image_shape, num_classes = meta["image_shape"], meta["num_classes"]
    crops_on_host = bool(meta.get("resize_shorter"))
    crops = host_crops(config) if crops_on_host else {}
    sources = {split: RecordSource(arrayrecord_paths(config.data_dir, split), image_shape,
                                   crops.get(split)) for split in ("train", "eval")}
    class_names = meta.get("class_names", ())
  elif config.dataset in ("huggingface", "tfds"):
    if config.dataset == "huggingface":  # (the `huggingface` extra)
      import huggingface as reader
    else:  # (the `tfds` extra)
      import tfds_data as reader
    crops_on_host = config.augment_crop  # photos of any size: cropped from the whole photo
    sources, image_shape, class_names = reader.sources(
        config, host_crops(config) if crops_on_host else {})
    num_classes = len(class_names)
  elif config.dataset == "synthetic":
    sources, class_names = _synthetic(config), ()
    image_shape, num_classes = config.synthetic.image_shape, config.synthetic.num_classes
  else:
    sources, class_names = _digits(config), ()
    image_shape = sources["train"].images.shape[1:]
    num_classes = int(sources["train"].labels.max()) + 1
  first = sources["train"].take(np.zeros(1, np.int64))["image"] if len(sources["train"]) else None
  info = DatasetInfo(tuple(image_shape), int(num_classes),
                     {split: len(source) for split, source in sources.items()}, tuple(class_names),
                     "uint8" if first is None else first.dtype.name, crops_on_host)
  return sources, info


DIGITS_SHAPE, DIGITS_CLASSES, DIGITS_EXAMPLES = (8, 8, 1), 10, 1797  # load_digits()


def describe(config) -> DatasetInfo:
  """What `get_datasets(config)` would say of the data, without reading it (for aot.py): the
  digits' figures, the synthetic config, or an ArrayRecord directory's metadata.json."""
  if config.dataset == "arrayrecord":
    with open(os.path.join(config.data_dir, "metadata.json")) as f:
      meta = json.load(f)
    return DatasetInfo(tuple(meta["image_shape"]), int(meta["num_classes"]),
                       dict(meta["num_examples"]), tuple(meta.get("class_names", ())),
                       meta.get("pixel_dtype", "uint8"), bool(meta.get("resize_shorter")))
  if config.dataset in ("huggingface", "tfds"):  # their metadata and one image
    return get_datasets(config)[1]
  if config.dataset == "synthetic":
    spec = config.synthetic
    return DatasetInfo(tuple(spec.image_shape), spec.num_classes,
                       {"train": spec.num_train, "eval": spec.num_eval})
  num_eval = math.ceil(config.eval_fraction * DIGITS_EXAMPLES)  # train_test_split's rounding
  return DatasetInfo(DIGITS_SHAPE, DIGITS_CLASSES,
                     {"train": DIGITS_EXAMPLES - num_eval, "eval": num_eval})


def num_batches(num_examples: int, global_batch_size: int) -> int:
  return math.ceil(num_examples / global_batch_size)


@dataclasses.dataclass(frozen=True)
class LoadBatches:
  """Element number j -> this process's share of batches [j * k, (j + 1) * k) of the stream,
  padded, masked and stacked: `[k, local_batch, ...]` (the map of the Grain pipeline).

  Batches past the end of the stream, and before `first_batch` (a resumed run), are all
  padding: the steps skip them. With `trim` the last element holds only the batches left, so no
  batch is padding alone (evaluation's: its second shape compiles once). Elements are aligned
  to multiples of k batches from the start of the stream whatever `first_batch`, so the steps
  of a run are aligned too.
  """

  source: ArraySource | RecordSource
  global_batch_size: int
  num_epochs: int = 1
  shuffle_seed: int | None = None  # None: the source's order
  steps_per_element: int = 1  # k
  first_batch: int = 0
  process_index: int = 0
  process_count: int = 1
  trim: bool = False

  def __len__(self) -> int:
    return math.ceil(self.num_batches / self.steps_per_element)

  @property
  def num_batches(self) -> int:
    return num_batches(self.num_epochs * len(self.source), self.global_batch_size)

  @functools.lru_cache(maxsize=4)  # noqa: B019  (an element spans few epochs)
  def permutation(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.shuffle_seed, epoch]).permutation(len(self.source))

  def __call__(self, element: int) -> dict[str, np.ndarray]:
    k, local_batch_size = self.steps_per_element, self.global_batch_size // self.process_count
    batch_K1 = element * k + np.arange(k)[:, None]
    if self.trim:
      k = min(k, self.num_batches - element * k)
      batch_K1 = batch_K1[:k]
    positions_KB = (batch_K1 * self.global_batch_size + self.process_index
                    + self.process_count * np.arange(local_batch_size))
    mask_KB = (positions_KB < self.num_epochs * len(self.source)) & (batch_K1 >= self.first_batch)
    epoch, indices = np.divmod(np.where(mask_KB, positions_KB, 0), len(self.source))
    if self.shuffle_seed is not None:
      for e in np.unique(epoch[mask_KB]):  # an element may straddle epochs
        indices[epoch == e] = self.permutation(e)[indices[epoch == e]]
    if getattr(self.source, "crops", None) is not None:
      taken = self.source.take(indices.reshape(-1), positions_KB.reshape(-1))
    else:
      taken = self.source.take(indices.reshape(-1))
    image = taken["image"].reshape(k, local_batch_size, *taken["image"].shape[1:])
    image[~mask_KB] = 0  # a fresh array: padding zeroed in place
    label = np.where(mask_KB, taken["label"].reshape(k, local_batch_size), 0).astype(np.int32)
    return {"image": image, "label": label, "mask": mask_KB,
            "position": positions_KB.astype(np.uint32)}


def train_batches(source, config, first_step: int = 0, **process) -> grain.MapDataset:
  """`num_epochs` passes over `source`, reshuffled every epoch, as one stream of batches, from
  the element holding batch `first_step` on (`first_step`: the steps already done).

  Only the very last batch can be partial; it is padded and masked.
  """
  k = config.steps_per_dispatch
  load = LoadBatches(source, config.batch_size, config.num_epochs, config.seed, k, first_step,
                     **process)
  return grain.MapDataset.range(len(load)).map(load)[first_step // k:]


def eval_batches(source, config, **process) -> grain.MapDataset:
  """The split once, in its order, k batches an element, the last one only those left."""
  load = LoadBatches(source, config.batch_size, steps_per_element=config.steps_per_dispatch,
                     trim=True, **process)
  return grain.MapDataset.range(len(load)).map(load)


def available_cpus() -> int:
  """The cores this process may run on (its affinity: what SLURM, taskset or a container's
  cpuset gave it), not all the machine's."""
  if hasattr(os, "sched_getaffinity"):  # Linux (os.process_cpu_count: Python 3.13 on)
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def default_workers(config) -> int:
  """`config.num_workers`, or when it is -1: none for datasets held in memory (a batch is one
  NumPy gather, which workers would only copy again), else one per core of this process's but
  one (each holds up to `prefetch_batches` elements of k batches of its own: memory bounds
  them too)."""
  if config.num_workers >= 0:
    return config.num_workers
  in_memory = config.dataset in ("digits", "synthetic")
  return 0 if in_memory else max(available_cpus() - 1, 1)


@dataclasses.dataclass(frozen=True)
class HostMemory:
  """What the input pipeline holds in host memory, in elements of k batches of this process's
  share: each Grain worker its read-ahead (`prefetch_batches`), the elements its `read_threads`
  are building and the one in its queue to the main process; the main process the elements
  placed ahead on the devices (`prefetch_to_device`) and the one being placed (and, with no
  worker, the read-ahead itself)."""

  element_bytes: int
  workers: int
  per_worker: int  # elements
  main: int  # elements

  @property
  def bytes(self) -> int:
    return self.element_bytes * (self.workers * self.per_worker + self.main)


def host_memory(config, info: DatasetInfo, num_processes: int = 1) -> HostMemory:
  """The input's expected host memory on each process, for a resolved `config` (k, batch)."""
  image = math.prod(info.image_shape) * np.dtype(info.pixel_dtype).itemsize
  example = image + 4 + 1 + 4  # its label, mask and position
  element = config.steps_per_dispatch * (config.batch_size // num_processes) * example
  workers = default_workers(config)
  ahead = config.prefetch_batches + config.read_threads + 1
  return HostMemory(element, workers, ahead + 1,
                    (0 if workers else ahead) + config.prefetch_to_device + 1)


def available_memory() -> int:
  """This host's memory, or its container's limit (cgroup v2) when lower."""
  total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  try:
    with open("/sys/fs/cgroup/memory.max") as f:
      limit = f.read().strip()
  except OSError:
    return total
  return min(total, int(limit)) if limit.isdigit() else total


def leave_interrupts_to_the_main_process(worker_index: int, num_workers: int) -> None:
  """In each Grain worker: Ctrl-C sends SIGINT to the whole process group, workers too; the main
  process alone takes it (it saves, then stops the workers), so no worker prints a traceback."""
  del worker_index, num_workers
  signal.signal(signal.SIGINT, signal.SIG_IGN)


def as_iterator(batches: grain.MapDataset, config, put=None,
                num_workers: int | None = None) -> grain.DatasetIterator:
  """An iterator over `batches`, read with `num_workers` worker processes (default: chosen by
  `default_workers(config)`). Close it when done: that stops the workers.

  With `put` (a function placing stacked batches on the devices), they are placed by a
  background thread, `config.prefetch_to_device` elements ahead of the step.
  """
  read_options = grain.ReadOptions(num_threads=config.read_threads,
                                   prefetch_buffer_size=config.prefetch_batches)
  dataset = batches.to_iter_dataset(read_options)
  workers = default_workers(config) if num_workers is None else num_workers
  if workers:
    # Elements come back from the workers pickled, not in shared memory: Grain releases shared
    # memory from a background thread, and releases still queued at exit were reported as leaks.
    no_shm = grain.experimental.DatasetOptions(min_shm_size=2**62)
    dataset = grain.experimental.WithOptionsIterDataset(dataset, no_shm)
    dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers),
                                  worker_init_fn=leave_interrupts_to_the_main_process)
  if put is not None:
    dataset = dataset.map(put)
    if config.prefetch_to_device:
      dataset = grain.experimental.ThreadPrefetchIterDataset(
          dataset, prefetch_buffer_size=config.prefetch_to_device)
  return iter(dataset)


