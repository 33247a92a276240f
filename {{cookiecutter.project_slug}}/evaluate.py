"""Evaluates a run's checkpoint: loss, accuracy, per-class accuracy and the confusion matrix.

  python evaluate.py --workdir=workdir                         # the run's own evaluation split
  python evaluate.py --workdir=workdir --data_dir=data/other   # write_arrayrecord.py's eval split
  python evaluate.py --workdir=workdir --image_folder=test     # test/CLASS/*.jpg, the run's classes

Exact over padded batches, on every device, by training's own eval step. Prints the metrics
(and the confusion matrix for up to 10 classes) and writes them, the matrix as an image, to
TensorBoard in `workdir/evaluate/` at the checkpoint's step: the run's split under `eval_loss`,
`eval_accuracy`, ..., other data under tags of their own (`image_folder_NAME_loss`,
`data_dir_NAME_loss`, ...: NAME the folder's), never into the run's own evaluation curve.
"""

import contextlib
import os
import re
import sys

import jax
import numpy as np
from absl import app, flags, logging
from flax import nnx

from {{cookiecutter.project_slug}} import plan, process
from {{cookiecutter.project_slug}}.data import (
    arrayrecord,
    batches,
    image_files,
    input_pipeline,
    sources,
)
from {{cookiecutter.project_slug}}.errors import ConfigError
from {{cookiecutter.project_slug}}.parallel import sharding
from {{cookiecutter.project_slug}}.training import dispatch, metrics, trained, writers

FLAGS = flags.FLAGS


def image_folder_source(folder: str, run: trained.Restored) -> sources.ArraySource:
  """The images under `folder`/CLASS/, decoded as predict.py decodes them, labelled by the run's
  class names; unreadable files are reported on stderr and skipped."""
  info = run.info
  if not os.path.isdir(folder):
    raise ConfigError(f"--image_folder={folder!r} is not a directory.")
  if info.pixel_dtype != "uint8":
    raise ConfigError(f"--image_folder: the run was trained on {info.pixel_dtype} pixels as "
                      "stored, which image files do not give; evaluate on its data "
                      "(--data_dir) instead.")
  images, labels = [], []
  for entry in sorted(os.scandir(folder), key=lambda e: e.name):
    if not entry.is_dir():
      continue
    if entry.name not in info.class_names:
      raise ConfigError(f"--image_folder: {entry.path} is no class of the run; its classes "
                        f"are {', '.join(info.class_names)}.")
    for path in image_files.find_images([entry.path]):
      image = image_files.read_image(path, info.image_shape, center_ratio=trained.center_ratio(
          run), max_pixels=FLAGS.max_image_pixels)
      if isinstance(image, str):
        print(f"skipped {path}: {image}", file=sys.stderr)
        continue
      images.append(image)
      labels.append(info.class_names.index(entry.name))
  if not images:
    raise ConfigError(f"--image_folder={folder!r} holds no readable image in a class folder.")
  return sources.ArraySource(np.stack(images), np.array(labels, np.int32))


def confusion_text(names: list[str], counts: np.ndarray) -> str:
  """The matrix as text: a row a true class, a column a predicted one, names apart."""
  width = max(6, *map(len, names)) + 1  # (a space before each name)
  lines = ["confusion matrix (rows: true class, columns: predicted):",
           " " * width + "".join(n.rjust(width) for n in names)]
  lines += [name.rjust(width) + "".join(str(c).rjust(width) for c in row)
            for name, row in zip(names, counts, strict=True)]
  return "\n".join(lines)


def evaluate(run: trained.Restored, source) -> dict:
  """Loss, accuracy, examples, per-class accuracy and the confusion matrix of `source`."""
  config = run.config
  config.run.steps_per_dispatch = 1  # (and the run's batch, rounded up to the devices here)
  config.run.global_batch_size = -(-config.run.global_batch_size // run.mesh.size) * run.mesh.size
  graphdef, state = nnx.split((nnx.merge(run.graphdef, run.state),))  # eval_step's (model,)
  run_plan = plan.make_plan(config)
  compiled = dispatch.make(graphdef, run_plan, run.mesh, info=run.info)
  collection = metrics.with_confusion(run_plan.recipe, run.info.num_classes)
  rows = sharding.process_rows(run.mesh, config.run.global_batch_size)
  elements = batches.eval_batches(source, config, rows)
  with contextlib.closing(input_pipeline.as_iterator(elements, config)) as iterator:
    running = jax.device_get(dispatch.evaluate(compiled, state, iterator, len(elements), config,
                                               collection))
  counts = np.asarray(running.confusion.counts)
  with np.errstate(invalid="ignore"):
    per_class = np.diag(counts) / counts.sum(axis=1)  # NaN: a class without examples
  return dict(loss=float(running.loss.compute()), accuracy=float(running.accuracy.compute()),
              examples=int(running.loss.count), per_class_accuracy=per_class, confusion=counts)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  process.initialize()
  with process.exits():
    run = trained.Restored(FLAGS.workdir, FLAGS.step,
                           runs_model=FLAGS.use_runs_model)
    if FLAGS.image_folder:
      source = image_folder_source(FLAGS.image_folder, run)
    else:
      config = run.config.copy_and_resolve_references()
      if FLAGS.data_dir:
        config.dataset, config.data_dir = "arrayrecord", FLAGS.data_dir
        if not arrayrecord.arrayrecord_paths(config.data_dir, "eval"):
          raise ConfigError(f"--data_dir={config.data_dir!r} holds no eval-*.array_record "
                            "files; write them with write_arrayrecord.py.")
      splits, info = sources.get_datasets(config)
      if (info.image_shape, info.num_classes) != (run.info.image_shape, run.info.num_classes):
        raise ConfigError(f"the data hold {info.num_classes} classes of "
                          f"{'x'.join(map(str, info.image_shape))} images; the run was "
                          f"trained on {run.info.num_classes} of "
                          f"{'x'.join(map(str, run.info.image_shape))}.")
      source = splits["eval"]
  if process.is_first():
    print(run.summary, file=sys.stderr)
  with process.exits():
    result = evaluate(run, source)  # every process: its share of the batches
  if not process.is_first():
    return
  names = run.info.class_names
  print(f"step {run.step}: loss {result['loss']:.4f}  accuracy {result['accuracy']:.4f}  "
        f"({result['examples']} examples)")
  for name, accuracy, count in zip(names, result["per_class_accuracy"],
                                   result["confusion"].sum(axis=1), strict=True):
    print(f"  {name}: accuracy {accuracy:.4f} ({count} examples)")
  if len(names) <= 10:
    print(confusion_text(names, result["confusion"]))
  writer = writers.create_writer(os.path.join(FLAGS.workdir, "evaluate"))
  prefix = tag_prefix(FLAGS.image_folder, FLAGS.data_dir)
  writer.write_scalars(run.step, {f"{prefix}_loss": result["loss"],
                                  f"{prefix}_accuracy": result["accuracy"]})
  writers.write_confusion(writer, run.step, result["confusion"], names, prefix)
  writer.close()


def tag_prefix(image_folder: str | None, data_dir: str | None) -> str:
  """The tags' prefix: 'eval' for the run's own split, else the data's kind and folder name."""
  for kind, folder in (("image_folder", image_folder), ("data_dir", data_dir)):
    if folder:
      name = re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.basename(os.path.normpath(folder)))
      return f"{kind}_{name}"
  return "eval"


if __name__ == "__main__":  # flags defined here: the functions above can be imported
  flags.DEFINE_string("workdir", None, "A training run's workdir.", required=True)
  flags.DEFINE_string("step", None, "The checkpoint's step (default: the latest); best: the "
                      "best evaluation's (the run's config.best_metric).")
  flags.DEFINE_bool("use_runs_model", False, "Build the model with the run's own copy of "
                    "model.py (WORKDIR/model.py) where it differs from yours: this EXECUTES that "
                    "file's code; use it only on a workdir you trust.")
  flags.DEFINE_string("data_dir", None, "Evaluate on this directory's eval split.")
  flags.DEFINE_integer("max_image_pixels", image_files.MAX_PIXELS, "--image_folder: an image "
                       "of more pixels is named and skipped, not decoded.")
  flags.DEFINE_string("image_folder", None, "Evaluate on these images: one "
                       "subfolder per class, named as the run's classes.")
  app.run(main)
