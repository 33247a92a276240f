"""Writes a dataset as ArrayRecord shards that `config.dataset = 'arrayrecord'` reads.

  python write_arrayrecord.py --out_dir=data/mine --image_folder=photos  # photos/CLASS/*.jpg
  python write_arrayrecord.py --out_dir=data/mine --npz=mine.npz         # your arrays
  python write_arrayrecord.py --out_dir=data/digits                      # the digits, a demo

--image_folder: one subfolder per class, named after it (labels 0, 1, ... follow the names'
sorted order), holding JPEG or PNG files (in subfolders too). With `train/` and `val/` inside,
those are the two splits; otherwise `--eval_fraction` of each class is held out (seeded).
Images are decoded to uint8 (upright: their EXIF orientation applied) and, with
`--image_size=H[,W]`, scaled and center-cropped to it; without, images of several sizes are
fitted so to a square of side FIT_SIDE (224), or their typical (median) shorter side if less
(said in one line; and those a crop loses more than a quarter of: a panorama). They keep 1
channel if all are gray, else they are RGB.
`--keep_encoded` stores each file's bytes as they are (smaller on disk): the Grain workers then
decode, and resize, them while training. `--resize_shorter=S` (with `--image_size`, the size
that training and evaluation crop to, e.g. 224 from 256) keeps each photo whole, with its
aspect: encoded, as a JPEG of shorter side S where it was larger (at quality 95; else the file's
bytes), so that training crops from all of it (image_files.Crops). An unreadable image is
reported by its path and skipped; the class names go into `metadata.json`.

The .npz holds `train_images`, `train_labels`, `eval_images`, `eval_labels` (images
[N, H, W, C], anything else refused; feature vectors as [N, 1, F, 1], trained with
--config.augment_max_shift=0; labels [N], integers from 0). Store pixels as uint8, 0 to 255:
they stay uint8 up to the device, which divides them by 255 (float images reach the model as
they are, at 4x the bytes). Other integer pixels are written as uint8 if they fit; pixels that
stay far below 255 (0..16, say) get a warning. Without --npz or --image_folder: the digits, as
uint8.

Each record is one example, msgpack-encoded by flax.serialization; `metadata.json` records the
image shape, the number of classes (and their names) and the split sizes. Then train with
--config.dataset=arrayrecord --config.data_dir=OUT_DIR.
"""

import concurrent.futures
import functools
import glob
import io
import json
import os
import sys
from collections.abc import Iterable

import ml_collections
import numpy as np
from absl import app, flags
from array_record.python.array_record_module import ArrayRecordWriter
from flax import serialization
from PIL import Image

from {{cookiecutter.project_slug}}.data import batches, digits, image_files
from {{cookiecutter.project_slug}}.training import report

KEYS = ("train_images", "train_labels", "eval_images", "eval_labels")


def as_pixels(split: str, images: np.ndarray) -> np.ndarray:
  """Integer images as uint8 (refused if they do not fit 0..255); float images as they are.
  A warning when uint8 pixels stay far below 255: the step divides them by 255."""
  if images.dtype.kind in "iu" and images.dtype != np.uint8:
    low, high = int(images.min()), int(images.max())
    if low < 0 or high > 255:
      raise ValueError(f"{split}_images hold integers from {low} to {high}, which do not fit "
                       "uint8; scale them to 0..255 (or store floats, given to the model as "
                       "they are).")
    images = images.astype(np.uint8)
  if images.dtype == np.uint8 and images.max() < 64:
    print(f"warning: {split}_images are at most {images.max()} of 255; the step divides uint8 "
          f"pixels by 255, so the model sees 0 to {images.max() / 255:.2f}. Rescale them to "
          "0..255 unless that is what you mean.", file=sys.stderr)
  return images


def encode(image: np.ndarray | bytes, label: int) -> bytes:
  """One record: the image (an array, or a file's encoded bytes) and its label."""
  image = image if isinstance(image, bytes) else np.asarray(image)
  return serialization.msgpack_serialize({"image": image, "label": np.asarray(label, np.int32)})


def write_records(out_dir: str, split: str, records: Iterable[tuple[int, bytes]], count: int,
                  num_shards: int) -> int:
  """Writes `{split}-NNNNN-of-NNNNN.array_record` shards: record number i goes to the i-th part of
  `num_shards` consecutive parts, so that reading the shards in name order gives the records in
  order.

  Args:
    out_dir: where.
    split: the split's name.
    records: (i, the record's bytes), in any order; a number missing is skipped.
    count: the records' numbers, 0 to count - 1.
    num_shards: the files.
  Returns:
    How many records were written.
  """
  ends = np.cumsum([len(part) for part in np.array_split(np.arange(count), num_shards)])
  shards = [ArrayRecordWriter(os.path.join(out_dir, f"{split}-{i:05d}-of-{num_shards:05d}"
                                           ".array_record"), "group_size:1")
            for i in range(num_shards)]
  written = 0
  for index, record in records:
    shards[int(np.searchsorted(ends, index, side="right"))].write(record)
    written += 1
  for shard in shards:
    shard.close()
  return written


def write_metadata(out_dir: str, image_shape, num_classes: int, num_examples: dict[str, int],
                   **extra) -> None:
  """Writes metadata.json, which the arrayrecord source reads.

  Args:
    out_dir: where.
    image_shape: the images' [H, W, C].
    num_classes: the labels' bound.
    num_examples: each split's examples.
    **extra: what else it holds (class names, pixel dtype, the photos' stored sizes, ...).
  """
  metadata = dict(image_shape=[int(d) for d in image_shape], num_classes=int(num_classes),
                  num_examples=num_examples, **extra)
  with open(os.path.join(out_dir, "metadata.json"), "w") as f:
    json.dump(metadata, f, indent=2)


def write_dataset(out_dir: str, splits: dict[str, tuple[np.ndarray, np.ndarray]],
                  num_shards: int = 4) -> None:
  """Writes arrays as ArrayRecord files with their metadata.json.

  Args:
    out_dir: where.
    splits: {split: (images [N, H, W, C], labels [N])} for 'train' and 'eval'.
    num_shards: the files a split.
  """
  for split, (images, _) in splits.items():
    if np.ndim(images) != 4:
      shape = "[" + ", ".join(map(str, np.shape(images))) + "]"
      raise ValueError(
          f"{split}_images is {shape}; images must be [N, H, W, C]. For feature vectors [N, F], "
          "store them as [N, 1, F, 1] (`x.reshape(len(x), 1, -1, 1)`) and train with "
          "--config.augment_max_shift=0 (no shifts along the features).")
  splits = {split: (as_pixels(split, np.asarray(images)), np.asarray(labels))
            for split, (images, labels) in splits.items()}
  train = splits["train"][0]
  for split, (images, labels) in splits.items():
    if len(images) != len(labels):
      raise ValueError(f"{split}: {len(images)} images but {len(labels)} labels.")
    if (images.dtype, images.shape[1:]) != (train.dtype, train.shape[1:]):
      raise ValueError(f"{split}_images are {images.dtype} {list(images.shape[1:])}, the train "
                       f"images {train.dtype} {list(train.shape[1:])}; store every split alike "
                       "(the reader takes any other as a bad record).")
  os.makedirs(out_dir, exist_ok=True)
  for split, (images, labels) in splits.items():
    records = ((i, encode(images[i], labels[i])) for i in range(len(labels)))
    write_records(out_dir, split, records, len(labels), num_shards)
  write_metadata(out_dir, splits["train"][0].shape[1:],
                 max(labels.max() for _, labels in splits.values()) + 1,
                 {split: len(labels) for split, (_, labels) in splits.items()},
                 pixel_dtype=splits["train"][0].dtype.name,
                 train_class_counts=np.bincount(splits["train"][1]).tolist())


def list_image_folder(folder: str, eval_fraction: float,
                      ) -> tuple[list[str], dict[str, list[tuple[str, int]]]]:
  """The class names and, for 'train' and 'eval', the (path, label) of every image file.
  Raises ValueError, naming the folder, for a tree that holds fewer than two classes or an
  empty class."""
  def classes_in(directory: str) -> list[str]:
    return sorted(entry.name for entry in os.scandir(directory) if entry.is_dir())

  if not os.path.isdir(folder):
    raise ValueError(f"--image_folder={folder!r} is not a directory.")
  split_dirs = {"train": os.path.join(folder, "train"), "eval": os.path.join(folder, "val")}
  has_splits = all(os.path.isdir(d) for d in split_dirs.values())
  root = split_dirs["train"] if has_splits else folder
  classes = classes_in(root)
  if not classes:
    raise ValueError(f"{root} has no class folders: put each class's images (.jpg, .jpeg, .png) "
                     f"in {os.path.join(root, 'CLASS_NAME')}/.")
  if len(classes) == 1:  # (a wrong layout: a classifier of one class learns nothing)
    raise ValueError(f"{root} holds one class folder, {classes[0]!r}: a classifier needs two or "
                     f"more; give the folder whose subfolders are the classes ({root}/cat/, "
                     f"{root}/dog/, ...).")
  files = {name: image_files.images_under(os.path.join(root, name)) for name in classes}
  for name, paths in files.items():
    if not paths:
      raise ValueError(f"class folder {os.path.join(root, name)} holds no .jpg, .jpeg or .png "
                       "file; add its images or remove the folder.")
  if has_splits:
    unknown = sorted(set(classes_in(split_dirs["eval"])) - set(classes))
    if unknown:
      raise ValueError(f"{split_dirs['eval']} has classes that train/ lacks: "
                       f"{', '.join(unknown)}.")
    examples = {
        "train": [(p, label) for label, name in enumerate(classes) for p in files[name]],
        "eval": [(p, label) for label, name in enumerate(classes)
                 for p in image_files.images_under(os.path.join(split_dirs["eval"], name))]}
  else:
    if not 0 < eval_fraction < 1:
      raise ValueError(f"--eval_fraction={eval_fraction} must be between 0 and 1 (or put the "
                       "images in train/ and val/ folders).")
    rng, examples = np.random.default_rng(0), {"train": [], "eval": []}
    for label, name in enumerate(classes):
      held_out = set(rng.permutation(len(files[name]))[:round(eval_fraction * len(files[name]))])
      for i, path in enumerate(files[name]):
        examples["eval" if i in held_out else "train"].append((path, label))
  if not examples["eval"]:
    raise ValueError(f"no image was held out for evaluation from {folder}; raise "
                     "--eval_fraction or add images to val/.")
  return classes, examples


def read_header(path: str, max_pixels: int = image_files.MAX_PIXELS
                ) -> tuple[tuple[int, int], str] | str:
  """((width, height), mode) from the file's header (as seen: its EXIF orientation applied), or
  why it could not be read (more than `max_pixels` too)."""
  try:
    with open(path, "rb") as f, image_files.open_image(f.read(), max_pixels) as image:
      return image_files.upright_size(image), image.mode
  except Exception as e:  # noqa: BLE001  (any unreadable file is reported and skipped)
    return f"{type(e).__name__}: {e}"


def shrink(path: str, shorter: int, channels: int, max_pixels: int = image_files.MAX_PIXELS
           ) -> bytes | str:
  """A file as encoded bytes, upright, its shorter side at most `shorter`: a larger photo is
  scaled down, and a photo held sideways turned (its EXIF orientation), either stored as a JPEG
  of quality 95.

  Args:
    path: the file.
    shorter: the longest shorter side kept.
    channels: 1 (gray) or 3 (RGB).
    max_pixels: the most pixels decoded.
  Returns:
    The bytes, or why it could not be read (more than `max_pixels` too).
  """
  mode = "L" if channels == 1 else "RGB"
  try:
    with open(path, "rb") as f:
      data = f.read()
    with image_files.open_image(data, max_pixels) as image:
      turned = image_files.orientation(image) != 1
      if min(image.size) <= shorter and not turned:
        image.convert(mode)  # decodes: a broken file fails here
        return data
      if not turned:  # a JPEG decodes at a smaller scale
        image.draft(mode, tuple(max(round(s * shorter / min(image.size)), 1) for s in image.size))
      image = image_files.upright(image).convert(mode)
      size = tuple(max(round(s * min(shorter / min(image.size), 1)), 1) for s in image.size)
      image = image.resize(size, Image.Resampling.BICUBIC) if size != image.size else image
      out = io.BytesIO()
      image.save(out, "JPEG", quality=95)
      return out.getvalue()
  except Exception as e:  # noqa: BLE001  (any unreadable file is reported and skipped)
    return f"{type(e).__name__}: {e}"


def write_image_folder(out_dir: str, folder: str, image_size: tuple[int, int] | None = None,
                       keep_encoded: bool = False, eval_fraction: float = 0.2,
                       num_shards: int = 4, num_threads: int | None = None,
                       resize_shorter: int = 0, max_pixels: int = image_files.MAX_PIXELS
                       ) -> list[str]:
  """Writes the images of a folder (see the module's docstring). Checks the whole tree (file
  names and image headers) before writing anything.

  Args:
    out_dir: where.
    folder: class folders of images (or train/ and val/ of them).
    image_size: the images' (height, width); None: the first image's.
    keep_encoded: the files' bytes, decoded as training reads them, rather than pixels.
    eval_fraction: the share held out for evaluation (without a val/).
    num_shards: the files a split.
    num_threads: the threads that read the images; None: a core each.
    resize_shorter: > 0: photos kept whole, stored with their shorter side at most this.
    max_pixels: the most pixels decoded.
  Returns:
    The skipped paths (an image over `max_pixels` among them).
  """
  if resize_shorter and not image_size:
    raise ValueError("--resize_shorter needs --image_size: the size that training and evaluation "
                     "crop the photos to (e.g. --resize_shorter=256 --image_size=224).")
  if resize_shorter and resize_shorter < max(image_size):
    raise ValueError(f"--resize_shorter={resize_shorter} is below --image_size="
                     f"{','.join(map(str, image_size))}: the stored photos would be enlarged; "
                     "give a shorter side of at least the image size.")
  classes, examples = list_image_folder(folder, eval_fraction)
  num_threads = num_threads or batches.available_cpus()
  skipped = []
  with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:  # PIL releases the GIL
    for split, pairs in examples.items():
      headers = list(pool.map(functools.partial(read_header, max_pixels=max_pixels),
                              [path for path, _ in pairs], chunksize=64))
      skipped += [(path, h) for (path, _), h in zip(pairs, headers, strict=True)
                  if isinstance(h, str)]
      examples[split] = [(p, label, h) for (p, label), h in zip(pairs, headers, strict=True)
                         if not isinstance(h, str)]
    headers = [h for pairs in examples.values() for _, _, h in pairs]
    sizes = sorted({size for size, _ in headers})
    if image_size is None and len(sizes) == 1:
      image_size = sizes[0][::-1]
    elif image_size is None:  # their typical (median) shorter side, not one thin crop's
      shorter = sorted(min(size) for size, _ in headers)
      side = min(FIT_SIDE, shorter[len(shorter) // 2])
      image_size, smaller = (side, side), sum(s < side for s in shorter)
      print(f"the images have {len(sizes)} sizes ({sizes[0][1]}x{sizes[0][0]}, {sizes[1][1]}x"
            f"{sizes[1][0]}, ...): each is scaled to cover {side}x{side} (their typical shorter "
            f"side, at most {FIT_SIDE}" + (f"; {smaller} smaller scaled up" if smaller else "") +
            ") and centre-cropped (--image_size=H,W for another size; --resize_shorter=S with it "
            "keeps them whole)")
    if not resize_shorter:
      say_cropped(examples, image_size)
    channels = 1 if all(mode in image_files.GRAY_MODES for _, mode in headers) else 3
    image_shape = (*image_size, channels)
    os.makedirs(out_dir, exist_ok=True)
    num_examples, train_class_counts = {}, [0] * len(classes)
    for split, triples in examples.items():
      def records(split=split, triples=triples):
        chunk = 1024  # decoded a chunk at a time, in order, by the threads
        for start in range(0, len(triples), chunk):
          part = triples[start:start + chunk]
          images = pool.map(functools.partial(
              shrink, shorter=resize_shorter, channels=channels, max_pixels=max_pixels)
              if resize_shorter else functools.partial(
              image_files.read_image, image_shape=image_shape, keep_encoded=keep_encoded,
              max_pixels=max_pixels), [p for p, _, _ in part])
          for i, ((path, label, _), image) in enumerate(zip(part, images, strict=True)):
            if isinstance(image, str):
              skipped.append((path, image))
              continue
            train_class_counts[label] += split == "train"
            yield start + i, encode(image, label)
            if sys.stderr.isatty() and (start + i) % 64 == 0:
              report.draw_bar(start + i + 1, len(triples), split)
      num_examples[split] = write_records(out_dir, split, records(), len(triples), num_shards)
      if sys.stderr.isatty():
        report.draw_bar(len(triples), len(triples), split)
        sys.stderr.write("\n")
  for path, reason in skipped:
    print(f"skipped {path}: {reason}", file=sys.stderr)
  for split, count in num_examples.items():
    if not count:
      raise ValueError(f"no {split} image of {folder} could be read.")
  write_metadata(out_dir, image_shape, len(classes), num_examples, class_names=classes,
                 train_class_counts=train_class_counts,
                 encoded=keep_encoded or bool(resize_shorter), pixel_dtype="uint8",
                 **({"resize_shorter": resize_shorter, "sizes": stored_sizes(
                     [size for _, _, (size, _) in examples["train"]], resize_shorter)}
                    if resize_shorter else {}))
  return [path for path, _ in skipped]


def stored_sizes(sizes, shorter: int, most: int = 256) -> list[list[int]]:
  """(width, height) of some photos as stored (`shrink`): what host_memory expects their crops
  to hold.

  Args:
    sizes: the photos' (width, height).
    shorter: the longest shorter side stored.
    most: how many, at most, evenly spread.
  """
  return [[max(round(s * min(shorter / min(w, h), 1)), 1) for s in (w, h)]
          for w, h in sizes[::-(-len(sizes) // most) or 1]]


FIT_SIDE = 224  # the side of the square that images of several sizes are fitted to by default


def say_cropped(examples: dict, image_size) -> None:
  """Says, once, how many images the centre crop to `image_size` (height, width) loses more than
  a quarter of (a panorama), naming the one it loses most of."""
  kept = sorted((min(w * image_size[0] / (h * image_size[1]), h * image_size[1] /
                     (w * image_size[0])), path, (w, h))
                for triples in examples.values() for path, _, ((w, h), _) in triples)
  if lost := [k for k in kept if k[0] < 0.75]:
    share, path, (w, h) = lost[0]
    print(f"images losing more than a quarter of their area to the centre crop to {image_size[0]}"
          f"x{image_size[1]}: {len(lost)}; the most, {path} ({h}x{w}), keeps {100 * share:.0f}% "
          "(--resize_shorter=S with --image_size keeps photos whole)")


def parse_size(text: str) -> tuple[int, int]:
  """'64' -> (64, 64); '48,64' -> (48, 64)."""
  try:
    size = tuple(int(x) for x in text.split(","))
  except ValueError:
    size = ()
  if len(size) not in (1, 2) or min(size) < 1:
    raise ValueError(f"--image_size={text!r} must be H or H,W: positive integers.")
  return size * (3 - len(size))


_OUT_DIR = flags.DEFINE_string("out_dir", None, "Where the shards go (required).")
_NPZ = flags.DEFINE_string("npz", None, "Arrays to write.")
_IMAGE_FOLDER = flags.DEFINE_string("image_folder", None, "A folder of JPEG/PNG files, one "
                                    "subfolder per class (and train/, val/ folders, if split).")
_IMAGE_SIZE = flags.DEFINE_string("image_size", None, "H or H,W: scale and center-crop to it.")
_RESIZE_SHORTER = flags.DEFINE_integer(
    "resize_shorter", 0, "Keep each photo whole, its shorter side at most this (e.g. 256): "
    "training crops from all of it, evaluation its centre (needs --image_size).")
_KEEP_ENCODED = flags.DEFINE_bool("keep_encoded", False, "Store the image files' bytes; the "
                                  "training pipeline decodes them.")
_EVAL_FRACTION = flags.DEFINE_float("eval_fraction", 0.2, "--image_folder without train/ and "
                                    "val/, or the digits: the share of each class held out.")
_NUM_SHARDS = flags.DEFINE_integer("num_shards", 4, "Files per split.")
_MAX_PIXELS = flags.DEFINE_integer(
    "max_image_pixels", image_files.MAX_PIXELS, "An image of more pixels (width x height) is "
    "named and skipped, not decoded (PIL's decompression-bomb bound by default).")


def main(argv):
  del argv
  out_dir = _OUT_DIR.value
  if glob.glob(os.path.join(glob.escape(out_dir), "*.array_record")):
    raise SystemExit(f"error: {out_dir} already holds a dataset; give another --out_dir (or "
                     "delete it): new shards would mix with the old.")
  if _NPZ.value and _IMAGE_FOLDER.value:
    raise SystemExit("error: give --npz or --image_folder, not both.")
  try:
    if _IMAGE_FOLDER.value:
      size = _IMAGE_SIZE.value and parse_size(_IMAGE_SIZE.value)
      skipped = write_image_folder(out_dir, _IMAGE_FOLDER.value, size or None,
                                   _KEEP_ENCODED.value, _EVAL_FRACTION.value, _NUM_SHARDS.value,
                                   resize_shorter=_RESIZE_SHORTER.value,
                                   max_pixels=_MAX_PIXELS.value)
      with open(os.path.join(out_dir, "metadata.json")) as f:
        meta = json.load(f)
      print(f"wrote {', '.join(f'{s}: {n}' for s, n in meta['num_examples'].items())} images "
            f"of {'x'.join(map(str, meta['image_shape']))} in {meta['num_classes']} classes to "
            f"{out_dir}; skipped {len(skipped)} unreadable file{'s' * (len(skipped) != 1)}")
      return
    if _NPZ.value:
      if not os.path.isfile(_NPZ.value):
        raise SystemExit(f"error: --npz={_NPZ.value!r} does not exist.")
      arrays = np.load(_NPZ.value)
      missing = [key for key in KEYS if key not in arrays]
      if missing:
        raise SystemExit(f"error: {_NPZ.value} has no {', '.join(missing)}; it must hold "
                         f"{', '.join(KEYS)}.")
      splits = {s: (arrays[f"{s}_images"], arrays[f"{s}_labels"]) for s in ("train", "eval")}
    else:  # the digits, held out as configs/default.py holds them out
      data = digits.load(ml_collections.ConfigDict(dict(eval_fraction=_EVAL_FRACTION.value)))
      splits = {split: (source.images, source.labels) for split, source in data.sources.items()}
    write_dataset(out_dir, splits, _NUM_SHARDS.value)
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  print(f"wrote {', '.join(f'{s}: {len(y)}' for s, (_, y) in splits.items())} to {out_dir}")


if __name__ == "__main__":
  flags.mark_flag_as_required("out_dir")  # here: benchmark.py imports this module
  app.run(main)
