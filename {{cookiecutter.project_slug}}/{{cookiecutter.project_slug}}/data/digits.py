"""The UCI handwritten digits (1797 images of 8x8, 10 classes; Alpaydin and Kaynak, CC BY 4.0),
as scikit-learn ships them (digits.csv.gz, copied here: nothing downloaded, no scikit-learn):
the default data; `config.eval_fraction` of them held out, stratified, as scikit-learn's
`train_test_split(..., random_state=0, stratify=labels)` holds them out (`split`).

A data source, whole: `load`, `describe` and `check` (named in sources.SOURCES). Copy it
to add your own."""

import math
import os

import numpy as np

from .sources import ArraySource, DatasetInfo, Loaded

SHAPE, CLASSES, EXAMPLES = (8, 8, 1), 10, 1797
FILE = os.path.join(os.path.dirname(__file__), "digits.csv.gz")  # a row an image: 64 pixels, label


def load(config) -> Loaded:
  """The 'train' and 'eval' splits, in memory (uint8 pixels, 0..16 scaled to 0..255)."""
  rows = np.loadtxt(FILE, delimiter=",")
  images = np.round(rows[:, :-1].reshape(-1, *SHAPE) * (255 / 16)).astype(np.uint8)
  labels = rows[:, -1].astype(np.int32)
  train, held_out = split(labels, config.eval_fraction)
  return Loaded({"train": ArraySource(images[train], labels[train]),
                 "eval": ArraySource(images[held_out], labels[held_out])}, SHAPE, CLASSES)


def split(labels: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
  """The indices of the training examples and of the `fraction` held out, each class's share
  kept: scikit-learn's StratifiedShuffleSplit at random_state=0, the same draws in its order."""
  rng = np.random.RandomState(0)
  counts = np.bincount(labels)
  by_class = np.split(np.argsort(labels, kind="stable"), np.cumsum(counts)[:-1])
  num_eval = math.ceil(fraction * len(labels))
  train_K = approximate_mode(counts, len(labels) - num_eval, rng)
  eval_K = approximate_mode(counts - train_K, num_eval, rng)
  train, held_out = [], []
  for indices, n_train, n_eval in zip(by_class, train_K, eval_K, strict=True):
    indices = indices[rng.permutation(len(indices))]
    train += list(indices[:n_train])
    held_out += list(indices[n_train:n_train + n_eval])
  return rng.permutation(train), rng.permutation(held_out)


def approximate_mode(counts: np.ndarray, draws: int, rng) -> np.ndarray:
  """How many of the draws each class gets: its share, floored, then one more each in order of
  what the floor left, as scikit-learn's `_approximate_mode`.

  Args:
    counts: each class's examples.
    draws: the examples to draw.
    rng: draws the ties (NumPy's Generator).
  """
  share = counts / counts.sum() * draws
  taken = np.floor(share)
  left = int(draws - taken.sum())
  remainder = share - taken
  for value in np.sort(np.unique(remainder))[::-1]:
    if left <= 0:
      break
    tied = rng.choice(np.flatnonzero(remainder == value), size=min((remainder == value).sum(),
                                                                      left), replace=False)
    taken[tied] += 1
    left -= len(tied)
  return taken.astype(int)


def describe(config) -> DatasetInfo:
  """What `load` gives, without loading (aot.py)."""
  num_eval = math.ceil(config.eval_fraction * EXAMPLES)  # train_test_split's rounding
  return DatasetInfo(SHAPE, CLASSES, {"train": EXAMPLES - num_eval, "eval": num_eval})


def check(config) -> str | None:
  """What is wrong with the config for this data, before anything is read (rules.py), or None."""
  return None  # (config.eval_fraction has its value rule in rules.py)
