"""What the Hugging Face and TFDS sources share: their check (`check_hub`), and the shape a run
takes from their first images (`first_shape`)."""

import io

from absl import logging
from PIL import Image

from .image_files import GRAY_MODES


def check_hub(config, package: str, extra: str, probe, more=lambda config: None) -> str | None:
  """A Hugging Face or TFDS source's check (their `check`): its package installed, image_size a
  shape, `more(config)`, then the data opened by `probe(config)` (its ValueError said)."""
  import importlib.util

  try:
    installed = importlib.util.find_spec(package) is not None
  except ModuleNotFoundError:  # its parent package is missing
    installed = False
  if not installed:
    return (f"config.dataset={config.dataset!r} needs the `{package}` package: pip install -e "
            f"'.[{extra}]'.")
  size = config.image_size
  if size and not (isinstance(size, (tuple, list)) and len(size) == 3 and all(
      isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in size)):
    return (f"config.image_size={size!r} must be (height, width, channels), e.g. "
            "--config.image_size='(224,224,3)'.")
  if wrong := more(config):
    return wrong
  try:  # the data's folder, splits, image and label
    probe(config)
  except ValueError as e:
    return str(e)
  return None


def encoded_shape(data: bytes) -> tuple[int, int, int]:
  """(height, width, channels) that an encoded image decodes to here: 1 channel if gray, else 3."""
  with Image.open(io.BytesIO(data)) as image:
    return image.size[1], image.size[0], 1 if image.mode in GRAY_MODES else 3


def first_shape(encoded, num_images: int, name: str, look: int = 64) -> tuple[int, int, int]:
  """The shape a run takes without `config.image_size`: the first image's (`encoded(i)`: image
  i's bytes). Where the first `look` differ in height or width, says so, naming what it takes."""
  shapes = [encoded_shape(encoded(i)) for i in range(min(look, num_images))]
  sizes = sorted({shape[:2] for shape in shapes})
  if len(sizes) > 1:
    logging.warning(
        "%s: the first %d training images have %d sizes (height x width %s); each is scaled to "
        "cover and centre-cropped to the first's, %dx%d: give --config.image_size=H,W to choose",
        name, len(shapes), len(sizes), ", ".join(f"{h}x{w}" for h, w in sizes[:4])
        + (", ..." if len(sizes) > 4 else ""), *shapes[0][:2])
  return shapes[0]
