"""TensorFlow Datasets read without TensorFlow (`config.dataset = 'tfds'`, the `tfds` extra): the
dataset `config.tfds_name` (e.g. 'imagenet2012') as TFDS prepared it in its data dir
`config.data_dir` (default: TFDS's, ~/tensorflow_datasets), in ArrayRecord files
(`tfds build NAME --file_format=array_record`), read with random access by
`tfds.data_source`. Nothing is converted.

The image feature is the `Image` one and the label the `ClassLabel` one, whose names are the
class names. Training reads the split 'train'; evaluation 'validation', else 'test'. Images
are decoded in Grain's workers, to `image_shape` (the first training image's height and width,
1 channel if gray, else 3, or `config.image_size`): cut from the whole photo by
`sources.host_crops` when the run crops (`augment_crop`), else as predict.py decodes
files (`image_files.decode_image`).
"""

import numpy as np

from . import image_files
from .huggingface import read_in_place
from .sources import Loaded

EVAL_SPLITS = ("validation", "test")


def builder(config):
  """The prepared dataset's builder (read-only: no code of the dataset's needed), its image and
  label features, and its eval split. Raises ValueError saying what is wrong."""
  import tensorflow_datasets as tfds

  where = config.data_dir or "TFDS's data dir"
  try:
    found = tfds.builder(config.tfds_name, data_dir=config.data_dir or None)
  except Exception as e:  # noqa: BLE001  (TFDS raises several kinds for a name it cannot find)
    raise ValueError(f"config.tfds_name={config.tfds_name!r} is not in {where} "
                     f"({type(e).__name__}); prepare it there: tfds build {config.tfds_name} "
                     "--file_format=array_record --data_dir=DIR.") from None
  if not found.is_prepared():
    raise ValueError(f"{config.tfds_name} is not prepared in {where}; prepare it: tfds build "
                     f"{config.tfds_name} --file_format=array_record --data_dir=DIR.")
  if found.info.file_format != tfds.core.FileFormat.ARRAY_RECORD:
    raise ValueError(f"{config.tfds_name} in {where} is stored as "
                     f"{found.info.file_format.value}, "
                     "which has no random access; prepare it again with "
                     "--file_format=array_record.")
  features = found.info.features
  kinds = {kind: [k for k, f in features.items() if isinstance(f, feature)]
           for kind, feature in (("image", tfds.features.Image),
                                 ("label", tfds.features.ClassLabel))}
  for kind, keys in kinds.items():
    if len(keys) != 1:
      raise ValueError(f"{config.tfds_name} has {len(keys) or 'no'} {kind} features "
                       f"({', '.join(features)}); this reader takes exactly one.")
  splits = found.info.splits
  eval_split = next((name for name in EVAL_SPLITS if name in splits), None)
  if "train" not in splits or eval_split is None:
    raise ValueError(f"{config.tfds_name}'s splits are {', '.join(splits)}: it needs 'train' "
                     f"and one of {', '.join(EVAL_SPLITS)}.")
  return found, kinds["image"][0], kinds["label"][0], eval_split


class Source:
  """A TFDS split as a Grain source: `take` decodes a batch of its images.

  Args:
    data_source: the split (`tfds.data_source`'s).
    image_key: its images' feature.
    label_key: its labels' feature.
    image_shape: the images' [H, W, C].
    crops: a `Crops` for photos cropped on the host; None: none.
    name: the split's name, in the log's lines.
  """

  def __init__(self, data_source, image_key: str, label_key: str, image_shape, crops=None,
               name: str = "tfds"):
    self.data, self.image_key, self.label_key = data_source, image_key, label_key
    self.image_shape, self.crops, self.name = tuple(image_shape), crops, name

  def __len__(self) -> int:
    return len(self.data)

  def take(self, indices: np.ndarray, positions: np.ndarray | None = None
           ) -> dict[str, np.ndarray]:
    rows = image_files.read_rows(self.data.__getitems__, self.data.__getitem__,
                                 [int(i) for i in indices])
    decoded, failed = image_files.decode_batch(
        [row if isinstance(row, str) else row[self.image_key] for row in rows], self.image_shape,
        self.crops, positions)
    return {**decoded, "failed": failed, "label": np.array(
        [0 if isinstance(row, str) else row[self.label_key] for row in rows], np.int32)}


def sources(config, crops: dict) -> tuple[dict[str, Source], tuple[int, int, int],
                                          tuple[str, ...]]:
  """The 'train' and 'eval' sources (each cut by its `crops`, if any), the image shape, the
  class names."""
  import tensorflow_datasets as tfds

  found, image, label, eval_split = builder(config)
  data = {split: found.as_data_source(split=name, decoders={image: tfds.decode.SkipDecoding()})
          for split, name in (("train", "train"), ("eval", eval_split))}
  shape = tuple(config.image_size) or image_files.first_shape(
      lambda i: data["train"][i][image], len(data["train"]), "tfds")
  return ({split: Source(d, image, label, shape, crops.get(split),
                         f"tfds {config.tfds_name} {split}") for split, d in data.items()},
          shape, tuple(found.info.features[label].names))


def load(config) -> Loaded:  # (the data source's interface: sources.SOURCES)
  return read_in_place(config, sources)


def describe(config) -> None:  # the shape and classes are known once the data is opened
  return None


def check(config) -> str | None:
  def named(config):
    if not config.tfds_name:
      return ("config.dataset='tfds' needs config.tfds_name: the dataset's TFDS name, e.g. "
              "--config.tfds_name=imagenet2012.")
    return None

  return image_files.check_hub(config, "tensorflow_datasets", "tfds", builder, named)
