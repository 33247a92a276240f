"""write_arrayrecord.py --image_folder on real PNG and JPEG files: decoded when written, or kept
encoded and decoded by the Grain workers while training; unreadable files skipped by path."""

import contextlib
import dataclasses
import functools
import glob
import io
import json
import math
import multiprocessing
import os
import re
import subprocess
import sys
import time

import grain
import jax
import numpy as np
import pytest
from conftest import held_while_more_go_through, own_mount_namespace, owned, run_main
from flax import serialization
from PIL import Image

import train
import write_arrayrecord
from configs import default

from {{cookiecutter.project_slug}} import errors, plan, rules
from {{cookiecutter.project_slug}}.data import (
    arrayrecord,
    augment,
    batches,
    image_files,
    input_pipeline,
    sources,
)
from {{cookiecutter.project_slug}}.training import checkpoints

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_digits_as_pngs(root) -> dict[str, sources.ArraySource]:
  """The digits' train and eval splits (those of dataset=digits) as root/{train,val}/LABEL/*.png."""
  data, _ = sources.get_datasets(default.get_config())
  for split, folder in (("train", "train"), ("eval", "val")):
    for i, (image, label) in enumerate(zip(data[split].images, data[split].labels,
                                           strict=True)):
      os.makedirs(directory := os.path.join(root, folder, str(label)), exist_ok=True)
      Image.fromarray(image[..., 0]).save(os.path.join(directory, f"{i:04d}.png"))
  return data


def convert(*args, process: bool = False) -> subprocess.CompletedProcess:
  """write_arrayrecord.py with these arguments: in this process, or as a real `process`."""
  if not process:
    return run_main(write_arrayrecord, *args)
  return subprocess.run([sys.executable, "write_arrayrecord.py", *args], cwd=PROJECT,
                        capture_output=True, text=True, timeout=300)


def read_all(data_dir: str, split: str) -> dict[str, np.ndarray]:
  """Every example of a split, in order, by the pipeline's own reader."""
  with open(os.path.join(data_dir, "metadata.json")) as f:
    image_shape = json.load(f)["image_shape"]
  source = arrayrecord.RecordSource(arrayrecord.arrayrecord_paths(data_dir, split),
                                       image_shape)
  return source.take(np.arange(len(source)))


def convert_digits_pngs(tmp_path) -> str:
  """The digits written as PNG files and converted; checks that they read back bitwise, with
  the class names. Returns the data directory."""
  digits = write_digits_as_pngs(tmp_path / "pngs")
  done = convert(f"--out_dir={tmp_path / 'data'}", f"--image_folder={tmp_path / 'pngs'}")
  assert done.returncode == 0, done.stderr
  assert "wrote train: 1437, eval: 360 images of 8x8x1 in 10 classes" in done.stdout
  meta = json.loads((tmp_path / "data" / "metadata.json").read_text())
  assert meta["class_names"] == [str(i) for i in range(10)]
  for split, source in digits.items():
    order = np.argsort(source.labels, kind="stable")  # class folders, then file names
    examples = read_all(str(tmp_path / "data"), split)
    np.testing.assert_array_equal(examples["image"], source.images[order])
    np.testing.assert_array_equal(examples["label"], source.labels[order])
  return str(tmp_path / "data")


def test_a_png_folder_reads_back_as_the_digits_it_holds(tmp_path):
  convert_digits_pngs(tmp_path)


@pytest.mark.slow
def test_a_png_folder_trains_as_well_as_the_digits_it_holds(tmp_path):
  """The digits written as PNG files, converted, read back bitwise and trained on with the
  default config: held-out accuracy within 1 point of dataset=digits."""
  data_dir = convert_digits_pngs(tmp_path)
  config = owned(default.get_config())
  digits = train.train_and_evaluate(config, str(tmp_path / "digits"))
  config.dataset, config.data_dir = "arrayrecord", data_dir
  folder = train.train_and_evaluate(config, str(tmp_path / "folder"))
  assert folder["examples"] == digits["examples"] == 360
  assert abs(folder["accuracy"] - digits["accuracy"]) <= 0.01, (folder, digits)


def write_photos(root, sizes=((20, 30), (30, 20), (24, 24)), per_class: int = 4) -> list[str]:
  """RGB JPEGs and PNGs of several sizes in three class folders; returns their paths."""
  rng, paths = np.random.default_rng(0), []
  for label, name in enumerate(("cat", "dog", "emu")):
    os.makedirs(root / name, exist_ok=True)
    for i in range(per_class):
      height, width = sizes[i % len(sizes)]
      coarse = Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8))
      image = coarse.resize((width, height), Image.Resampling.BICUBIC)
      paths.append(str(root / name / f"{i}.{'jpg' if (i + label) % 2 else 'png'}"))
      image.save(paths[-1])
  return paths


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_images_kept_encoded_are_decoded_by_grain_as_when_written(tmp_path, num_workers):
  """--keep_encoded: the Grain workers decode and resize the files into the same batches,
  bitwise and in the same order, as images decoded by write_arrayrecord.py."""
  write_photos(tmp_path / "photos")
  for name, extra in (("decoded", []), ("encoded", ["--keep_encoded"])):
    done = convert(f"--out_dir={tmp_path / name}", f"--image_folder={tmp_path / 'photos'}",
                   "--image_size=16,12", "--eval_fraction=0.25", *extra)
    assert done.returncode == 0, done.stderr
    assert "wrote train: 9, eval: 3 images of 16x12x3 in 3 classes" in done.stdout
  records = grain.sources.ArrayRecordDataSource(
      arrayrecord.arrayrecord_paths(str(tmp_path / "encoded"), "train"))
  assert all(isinstance(serialization.msgpack_restore(records[i])["image"], bytes)
             for i in range(len(records)))  # the files' bytes, not pixels

  config = owned(default.get_config())
  config.dataset, config.batch_size, config.num_epochs, config.steps_per_dispatch = (
      "arrayrecord", 4, 3, 2)
  read = {}
  for name, workers in (("decoded", 0), ("encoded", num_workers)):
    config.data_dir = str(tmp_path / name)
    splits, info = sources.get_datasets(config)
    assert info.image_shape == (16, 12, 3) and info.class_names == ("cat", "dog", "emu")
    iterator = input_pipeline.as_iterator(
        batches.train_batches(splits["train"], plan.resolved(config)), config,
        num_workers=workers)
    read[name] = list(iterator)
    iterator.close()
  assert len(read["decoded"]) == len(read["encoded"]) == 4  # ceil(ceil(27 / 4) / 2)
  for decoded, encoded in zip(read["decoded"], read["encoded"], strict=True):
    for key in ("image", "label", "mask", "position"):
      np.testing.assert_array_equal(decoded[key], encoded[key])
  assert sum(b["mask"].sum() for b in read["encoded"]) == 27  # 3 epochs of 9, none twice


@pytest.mark.slow
def test_evaluation_decodes_encoded_images_in_worker_processes(tmp_path):
  """Evaluation reads as training does: encoded images are decoded in Grain's worker processes,
  which stay between evaluations, into the batches read in this process, pass after pass; the
  last element holds only the batches left."""
  write_photos(tmp_path / "photos")
  done = convert(f"--out_dir={tmp_path / 'data'}", f"--image_folder={tmp_path / 'photos'}",
                 "--image_size=16,12", "--eval_fraction=0.25", "--keep_encoded")
  assert done.returncode == 0, done.stderr
  config = owned(default.get_config())
  config.dataset, config.data_dir = "arrayrecord", str(tmp_path / "data")
  config.batch_size, config.steps_per_dispatch = 1, 2
  splits, _ = sources.get_datasets(config)
  stream = batches.eval_batches(splits["eval"], plan.resolved(config))
  assert [len(e["mask"]) for e in stream] == [2, 1]  # 3 images: no batch of padding alone
  expected = [stream[i] for i in range(len(stream))]  # read here, in this process
  assert batches.default_workers(config) >= 1
  with contextlib.closing(input_pipeline.as_iterator(stream.repeat(), config)) as iterator:
    passes = [[next(iterator) for _ in range(len(stream))] for _ in range(2)]
    assert multiprocessing.active_children()  # the workers, alive between passes
  for elements in passes:
    for element, want in zip(elements, expected, strict=True):
      for key in ("image", "label", "mask", "position"):
        np.testing.assert_array_equal(element[key], want[key])


def write_wide_photos(root, per_class: int = 4):
  """RGB JPEGs of 120 x 240 (and one of 40 x 80, smaller than the store), whose red channel rises
  from 0 at the left edge to 255 at the right: a pixel's red says where it was."""
  ramp = np.linspace(0, 255, 240)[None, :, None]
  pixels = np.concatenate([np.broadcast_to(ramp, (120, 240, 1)),
                           np.full((120, 240, 2), 128.0)], axis=-1).astype(np.uint8)
  for name in ("left", "right"):
    os.makedirs(root / name, exist_ok=True)
    for i in range(per_class):
      image = Image.fromarray(pixels)
      image = image.resize((80, 40)) if i == 0 else image
      image.save(root / name / f"{i}.jpg", quality=95)


@pytest.mark.parametrize("resize_on_device", [True, False])
def test_photos_kept_whole_are_cropped_from_all_of_them(tmp_path, resize_on_device):
  """--resize_shorter=60 stores the photos whole (120 x 240 -> 60 x 120 JPEGs, the 40 x 80 one as
  it was). Training crops (random, of 8-100% of the area) reach far beyond the central square
  of the stored photo (red 64-191), drawn from the seed and the stream position alone: the same
  batches again, and from a resumed position; evaluation keeps the centre 0.875 of the photo
  scaled to cover 32 / 0.875 (red about 72-183), and the device crops nothing more. Resized on
  the devices (each crop sent as its own pixels, with its box) or on the host."""
  write_wide_photos(tmp_path / "photos")
  done = convert(f"--out_dir={tmp_path / 'data'}", f"--image_folder={tmp_path / 'photos'}",
                 "--image_size=32", "--resize_shorter=60", "--eval_fraction=0.25")
  assert done.returncode == 0, done.stderr
  with open(tmp_path / "data" / "metadata.json") as f:
    meta = json.load(f)
  assert meta["image_shape"] == [32, 32, 3] and meta["resize_shorter"] == 60
  records = grain.sources.ArrayRecordDataSource(
      arrayrecord.arrayrecord_paths(str(tmp_path / "data"), "train"))
  sizes = {Image.open(io.BytesIO(serialization.msgpack_restore(records[i])["image"])).size
           for i in range(len(records))}
  assert sizes <= {(120, 60), (80, 40)} and (120, 60) in sizes

  config = owned(default.get_config())
  config.update(dataset="arrayrecord", data_dir=str(tmp_path / "data"),
                resize_on_device=resize_on_device)
  splits, elements = cropped_from_the_whole_photo(config, eval_examples=2)
  assert ("box" in elements[0]) == resize_on_device
  if resize_on_device:  # the pixels host_memory expects a crop to hold, against those sent
    stored = {split: [Image.open(io.BytesIO(serialization.msgpack_restore(r)["image"])).size
                      for r in grain.sources.ArrayRecordDataSource(arrayrecord.arrayrecord_paths(
                          str(tmp_path / "data"), split))] for split in ("train", "eval")}
    assert sorted(map(tuple, meta["sizes"])) == sorted(stored["train"])  # (all: under 256)
    evaluated = batches.eval_batches(splits["eval"], plan.resolved(config))
    for split, sent in (("train", elements), ("eval", evaluated)):
      mean = sum(int(e["filled"].sum()) for e in sent) / sum(int(e["mask"].sum()) for e in sent)
      sizes = stored[split]
      expected = sources.crop_pixels(config, (32, 32), sizes, [split])
      assert abs(expected * 3 / mean - 1) < 0.05, (split, expected * 3, mean)
  again = batches.train_batches(splits["train"], plan.resolved(config), first_step=4)
  for element in range(4, 8):
    np.testing.assert_array_equal(again[element - 4]["image"], elements[element]["image"])


def cropped_from_the_whole_photo(config, eval_examples: int):
  """Asserts that `config`'s data (`write_wide_photos`' photos, however stored), read at 32 x 32
  with the random-resized crop on, are cut on the host: training's crops reach beyond the
  central square (red 64-191), each its own; evaluation keeps the centre 0.875 of the photo
  scaled to cover 32 / 0.875 (red about 72-183). Returns the sources and training's elements."""
  config.update(batch_size=3, num_epochs=20, augment_crop=True, augment_crop_scale=(0.08, 1.0),
                steps_per_dispatch=1)
  splits, info = sources.get_datasets(config)
  assert info.image_shape == (32, 32, 3) and info.crops_on_host
  assert info.pixel_dtype == "uint8"  # (the crops' own, each in an object array: as stored)
  elements = batches.train_batches(splits["train"], plan.resolved(config))
  red = np.concatenate([pixels(elements[i], info.canvas)[elements[i]["mask"]][..., 0]
                        for i in range(len(elements))])
  assert red.shape[1:] == (32, 32)
  assert red.min() < 30 and red.max() > 225  # beyond the central square's 64-191
  assert len({image.tobytes() for image in red}) > 0.9 * len(red)  # every crop its own
  evaluated = batches.eval_batches(splits["eval"], plan.resolved(config))
  eval_red = np.concatenate([pixels(e, info.canvas)[e["mask"]][..., 0] for e in evaluated])
  assert len(eval_red) == eval_examples and 60 < eval_red.min() and eval_red.max() < 195
  assert abs(float(eval_red.mean()) - 127.5) < 3
  return splits, elements


def pixels(element, canvas=None, shape=(32, 32)) -> np.ndarray:
  """An element's images as the model sees them, before / 255: crops packed end to end unpacked
  and resized as the devices do it (`augment.unpacked`, `augment.resize_crops`)."""
  if "box" not in element:
    return element["image"]
  return np.asarray(unpacked_and_resized(element["image"][0], element["offset"], element["box"],
                                         tuple(canvas), shape))


@functools.partial(jax.jit, static_argnums=(3, 4))
def unpacked_and_resized(packed_GN, offset_KB, box_KB6, canvas, shape):
  """`pixels`' program: compiled once for the elements of a shape, not once an element."""

  def resized(offset_B, box_B6):
    crops_BHWC = augment.unpacked(packed_GN, offset_B, box_B6, (*canvas, 3))
    return augment.resize_crops(crops_BHWC.astype(np.float32), box_B6, shape)

  return jax.vmap(resized)(offset_KB, box_KB6)


def smooth_photos() -> list[bytes]:
  """JPEGs like photos (smooth colour with noise) of several sizes: one progressive, one gray."""
  rng = np.random.default_rng(0)
  photos = []
  for (height, width), mode, options in (((256, 341), "RGB", {}), ((384, 256), "RGB", {}),
                                         ((60, 120), "RGB", {"progressive": True}),
                                         ((300, 301), "L", {})):
    y, x = np.mgrid[:height, :width]
    smooth = np.stack([np.sin(x / (9 + c) + c) + np.cos(y / (7 + c)) for c in range(3)], -1)
    pixels = np.clip(64 * smooth + 128 + rng.normal(0, 10, smooth.shape), 0, 255)
    photo = Image.fromarray(pixels.astype(np.uint8)).convert(mode)
    data = io.BytesIO()
    photo.save(data, "JPEG", quality=90, **options)
    photos.append(data.getvalue())
  return photos


def test_simplejpeg_cuts_the_crops_that_pil_cuts(monkeypatch):
  """A JPEG's crop decoded by simplejpeg (at Image.draft's DCT scale) is PIL's crop, bit for bit:
  photos of several sizes (one progressive, one gray), random crops (8-100% of the area, so
  every scale from 1 to 1/8) and evaluation's centre, to RGB and to gray."""
  photos = smooth_photos()
  cases = [(crops, shape, photo, position) for crops in (
      image_files.Crops(seed=1, scale=(0.08, 1.0)), image_files.Crops())
           for shape in ((224, 224, 3), (32, 32, 3), (16, 12, 1)) for photo in photos
           for position in range(12 if crops.scale else 1)]
  assert all(image_files.jpeg_size(photo) for photo in photos)
  fast = [crops(photo, shape, position) for crops, shape, photo, position in cases]
  monkeypatch.setattr(image_files, "simplejpeg", None)  # PIL alone
  assert not image_files.jpeg_size(photos[0])
  for got, (crops, shape, photo, position) in zip(fast, cases, strict=True):
    np.testing.assert_array_equal(got, crops(photo, shape, position))
  scales = {image_files.draft_scale((341, 256), (math.ceil(341 * 32 / w), math.ceil(
      256 * 32 / h))) for w, h in ((341, 256), (170, 128), (100, 75), (40, 30))}
  assert scales == {8, 4, 2, 1}  # (each DCT scale among the cases: 32 from crops that large)


@pytest.mark.parametrize("shape", [(224, 224, 3), (24, 32, 1)])
def test_the_devices_resize_the_crops_as_the_host_does(shape):
  """Crops cut on the host, packed end to end a device each (two here) and unpacked and resized
  on the devices (`Crops.cut`, `batches.pack`, `augment.unpacked`, `augment.resize_crops`) are
  the host's PIL resize of the same boxes within one level of 255 at every pixel: training's
  random crops (every DCT scale) and evaluation's centre, RGB and gray; the bytes sent are the
  crops' own, fewer than the room for the largest. Under the largest crop that `sources.canvas`
  gives photos stored at shorter side 256 none is resized on the host, and under one too small
  for some (2 pixels larger than the image) those are resized there, as before. A padding
  example (no pixels, its box zeros) gives zeros."""
  photos = smooth_photos()
  config = default.get_config()
  config.update(augment_crop=True, resize_on_device=True)

  @functools.partial(jax.jit, static_argnums=(3, 4))
  def resized(packed_GN, offset_B, box_B6, canvas_HWC, out_hw):
    crops_BHWC = augment.unpacked(packed_GN, offset_B, box_B6, canvas_HWC)
    return augment.resize_crops(crops_BHWC.astype(np.float32), box_B6, out_hw)

  for canvas, small in ((sources.canvas(config, 384, shape), False),
                        ((shape[0] + 2, shape[1] + 2), True)):
    for crops in (image_files.Crops(seed=1, scale=(0.08, 1.0)), image_files.Crops()):
      positions = np.arange(12 if crops.scale else 1).repeat(len(photos))
      encoded = photos * (len(positions) // len(photos))
      host, failed = image_files.decode_batch(encoded, shape, crops, positions)
      cut, failed_cut = image_files.decode_batch(
          encoded, shape, dataclasses.replace(crops, canvas=canvas), positions)
      n = len(encoded)
      packed = batches.pack(cut["image"], np.arange(n), (1, n, *canvas, shape[2]), 2)
      assert not failed and not failed_cut and packed["filled"].sum() == sum(
          crop.size for crop in cut["image"]) < packed["image"].size
      got = resized(packed["image"][0], packed["offset"][0], cut["box"], (*canvas, shape[2]),
                    shape[:2])
      assert np.abs(np.asarray(got) - host["image"]).max() <= 1 + 1e-4, (canvas, crops)
      on_host = (cut["box"][:, 4:] == shape[:2]).all(1) & (cut["box"][:, :2] == 0).all(1)
      assert on_host.any() == small
  padding = resized(np.zeros((1, 4), np.uint8), np.zeros(1, np.int32),
                    np.zeros((1, 6), np.float32), (8, 8, 1), (4, 4))
  np.testing.assert_array_equal(padding, 0)


def test_a_worker_packs_into_the_file_given_back_and_sends_it_as_it_is():
  """Photos' crops packed (`batches.pack`) into a file that the main process gave back
  (`shm.Outbox.empty`), which holds the last unit's bytes (all 255s): the bytes the crops fill
  and their offsets are those packed into zeros, bit for bit (an unreadable image left out), and
  the unit is sent in that file as it is, no other made; with no file given back, `empty` gives
  zeros, sent as any array."""
  from {{cookiecutter.project_slug}}.data import shm

  shape, config = (224, 224, 3), default.get_config()
  config.update(augment_crop=True, resize_on_device=True)
  crops = image_files.Crops(seed=1, scale=(0.08, 1.0), canvas=sources.canvas(config, 384, shape))
  photos = smooth_photos()
  encoded, used = [*photos[:2], "unreadable", *photos[2:]], np.array([0, 1, 3, 4])
  rows = (1, 5, *crops.canvas, 3)
  outbox = shm.Outbox(prefix := shm.iterator_prefix())
  try:
    last = outbox.empty((1, 1, math.prod(rows[1:])), np.uint8)
    assert not last.any() and not outbox.lent  # none given back: new zeros
    last[:] = 255
    received = shm.receive(outbox({"image": last}))
    (path,) = glob.glob(f"{shm.DIRECTORY}/{prefix}-*")
    inode = os.stat(path).st_ino
    for positions in (np.arange(5), np.arange(5, 10), np.arange(3, 8)):
      cut, failed = image_files.decode_batch(encoded, shape, crops, positions)
      assert list(failed) == [2] and cut["image"][2].size == 0
      want = batches.pack(cut["image"][used], used, rows, 1)
      del received  # given back
      got = batches.pack(cut["image"][used], used, rows, 1, outbox.empty)
      assert len(outbox.lent) == 1
      sent = outbox(got)
      assert not outbox.lent
      (path,) = glob.glob(f"{shm.DIRECTORY}/{prefix}-*")
      assert os.path.basename(path) == sent["image"].name and os.stat(path).st_ino == inode
      received = shm.receive(sent)
      n = int(want["filled"][0, 0])
      assert n == sum(cut["image"][i].size for i in used) < math.prod(rows[1:])
      np.testing.assert_array_equal(received["image"][..., :n], want["image"][..., :n])
      np.testing.assert_array_equal(received["offset"], want["offset"])
  finally:
    shm.remove_unreceived(prefix)


@pytest.mark.slow  # (a worker process: the unit's own test above is the fast tier's)
def test_photos_decoded_by_a_worker_into_files_given_back_are_those_read_here(tmp_path,
                                                                             monkeypatch):
  """Photos stored whole, their crops packed by a worker: 3 elements placed on the devices and
  held while 9 more go through, each equal to the same element read in this process, bit for
  bit (the bytes the crops fill, boxes, offsets, labels, masks), packed into the files the
  devices let go (fewer files than units)."""
  write_wide_photos(tmp_path / "photos", per_class=8)
  done = convert(f"--out_dir={tmp_path / 'data'}", f"--image_folder={tmp_path / 'photos'}",
                 "--image_size=32", "--resize_shorter=60", "--eval_fraction=0.25")
  assert done.returncode == 0, done.stderr
  config = owned(default.get_config())
  config.update(dataset="arrayrecord", data_dir=str(tmp_path / "data"), augment_crop=True,
                resize_on_device=True, num_workers=1, batch_size=16, steps_per_dispatch=1,
                num_epochs=16)
  splits, info = sources.get_datasets(config)
  elements = batches.train_batches(splits["train"], resolved := plan.resolved(config))
  assert info.canvas and len(elements) == 12 and elements.shares == 8  # 2 crops a unit
  files = held_while_more_go_through(elements, resolved, monkeypatch,
                                     ("image", "box", "offset", "label", "mask"))
  assert files < 12 * 8, files  # reused (the devices hold their own copies, padded: `padded`)


def test_decode_image_scales_to_cover_and_crops_the_center():
  """A 20x40 image, left half black, right half white, to 10x10: the middle columns."""
  pixels = np.zeros((20, 40), np.uint8)
  pixels[:, 20:] = 255
  data = io.BytesIO()
  Image.fromarray(pixels).save(data, "PNG")
  out = image_files.decode_image(data.getvalue(), (10, 10, 1))
  assert out.shape == (10, 10, 1)
  np.testing.assert_array_equal(out[:, :4, 0], 0)
  np.testing.assert_array_equal(out[:, 6:, 0], 255)
  gray = image_files.decode_image(data.getvalue(), (20, 40, 1))
  np.testing.assert_array_equal(gray[..., 0], pixels)  # the size it has: unchanged


def test_unreadable_files_and_an_empty_class_are_reported_by_path(tmp_path):
  photos = tmp_path / "photos"
  paths = write_photos(photos, sizes=((24, 24),), per_class=5)
  (photos / "fox").mkdir()  # an empty class folder: stops before anything is written
  done = convert(f"--out_dir={tmp_path / 'data'}", f"--image_folder={photos}", process=True)
  assert done.returncode == 1
  assert done.stderr.strip().splitlines() == [
      f"error: class folder {photos / 'fox'} holds no .jpg, .jpeg or .png file; add its images "
      "or remove the folder."]
  assert not (tmp_path / "data").exists()

  (photos / "fox").rmdir()
  (photos / "cat" / "notes.png").write_bytes(b"not an image")
  jpeg = next(p for p in paths if p.endswith(".jpg"))
  with open(jpeg, "rb") as f:
    whole = f.read()
  truncated = photos / "dog" / "truncated.jpg"  # its header reads; its pixels do not
  truncated.write_bytes(whole[:len(whole) // 2])
  done = convert(f"--out_dir={tmp_path / 'data'}", f"--image_folder={photos}")
  assert done.returncode == 0, done.stderr
  reported = sorted(line.split(":")[0] for line in done.stderr.splitlines())
  assert reported == [f"skipped {photos / 'cat' / 'notes.png'}", f"skipped {truncated}"]
  assert done.stdout.strip().endswith("skipped 2 unreadable files")

  written = {split: read_all(str(tmp_path / "data"), split) for split in ("train", "eval")}
  assert sum(len(w["label"]) for w in written.values()) == len(paths)  # nothing else lost
  expected = sorted((label, np.asarray(Image.open(p).convert("RGB")).tobytes())
                    for label, name in enumerate(("cat", "dog", "emu"))
                    for p in paths if f"{os.sep}{name}{os.sep}" in p)
  got = sorted((int(label), image.tobytes()) for w in written.values()
               for image, label in zip(w["image"], w["label"], strict=True))
  assert got == expected

  again = convert(f"--out_dir={tmp_path / 'data'}", f"--image_folder={photos}")
  assert again.returncode == 1 and "already holds a dataset" in again.stderr
  assert sum(len(read_all(str(tmp_path / "data"), s)["label"]) for s in ("train", "eval")) == 15


def test_the_held_out_split_and_the_tree_checks(tmp_path, capsys):
  rng = np.random.default_rng(0)
  for name, count in (("a", 10), ("b", 5)):
    (tmp_path / "two" / name).mkdir(parents=True)
    for i in range(count):
      Image.fromarray(rng.integers(0, 256, (6, 6), dtype=np.uint8)).save(
          tmp_path / "two" / name / f"{i}.png")
  classes, examples = write_arrayrecord.list_image_folder(str(tmp_path / "two"), 0.2)
  assert classes == ["a", "b"]
  assert [label for _, label in examples["eval"]] == [0, 0, 1]  # 2 of 10, 1 of 5
  assert [label for _, label in examples["train"]] == [0] * 8 + [1] * 4
  assert not {p for p, _ in examples["eval"]} & {p for p, _ in examples["train"]}

  Image.fromarray(np.zeros((7, 6), np.uint8)).save(tmp_path / "two" / "b" / "tall.png")
  Image.fromarray(np.zeros((6, 30), np.uint8)).save(tmp_path / "two" / "b" / "wide.png")
  write_arrayrecord.write_image_folder(str(tmp_path / "out"), str(tmp_path / "two"))
  assert capsys.readouterr().out.splitlines() == [
      "the images have 3 sizes (6x6, 7x6, ...): each is scaled to cover 6x6 (their typical "
      "shorter side, at most 224) and centre-cropped (--image_size=H,W for another size; "
      "--resize_shorter=S with it keeps them whole)",
      "images losing more than a quarter of their area to the centre crop to 6x6: 1; the most, "
      f"{tmp_path / 'two' / 'b' / 'wide.png'} (6x30), keeps 20% (--resize_shorter=S with "
      "--image_size keeps photos whole)"]
  assert json.loads((tmp_path / "out" / "metadata.json").read_text())["image_shape"] == [6, 6, 1]
  # Photos of 20x20 and one thin crop (3x40): fitted to the photos' typical side, not the crop's.
  Image.fromarray(np.zeros((3, 40), np.uint8)).save(tmp_path / "two" / "b" / "wide.png")
  for path in (tmp_path / "two").rglob("[0-9]*.png"):
    Image.fromarray(rng.integers(0, 256, (20, 20), dtype=np.uint8)).save(path)
  write_arrayrecord.write_image_folder(str(tmp_path / "out20"), str(tmp_path / "two"))
  assert capsys.readouterr().out.splitlines()[0].startswith(
      "the images have 3 sizes (7x6, 20x20, ...): each is scaled to cover 20x20 (their typical "
      "shorter side, at most 224; 2 smaller scaled up)")
  assert json.loads((tmp_path / "out20" / "metadata.json").read_text())["image_shape"] == [
      20, 20, 1]
  (tmp_path / "none").mkdir()
  with pytest.raises(ValueError, match="has no class folders"):
    write_arrayrecord.list_image_folder(str(tmp_path / "none"), 0.2)
  with pytest.raises(ValueError, match="must be H or H,W"):
    write_arrayrecord.parse_size("64,x")
  assert write_arrayrecord.parse_size("64") == (64, 64)


@pytest.mark.slow
def test_the_imagenet_recipe_trains_on_a_photo_folder(tmp_path):
  """configs/imagenet.py as it is (ResNet-50 in bfloat16, SGD, crops and flips), on a small
  folder in ImageNet's layout (train/ and val/ class folders of JPEGs, stored whole at a shorter
  side of 73, cropped to 64 by the input pipeline) and a batch of 8: a few steps run on the CPU,
  every example counted once, finite metrics."""
  for split, per_class in (("train", 4), ("val", 2)):
    write_photos(tmp_path / "imagenet" / split, sizes=((80, 100), (100, 72)), per_class=per_class)
  done = convert(f"--out_dir={tmp_path / 'data'}", f"--image_folder={tmp_path / 'imagenet'}",
                 "--image_size=64", "--resize_shorter=73")
  assert done.returncode == 0, done.stderr
  from configs import imagenet

  config = owned(imagenet.get_config())
  config.update(data_dir=str(tmp_path / "data"), batch_size=8, num_epochs=1, log_every_steps=1,
                eval_every_steps=2, checkpoint_every_steps=2, num_workers=0)
  result = train.train_and_evaluate(config, str(tmp_path / "run"))
  assert result["examples"] == 6 and np.isfinite(result["loss"])
  assert checkpoints.checkpoint_manager(str(tmp_path / "run")).latest_step() == 2  # ceil(12 / 8)
  with open(tmp_path / "run" / "data.json") as f:  # (what predict.py and export.py take)
    described = json.load(f)
  assert (described["pixel_dtype"], described["model_input"]) == ("uint8", "pixels / 255")


def seconds_after_last_line(command: list[str]) -> tuple[subprocess.CompletedProcess, float]:
  """Runs `command` in the project; returns its result (its `args`: the process id) and the
  seconds from its last line of output (stdout or stderr) to its exit."""
  last, lines = time.perf_counter(), []
  with subprocess.Popen(command, cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True) as process:
    for line in process.stdout:
      last = time.perf_counter()
      lines.append(line)
    code = process.wait(timeout=120)
  return (subprocess.CompletedProcess(process.pid, code, "".join(lines)),
          time.perf_counter() - last)


GRAINS_KILL_WAIT = 10  # s: well under the 25 s a worker left waiting took to be killed


@pytest.mark.slow
def test_commands_reading_with_workers_end_without_waiting_for_grain_to_kill_them(tmp_path):
  """96x96 photos kept encoded, read by 2 Grain workers a reader. An evaluation iterator closed
  after a pass stops its workers, 5 times out of 5, without the 25 s that a worker whose queue
  nobody read any more waited for Grain to kill it (in 5 of 5 here before); the training run,
  then evaluate.py 3 times, each ends as soon after its last line, leaving nothing in /dev/shm.
  The bound, 10 s, tells the two apart; the times themselves (0.8 s a close here on a quiet
  machine, up to 3.4 s beside the other tests: the workers' exit is CPU work) are printed, not
  asserted: a speed, not a behaviour."""
  from {{cookiecutter.project_slug}}.data import shm
  from {{cookiecutter.project_slug}}.tools.benchmark_data import write_jpeg_folder

  write_jpeg_folder(str(tmp_path / "photos"), 256, 96)  # a device's share: 221 KB decoded
  done = convert(f"--out_dir={tmp_path / 'data'}", f"--image_folder={tmp_path / 'photos'}",
                 "--keep_encoded", "--eval_fraction=0.5")
  assert done.returncode == 0, done.stderr
  config = owned(default.get_config())
  config.dataset, config.data_dir, config.num_workers = "arrayrecord", str(tmp_path / "data"), 2
  config.batch_size, config.steps_per_dispatch = 64, 1
  splits, _ = sources.get_datasets(config)
  elements = batches.eval_batches(splits["eval"], plan.resolved(config))
  closing = []
  for _ in range(5):
    iterator = input_pipeline.as_iterator(elements.repeat(), config)
    assert sum(int(next(iterator)["mask"].sum()) for _ in range(len(elements))) == 128
    start = time.perf_counter()
    iterator.close()
    closing.append(time.perf_counter() - start)
  print("closing, s:", [round(t, 2) for t in closing])
  assert max(closing) < GRAINS_KILL_WAIT, closing
  workdir = tmp_path / "run"
  run, after = seconds_after_last_line([
      sys.executable, "train.py", "--config=configs/tiny.py", f"--workdir={workdir}",
      "--config.model.module=shipped_model", "--config.dataset=arrayrecord",
      f"--config.data_dir={tmp_path / 'data'}", "--config.num_workers=2",
      "--config.batch_size=64", "--config.num_epochs=2"])
  assert run.returncode == 0, run.stdout[-3000:]
  exits, pids = [after], [run.args]
  for _ in range(3):
    evaluated, after = seconds_after_last_line([
        sys.executable, "evaluate.py", f"--workdir={workdir}"])
    assert evaluated.returncode == 0 and "128 examples" in evaluated.stdout, evaluated.stdout
    exits.append(after)
    pids.append(evaluated.args)
  print("ended after the last line, s:", [round(t, 2) for t in exits])
  assert max(exits) < GRAINS_KILL_WAIT, exits
  for pid in pids:  # every unit its workers made, and its lock: received and unlinked, removed
    assert not glob.glob(os.path.join(shm.DIRECTORY, f"{shm.PREFIX}-{pid}.*"))


def children_of(pid: int) -> list[int]:
  """The processes whose parent is `pid` (from /proc)."""
  found = []
  for stat in glob.glob("/proc/[0-9]*/stat"):
    with contextlib.suppress(OSError):
      with open(stat) as f:
        fields = f.read().rsplit(")", 1)[1].split()
      if int(fields[1]) == pid:
        found.append(int(stat.split("/")[2]))
  return found


@pytest.mark.slow
def test_a_killed_run_leaves_no_worker_and_the_next_run_removes_what_it_left(tmp_path):
  """train.py reading photos with 2 Grain workers, SIGKILLed after its first checkpoint: within
  10 s none of its worker processes is alive; the next command (evaluate.py on its workdir,
  workers reading) removes what it left in /dev/shm (its lock, any unit in flight), in one line.
  Both in a /dev/shm of their own (`own_mount_namespace`)."""
  own_mount_namespace()
  from {{cookiecutter.project_slug}}.data import shm
  from {{cookiecutter.project_slug}}.tools.benchmark_data import write_jpeg_folder

  write_jpeg_folder(str(tmp_path / "photos"), 256, 96)
  done = convert(f"--out_dir={tmp_path / 'data'}", f"--image_folder={tmp_path / 'photos'}",
                 "--keep_encoded", "--eval_fraction=0.5")
  assert done.returncode == 0, done.stderr
  # In a /dev/shm of its own (unshare -m, as root): no other test's run, started meanwhile,
  # removes what the killed run left before evaluate.py can.
  (tmp_path / "kill.py").write_text(KILLED_RUN.replace("WORKDIR", str(tmp_path / "run")).replace(
      "DATA", str(tmp_path / "data")))
  out = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=2g tmpfs /dev/shm && "
                        f"exec {sys.executable} {tmp_path / 'kill.py'}"], cwd=PROJECT,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  seen = json.loads(out.stdout.strip().splitlines()[-1])
  assert len(seen["workers"]) >= 4 and seen["left"], seen  # 2 a reader (training, evaluation)
  assert not seen["outlived"], "workers outlived their run"
  assert seen["evaluated"] == 0, seen["stderr"]
  assert re.search(r"removed \d+ units? \(\S+ MiB\)( and \d+ semaphores?)? that 1 run no longer "
                   f"running left in {shm.DIRECTORY}", seen["stderr"]), seen["stderr"]
  assert not seen["left_after"], seen


# test_a_killed_run_...'s run, in its own /dev/shm: train.py SIGKILLed after its first checkpoint,
# its workers watched for 10 s, then evaluate.py; what it saw, as JSON.
KILLED_RUN = """
import glob, json, os, subprocess, sys, time
sys.path[:0] = [".", "tests"]
from conftest import alive
from test_image_folder import children_of
from {{cookiecutter.project_slug}}.data import shm

process = subprocess.Popen([
    sys.executable, "train.py", "--config=configs/tiny.py", "--workdir=WORKDIR",
    "--config.model.module=shipped_model", "--config.dataset=arrayrecord",
    "--config.data_dir=DATA", "--config.num_workers=2", "--config.batch_size=64",
    "--config.num_epochs=50"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
  deadline = time.monotonic() + 300
  while not os.path.isdir("WORKDIR/checkpoints/10"):
    assert process.poll() is None and time.monotonic() < deadline, "no checkpoint"
    time.sleep(0.1)
  workers = children_of(process.pid)
  mine = os.path.join(shm.DIRECTORY, f"{shm.PREFIX}-{process.pid}.*")
  left = glob.glob(mine)
  process.kill()
  process.wait(timeout=60)
  killed = time.monotonic()
  while [pid for pid in workers if alive(pid)] and time.monotonic() < killed + 10:
    time.sleep(0.1)
  outlived = [pid for pid in workers if alive(pid)]
finally:
  process.kill()
evaluated = subprocess.run([sys.executable, "evaluate.py", "--workdir=WORKDIR"],
                           capture_output=True, text=True, timeout=300)
print(json.dumps(dict(workers=workers, left=left, outlived=outlived, left_after=glob.glob(mine),
                      evaluated=evaluated.returncode, stderr=evaluated.stderr[-3000:])))
"""


@pytest.mark.parametrize("layout", ["class_folders", "train_and_val"])
def test_a_folder_of_images_given_as_a_dataset_points_to_write_arrayrecord(tmp_path, layout):
  """--config.dataset=<not a source> --config.data_dir=<class folders of images>: one line that
  says to write them with write_arrayrecord.py --image_folder first, and how to train on them."""
  for split in (("train", "val") if layout == "train_and_val" else ("",)):
    os.makedirs(folder := tmp_path / "photos" / split / "cat")
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(folder / "0.png")
  config = owned(default.get_config())
  config.dataset, config.data_dir = "imagefolder", str(tmp_path / "photos")
  with pytest.raises(rules.ConfigError) as refused:
    rules.validate_config(config)
  assert str(refused.value) == (
      f"config.dataset='imagefolder' is unknown; config.data_dir={config.data_dir!r} holds "
      "folders of images: write them as ArrayRecord files first (python write_arrayrecord.py "
      f"--image_folder={config.data_dir} --out_dir=data/mine), then train on them with "
      "--config.dataset=arrayrecord --config.data_dir=data/mine.")
  config.data_dir = str(tmp_path)  # no image in a class folder: the sources are named
  with pytest.raises(rules.ConfigError, match=r"^config.dataset='imagefolder' is unknown; use one "
                     r"of \('digits', "):
    rules.validate_config(config)


def test_a_shared_memory_too_small_for_the_workers_is_one_line(monkeypatch):
  """Grain's workers need /dev/shm for their queues' semaphores even when images travel
  pickled: less than that free is one line naming the room, the need and the fixes."""
  from {{cookiecutter.project_slug}}.data import shm

  config = owned(default.get_config())
  config.num_workers = 2
  monkeypatch.setattr(shm, "free_bytes", lambda: 64 * 2**10)
  with pytest.raises(rules.ConfigError) as refused:
    rules.validate_config(config)
  assert str(refused.value) == (
      f"{shm.DIRECTORY} has 64 KiB free; the 2 + 2 Grain worker processes of training and "
      f"evaluation need {shm.fallback_bytes(2) // 2**10} KiB there at the least (their queues' "
      "semaphores): give it room (docker run --shm-size=16g; a pod: an emptyDir of medium "
      "Memory at /dev/shm, as clusters/gke-gpu-jobset.yaml), or read without workers: "
      "--config.num_workers=0.")
  config.num_workers = 0
  rules.validate_config(config)


@pytest.mark.slow
@pytest.mark.parametrize("size", ["64k", "1m"])
def test_a_small_shared_memory_is_one_line_or_a_run_that_ends(tmp_path, size):
  """train.py with 2 workers on photos, given a /dev/shm of its own (a private mount namespace:
  unshare -m, as root) of 64 KiB (a pod's is 64 MB): one `error:` line at start; of 1 MiB:
  the run ends, its units pickled once /dev/shm is nearly full."""
  own_mount_namespace()
  from {{cookiecutter.project_slug}}.tools.benchmark_data import write_jpeg_folder

  write_jpeg_folder(str(tmp_path / "photos"), 256, 96)
  done = convert(f"--out_dir={tmp_path / 'data'}", f"--image_folder={tmp_path / 'photos'}",
                 "--keep_encoded", "--eval_fraction=0.5")
  assert done.returncode == 0, done.stderr
  train_py = " ".join([
      sys.executable, "train.py", "--config=configs/tiny.py", f"--workdir={tmp_path / 'run'}",
      "--config.model.module=shipped_model", "--config.dataset=arrayrecord",
      f"--config.data_dir={tmp_path / 'data'}", "--config.num_workers=2",
      "--config.batch_size=64", "--config.num_epochs=20"])
  out = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs "
                        f"/dev/shm && exec {train_py}"], cwd=PROJECT, capture_output=True,
                       text=True, timeout=600)
  assert "Traceback" not in out.stderr, out.stderr[-3000:]
  if size == "64k":
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1].startswith(
        "error: /dev/shm has 64 KiB free; the 2 + 2 Grain worker processes"), out.stderr[-3000:]
  else:
    assert out.returncode == 0 and "Final eval" in out.stderr, out.stderr[-3000:]
    assert "/dev/shm is full (" in out.stderr, out.stderr[-3000:]


def sideways(seen: np.ndarray, fmt: str) -> bytes:
  """`seen` (the photo as seen) stored as a phone stores it held upright: its pixels turned a
  quarter to the left, EXIF orientation 6 (turn them a quarter right to show it)."""
  exif = Image.Exif()
  exif[image_files.ORIENTATION] = 6
  out = io.BytesIO()
  Image.fromarray(seen).transpose(Image.Transpose.ROTATE_90).save(out, fmt, exif=exif,
                                                                 **({"quality": 100} if fmt ==
                                                                    "JPEG" else {}))
  return out.getvalue()


def test_a_photo_held_sideways_is_read_upright(tmp_path):
  """A photo of EXIF orientation 6 (stored 30 high, 20 wide; seen 20 high, 30 wide) is read as
  seen wherever images are decoded: its shape from the header, the decoders (records kept
  encoded, predict's and evaluate's files), the crops of photos stored whole (PIL's and
  simplejpeg's paths), and the writer's photos stored whole (turned, then stored)."""
  y, x = np.mgrid[0:20, 0:30]
  seen = np.stack([y * 12, x * 8, np.full_like(y, 128)], -1).astype(np.uint8)  # smooth, no symmetry
  png, jpeg = sideways(seen, "PNG"), sideways(seen, "JPEG")
  assert np.asarray(Image.open(io.BytesIO(png))).shape == (30, 20, 3)  # as stored
  for data in (png, jpeg):
    assert image_files.encoded_shape(data) == (20, 30, 3)
  upright, exif = io.BytesIO(), Image.Exif()  # a camera's upright JPEG: simplejpeg's to decode
  exif[image_files.ORIENTATION] = 1
  Image.fromarray(seen).save(upright, "JPEG", exif=exif)
  assert image_files.jpeg_orientation(jpeg) == 6 and image_files.jpeg_orientation(
      upright.getvalue()) == 1
  assert image_files.jpeg_size(jpeg) is None and image_files.jpeg_size(upright.getvalue()) == (
      (30, 20) if image_files.simplejpeg else None)
  np.testing.assert_array_equal(image_files.decode_image(png, (20, 30, 3)), seen)
  np.testing.assert_array_equal(image_files.Crops(center_ratio=1.0)(png, (20, 30, 3), 0), seen)
  for decoded in (image_files.decode_image(jpeg, (20, 30, 3)),
                  image_files.Crops(center_ratio=1.0)(jpeg, (20, 30, 3), 0)):
    assert np.abs(decoded.astype(int) - seen).max() <= 8  # (JPEG's loss only)
  os.makedirs(tmp_path / "photos" / "a")
  os.makedirs(tmp_path / "photos" / "b")
  (tmp_path / "photos" / "a" / "sideways.png").write_bytes(png)
  for i in range(4):
    Image.fromarray(seen).save(tmp_path / "photos" / "b" / f"{i}.png")
  Image.fromarray(seen).save(tmp_path / "photos" / "a" / "upright.png")
  done = convert(f"--out_dir={tmp_path / 'data'}", f"--image_folder={tmp_path / 'photos'}",
                 "--resize_shorter=20", "--image_size=20", "--eval_fraction=0.5")
  assert done.returncode == 0, done.stderr
  for split in ("train", "eval"):
    stored = arrayrecord.RecordSource(arrayrecord.arrayrecord_paths(str(tmp_path / "data"),
                                                                    split), (20, 20, 3))
    for record in stored.read(list(range(len(stored)))):  # (the bytes stored: upright)
      assert np.asarray(Image.open(io.BytesIO(record["image"]))).shape == (20, 30, 3)


def test_an_image_of_too_many_pixels_is_named_and_skipped_undecoded(tmp_path):
  """A 12000x12000 PNG (144 megapixels, a 20 KB file) is named and skipped from its header by
  the writer, predict's and evaluate's reader and the decoders, over PIL's bound by default or
  --max_image_pixels; an image within the limit is read."""
  write_photos(tmp_path / "photos", per_class=2)  # (cat, dog, emu)
  Image.new("1", (12000, 12000)).save(bomb := tmp_path / "photos" / "emu" / "bomb.png")
  assert bomb.stat().st_size < 1_000_000
  done = convert(f"--out_dir={tmp_path / 'data'}", f"--image_folder={tmp_path / 'photos'}",
                 "--image_size=24", "--eval_fraction=0.5")
  assert done.returncode == 0, done.stderr
  said = [line for line in done.stderr.splitlines() if "bomb.png" in line]
  assert said == [f"skipped {bomb}: ValueError: 12000x12000 is 144 megapixels, over the limit "
                  "of 89 (--max_image_pixels)"], done.stderr
  why = image_files.read_image(str(bomb), (24, 24, 3))
  assert isinstance(why, str) and "144 megapixels" in why
  photo = tmp_path / "photos" / "cat" / "0.png"
  assert not isinstance(image_files.read_image(str(photo), (24, 24, 3)), str)
  assert "over the limit of 0" in image_files.read_image(str(photo), (24, 24, 3),
                                                         max_pixels=100)
  with pytest.raises(ValueError, match="over the limit"):
    image_files.decode_image(photo.read_bytes(), (24, 24, 3), max_pixels=100)


def test_data_of_one_class_is_refused_by_the_writer_and_by_training(tmp_path):
  """A folder of one class folder (a wrong layout: the photos' folder one level too deep) is
  refused by the writer in one line, writing nothing; data of one class that was written
  (ArrayRecord of labels all 0) is refused by training before anything compiles, naming it."""
  write_photos(tmp_path / "photos", sizes=((24, 24),), per_class=3)
  done = convert(f"--out_dir={tmp_path / 'data'}", f"--image_folder={tmp_path}", process=True)
  root = tmp_path
  assert done.returncode == 1 and done.stderr.strip().splitlines() == [
      f"error: {root} holds one class folder, 'photos': a classifier needs two or more; give "
      f"the folder whose subfolders are the classes ({root}/cat/, {root}/dog/, ...)."]
  assert not (tmp_path / "data").exists()
  images = np.zeros((10, 8, 8, 1), np.uint8)
  write_arrayrecord.write_dataset(str(tmp_path / "one"), {
      split: (images, np.zeros(10, np.int64)) for split in ("train", "eval")}, 1)
  config = owned(default.get_config())
  config.dataset, config.data_dir = "arrayrecord", str(tmp_path / "one")
  with pytest.raises(errors.BadData, match=r"holds 1 class: a classifier needs two or more"):
    train.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists() or not os.listdir(tmp_path / "run" / "checkpoints")


def test_a_class_with_fewer_images_than_its_share_of_a_batch_is_said_once(tmp_path, caplog):
  """The writer stores the train split's images a class (a folder's and arrays'); a class with
  fewer than its share of the global batch (the batch over the classes) is named, with its count,
  in one warning as the data is read, and the others are not."""
  images = np.zeros((22, 8, 8, 1), np.uint8)
  labels = np.array([0] * 20 + [1] * 2)
  write_arrayrecord.write_dataset(str(tmp_path / "data"), {
      split: (images, labels) for split in ("train", "eval")}, 1)
  with open(tmp_path / "data" / "metadata.json") as f:
    assert json.load(f)["train_class_counts"] == [20, 2]
  config = owned(default.get_config())
  config.dataset, config.data_dir, config.batch_size = "arrayrecord", str(tmp_path / "data"), 16
  with caplog.at_level("WARNING"):
    sources.get_datasets(config)
  said = [r.getMessage() for r in caplog.records if "share of a batch" in r.getMessage()]
  assert said == ["1 of 2 classes hold fewer training images than their share of a batch of 16 "
                  "(8.0): '1' (2); each epoch shows them less than the others: add images, or "
                  "weigh their loss (recipe.loss)"], said
  write_photos(tmp_path / "photos", sizes=((24, 24),), per_class=4)
  done = convert(f"--out_dir={tmp_path / 'folder'}", f"--image_folder={tmp_path / 'photos'}",
                 "--eval_fraction=0.5")
  assert done.returncode == 0, done.stderr
  with open(tmp_path / "folder" / "metadata.json") as f:
    meta = json.load(f)
  assert sum(meta["train_class_counts"]) == meta["num_examples"]["train"]
  assert len(meta["train_class_counts"]) == len(meta["class_names"])


@pytest.mark.parametrize("channels", [1, 3], ids=["gray", "rgb"])
def test_a_16_bit_png_is_scaled_to_8_bits_not_clipped_white(channels):
  """A 16-bit gray PNG (PIL's I;16): decoded as its top byte, on both of the decoders' paths
  (decode_image: write_arrayrecord.py and predict.py; Crops, a photo kept whole), not clipped at
  255 by PIL's convert (97% white)."""
  wide = (np.arange(16 * 16, dtype=np.uint32).reshape(16, 16) * 257).astype(np.uint16)
  encoded = io.BytesIO()
  Image.fromarray(wide).save(encoded, format="PNG")  # (mode I;16)
  data = encoded.getvalue()
  assert Image.open(io.BytesIO(data)).mode.startswith("I")  # (16 bits in the file)
  decoded = image_files.decode_image(data, (16, 16, channels))
  top_byte = np.repeat((wide >> 8)[..., None], channels, axis=-1)
  np.testing.assert_array_equal(decoded, top_byte)
  image, _ = image_files.Crops().decoded(data, (16, 16, channels), position=0)
  np.testing.assert_array_equal(np.asarray(image).reshape(16, 16, channels), top_byte)
