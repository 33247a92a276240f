"""ArrayRecord shards that write_arrayrecord.py wrote into `config.data_dir`: `train-*` and
`eval-*.array_record` (msgpack records: image, label) and `metadata.json` (shape, classes, pixel
dtype, and `resize_shorter` for photos stored whole, which the host then crops). A data source:
`load`, `describe`, `check` (input_pipeline.SOURCES)."""

import json
import os

from .input_pipeline import DatasetInfo, Loaded, RecordSource, arrayrecord_paths, host_crops

READS_DATA_DIR = True  # (plan.py: config.data_dir is this source's)


def metadata(data_dir: str) -> dict:
  with open(os.path.join(data_dir, "metadata.json")) as f:
    return json.load(f)


def load(config) -> Loaded:
  meta = metadata(config.data_dir)
  crops_on_host = bool(meta.get("resize_shorter"))
  crops = host_crops(config) if crops_on_host else {}
  sources = {split: RecordSource(arrayrecord_paths(config.data_dir, split), meta["image_shape"],
                                 crops.get(split), f"arrayrecord {config.data_dir} {split}",
                                 meta.get("pixel_dtype", "uint8"))
             for split in ("train", "eval")}
  return Loaded(sources, tuple(meta["image_shape"]), meta["num_classes"],
                tuple(meta.get("class_names", ())), crops_on_host)


def describe(config) -> DatasetInfo:
  meta = metadata(config.data_dir)
  return DatasetInfo(tuple(meta["image_shape"]), int(meta["num_classes"]),
                     dict(meta["num_examples"]), tuple(meta.get("class_names", ())),
                     meta.get("pixel_dtype", "uint8"), bool(meta.get("resize_shorter")))


def check(config) -> str | None:
  written = "write_arrayrecord.py wrote"
  if not config.data_dir:
    return f"config.data_dir is empty; give the directory that {written}: --config.data_dir=DIR."
  if not os.path.isdir(config.data_dir):
    return (f"config.data_dir={config.data_dir!r} " + ("is not a directory" if os.path.exists(
        config.data_dir) else "does not exist") + f"; give the directory that {written}.")
  for split in ("train", "eval"):
    if not arrayrecord_paths(config.data_dir, split):
      return (f"config.data_dir={config.data_dir!r} holds no {split}-*.array_record files; "
              "write them with write_arrayrecord.py.")
  if not os.path.isfile(os.path.join(config.data_dir, "metadata.json")):
    return (f"config.data_dir={config.data_dir!r} has no metadata.json; write the data with "
            "write_arrayrecord.py.")
  return None
