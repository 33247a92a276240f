"""A record that cannot be read, in any source (ArrayRecord, Hugging Face, TFDS; image folders:
test_image_folder.py), is named in the log (source, split, row) and skipped: masked like padding,
every other example read once; more than a small share stops the run in one line."""

import collections
import io
import logging
import re

import datasets
import numpy as np
import pytest
import tensorflow_datasets as tfds
from conftest import DIGIT_NAMES, owned
from flax import serialization
from PIL import Image
from test_train import OWN, run_cli, run_in_process

import train
import write_arrayrecord
from configs import default, tiny

from {{cookiecutter.project_slug}} import plan
from {{cookiecutter.project_slug}}.data import (
    arrayrecord,
    batches,
    input_pipeline,
    sources,
)
from {{cookiecutter.project_slug}}.errors import BadData

BAD = {5: "truncated", 17: "garbage", 30: "garbage"}  # eval rows and what is wrong with them


def png(image: np.ndarray) -> bytes:
  out = io.BytesIO()
  Image.fromarray(image[..., 0]).save(out, format="PNG")
  return out.getvalue()


def damaged(row: int, data: bytes, bad: dict) -> bytes:
  return {"truncated": data[:len(data) // 2], "garbage": b"not an image"}.get(bad.get(row), data)


def digits(bad: dict, damaged_split: str = "eval") -> dict[str, tuple[list[bytes], np.ndarray]]:
  """The digits' splits as PNG bytes, the rows in `bad` of `damaged_split` damaged."""
  data, _ = sources.get_datasets(default.get_config())
  return {split: ([damaged(i, png(image), bad if split == damaged_split else {})
                   for i, image in enumerate(source.images)], source.labels)
          for split, source in data.items()}


def write_arrayrecord_digits(root, bad: dict, garbled_records=(), damaged_split="eval") -> str:
  """The digits kept encoded as ArrayRecord (as `--keep_encoded` writes them), the rows in `bad`
  of `damaged_split` damaged; the eval records in `garbled_records` are not even msgpack."""
  root.mkdir(parents=True)
  for split, (images, labels) in digits(bad, damaged_split).items():
    records = ((i, b"\xc1 garbled" if split == "eval" and i in garbled_records else
                write_arrayrecord.encode(image, label))
               for i, (image, label) in enumerate(zip(images, labels, strict=True)))
    write_arrayrecord.write_records(str(root), split, records, len(labels), 2)
  write_arrayrecord.write_metadata(str(root), (8, 8, 1), 10, {"train": 1437, "eval": 360},
                                   encoded=True, pixel_dtype="uint8")
  return str(root)


class DamagedDigits(tfds.core.GeneratorBasedBuilder):
  """The digits as PNGs, the eval rows in BAD damaged ('note' says which)."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        "note": tfds.features.Text(), "picture": tfds.features.Image(shape=(None, None, 1)),
        "digit": tfds.features.ClassLabel(names=list(DIGIT_NAMES))}))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples("train"),
            "validation": self._generate_examples("eval")}

  def _generate_examples(self, split):
    images, labels = digits(BAD)[split]
    for i, (image, label) in enumerate(zip(images, labels, strict=True)):
      note = f"bad {i}" if split == "eval" and i in BAD else "a digit"
      yield i, {"note": note, "picture": image, "digit": int(label)}


def config_for(source: str, root) -> tuple:
  """The tiny config reading `source` (its eval rows in BAD damaged), and those rows' places."""
  config = owned(tiny.get_config())
  config.num_workers, config.batch_size, config.steps_per_dispatch = 0, 64, 1
  if source == "arrayrecord":
    config.dataset = "arrayrecord"
    config.data_dir = write_arrayrecord_digits(root / "ar", {5: "truncated", 17: "garbage"}, {30})
    return config, sorted(BAD)
  if source == "huggingface":
    features = datasets.Features({"note": datasets.Value("string"), "picture": datasets.Image(),
                                  "digit": datasets.ClassLabel(names=list(DIGIT_NAMES))})
    datasets.DatasetDict({name: datasets.Dataset.from_dict(
        {"note": ["a digit"] * len(labels), "digit": labels.tolist(),
         "picture": [{"bytes": image, "path": None} for image in images]}, features=features)
        for name, (images, labels) in zip(("train", "validation"), digits(BAD).values(),
                                          strict=True)}).save_to_disk(str(root / "hf"))
    config.dataset, config.data_dir = "huggingface", str(root / "hf")
    return config, sorted(BAD)
  DamagedDigits(data_dir=str(root / "tfds"), file_format="array_record").download_and_prepare()
  config.dataset, config.data_dir, config.tfds_name = "tfds", str(root / "tfds"), "damaged_digits"
  notes = DamagedDigits(data_dir=str(root / "tfds")).as_data_source(
      "validation", decoders={"picture": tfds.decode.SkipDecoding()})  # (TFDS shuffled them)
  return config, sorted(i for i in range(len(notes)) if notes[i]["note"].startswith(b"bad"))


@pytest.mark.parametrize("source", ["arrayrecord", "huggingface", "tfds"])
def test_a_bad_record_is_named_and_skipped(source, tmp_path, caplog):
  config, bad_rows = config_for(source, tmp_path)
  splits, _ = sources.get_datasets(config)
  caplog.set_level(logging.WARNING)
  elements = list(batches.eval_batches(splits["eval"], plan.resolved(config)))
  positions = np.concatenate([e["position"][e["mask"]] for e in elements])
  assert sorted(positions.tolist()) == sorted(set(range(360)) - set(bad_rows))  # each once
  skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped ")]
  assert len(skipped) == len(bad_rows), skipped
  name = splits["eval"].name
  for row, line in zip(bad_rows, skipped, strict=True):
    assert line.startswith(f"skipped {name} row {row}, unreadable ("), line
    assert re.search(r"\): \d+ of \d+ records read here so far$", line), line
  assert name.startswith(source) and name.endswith(" eval")


def test_a_small_share_bad_is_read_around(tmp_path, caplog):
  """12 of the 1437 training records damaged (0.8%, more than 10 but under 1% of those read):
  every other record read, the 12 named."""
  bad = {i: "garbage" for i in range(0, 1437, 120)}
  config = owned(tiny.get_config())
  config.dataset, config.num_workers, config.steps_per_dispatch = "arrayrecord", 0, 1
  config.data_dir = write_arrayrecord_digits(tmp_path / "data", bad, damaged_split="train")
  splits, _ = sources.get_datasets(config)
  caplog.set_level(logging.WARNING)
  elements = list(batches.eval_batches(splits["train"], plan.resolved(config)))
  assert sum(int(e["mask"].sum()) for e in elements) == 1437 - len(bad) == 1425
  assert len([r for r in caplog.records if r.getMessage().startswith("skipped ")]) == 12


@pytest.mark.slow  # (a full training; fast: a run that reads around bad records to its end)
def test_more_than_a_small_share_bad_stops_in_one_line(tmp_path):
  """30% of the training records garbled: the run stops with one line, naming the share."""
  bad = {i: "garbage" for i in range(0, 360, 3)}
  write_arrayrecord_digits(tmp_path / "data", bad)
  with pytest.raises(BadData, match=r"^\d+ of the \d+ records read in this process could not be "
                     r"read, more than 1% \(batches.MAX_BAD_SHARE\); the last: "):
    config = owned(tiny.get_config())
    config.dataset, config.data_dir, config.num_workers = "arrayrecord", str(tmp_path / "data"), 0
    config.steps_per_dispatch = 1
    splits, _ = sources.get_datasets(config)
    list(batches.eval_batches(splits["eval"], plan.resolved(config)))
  error = run_in_process("--config=configs/tiny.py", *OWN, f"--workdir={tmp_path / 'run'}",
                         "--config.dataset=arrayrecord", f"--config.data_dir={tmp_path / 'data'}",
                         "--config.num_workers=0")
  assert error.startswith("error: ") and "\n" not in error, error
  assert "records read in this process could not be read, more than 1%" in error


@pytest.mark.slow
def test_with_workers_a_bad_record_is_named_and_too_many_stop_in_one_line(tmp_path):
  """The same through train.py's process, its Grain workers reading: each bad record named on
  stderr, the run ending normally; with 30% bad, one line and nothing else."""
  write_arrayrecord_digits(tmp_path / "few", BAD)
  out, _ = run_cli(tmp_path / "run", "--config.dataset=arrayrecord", "--config.num_workers=2",
                   f"--config.data_dir={tmp_path / 'few'}", "--config.num_epochs=1")
  assert out.returncode == 0, out.stderr[-3000:]
  for row in BAD:
    assert f"skipped arrayrecord {tmp_path / 'few'} eval row {row}, unreadable (" in out.stderr
  write_arrayrecord_digits(tmp_path / "many", {i: "garbage" for i in range(0, 360, 3)})
  out, _ = run_cli(tmp_path / "run2", "--config.dataset=arrayrecord", "--config.num_workers=2",
                   f"--config.data_dir={tmp_path / 'many'}", "--config.num_epochs=1")
  assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
  assert out.stderr.strip().splitlines()[-1].startswith("error: "), out.stderr[-3000:]


def test_a_record_that_is_not_msgpack_is_read_around(tmp_path):
  """A garbled record among good ones: the good ones of its batch are read all the same."""
  root = write_arrayrecord_digits(tmp_path / "data", {}, garbled_records={3})
  source = arrayrecord.RecordSource(arrayrecord.arrayrecord_paths(root, "eval"), (8, 8, 1))
  taken = source.take(np.arange(8))
  assert list(taken["failed"]) == [3]
  assert not taken["image"][3].any() and taken["image"][[0, 1, 2, 4]].any(axis=(1, 2, 3)).all()
  assert isinstance(serialization.msgpack_restore(source.records[4]), dict)


# Records that read but are not examples of the data (8x8x1 uint8 digits, 10 classes): 3 eval
# rows of each kind, and what the log says of each.
NOT_AN_EXAMPLE = {
    **dict.fromkeys((4, 40, 140), ("missing", "not a record of image and label: holds ['label', "
                                   "'picture']")),
    **dict.fromkeys((9, 90, 190), ("shape", "an image of uint8 [7, 8, 1], not the data's uint8 "
                                   "[8, 8, 1]")),
    **dict.fromkeys((16, 160, 260), ("dtype", "an image of float32 [8, 8, 1], not the data's "
                                     "uint8 [8, 8, 1]")),
    **dict.fromkeys((25, 250), ("label 99", "label 99 outside [0, 10), the data's classes")),
    359: ("label -1", "label -1 outside [0, 10), the data's classes"),
}


def not_an_example(image: np.ndarray, label: int, kind: str) -> bytes:
  if kind == "missing":
    return serialization.msgpack_serialize({"picture": image, "label": np.asarray(label)})
  if kind in ("shape", "dtype"):
    image = image[:7] if kind == "shape" else image.astype(np.float32)
    return serialization.msgpack_serialize({"image": image, "label": np.asarray(label)})
  return write_arrayrecord.encode(image, int(kind.split()[1]))


def write_digits_with_records_of_every_bad_kind(root) -> str:
  """The digits stored decoded (write_arrayrecord's records), the eval rows of NOT_AN_EXAMPLE
  each made its kind of bad record."""
  root.mkdir(parents=True)
  splits, _ = sources.get_datasets(default.get_config())
  for split, source in splits.items():
    records = ((i, not_an_example(image, label, NOT_AN_EXAMPLE[i][0])
                if split == "eval" and i in NOT_AN_EXAMPLE else
                write_arrayrecord.encode(image, label))
               for i, (image, label) in enumerate(zip(source.images, source.labels, strict=True)))
    write_arrayrecord.write_records(str(root), split, records, len(source.labels), 2)
  write_arrayrecord.write_metadata(str(root), (8, 8, 1), 10, {"train": 1437, "eval": 360},
                                   pixel_dtype="uint8")
  return str(root)


def test_records_of_every_bad_kind_are_named_and_masked_and_the_run_ends(tmp_path, monkeypatch,
                                                                          caplog):
  """A record without an image, an image of another shape or dtype, a label outside the classes
  (99, -1): each named (source, row, why) and masked, every other example evaluated once; the
  run ends normally (12 bad of the 1797 read: under 1%)."""
  monkeypatch.setattr(batches, "_records", collections.Counter())  # this run's alone
  config = owned(tiny.get_config())
  config.dataset, config.num_workers, config.eval_every_steps = "arrayrecord", 0, 1000
  config.data_dir = write_digits_with_records_of_every_bad_kind(tmp_path / "data")
  caplog.set_level(logging.WARNING)
  metrics = train.train_and_evaluate(config, str(tmp_path / "run"))
  assert metrics["examples"] == 360 - len(NOT_AN_EXAMPLE) == 348
  skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped ")]
  assert [re.sub(r": \d+ of \d+ records read here so far$", "", line) for line in skipped] == [
      f"skipped arrayrecord {config.data_dir} eval row {row}, unreadable ({why})"
      for row, (_, why) in sorted(NOT_AN_EXAMPLE.items())], skipped  # the eval split, in order


@pytest.mark.slow
@pytest.mark.parametrize("bad_share", [0.008, 0.3])
def test_the_stop_is_counted_over_all_workers_the_same_for_0_1_and_2(tmp_path, monkeypatch,
                                                                     bad_share):
  """The training split read through the input (as_iterator) with 0, 1 and 2 worker processes
  (an element in 1 unit, or in 8: a device's share each): the bad records counted in the main
  process an element at a time, over all workers, give the same verdict at the same element
  (0.8% bad: read around, each named; 30%: the same one-line stop)."""
  bad = {i: "garbage" for i in range(0, 1437, round(1 / bad_share))}
  config = owned(tiny.get_config())
  config.dataset, config.steps_per_dispatch = "arrayrecord", 1
  config.data_dir = write_arrayrecord_digits(tmp_path / "data", bad, damaged_split="train")
  splits, _ = sources.get_datasets(config)
  verdicts = {}
  for workers in (0, 1, 2):
    config.num_workers = workers
    elements = batches.eval_batches(splits["train"], plan.resolved(config))
    assert elements.shares == (8 if workers else 1)
    monkeypatch.setattr(batches, "_records", collections.Counter())
    iterator = input_pipeline.as_iterator(elements, config)
    try:
      verdicts[workers] = sum(int(next(iterator)["mask"].sum()) for _ in range(len(elements)))
    except BadData as e:
      verdicts[workers] = str(e)
    finally:
      iterator.close()
  assert verdicts[0] == verdicts[1] == verdicts[2], verdicts
  if bad_share < 0.01:
    assert verdicts[0] == 1437 - len(bad)
  else:
    assert verdicts[0] == (  # rows 0, 3, ..., 63 bad: 22 in the first element, 64 rows
        "22 of the 64 records read in this process could not be read, more than 1% "
        "(batches.MAX_BAD_SHARE); the last: arrayrecord "
        f"{config.data_dir} train row 63: UnidentifiedImageError: cannot identify image file")
