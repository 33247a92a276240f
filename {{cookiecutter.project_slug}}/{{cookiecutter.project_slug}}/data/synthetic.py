"""Random images and labels of any shape (`config.synthetic`): for benchmarks and tests, not for
learning. A data source: `load`, `describe`, `check` (sources.SOURCES)."""

import numpy as np

from .sources import ArraySource, DatasetInfo, Loaded


def load(config) -> Loaded:
  spec = config.synthetic
  rng = np.random.default_rng(0)

  def split(n):
    images = rng.integers(0, 256, (n, *spec.image_shape), dtype=np.uint8)
    return ArraySource(images, rng.integers(0, spec.num_classes, n, dtype=np.int32))

  return Loaded({"train": split(spec.num_train), "eval": split(spec.num_eval)},
                tuple(spec.image_shape), spec.num_classes)


def describe(config) -> DatasetInfo:
  spec = config.synthetic
  return DatasetInfo(tuple(spec.image_shape), spec.num_classes,
                     {"train": spec.num_train, "eval": spec.num_eval})


def check(config) -> str | None:
  spec = config.synthetic
  positive = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1  # noqa: E731
  if not (len(spec.image_shape) == 3 and all(map(positive, spec.image_shape))):
    return f"config.synthetic.image_shape={spec.image_shape!r} must be (height, width, channels)."
  for key in ("num_classes", "num_train", "num_eval"):
    if not positive(spec[key]):
      return f"config.synthetic.{key}={spec[key]!r} must be a positive integer."
  return None
