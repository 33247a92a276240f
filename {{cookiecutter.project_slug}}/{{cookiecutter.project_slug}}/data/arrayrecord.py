"""ArrayRecord shards that write_arrayrecord.py wrote into `config.data_dir`: `train-*` and
`eval-*.array_record` (msgpack records: image, label) and `metadata.json` (shape, classes, pixel
dtype, and `resize_shorter` for photos stored whole, which the host then crops). A data source:
`load`, `describe`, `check` (sources.SOURCES)."""

import glob
import json
import os
from typing import TYPE_CHECKING

import grain
import numpy as np
from flax import serialization

from .sources import DatasetInfo, Loaded, canvas, crop_pixels, host_crops

if TYPE_CHECKING:  # (image_files is imported where images are decoded or cropped)
  from .image_files import Crops



class RecordSource:
  """Examples in ArrayRecord files (msgpack, one a record). Images stored encoded are decoded
  here, in the reading workers; photos stored whole are cropped by `crops`, by stream position.
  `take` also says which records could not be used, and why (`failed`): unreadable, or not an
  example of this data (`problem`).

  Args:
    paths: the ArrayRecord files.
    image_shape: the images' [H, W, C].
    crops: a `Crops` for photos stored whole; None: none.
    name: the split's name, in the log's lines.
    pixel_dtype: the pixels' dtype as stored.
    num_classes: the labels' bound (a label outside it is not an example); None: not checked.
  """

  def __init__(self, paths: list[str], image_shape: tuple[int, int, int],
               crops: "Crops | None" = None, name: str = "arrayrecord",
               pixel_dtype: str = "uint8", num_classes: int | None = None):
    self.records = grain.sources.ArrayRecordDataSource(paths)
    self.image_shape, self.pixel_dtype = tuple(image_shape), pixel_dtype
    self.crops, self.name, self.num_classes = crops, name, num_classes

  def __len__(self) -> int:
    return len(self.records)

  def read(self, indices: list[int]) -> list:
    """The records, each decoded from msgpack, or why it could not be read (a str)."""
    from .image_files import read_rows, why

    # One at a time: ArrayRecord's batched read starts a thread a shard on every call (0.067 ms a
    # record here, against 0.017); the workers and Grain's threads already read in parallel.
    records = read_rows(None, self.records.__getitem__, indices)
    examples = []
    for record in records:
      try:
        examples.append(record if isinstance(record, str) else
                        serialization.msgpack_restore(record))
      except Exception as e:  # noqa: BLE001
        examples.append(why(e))
    return examples

  def take(self, indices: np.ndarray, positions: np.ndarray | None = None
           ) -> dict[str, np.ndarray]:
    from .image_files import decode_batch

    examples = self.read([int(i) for i in indices])
    unread = {i: why for i, example in enumerate(examples)
              if (why := example if isinstance(example, str) else self.problem(example))}
    blank = {"image": "unread" if self.crops else np.zeros(self.image_shape, self.pixel_dtype),
             "label": 0}  # masked later
    examples = [blank if i in unread else ex for i, ex in enumerate(examples)]
    decoded, failed = decode_batch([ex["image"] for ex in examples], self.image_shape,
                                  self.crops, positions)
    return {**decoded, "label": np.array([ex["label"] for ex in examples], np.int32),
            "failed": failed | unread}


  def problem(self, example) -> str | None:
    """Why a record that was read is not an example of this data (its keys, its image's shape
    or dtype, its label outside [0, classes)), or None."""
    if not (isinstance(example, dict) and {"image", "label"} <= example.keys()):
      held = sorted(example) if isinstance(example, dict) else type(example).__name__
      return f"not a record of image and label: holds {held}"
    image, label = example["image"], example["label"]
    if isinstance(image, np.ndarray):
      if image.shape != self.image_shape or image.dtype != self.pixel_dtype:
        return (f"an image of {image.dtype} {list(image.shape)}, not the data's "
                f"{self.pixel_dtype} {list(self.image_shape)}")
    elif not isinstance(image, bytes):
      return f"an image of type {type(image).__name__}, not an array or encoded bytes"
    label = np.asarray(label)
    if label.shape != () or not np.issubdtype(label.dtype, np.integer):
      return f"a label of {label.dtype} {list(label.shape)}, not an integer"
    if self.num_classes is not None and not 0 <= label < self.num_classes:
      return f"label {label} outside [0, {self.num_classes}), the data's classes"
    return None


def arrayrecord_paths(data_dir: str, split: str) -> list[str]:
  return sorted(glob.glob(os.path.join(data_dir, f"{split}-*.array_record")))


def metadata(data_dir: str) -> dict:
  with open(os.path.join(data_dir, "metadata.json")) as f:
    return json.load(f)


def load(config) -> Loaded:
  meta = metadata(config.data_dir)
  crops_on_host, crop_canvas, pixels = crops_of(config, meta)
  crops = host_crops(config, crop_canvas) if crops_on_host else {}
  sources = {split: RecordSource(arrayrecord_paths(config.data_dir, split), meta["image_shape"],
                                 crops.get(split), f"arrayrecord {config.data_dir} {split}",
                                 meta.get("pixel_dtype", "uint8"), meta["num_classes"])
             for split in ("train", "eval")}
  return Loaded(sources, tuple(meta["image_shape"]), meta["num_classes"],
                tuple(meta.get("class_names", ())), crops_on_host, crop_canvas,
                tuple(meta.get("train_class_counts", ())), pixels)


def crops_of(config, meta: dict) -> tuple[bool, tuple[int, int] | None, int]:
  """Whether the host crops (photos stored whole), the canvas its crops are sent in
  (`sources.canvas`: None where the host resizes them), and a crop's expected pixels there (0:
  unknown, data written before metadata.json held a sample of the photos' "sizes")."""
  shorter = meta.get("resize_shorter")
  room = canvas(config, shorter, meta["image_shape"]) if shorter else None
  sizes = meta.get("sizes") if room else None
  return bool(shorter), room, crop_pixels(config, meta["image_shape"], sizes) if sizes else 0


def describe(config) -> DatasetInfo:
  meta = metadata(config.data_dir)
  return DatasetInfo(tuple(meta["image_shape"]), int(meta["num_classes"]),
                     dict(meta["num_examples"]), tuple(meta.get("class_names", ())),
                     meta.get("pixel_dtype", "uint8"), *crops_of(config, meta))


def check(config) -> str | None:
  written = "write_arrayrecord.py wrote"
  if not config.data_dir:
    return f"config.data_dir is empty; give the directory that {written}: --config.data_dir=DIR."
  if not os.path.isdir(config.data_dir):
    return (f"config.data_dir={config.data_dir!r} " + ("is not a directory" if os.path.exists(
        config.data_dir) else "does not exist") + f"; give the directory that {written}.")
  for split in ("train", "eval"):
    if not arrayrecord_paths(config.data_dir, split):
      return (f"config.data_dir={config.data_dir!r} holds no {split}-*.array_record files; "
              "write them with write_arrayrecord.py.")
  if not os.path.isfile(os.path.join(config.data_dir, "metadata.json")):
    return (f"config.data_dir={config.data_dir!r} has no metadata.json; write the data with "
            "write_arrayrecord.py.")
  return None
