"""Writes a dataset as ArrayRecord shards that `config.dataset = 'arrayrecord'` reads.

  python write_arrayrecord.py --out_dir=/data/mine --npz=mine.npz  # your arrays
  python write_arrayrecord.py --out_dir=/data/digits                # the digits, as a demo

The .npz holds `train_images`, `train_labels`, `eval_images`, `eval_labels` (images
[N, H, W, C]; labels [N], integers from 0). Store pixels as uint8, 0 to 255: they stay uint8 up
to the device, which divides them by 255 (float images reach the model as they are, at 4x the
bytes). The digits are written as uint8. Each record is one example,
msgpack-encoded by flax.serialization; `metadata.json` records the image shape, the number of
classes and the split sizes. Then train with --config.dataset=arrayrecord --config.data_dir=DIR.
"""

import json
import os

import numpy as np
from absl import app, flags
from array_record.python.array_record_module import ArrayRecordWriter
from flax import serialization

import input_pipeline


def write_split(out_dir: str, split: str, images: np.ndarray, labels: np.ndarray,
                num_shards: int) -> list[str]:
  """Writes `{split}-NNNNN-of-NNNNN.array_record` shards of consecutive examples, so that
  reading the shards in name order gives the examples in their original order."""
  if len(images) != len(labels):
    raise ValueError(f"{split}: {len(images)} images but {len(labels)} labels.")
  paths = [os.path.join(out_dir, f"{split}-{i:05d}-of-{num_shards:05d}.array_record")
           for i in range(num_shards)]
  for path, indices in zip(paths, np.array_split(np.arange(len(labels)), num_shards), strict=True):
    writer = ArrayRecordWriter(path, "group_size:1")
    for index in indices:
      writer.write(serialization.msgpack_serialize(
          {"image": np.asarray(images[index]), "label": np.asarray(labels[index], np.int32)}))
    writer.close()
  return paths


def write_dataset(out_dir: str, splits: dict[str, tuple[np.ndarray, np.ndarray]],
                  num_shards: int = 4) -> None:
  os.makedirs(out_dir, exist_ok=True)
  for split, (images, labels) in splits.items():
    write_split(out_dir, split, images, labels, num_shards)
  images, _ = splits["train"]
  metadata = dict(
      image_shape=list(images.shape[1:]),
      num_classes=int(max(labels.max() for _, labels in splits.values())) + 1,
      num_examples={split: len(labels) for split, (_, labels) in splits.items()},
  )
  with open(os.path.join(out_dir, "metadata.json"), "w") as f:
    json.dump(metadata, f, indent=2)


_OUT_DIR = flags.DEFINE_string("out_dir", None, "Where the shards go.", required=True)
_NPZ = flags.DEFINE_string("npz", None, "Arrays to write; default: the digits dataset.")
_NUM_SHARDS = flags.DEFINE_integer("num_shards", 4, "Files per split.")


def main(argv):
  del argv
  if _NPZ.value:
    arrays = np.load(_NPZ.value)
    splits = {s: (arrays[f"{s}_images"], arrays[f"{s}_labels"]) for s in ("train", "eval")}
  else:
    from configs import default

    sources, _ = input_pipeline.get_datasets(default.get_config())
    splits = {split: (source.images, source.labels) for split, source in sources.items()}
  write_dataset(_OUT_DIR.value, splits, _NUM_SHARDS.value)
  print(f"wrote {', '.join(f'{s}: {len(y)}' for s, (_, y) in splits.items())} to {_OUT_DIR.value}")


if __name__ == "__main__":
  app.run(main)
