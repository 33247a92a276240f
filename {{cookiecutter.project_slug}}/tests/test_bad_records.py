"""A record that cannot be read, in any source (ArrayRecord, Hugging Face, TFDS; image folders:
test_image_folder.py), is named in the log (source, split, row) and skipped: masked like padding,
every other example read once; more than a small share stops the run in one line."""

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

import write_arrayrecord
from configs import default, tiny

from {{cookiecutter.project_slug}} import plan
from {{cookiecutter.project_slug}}.data import arrayrecord, input_pipeline
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
  sources, _ = input_pipeline.get_datasets(default.get_config())
  return {split: ([damaged(i, png(image), bad if split == damaged_split else {})
                   for i, image in enumerate(source.images)], source.labels)
          for split, source in sources.items()}


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
  splits, _ = input_pipeline.get_datasets(config)
  caplog.set_level(logging.WARNING)
  elements = list(input_pipeline.eval_batches(splits["eval"], plan.resolved(config)))
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
  splits, _ = input_pipeline.get_datasets(config)
  caplog.set_level(logging.WARNING)
  elements = list(input_pipeline.eval_batches(splits["train"], plan.resolved(config)))
  assert sum(int(e["mask"].sum()) for e in elements) == 1437 - len(bad) == 1425
  assert len([r for r in caplog.records if r.getMessage().startswith("skipped ")]) == 12


def test_more_than_a_small_share_bad_stops_in_one_line(tmp_path):
  """30% of the training records garbled: the run stops with one line, naming the share."""
  bad = {i: "garbage" for i in range(0, 360, 3)}
  write_arrayrecord_digits(tmp_path / "data", bad)
  with pytest.raises(BadData, match=r"^\d+ of the \d+ records read in this process could not be "
                     r"read, more than 1% \(input_pipeline.MAX_BAD_SHARE\); the last: "):
    config = owned(tiny.get_config())
    config.dataset, config.data_dir, config.num_workers = "arrayrecord", str(tmp_path / "data"), 0
    config.steps_per_dispatch = 1
    splits, _ = input_pipeline.get_datasets(config)
    list(input_pipeline.eval_batches(splits["eval"], plan.resolved(config)))
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
