"""Image files: found, decoded to the run's image shape (scaled to cover it, centre-cropped), and
the crops of photos stored whole (`Crops`). NumPy, PIL and simplejpeg (JPEGs, when installed):
it runs in Grain's workers."""

import dataclasses
import glob
import io
import math
import os
import struct

import numpy as np
from absl import logging
from PIL import Image, ImageOps

from ..errors import ConfigError

try:  # libjpeg-turbo without PIL's overhead: the same library, so PIL's pixels
  import simplejpeg
except ImportError:  # PIL decodes alone
  simplejpeg = None


def check_hub(config, package: str, extra: str, probe, more=lambda config: None) -> str | None:
  """A Hugging Face or TFDS source's check (their `check`): its package installed, image_size a
  shape, `more(config)`, then the data opened by `probe(config)` (its ValueError said).

  Args:
    config: the run's config.
    package: the package the source needs.
    extra: the project's extra that installs it.
    probe: config -> opens the data (raises ValueError where it cannot).
    more: config -> what else is wrong, or None.
  Returns:
    What is wrong, in a line, or None.
  """
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


# The pixels an image may have (width x height) to be decoded: PIL's own decompression-bomb bound
# (Image.MAX_IMAGE_PIXELS); write_arrayrecord.py's, evaluate.py's and predict.py's
# --max_image_pixels.
MAX_PIXELS = 89_478_485
Image.MAX_IMAGE_PIXELS = None  # (PIL's own check, a warning then an error: this limit replaces it)
ORIENTATION = 0x0112  # the EXIF tag: 1 upright; 3, 6, 8 turned; 2, 4, 5, 7 mirrored


def open_image(data: bytes, max_pixels: int = MAX_PIXELS):
  """PIL's image of `data`, its header read (not its pixels). Raises ValueError, naming its size
  and the limit, for an image of more than `max_pixels` pixels."""
  image = Image.open(io.BytesIO(data))
  if image.width * image.height > max_pixels:
    image.close()
    raise ValueError(f"{image.width}x{image.height} is {image.width * image.height / 1e6:.0f} "
                     f"megapixels, over the limit of {max_pixels / 1e6:.0f} "
                     "(--max_image_pixels)")
  return image


def orientation(image) -> int:
  """PIL's `image`'s EXIF orientation, from its header alone (a PNG's EXIF after its pixels is
  not looked for: PIL would decode them all to find it)."""
  if image.format == "PNG" and "exif" not in image.info:
    return 1
  return image.getexif().get(ORIENTATION, 1)


def upright_size(image) -> tuple[int, int]:
  """(width, height) of PIL's `image` as seen, its EXIF orientation applied."""
  turned = orientation(image) in (5, 6, 7, 8)
  return (image.height, image.width) if turned else image.size


def upright(image):
  """PIL's `image` turned as its EXIF orientation says (a phone's photo held sideways: its pixels
  as it is seen), else itself."""
  return ImageOps.exif_transpose(image) if orientation(image) != 1 else image


def eight_bit(image):
  """A 16-bit gray image (PNG's: PIL's I;16 modes, or I) as 8 bits, scaled (its top byte): PIL's
  convert would clip it at 255, a photo almost all white. Any other image: itself."""
  if not (image.mode.startswith("I;16") or image.mode == "I"):
    return image
  return Image.fromarray((np.asarray(image, np.uint32) >> 8).clip(0, 255).astype(np.uint8))


def decode_image(data: bytes, image_shape: tuple[int, int, int],
                 max_pixels: int = MAX_PIXELS) -> np.ndarray:
  """An encoded image (JPEG, PNG, ...) as uint8 [H, W, C]: upright (its EXIF orientation
  applied), gray (C = 1) or RGB (C = 3), scaled until it covers H x W and center-cropped
  (unchanged if already H x W).

  Args:
    data: the encoded bytes.
    image_shape: [H, W, C].
    max_pixels: the most pixels decoded: a larger image raises ValueError.
  """
  height, width, channels = image_shape
  with open_image(data, max_pixels) as image:
    image = eight_bit(upright(image)).convert("L" if channels == 1 else "RGB")
    if image.size != (width, height):
      image = ImageOps.fit(image, (width, height), Image.Resampling.BILINEAR)
    return np.asarray(image).reshape(height, width, channels)


def decode_batch(encoded: list, image_shape, crops=None, positions=None
                 ) -> tuple[dict[str, np.ndarray], dict[int, str]]:
  """Encoded images as a batch: each cut by `crops` when given, else scaled to cover and
  center-cropped (`decode_image`).

  Args:
    encoded: the images' bytes (arrays pass as they are).
    image_shape: [H, W, C].
    crops: a `Crops`; None: none.
    positions: each example's stream position (the crops' draws).
  Returns:
    {"image": the batch} (with a `Crops` of a canvas: each crop's own pixels, [h, w, C] in an
    object array, and "box": `Crops.cut`'s, for `batches.pack`), and {i: why} for those that
    failed (zeros; no pixels).
  """
  if all(isinstance(data, np.ndarray) for data in encoded):  # arrays, as stored
    return {"image": np.stack(encoded)}, {}
  positions = np.zeros(len(encoded), np.int64) if positions is None else positions
  canvas = crops.canvas if crops is not None else None
  if canvas:
    images = np.empty(len(encoded), object)
    images[:] = [np.zeros((0, 0, image_shape[2]), np.uint8)] * len(encoded)
  else:
    images = np.zeros((len(encoded), *image_shape), np.uint8)
  boxes, failed = np.zeros((len(encoded), 6), np.float32), {}
  for i, (data, position) in enumerate(zip(encoded, positions, strict=True)):
    try:
      if isinstance(data, str):  # why it could not be read
        failed[i] = data
      elif canvas:  # (a copy of the crop alone: the photo's decoded pixels freed at once)
        crop, boxes[i] = crops.cut(data, image_shape, int(position))
        images[i] = np.ascontiguousarray(crop)
      elif crops is not None:
        images[i] = crops(data, image_shape, int(position))
      else:
        images[i] = decode_image(data, image_shape) if isinstance(data, bytes) else data
    except Exception as e:  # noqa: BLE001  (any unreadable image is named and skipped)
      failed[i] = why(e)
  return {"image": images, **({"box": boxes} if canvas else {})}, failed


def read_rows(read_many, read_one, indices: list[int]) -> list:
  """Rows read together; where that fails, each alone, so that one bad row names itself and
  spoils no other.

  Args:
    read_many: indices -> their rows; None: none.
    read_one: i -> row i.
    indices: the rows to read.
  Returns:
    The rows, each a row or why it could not be read (a str).
  """
  if read_many is not None:
    try:
      return read_many(indices)
    except Exception:  # noqa: BLE001
      pass
  rows = []
  for i in indices:
    try:
      rows.append(read_one(i))
    except Exception as e:  # noqa: BLE001
      rows.append(why(e))
  return rows


def why(error: Exception) -> str:
  """An error in a few words: its type and message (without PIL's `<_io.BytesIO object ...>`)."""
  message = str(error).split(" <_io.")[0]
  return f"{type(error).__name__}: {message}" if message else type(error).__name__


def encoded_shape(data: bytes) -> tuple[int, int, int]:
  """(height, width, channels) that an encoded image decodes to here (upright): 1 channel if gray,
  else 3."""
  with Image.open(io.BytesIO(data)) as image:
    width, height = upright_size(image)
    return height, width, 1 if image.mode in GRAY_MODES else 3


def first_shape(encoded, num_images: int, name: str, look: int = 64) -> tuple[int, int, int]:
  """The shape a run takes without `config.image_size`: the first image's. Where the first
  images differ in height or width, says so, naming what it takes.

  Args:
    encoded: i -> image i's bytes.
    num_images: the images.
    name: the data's name, in what is said.
    look: how many to look at.
  """
  shapes = [encoded_shape(encoded(i)) for i in range(min(look, num_images))]
  sizes = sorted({shape[:2] for shape in shapes})
  if len(sizes) > 1:
    logging.warning(
        "%s: the first %d training images have %d sizes (height x width %s); each is scaled to "
        "cover and centre-cropped to the first's, %dx%d: give --config.image_size=H,W to choose",
        name, len(shapes), len(sizes), ", ".join(f"{h}x{w}" for h, w in sizes[:4])
        + (", ..." if len(sizes) > 4 else ""), *shapes[0][:2])
  return shapes[0]


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")  # the image files that folders are read for


GRAY_MODES = ("1", "L", "LA", "I", "I;16", "F")  # PIL modes of one channel


def images_under(directory: str, suffixes: tuple[str, ...] = IMAGE_SUFFIXES) -> list[str]:
  """The files ending in one of `suffixes` anywhere under `directory`, sorted."""
  paths = glob.glob(os.path.join(glob.escape(directory), "**", "*"), recursive=True)
  return sorted(p for p in paths if p.lower().endswith(suffixes) and os.path.isfile(p))


def holds_image_folders(directory: str) -> bool:
  """Whether `directory` (or its train/) holds class folders with image files in them."""
  train = os.path.join(directory, "train")
  root = train if os.path.isdir(train) else directory
  return os.path.isdir(root) and any(entry.is_dir() and any(name.lower().endswith(IMAGE_SUFFIXES)
                                    for name in os.listdir(entry.path))
             for entry in os.scandir(root))


def read_image(path: str, image_shape, keep_encoded: bool = False,
               pixel_dtype: str = "uint8", center_ratio: float = 1.0,
               max_pixels: int = MAX_PIXELS) -> np.ndarray | bytes | str:
  """An image file decoded (`decode_image`), or a .npy file's array as stored.

  Args:
    path: the file.
    image_shape: [H, W, C].
    keep_encoded: the file's bytes once they decode, rather than the pixels.
    pixel_dtype: a .npy file's dtype.
    center_ratio: < 1: evaluation's crop of a photo stored whole (`Crops`).
    max_pixels: the most pixels decoded.
  Returns:
    The pixels (or bytes), or why the file could not be read (an image over `max_pixels` too).
  """
  try:
    if path.lower().endswith(".npy"):
      image = np.load(path, allow_pickle=False)
      if image.shape != tuple(image_shape) or image.dtype != pixel_dtype:
        return (f"holds {image.dtype} {list(image.shape)}, not the run's {pixel_dtype} "
                f"{list(image_shape)}")
      return image
    with open(path, "rb") as f:
      data = f.read()
    image = (Crops(center_ratio=center_ratio, max_pixels=max_pixels)(data, image_shape, 0)
             if center_ratio < 1 else decode_image(data, image_shape, max_pixels))
    return data if keep_encoded else image
  except Exception as e:  # noqa: BLE001  (any unreadable file is reported and skipped)
    return f"{type(e).__name__}: {e}"


def window(box, image_shape, full_hw) -> tuple[int, int, int, int]:
  """(y0, x0, y1, x1): the pixels that the resize of a box reads: the box, its reach (the scale,
  at least 1) and one more each way (`Crops.cut` sends them; `sources.crop_pixels` expects them).

  Args:
    box: (left, top, right, bottom).
    image_shape: the resize's [H, W, C].
    full_hw: the image's (height, width).
  """
  left, top, right, bottom = box
  reach_h = max((bottom - top) / image_shape[0], 1)
  reach_w = max((right - left) / image_shape[1], 1)
  return (max(math.floor(top - reach_h) - 1, 0), max(math.floor(left - reach_w) - 1, 0),
          min(math.ceil(bottom + reach_h) + 1, full_hw[0]),
          min(math.ceil(right + reach_w) + 1, full_hw[1]))


@dataclasses.dataclass(frozen=True)
class Crops:
  """How a photo stored whole (`write_arrayrecord.py --resize_shorter`) becomes `image_shape`: with
  `scale`, Inception's random crop (area fraction in `scale`, log-uniform aspect in `ratio`, the
  first of 10 draws that fits, else the centre), drawn from `seed` and the stream position alone;
  without, evaluation's centre crop (scaled to cover `image_shape` / `center_ratio`). The box comes
  from the header, and a JPEG is decoded at the smallest DCT scale that keeps the box's pixels.
  Resized here (call it), or cut for the devices to resize (`cut`, with a `canvas`)."""

  seed: int = 0
  scale: tuple[float, float] | None = None
  ratio: tuple[float, float] = (3 / 4, 4 / 3)
  center_ratio: float = 0.875
  canvas: tuple[int, int] | None = None  # (height, width) of the largest crop `cut` sends
  max_pixels: int = MAX_PIXELS  # a larger image is refused (`open_image`)

  def box(self, width: int, height: int, out_hw, position: int):
    """A crop's (left, top, right, bottom) in the stored image's pixels.

    Args:
      width: the image's.
      height: the image's.
      out_hw: the crop's resized (height, width).
      position: the example's stream position (the draw's).
    """
    if self.scale is not None:
      rng = np.random.default_rng([self.seed, position])
      for _ in range(10):
        area = width * height * rng.uniform(*self.scale)
        aspect = math.exp(rng.uniform(math.log(self.ratio[0]), math.log(self.ratio[1])))
        w, h = math.sqrt(area * aspect), math.sqrt(area / aspect)
        if w <= width and h <= height:
          left, top = rng.uniform(0, width - w), rng.uniform(0, height - h)
          return left, top, left + w, top + h
    zoom = max(out_hw[1] / width, out_hw[0] / height) / self.center_ratio
    w, h = min(out_hw[1] / zoom, width), min(out_hw[0] / zoom, height)
    return (width - w) / 2, (height - h) / 2, (width + w) / 2, (height + h) / 2

  def __call__(self, data: bytes, image_shape, position: int) -> np.ndarray:
    """The photo's box resized here (PIL's bilinear resize), uint8.

    Args:
      data: the photo's bytes.
      image_shape: the resize's [H, W, C].
      position: the example's stream position.
    """
    image, box = self.decoded(data, image_shape, position)
    return resized(image, box, image_shape)

  def cut(self, data: bytes, image_shape, position: int) -> tuple[np.ndarray, np.ndarray]:
    """The photo's box with the pixels its resize reads around it, for the devices to resize
    (`augment.resize_crops`). Where they would be larger than `canvas`, the box resized here
    instead (its box: the whole of it).

    Args:
      data: the photo's bytes.
      image_shape: the resize's [H, W, C].
      position: the example's stream position.
    Returns:
      The pixels cut, and their box: (top, left, bottom, right, height, width), those of the box
      and of the pixels cut.
    """
    height, width, channels = image_shape
    image, (left, top, right, bottom) = self.decoded(data, image_shape, position)
    pixels = np.asarray(image)  # (a PIL image's: copied)
    y0, x0, y1, x1 = window((left, top, right, bottom), image_shape, pixels.shape[:2])
    if y1 - y0 > self.canvas[0] or x1 - x0 > self.canvas[1]:
      whole = resized(image, (left, top, right, bottom), image_shape)
      return whole, np.array([0, 0, height, width, height, width], np.float32)
    return (pixels[y0:y1, x0:x1].reshape(y1 - y0, x1 - x0, channels),
            np.array([top - y0, left - x0, bottom - y0, right - x0, y1 - y0, x1 - x0], np.float32))

  def decoded(self, data: bytes, image_shape, position: int):
    """The photo decoded (a JPEG at the smallest DCT scale that keeps the box's pixels: an array
    by simplejpeg, else PIL's image; upright, its EXIF orientation applied) and its box (left,
    top, right, bottom) in those pixels.

    Args:
      data: the photo's bytes.
      image_shape: the resize's [H, W, C].
      position: the example's stream position.
    """
    height, width, channels = image_shape
    mode = "L" if channels == 1 else "RGB"
    full = jpeg_size(data, self.max_pixels)
    opened = None if full else open_image(data, self.max_pixels)  # (its header, not its pixels)
    turned = opened is not None and orientation(opened) != 1
    full = full or upright_size(opened)
    left, top, right, bottom = self.box(*full, (height, width), position)
    wanted = (math.ceil(full[0] * width / (right - left)),
              math.ceil(full[1] * height / (bottom - top)))
    if opened is None:  # simplejpeg, at the scale Image.draft would take
      scale = draft_scale(full, wanted)
      image = simplejpeg.decode_jpeg(data, "GRAY" if channels == 1 else "RGB",
                                     min_width=-(-full[0] // scale),
                                     min_height=-(-full[1] // scale))
      size = image.shape[1], image.shape[0]
    else:
      with opened:
        if not turned:  # (a photo held sideways: decoded whole, then turned)
          opened.draft(mode, wanted)  # (a JPEG only)
        image = eight_bit(upright(opened)).convert(mode)
      size = image.size
    sx, sy = size[0] / full[0], size[1] / full[1]  # 1 unless a JPEG decoded scaled
    return image, (left * sx, top * sy, right * sx, bottom * sy)


def resized(image, box, image_shape) -> np.ndarray:
  """A box of an image resized by PIL (bilinear).

  Args:
    image: PIL's image, or an array.
    box: (left, top, right, bottom).
    image_shape: the resized [H, W, C].
  """
  height, width, channels = image_shape
  if isinstance(image, np.ndarray):
    image = Image.fromarray(image[..., 0] if channels == 1 else image)
  image = image.resize((width, height), Image.Resampling.BILINEAR, box=box)
  return np.asarray(image).reshape(height, width, channels)


def jpeg_size(data: bytes, max_pixels: int = MAX_PIXELS) -> tuple[int, int] | None:
  """(width, height) of a JPEG that simplejpeg decodes (YCbCr or gray: PIL's pixels; upright;
  at most `max_pixels`), else None: for PIL to decode (no simplejpeg, another format or colour
  space, an EXIF orientation that turns it, or more pixels: refused there)."""
  if simplejpeg is None or not data.startswith(b"\xff\xd8"):
    return None
  if jpeg_orientation(data) != 1:
    return None
  try:
    height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
  except ValueError:
    return None
  fits = colorspace in ("YCbCr", "Gray") and width * height <= max_pixels
  return (width, height) if fits else None


def jpeg_orientation(data: bytes) -> int:
  """A JPEG's EXIF orientation (1 without one), read from the bytes of its first directory:
  PIL's open and getexif would cost a camera's JPEG a third of its crop's CPU time here."""
  at = data.find(b"Exif\0\0", 0, 1 << 16)
  if at < 0:
    return 1
  tiff, order = at + 6, "<" if data[at + 6:at + 8] == b"II" else ">"
  try:
    directory = tiff + struct.unpack_from(order + "I", data, tiff + 4)[0]
    for i in range(struct.unpack_from(order + "H", data, directory)[0]):
      tag, _, _, value = struct.unpack_from(order + "HHIH", data, directory + 2 + 12 * i)
      if tag == ORIENTATION:
        return value
  except struct.error:  # (a damaged block: as without one)
    pass
  return 1


def draft_scale(full: tuple[int, int], wanted: tuple[int, int]) -> int:
  """Image.draft's DCT scale for a JPEG of `full` (width, height): the largest of 8, 4, 2, 1 that
  keeps `wanted` pixels (1 where it is larger than the image)."""
  scale = min(full[0] // wanted[0], full[1] // wanted[1])
  return next((s for s in (8, 4, 2) if scale >= s), 1)


def find_images(paths: list[str]) -> list[str]:
  """The files of `paths`, a folder meaning the .jpg, .jpeg, .png and .npy files under it
  (sorted). Raises ConfigError for a path that does not exist."""
  found = []
  for path in paths:
    if os.path.isdir(path):
      found += images_under(path, (*IMAGE_SUFFIXES, ".npy"))
    elif os.path.exists(path):
      found.append(path)
    else:
      raise ConfigError(f"{path!r} does not exist; give image files or folders of them.")
  return found
