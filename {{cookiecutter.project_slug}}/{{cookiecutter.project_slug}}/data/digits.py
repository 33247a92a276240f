"""The UCI handwritten digits that scikit-learn ships on disk (1797 images of 8x8, 10 classes):
the default data, nothing downloaded; `config.eval_fraction` of them held out (stratified).

A data source, whole: `load`, `describe` and `check` (named in sources.SOURCES). Copy it
to add your own."""

import math

import numpy as np

from .sources import ArraySource, DatasetInfo, Loaded

SHAPE, CLASSES, EXAMPLES = (8, 8, 1), 10, 1797  # load_digits()


def load(config) -> Loaded:
  """The 'train' and 'eval' splits, in memory (uint8 pixels, 0..16 scaled to 0..255)."""
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split

  digits = load_digits()
  images = np.round(digits.images * (255 / 16)).astype(np.uint8)[..., None]
  labels = digits.target.astype(np.int32)
  train_x, eval_x, train_y, eval_y = train_test_split(
      images, labels, test_size=config.eval_fraction, random_state=0, stratify=labels)
  return Loaded({"train": ArraySource(train_x, train_y), "eval": ArraySource(eval_x, eval_y)},
                SHAPE, CLASSES)


def describe(config) -> DatasetInfo:
  """What `load` gives, without loading (aot.py)."""
  num_eval = math.ceil(config.eval_fraction * EXAMPLES)  # train_test_split's rounding
  return DatasetInfo(SHAPE, CLASSES, {"train": EXAMPLES - num_eval, "eval": num_eval})


def check(config) -> str | None:
  """What is wrong with the config for this data, before anything is read (rules.py), or None."""
  return None  # (config.eval_fraction has its value rule in rules.py)
