"""Classifies image files with a run's checkpoint.

  python predict.py --workdir=workdir photos/cat.jpg photos/more/  # a folder: the images under it
  python predict.py --workdir=workdir --top_k=3 --json photos/ > predictions.jsonl

One line per image: `path: class probability` (`--top_k` classes, most probable first), or with
--json one object per line: {"path", "class", "probability", "top_k": [{"class",
"probability"}, ...]}. The images are decoded and resized as write_arrayrecord.py does, the
model is the project's `model.py` with the latest checkpoint (`--step` for another), on every
device, in batches of one fixed shape (padded and masked), so that the step compiles once. An
unreadable file is reported on stderr and skipped.
"""

import concurrent.futures
import json
import sys

import jax
import numpy as np
from absl import app, flags, logging
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import input_pipeline
import runs

FLAGS = flags.FLAGS


def predict(run: runs.Restored, paths: list[str], batch_size: int = 0):
  """Yields (path, probabilities [classes] or why the file could not be read), in order."""
  devices = run.mesh.size
  batch_size = -(-(batch_size or run.config.batch_size) // devices) * devices
  height, width, channels = run.info.image_shape
  sharding = NamedSharding(run.mesh, P(run.mesh.axis_names))  # over every axis (fsdp's too)
  step = jax.jit(runs.probabilities, static_argnums=0)
  with concurrent.futures.ThreadPoolExecutor(input_pipeline.available_cpus()) as pool:
    for start in range(0, len(paths), batch_size):
      chunk = paths[start:start + batch_size]
      images = list(pool.map(input_pipeline.read_image, chunk,
                             [run.info.image_shape] * len(chunk)))
      read = [i for i, image in enumerate(images) if not isinstance(image, str)]
      batch = np.zeros((batch_size, height, width, channels), np.uint8)  # padding: masked out
      for row, i in enumerate(read):
        batch[row] = images[i]
      mask = np.arange(batch_size) < len(read)
      probs = np.asarray(step(run.graphdef, run.state, jax.device_put(batch, sharding),
                              jax.device_put(mask, sharding)))
      rows = iter(range(len(read)))
      for path, image in zip(chunk, images, strict=True):
        yield path, image if isinstance(image, str) else probs[next(rows)]


def main(argv):
  logging.set_verbosity(logging.WARNING)
  try:
    if FLAGS.top_k < 1:
      raise runs.ConfigError(f"--top_k={FLAGS.top_k} must be 1 or more.")
    paths = runs.find_images(argv[1:])
    if not paths:
      raise runs.ConfigError("no image to classify: give image files (.jpg, .jpeg, .png) or "
                             "folders of them after the flags.")
    run = runs.Restored(FLAGS.workdir, FLAGS.step)
  except runs.ConfigError as e:
    raise SystemExit(f"error: {e}") from None
  names, skipped = run.info.class_names, 0
  for path, probs in predict(run, paths, FLAGS.batch_size):
    if isinstance(probs, str):
      print(f"skipped {path}: {probs}", file=sys.stderr)
      skipped += 1
      continue
    top = np.argsort(-probs, kind="stable")[:FLAGS.top_k]
    if FLAGS.json:
      print(json.dumps(dict(path=path, **{"class": names[top[0]]},
                            probability=float(probs[top[0]]),
                            top_k=[{"class": names[i], "probability": float(probs[i])}
                                   for i in top])))
    else:
      print(f"{path}: " + ", ".join(f"{names[i]} {probs[i]:.4f}" for i in top))
  print(f"classified {len(paths) - skipped} images with the checkpoint of step {run.step}; "
        f"skipped {skipped} unreadable file{'s' * (skipped != 1)}", file=sys.stderr)


if __name__ == "__main__":  # flags defined here: the functions above can be imported
  flags.DEFINE_string("workdir", None, "A training run's workdir.", required=True)
  flags.DEFINE_integer("step", None, "The checkpoint's step (default: the latest).")
  flags.DEFINE_integer("top_k", 1, "How many classes to report per image.")
  flags.DEFINE_bool("json", False, "One JSON object per line.")
  flags.DEFINE_integer("batch_size", 0, "Images per call (0: the run's batch size, "
                        "rounded up to a multiple of the devices).")
  app.run(main)
