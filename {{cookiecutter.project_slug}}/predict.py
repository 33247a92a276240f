"""Classifies image files with a run's checkpoint.

  python predict.py --workdir=workdir photos/cat.jpg photos/more/  # a folder: the images under it
  python predict.py --workdir=workdir --top_k=3 --json photos/ > predictions.jsonl

One line per image: `path: class probability` (`--top_k` classes, most probable first), or with
--json one object per line: {"path", "class", "probability", "top_k": [{"class",
"probability"}, ...]}. The images are decoded and resized as write_arrayrecord.py does (a
.npy file holds one image as stored: the only input of a run trained on float pixels), the
model is the project's `model.py` with the latest checkpoint (`--step` for another), on every
device, in batches of one fixed shape (padded and masked), so that the step compiles once. An
unreadable file is reported on stderr and skipped. On several processes (process.py) each
reads its share of every batch and process 0 prints.
"""

import concurrent.futures
import functools
import json
import sys

import jax
import numpy as np
from absl import app, flags, logging
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from {{cookiecutter.project_slug}} import process
from {{cookiecutter.project_slug}}.data import batches, image_files
from {{cookiecutter.project_slug}}.training import steps, trained

FLAGS = flags.FLAGS


def predict(run: trained.Restored, paths: list[str], batch_size: int = 0,
            max_pixels: int = image_files.MAX_PIXELS):
  """Yields (path, probabilities [classes] or why the file could not be read), in order. Each
  process reads its share of every batch; every process gets every row's probabilities.

  Args:
    run: the trained run.
    paths: the image files.
    batch_size: rows a batch over all devices; 0: the run's.
    max_pixels: the most pixels decoded.
  """
  batch_size = -(-(batch_size or run.config.run.global_batch_size) // run.mesh.size) * run.mesh.size
  local = batch_size // jax.process_count()
  first = jax.process_index() * local  # this process's rows of each batch
  height, width, channels = run.info.image_shape
  sharding = NamedSharding(run.mesh, P(run.mesh.axis_names))  # over every axis (fsdp's too)
  step = jax.jit(lambda graphdef, state, images, mask, rows: (
      steps.probabilities(graphdef, state, images, mask, run.config), mask, rows),
      static_argnums=0, out_shardings=NamedSharding(run.mesh, P()))  # every row, everywhere
  put = lambda x: jax.make_array_from_process_local_data(sharding, x)  # noqa: E731
  read = functools.partial(image_files.read_image, image_shape=run.info.image_shape,
                           pixel_dtype=run.info.pixel_dtype, center_ratio=trained.center_ratio(run),
                           max_pixels=max_pixels)
  with concurrent.futures.ThreadPoolExecutor(batches.available_cpus()) as pool:
    for start in range(0, len(paths), batch_size):
      chunk = paths[start:start + batch_size]
      mine = chunk[first:first + local]
      images = list(pool.map(read, mine))
      batch = np.zeros((local, height, width, channels), run.info.pixel_dtype)  # padding: masked
      mask = np.zeros(local, bool)
      for row, image in enumerate(images):
        if not isinstance(image, str):
          batch[row], mask[row] = image, True
      probs, real, rows = jax.device_get(step(run.graphdef, run.state, put(batch), put(mask),
                                              put(first + np.arange(local, dtype=np.int32))))
      by_row = {int(row): p for row, p, ok in zip(rows, probs, real, strict=True) if ok}
      for row, path in enumerate(chunk):  # unreadable: read again (here) for the reason
        yield path, by_row[row] if row in by_row else read(path)


def say_fitted(path: str, image_shape) -> bool:
  """Says how `path` was fitted to the run's `image_shape`, where it had another; returns whether
  it did."""
  with open(path, "rb") as f:
    height, width, channels = image_files.encoded_shape(f.read())
  if (height, width, channels) == tuple(image_shape):
    return False
  colour = {(3, 1): ", its colours made gray", (1, 3): ", its gray made RGB"}.get(
      (channels, image_shape[2]), "")
  print(f"predict.py: {path} is {height}x{width}x{channels}, the model's images "
        f"{'x'.join(map(str, image_shape))}: each image of another size is scaled to cover it "
        f"and centre-cropped{colour}, as the run's data was", file=sys.stderr)
  return True


def main(argv):
  logging.set_verbosity(logging.WARNING)
  process.initialize()
  if FLAGS.top_k < 1:
    raise SystemExit(f"error: --top_k={FLAGS.top_k} must be 1 or more.")
  with process.exits():  # (a path that is not there: one line, before the restore)
    paths = image_files.find_images(argv[1:])
  if not paths:
    raise SystemExit("error: no image to classify: give image files (.jpg, .jpeg, .png) or "
                     "folders of them after the flags.")
  with process.exits():
    run = trained.Restored(FLAGS.workdir, FLAGS.step, runs_model=FLAGS.use_runs_model)
  files = [p for p in paths if not p.lower().endswith(".npy")]
  if files and run.info.pixel_dtype != "uint8":
    raise SystemExit(
        f"error: the run was trained on {run.info.pixel_dtype} pixels as stored (its data.json), "
        f"which image files such as {files[0]!r} do not give: pass .npy arrays "
        f"{list(run.info.image_shape)} of {run.info.pixel_dtype} instead.")
  if process.is_first():
    print(run.summary, file=sys.stderr)
  names, skipped, fitted = run.info.class_names, 0, False
  for path, probs in predict(run, paths, FLAGS.batch_size, FLAGS.max_image_pixels):
    if not process.is_first():  # process 0 prints
      continue
    if isinstance(probs, str):
      print(f"skipped {path}: {probs}", file=sys.stderr)
      skipped += 1
      continue
    if not fitted and not path.lower().endswith(".npy"):  # said once: how images were fitted
      fitted = say_fitted(path, run.info.image_shape)
    top = np.argsort(-probs, kind="stable")[:FLAGS.top_k]
    if FLAGS.json:
      print(json.dumps(dict(path=path, **{"class": names[top[0]]},
                            probability=float(probs[top[0]]),
                            top_k=[{"class": names[i], "probability": float(probs[i])}
                                   for i in top])))
    else:
      print(f"{path}: " + ", ".join(f"{names[i]} {probs[i]:.4f}" for i in top))
  if process.is_first():
    print(f"classified {len(paths) - skipped} images with the checkpoint of step {run.step}; "
          f"skipped {skipped} unreadable file{'s' * (skipped != 1)}", file=sys.stderr)


if __name__ == "__main__":  # flags defined here: the functions above can be imported
  flags.DEFINE_string("workdir", None, "A training run's workdir.", required=True)
  flags.DEFINE_string("step", None, "The checkpoint's step (default: the latest); best: the "
                      "best evaluation's (the run's config.best_metric).")
  flags.DEFINE_bool("use_runs_model", False, "Build the model with the run's own copy of "
                    "model.py (WORKDIR/model.py) where it differs from yours: this EXECUTES that "
                    "file's code; use it only on a workdir you trust.")
  flags.DEFINE_integer("top_k", 1, "How many classes to report per image.")
  flags.DEFINE_integer("max_image_pixels", image_files.MAX_PIXELS, "An image of more pixels is "
                       "named and skipped, not decoded.")
  flags.DEFINE_bool("json", False, "One JSON object per line.")
  flags.DEFINE_integer("batch_size", 0, "Images per call (0: the run's batch size, "
                        "rounded up to a multiple of the devices).")
  app.run(main)
