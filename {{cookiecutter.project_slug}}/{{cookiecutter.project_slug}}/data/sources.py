"""The data sources, by `config.dataset`, and what a source gives: its 'train' and 'eval' splits
(`Loaded`) and what the model is told of them (`DatasetInfo`).

A source is a module with `load(config)` (its splits: each a `Split`), `describe(config)` and
`check(config)` (digits.py is the simplest: copy it) and one line in `SOURCES`, which says what
the source reads: rules.py checks a config against it without importing any source, and a run
imports only its own."""

import dataclasses
import importlib
import math
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
from absl import logging

from ..errors import BadData

if TYPE_CHECKING:  # (image_files is imported where images are decoded or cropped)
  from .image_files import Crops


class Source(NamedTuple):
  """A data source's line in `SOURCES`."""

  module: str  # its module's name; one that starts with '.' is in this folder
  reads_data_dir: bool = False  # config.data_dir names its data
  in_memory: bool = False  # held in memory: a batch is one NumPy gather, read without workers


SOURCES = {
    "digits": Source(".digits", in_memory=True),
    "synthetic": Source(".synthetic", in_memory=True),
    "arrayrecord": Source(".arrayrecord", reads_data_dir=True),
    "huggingface": Source(".huggingface", reads_data_dir=True),
    "tfds": Source(".tfds_data", reads_data_dir=True),
}


def source(name: str):
  """The module of the data source `name` (`SOURCES`), imported."""
  return importlib.import_module(SOURCES[name].module, __package__)


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
  # (height, width) that holds any of those crops (its box and the pixels its resize reads): each
  # is sent as its own pixels, end to end (`batches.pack`), with its "box" and "offset", and
  # unpacked and resized on the devices (`config.resize_on_device`: dispatch.on_resized); None:
  # resized on the host.
  canvas: tuple[int, int] | None = None
  # A crop's expected pixels, sent packed (`crop_pixels`); 0: not known (host_memory counts the
  # canvas).
  crop_pixels: int = 0
  # The train split's images a class, where known cheaply (class_weights='balanced'): what was
  # read, not the data's description (aot.py's, from the metadata alone, has none).
  class_counts: tuple[int, ...] = dataclasses.field(default=(), compare=False)


class Split(Protocol):
  """What every source gives of a split ('train', 'eval'): batches.py reads it through this alone.

  `len(split)`: its number of examples. `take(indices, positions)`: the examples at `indices`
  ([S] int64, in that order) as a dict of NumPy arrays of S rows: "image" ([S, H, W, C] of the
  stored dtype) and "label" ([S] integers); a split that can fail to use an example (a record
  unreadable, a file not an image) returns a stand-in for it and adds "failed", {its place in
  `indices`: why, one line}: the example is masked out, and named in the log by `name` and its
  index (a run stops past 1% of them). A split of photos kept whole (`crops`: an
  image_files.Crops, else None) cuts each on the host, keyed by its place in the stream
  (`positions`, [S]); with a canvas, "image" holds each crop's own pixels ([S] arrays of
  [h, w, C]) and "box" ([S, 6]) where its box lies in them (`batches.pack` sends them end to
  end). ArraySource is the simplest; a file source of your own: arrayrecord.RecordSource."""

  name: str  # how the log names it
  crops: "Crops | None"

  def __len__(self) -> int: ...

  def take(self, indices: np.ndarray, positions: np.ndarray | None = None
           ) -> dict[str, np.ndarray]: ...


class Loaded(NamedTuple):
  """What a source's `load(config)` returns."""

  sources: dict[str, Split]  # 'train' and 'eval'
  image_shape: tuple[int, int, int]
  num_classes: int
  class_names: tuple[str, ...] = ()
  crops_on_host: bool = False  # photos kept whole, cropped to image_shape by the reading workers
  canvas: tuple[int, int] | None = None  # DatasetInfo's
  class_counts: tuple[int, ...] = ()  # the train split's images a class, where known cheaply
  crop_pixels: int = 0  # DatasetInfo's


def model_input(pixel_dtype: str) -> str:
  """What the model is given of stored pixels of `pixel_dtype` (steps.forward)."""
  return "pixels / 255" if np.issubdtype(pixel_dtype, np.integer) else "pixels as stored"


class ArraySource:
  """A `Split` held in memory: `take` gathers a batch of it at once."""

  name, crops = "arrays", None  # (never fails; never cropped)

  def __init__(self, images: np.ndarray, labels: np.ndarray):
    self.images, self.labels = images, labels

  def __len__(self) -> int:
    return len(self.labels)

  def take(self, indices: np.ndarray, positions=None) -> dict[str, np.ndarray]:
    return {"image": self.images[indices], "label": self.labels[indices]}


def host_crops(config, canvas: tuple[int, int] | None = None) -> "dict[str, Crops]":
  """How the host cuts photos kept whole (stored whole by write_arrayrecord.py --resize_shorter,
  or in a Hugging Face or TFDS dataset when the run crops): training's random-resized crop
  (`augment_crop`: from the whole photo), else, and in evaluation, the `eval_crop_ratio` centre;
  with a `canvas` (the largest crop), cut for the devices to resize (`Crops.cut`)."""
  from .image_files import Crops

  return {"eval": Crops(center_ratio=config.eval_crop_ratio, canvas=canvas),
          "train": Crops(config.seed, tuple(config.augment_crop_scale)
                         if config.augment_crop else None, tuple(config.augment_crop_ratio),
                         config.eval_crop_ratio, canvas)}


def canvas(config, resize_shorter: int, image_shape) -> tuple[int, int] | None:
  """The (height, width) that holds any crop of the photos with the pixels its resize reads.

  A crop's longest side is the shorter side times the widest aspect drawn (`augment_crop_ratio`);
  the resize reads around it as `Crops.cut` cuts.

  Args:
    config: the run's config.
    resize_shorter: the photos' shorter side as stored.
    image_shape: the model's input [H, W, C].
  Returns:
    (height, width) where `config.resize_on_device`; else None (RandAugment's images: resized
    on the host).
  """
  if not config.get("resize_on_device") or config.get("randaugment"):
    return None
  low, high = config.augment_crop_ratio if config.augment_crop else (1, 1)
  longest = resize_shorter * max(high, 1 / low, 1)
  side = math.ceil(longest + 2 * max(longest / min(image_shape[:2]), 1)) + 4
  return max(side, image_shape[0]), max(side, image_shape[1])  # (a crop resized here: fits)


def crop_pixels(config, image_shape, sizes, splits=("train", "eval")) -> int:
  """A crop's expected pixels as the host cuts them.

  `Crops.cut` cuts its box and the pixels its resize reads around it (`image_files.window`).

  Args:
    config: the run's config.
    image_shape: the model's input [H, W, C].
    sizes: the photos' (width, height) as stored (metadata.json's sample).
    splits: the splits to take the larger of (one unit size serves both iterators).
  Returns:
    The larger of training's mean (16 draws a photo) and evaluation's, in pixels.
  """
  from .image_files import window

  crops, draws = host_crops(config), {"train": 16, "eval": 1}

  def cut(crop, w: int, h: int, position: int) -> int:
    y0, x0, y1, x1 = window(crop.box(w, h, image_shape[:2], position), image_shape, (h, w))
    return (y1 - y0) * (x1 - x0)

  return math.ceil(max(np.mean([cut(crops[split], w, h, i) for w, h in sizes
                                for i in range(draws[split])]) for split in splits))


def get_datasets(config) -> tuple[dict, DatasetInfo]:
  """The 'train' and 'eval' sources of `config.dataset`, and what the model needs to know."""
  loaded = source(config.dataset).load(config)
  if int(loaded.num_classes) < 2:  # (a wrong layout, or a filter: it would train "perfectly")
    where = f" (config.data_dir={config.data_dir!r})" if config.get("data_dir") else ""
    raise BadData(f"config.dataset={config.dataset!r}{where} holds {int(loaded.num_classes)} "
                  f"class{'es' * (int(loaded.num_classes) != 1)}: a classifier needs two or "
                  "more; check the data's layout (a folder a class when it was written).")
  train = loaded.sources["train"]
  counts = loaded.class_counts or (tuple(np.bincount(train.labels, minlength=loaded.num_classes))
                                   if isinstance(train, ArraySource) else ())
  if config.dataset != "synthetic":  # (random labels, not for learning)
    say_scarce(counts, loaded.class_names, config)
  # The stored pixels' type, from the first image (packed crops: its own array, not the object
  # array that holds it).
  first = train.take(np.zeros(1, np.int64))["image"][0] if len(train) else None
  info = DatasetInfo(tuple(loaded.image_shape), int(loaded.num_classes),
                     {split: len(data) for split, data in loaded.sources.items()},
                     tuple(loaded.class_names), "uint8" if first is None else first.dtype.name,
                     loaded.crops_on_host, loaded.canvas, loaded.crop_pixels,
                     tuple(int(n) for n in counts))
  return loaded.sources, info


def say_scarce(counts, names, config) -> None:
  """Says once, as a warning, which classes hold fewer training images than their share of a batch.

  A class's share is the global batch over the classes: each epoch shows a class below it less
  than the others.

  Args:
    counts: each class's training images.
    names: the classes' names.
    config: the run's config (or write_arrayrecord.py's, which has no batch: nothing said).
  """
  batch = config.run.global_batch_size if "run" in config else config.get("batch_size", 0)
  if not batch:  # (write_arrayrecord.py's check: no batch yet)
    return
  share = batch / max(len(counts), 1)
  scarce = sorted((int(n), names[k] if k < len(names) else str(k))
                  for k, n in enumerate(counts) if n < share)
  if scarce:
    listed = ", ".join(f"{name!r} ({n})" for n, name in scarce[:3])
    logging.warning(
        "%d of %d classes hold fewer training images than their share of a batch of %d (%.1f): "
        "%s%s; each epoch shows them less than the others: add images, or weigh their loss "
        "(recipe.loss)", len(scarce), len(counts), batch, share, listed,
        ", ..." if len(scarce) > 3 else "")


def describe(config) -> DatasetInfo:
  """What `get_datasets(config)` would say of the data, without reading it where the source can
  (its `describe`: aot.py), else read."""
  return source(config.dataset).describe(config) or get_datasets(config)[1]
