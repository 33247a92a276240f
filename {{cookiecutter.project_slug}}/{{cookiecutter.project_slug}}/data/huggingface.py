"""Hugging Face datasets read in place (`config.dataset = 'huggingface'`, the `huggingface`
extra): a `save_to_disk` folder or a folder of data files in `config.data_dir` (its splits named
by `datasets` from the files' names and folders, as on the Hub), or a Hub dataset named by
`config.huggingface.name` (downloaded to Hugging Face's cache). Nothing is converted.

The image column is the one whose feature is an `Image` and the label column the `ClassLabel`
one, unless named in `config.huggingface`; label ids and class names are the `ClassLabel`'s.
Training reads the split 'train'; evaluation 'validation' or 'test', whichever exists (named by
`config.huggingface.eval_split` when both or neither do). Images are decoded in Grain's workers,
to `image_shape` (the first training image's height and width, 1 channel if it is gray, else 3,
or `config.image_size`): cut from the whole photo by `sources.host_crops` when the run
crops (`augment_crop`), else as predict.py decodes files (`image_files.decode_image`).
"""

import os

import numpy as np

from . import image_files
from .sources import Loaded, host_crops

EVAL_SPLITS = ("validation", "test")


def read(config) -> dict:
  """The dataset's splits: {name: datasets.Dataset}. Raises ValueError saying what is wrong."""
  import datasets

  datasets.disable_progress_bars()  # the log keeps to training's lines
  spec, data_dir = config.huggingface, config.data_dir
  if spec.name:
    return dict(datasets.load_dataset(spec.name))
  if not os.path.isdir(data_dir):
    raise ValueError(f"config.data_dir={data_dir!r} is not a directory; give a folder that "
                     "datasets' save_to_disk wrote, or one of Parquet files, or "
                     "--config.huggingface.name=NAME (the Hub).")
  if os.path.isfile(os.path.join(data_dir, "dataset_dict.json")):
    return dict(datasets.load_from_disk(data_dir))
  try:  # data files: their splits as `datasets` names them (the Hub's own patterns)
    return dict(datasets.load_dataset(data_dir))
  except FileNotFoundError as e:  # (datasets' DataFilesNotFoundError, EmptyDatasetError)
    raise ValueError(f"config.data_dir={data_dir!r} holds neither a dataset saved by "
                     "save_to_disk (dataset_dict.json) nor data files that datasets reads "
                     f"(train.parquet, data/train-*.parquet, train/*.parquet, ...): {e}") from None


def columns(dataset, spec) -> tuple[str, str]:
  """The image and label columns of `dataset` (a split), found from its features or named."""
  import datasets

  found = {}
  for kind, key, feature in (("image", "image_column", datasets.Image),
                             ("label", "label_column", datasets.ClassLabel)):
    named = spec[key]
    of_kind = [name for name, f in dataset.features.items() if isinstance(f, feature)]
    if named and named not in dataset.features:
      raise ValueError(f"config.huggingface.{key}={named!r} is no column; the columns are "
                       f"{', '.join(dataset.features)}.")
    if not named and len(of_kind) != 1:
      raise ValueError(f"{len(of_kind) or 'no'} columns hold {feature.__name__} features"
                       f"{': ' + ', '.join(of_kind) if of_kind else ''}; name the {kind} "
                       f"column: --config.huggingface.{key}=NAME.")
    found[kind] = named or of_kind[0]
  return found["image"], found["label"]


def splits(config) -> tuple[dict, str, str]:
  """({'train': dataset, 'eval': dataset}, image column, label column). Raises ValueError."""
  loaded, spec = read(config), config.huggingface
  eval_split = spec.eval_split or None
  if eval_split is None:
    present = [name for name in EVAL_SPLITS if name in loaded]
    if len(present) != 1:
      raise ValueError(f"the dataset's splits are {', '.join(loaded)}: "
                       f"{'both' if present else 'neither'} of {' and '.join(EVAL_SPLITS)}; name "
                       "the evaluation split: --config.huggingface.eval_split=NAME.")
    eval_split = present[0]
  for key, name in (("train split", "train"), ("config.huggingface.eval_split", eval_split)):
    if name not in loaded:
      raise ValueError(f"the dataset has no {key} {name!r}; its splits are {', '.join(loaded)}.")
  image, label = columns(loaded["train"], spec)
  return {"train": loaded["train"], "eval": loaded[eval_split]}, image, label


class Source:
  """A split of a Hugging Face dataset as a Grain source: `take` decodes a batch of images.

  Args:
    dataset: the split (a `datasets.Dataset`).
    image_column: its images' column.
    label_column: its labels' column.
    image_shape: the images' [H, W, C].
    crops: a `Crops` for photos cropped on the host; None: none.
    name: the split's name, in the log's lines.
  """

  def __init__(self, dataset, image_column: str, label_column: str, image_shape, crops=None,
               name: str = "huggingface"):
    import datasets

    self.dataset = dataset.cast_column(image_column, datasets.Image(decode=False))
    self.name = name  # in the log's lines
    self.image_column, self.label_column = image_column, label_column
    self.image_shape, self.crops = tuple(image_shape), crops

  def __len__(self) -> int:
    return len(self.dataset)

  def encoded(self, image: dict) -> bytes | str:
    """The image's bytes (the file's, where only its path is stored), or why not."""
    if image["bytes"] is None:
      try:
        with open(image["path"], "rb") as f:
          return f.read()
      except OSError as e:
        return image_files.why(e)
    return image["bytes"]

  def take(self, indices: np.ndarray, positions: np.ndarray | None = None
           ) -> dict[str, np.ndarray]:
    rows = self.dataset[[int(i) for i in indices]]
    decoded, failed = image_files.decode_batch(
        [self.encoded(image) for image in rows[self.image_column]], self.image_shape, self.crops,
        positions)
    return {**decoded, "label": np.asarray(rows[self.label_column], np.int32),
            "failed": failed}


def sources(config, crops: dict) -> tuple[dict[str, Source], tuple[int, int, int],
                                          tuple[str, ...]]:
  """The 'train' and 'eval' sources (each cut by its `crops`, if any), the image shape, the
  class names."""
  loaded, image, label = splits(config)
  first = Source(loaded["train"], image, label, (1, 1, 1))
  shape = tuple(config.image_size) or image_files.first_shape(
      lambda i: first.encoded(first.dataset[i][image]), len(first), "huggingface")
  feature = loaded["train"].features[label]
  names = tuple(getattr(feature, "names", None) or ())
  if not names:  # integer labels without names: 0 .. max
    names = tuple(str(i) for i in range(max(loaded["train"][label]) + 1))
  where = config.huggingface.name or config.data_dir
  return ({split: Source(ds, image, label, shape, crops.get(split), f"huggingface {where} {split}")
           for split, ds in loaded.items()}, shape, names)


def load(config) -> Loaded:  # (the data source's interface: sources.SOURCES)
  return read_in_place(config, sources)


def read_in_place(config, sources) -> Loaded:
  """A source read in place's `load` (this one's, tfds_data's): photos of any size, cut from the
  whole photo on the host when the run crops. `sources(config, crops)`: splits, shape, names."""
  crops_on_host = config.augment_crop
  found, shape, names = sources(config, host_crops(config) if crops_on_host else {})
  return Loaded(found, shape, len(names), names, crops_on_host)


def describe(config) -> None:  # the shape and classes are known once the data is opened
  return None


def check(config) -> str | None:
  return image_files.check_hub(config, "datasets", "huggingface", splits)
