"""TensorFlow Datasets read without TensorFlow (tfds_data.py): the digits, prepared here by TFDS
itself (a GeneratorBasedBuilder, ArrayRecord files) as PNG images with a ClassLabel of names."""

import io
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds
from conftest import DIGIT_NAMES as NAMES
from conftest import owned, reads_as_the_digits, trains_as_written
from PIL import Image

from configs import default, tiny

from {{cookiecutter.project_slug}} import rules
from {{cookiecutter.project_slug}}.data import sources


class DigitsForTest(tfds.core.GeneratorBasedBuilder):
  """The digits' train and eval splits (those of dataset=digits) as 'train' and 'validation'."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        "note": tfds.features.Text(), "picture": tfds.features.Image(shape=(None, None, 1)),
        "digit": tfds.features.ClassLabel(names=list(NAMES))}))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples("train"),
            "validation": self._generate_examples("eval")}

  def _generate_examples(self, split):
    source = sources.get_datasets(default.get_config())[0][split]
    for i, (image, label) in enumerate(zip(source.images, source.labels, strict=True)):
      out = io.BytesIO()
      Image.fromarray(image[..., 0]).save(out, format="PNG")
      yield i, {"note": "a digit", "picture": out.getvalue(), "digit": int(label)}


class WidePhotosForTest(tfds.core.GeneratorBasedBuilder):
  """test_image_folder.write_wide_photos' JPEGs: all of them 'train', two also 'validation'."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        "image": tfds.features.Image(shape=(None, None, 3), encoding_format="jpeg"),
        "label": tfds.features.ClassLabel(names=["left", "right"])}))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples(None), "validation": self._generate_examples(2)}

  def _generate_examples(self, count):
    from {{cookiecutter.project_slug}}.data import image_files

    for i, path in enumerate(image_files.find_images([self._photos])[:count]):
      yield i, {"image": path, "label": int("right" in path)}


def test_photos_are_cropped_from_all_of_each(tmp_path):
  """Training's crops come from the whole photo, on the host; evaluation keeps the
  eval_crop_ratio centre (test_image_folder.cropped_from_the_whole_photo)."""
  from test_image_folder import cropped_from_the_whole_photo, write_wide_photos

  write_wide_photos(tmp_path / "photos")
  builder = WidePhotosForTest(data_dir=str(tmp_path / "tfds"), file_format="array_record")
  builder._photos = str(tmp_path / "photos")
  builder.download_and_prepare()
  config = config_for(str(tmp_path / "tfds"), name="wide_photos_for_test")
  config.image_size = (32, 32, 3)
  cropped_from_the_whole_photo(config, eval_examples=2)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("tfds")
  DigitsForTest(data_dir=str(root), file_format="array_record").download_and_prepare()
  return str(root)


def config_for(data_dir, name="digits_for_test"):
  config = owned(tiny.get_config())
  config.dataset, config.data_dir, config.tfds_name, config.num_workers = (
      "tfds", data_dir, name, 0)
  return config


def test_a_prepared_dataset_reads_as_the_digits_without_tensorflow(data_dir):
  """Found by their features: the image and the label; the class names and ids are the
  ClassLabel's, the images those of the digits, decoded; 'validation' is the eval split."""
  sources, digits = reads_as_the_digits(config_for(data_dir))
  for split in ("train", "eval"):  # the same examples (in TFDS's order: it shuffles them)
    taken = sources[split].take(np.arange(len(sources[split])))
    pairs = sorted(zip(taken["label"].tolist(), (image.tobytes() for image in taken["image"]),
                       strict=True))
    wanted = sorted(zip(digits[split].labels.tolist(),
                        (image.tobytes() for image in digits[split].images), strict=True))
    assert pairs == wanted
  assert "tensorflow" not in sys.modules


def test_what_cannot_be_read_is_one_line(data_dir, tmp_path):
  for config, message in [
      (config_for(data_dir, name=""), "config.dataset='tfds' needs config.tfds_name: the "
       "dataset's TFDS name, e.g. --config.tfds_name=imagenet2012."),
      (config_for(data_dir, name="no_such_set"), f"config.tfds_name='no_such_set' is not in "
       f"{data_dir} (DatasetNotFoundError); prepare it there: tfds build no_such_set "
       "--file_format=array_record --data_dir=DIR."),
      (config_for(str(tmp_path)), f"digits_for_test is not prepared in {tmp_path}; prepare "
       "it: tfds build digits_for_test --file_format=array_record --data_dir=DIR.")]:
    with pytest.raises(rules.ConfigError) as e:
      rules.validate_config(config)
    assert str(e.value) == message


@pytest.mark.slow
def test_a_run_on_a_tfds_dataset_keeps_its_class_names(data_dir, tmp_path):
  """Trained on it, read by a Grain worker process: the metrics of the same images, in the same
  order, written by write_arrayrecord.py; data.json keeps the ClassLabel's names, and
  evaluate.py reads the split."""
  config = config_for(data_dir)
  config.num_epochs, config.num_workers = 4, 1
  splits, _ = sources.get_datasets(config)
  taken = {split: source.take(np.arange(len(source))) for split, source in splits.items()}
  metrics = trains_as_written(config, tmp_path, {
      split: (t["image"], t["label"]) for split, t in taken.items()}, NAMES)
  assert metrics["examples"] == 360 and metrics["accuracy"] > 0.5
