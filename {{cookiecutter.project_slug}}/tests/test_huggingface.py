"""Hugging Face datasets read in place (huggingface.py): a save_to_disk folder and a folder of
Parquet files of the digits, with an Image column, a ClassLabel column of names and a third."""

import io
import logging

import datasets
import numpy as np
import pytest
from conftest import DIGIT_NAMES as NAMES
from conftest import owned, reads_as_the_digits, trains_as_written
from PIL import Image

from configs import default, tiny

from {{cookiecutter.project_slug}} import rules
from {{cookiecutter.project_slug}}.data import image_files, sources
from {{cookiecutter.project_slug}}.training import trained


def digits_dataset(split_names=("train", "validation")) -> datasets.DatasetDict:
  """The digits as PNG images (column 'picture'), their names (ClassLabel 'digit') and a note."""
  splits, _ = sources.get_datasets(default.get_config())
  features = datasets.Features({"note": datasets.Value("string"), "picture": datasets.Image(),
                                "digit": datasets.ClassLabel(names=list(NAMES))})

  def png(image):
    out = io.BytesIO()
    Image.fromarray(image[..., 0]).save(out, format="PNG")
    return out.getvalue()

  return datasets.DatasetDict({name: datasets.Dataset.from_dict(
      {"note": ["a digit"] * len(source), "digit": source.labels.tolist(),
       "picture": [{"bytes": png(image), "path": None} for image in source.images]},
      features=features) for name, source in zip(split_names, (splits["train"], splits["eval"]),
                                                 strict=True)})


# Where Dataset.to_parquet writes each split, in the layouts that `datasets` resolves itself
# (the Hub's among them); "test" is the evaluation split of one of them.
PARQUET_LAYOUTS = {"parquet": "{split}-00000-of-00001.parquet", "files": "{split}.parquet",
                   "hub": "data/{split}-00000-of-00001.parquet", "folders": "{split}/part0.parquet"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  """{'saved': a save_to_disk folder, and one folder per PARQUET_LAYOUTS entry}."""
  root, dataset = tmp_path_factory.mktemp("hf"), digits_dataset()
  dataset.save_to_disk(str(root / "saved"))
  for layout, pattern in PARQUET_LAYOUTS.items():
    for split, part in dataset.items():
      split = "test" if layout == "files" and split == "validation" else split
      path = root / layout / pattern.format(split=split)
      path.parent.mkdir(parents=True, exist_ok=True)
      part.to_parquet(str(path))
  return {"saved": str(root / "saved")} | {layout: str(root / layout) for layout in PARQUET_LAYOUTS}


def config_for(data_dir, **huggingface):
  config = owned(tiny.get_config())
  config.dataset, config.data_dir, config.num_workers = "huggingface", data_dir, 0
  config.huggingface.update(huggingface)
  return config


@pytest.mark.parametrize("kind", ["saved", *PARQUET_LAYOUTS])
def test_a_saved_dataset_and_parquet_files_read_as_the_digits(folders, kind):
  """Found by their features: the image and label columns; the class names and ids are the
  ClassLabel's, the images those of the digits, decoded; the splits as `datasets` names them
  from the files (train.parquet and test.parquet: test is the evaluation split)."""
  sources, digits = reads_as_the_digits(config_for(folders[kind]))
  indices = np.array([0, 5, 359])
  for split in ("train", "eval"):
    taken, wanted = sources[split].take(indices), digits[split].take(indices)
    np.testing.assert_array_equal(taken["image"], wanted["image"])
    np.testing.assert_array_equal(taken["label"], wanted["label"])


def test_what_cannot_be_read_is_one_line(folders, tmp_path):
  both = tmp_path / "both"
  digits_dataset(("train", "validation")).save_to_disk(str(tmp_path / "two"))
  dataset = datasets.load_from_disk(str(tmp_path / "two"))
  datasets.DatasetDict(dict(dataset, test=dataset["validation"])).save_to_disk(str(both))
  (tmp_path / "empty").mkdir()
  for config, message in [
      (config_for(str(both)), "the dataset's splits are train, validation, test: both of "
       "validation and test; name the evaluation split: --config.huggingface.eval_split=NAME."),
      (config_for(str(both), eval_split="val"), "the dataset has no config.huggingface.eval_split "
       "'val'; its splits are train, validation, test."),
      (config_for(folders["saved"], label_column="digits"), "config.huggingface.label_column="
       "'digits' is no column; the columns are note, digit, picture."),
      (config_for(str(tmp_path / "empty")), f"config.data_dir={str(tmp_path / 'empty')!r} holds "
       "neither a dataset saved by save_to_disk (dataset_dict.json) nor data files that datasets "
       "reads (train.parquet, data/train-*.parquet, train/*.parquet, ...): The directory at "
       f"{tmp_path / 'empty'} doesn't contain any data files")]:
    with pytest.raises(rules.ConfigError) as e:
      rules.validate_config(config)
    assert str(e.value) == message
  config = config_for(str(both), eval_split="test")
  rules.validate_config(config)
  assert sources.get_datasets(config)[1].num_examples["eval"] == 360


def test_photos_are_cropped_from_all_of_each(tmp_path):
  """Wide photos (JPEG files in an Image column) with the random-resized crop on: training's
  crops come from the whole photo, on the host, and evaluation keeps the eval_crop_ratio centre
  (test_image_folder.cropped_from_the_whole_photo)."""
  from test_image_folder import cropped_from_the_whole_photo, write_wide_photos

  write_wide_photos(tmp_path / "photos")
  paths = image_files.find_images([str(tmp_path / "photos")])
  features = datasets.Features({"image": datasets.Image(),
                                "label": datasets.ClassLabel(names=["left", "right"])})
  rows = {"image": paths, "label": [int("right" in path) for path in paths]}
  dataset = datasets.Dataset.from_dict(rows, features=features)
  datasets.DatasetDict(train=dataset, validation=dataset.select([1, 5])).save_to_disk(
      str(tmp_path / "saved"))
  config = config_for(str(tmp_path / "saved"))
  config.image_size = (32, 32, 3)
  cropped_from_the_whole_photo(config, eval_examples=2)


def test_images_of_several_sizes_are_said_at_start(tmp_path, caplog):
  """A split whose images differ in size: one warning at start naming the sizes and the one
  taken (the first's), and how to choose; the images all read at that size. With
  config.image_size given, no warning."""
  sizes = [(89, 71), (40, 60), (89, 71), (120, 90)]  # (height, width)
  rng = np.random.default_rng(0)
  images = []
  for height, width in sizes:
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, "PNG")
    images.append({"bytes": out.getvalue(), "path": None})
  features = datasets.Features({"image": datasets.Image(),
                                "label": datasets.ClassLabel(names=["a", "b"])})
  dataset = datasets.Dataset.from_dict({"image": images, "label": [0, 1, 0, 1]}, features=features)
  datasets.DatasetDict(train=dataset, test=dataset).save_to_disk(str(tmp_path / "saved"))
  config = config_for(str(tmp_path / "saved"))
  caplog.set_level(logging.WARNING)
  splits, info = sources.get_datasets(config)
  said = [r.getMessage() for r in caplog.records if "sizes" in r.getMessage()]
  assert said == ["huggingface: the first 4 training images have 3 sizes (height x width "
                  "40x60, 89x71, 120x90); each is scaled to cover and centre-cropped to the "
                  "first's, 89x71: give --config.image_size=H,W to choose"]
  assert info.image_shape == (89, 71, 3)
  assert splits["train"].take(np.arange(4))["image"].shape == (4, 89, 71, 3)
  caplog.clear()
  config.image_size = (64, 64, 3)
  assert sources.get_datasets(config)[1].image_shape == (64, 64, 3)
  assert not [r for r in caplog.records if "sizes" in r.getMessage()]


@pytest.mark.slow
def test_a_run_on_a_hugging_face_dataset_keeps_its_class_names(folders, tmp_path):
  """Trained on the saved dataset: the metrics of the same images written by write_arrayrecord.py;
  data.json keeps the ClassLabel's names, predict.py gives them and evaluate.py counts the whole
  validation split."""
  import predict

  config = config_for(folders["saved"])
  config.num_epochs = 4
  digits, _ = sources.get_datasets(default.get_config())
  metrics = trains_as_written(config, tmp_path, {
      split: (digits[split].images, digits[split].labels) for split in ("train", "eval")}, NAMES)
  assert metrics["examples"] == 360 and metrics["accuracy"] > 0.5
  run = trained.Restored(str(tmp_path / "run"))
  source = sources.get_datasets(run.config)[0]["eval"]
  images = source.take(np.arange(40))
  for i, image in enumerate(images["image"]):
    Image.fromarray(image[..., 0]).save(tmp_path / f"{i:02d}.png")
  paths = image_files.find_images([str(tmp_path)])
  predicted = [NAMES[int(np.argmax(p))] for _, p in predict.predict(run, paths)]
  assert sum(p == NAMES[label] for p, label in zip(predicted, images["label"], strict=True)) > 20
