"""Writes a run's model as one `.npz` file that runs with nothing but `jax`, `numpy` and
`flatbuffers` (jax.export's deserialisation needs it; no flax, no project code): a serialised
`jax.export` program and the model's arrays beside it.

  python export.py --workdir=workdir --out=model.npz  # also model.json: the class names

The program: (the model's arrays, images as the run stored them (uint8, or the floats a float
data set holds: `pixel_dtype` in model.json) `[batch, height, width, channels]`, any batch size)
-> float32 class probabilities `[batch, classes]`, computed as predict.py computes them, lowered
for the CPU, CUDA, ROCm and TPU. The arrays are its arguments, not constants inside it: the
file has no size limit (a program's constants are capped at 2 GiB by its flatbuffer), and the
arrays are gathered from the devices and written one at a time, so the host never holds two
copies of the model. Load it (README: Use the trained model):

  artifact = np.load("model.npz")
  exported = jax.export.deserialize(bytearray(artifact["program"]))
  arrays = [artifact[f"array_{i}"].view(aval.dtype)  # .view: bfloat16 is stored as bytes
            for i, aval in enumerate(exported.in_avals[:-1])]
  probabilities = exported.call(arrays, images)
"""

import json
import os
import sys
import zipfile

import jax
import numpy as np
from absl import app, flags, logging
from jax.experimental import multihost_utils

from {{cookiecutter.project_slug}} import process
from {{cookiecutter.project_slug}}.data import sources
from {{cookiecutter.project_slug}}.training import steps, trained

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

FLAGS = flags.FLAGS


def is_key(x) -> bool:
  return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def raw(x):
  """An array as the file holds it: a typed PRNG key (a Dropout's stream) as its key data."""
  return jax.random.key_data(x) if is_key(x) else x


def export(run: trained.Restored) -> jax.export.Exported:
  """The inference function of `run`'s model: (its arrays, in `jax.tree.leaves` order, `raw`,
  images) -> probabilities, for one device."""
  leaves, treedef = jax.tree.flatten(run.state)
  impls = [jax.random.key_impl(x) if is_key(x) else None for x in leaves]

  def infer(arrays, images):
    arrays = [jax.random.wrap_key_data(x, impl=impl) if impl else x
              for x, impl in zip(arrays, impls, strict=True)]
    return steps.probabilities(run.graphdef, jax.tree.unflatten(treedef, arrays), images,
                               config=run.config)

  batch, = jax.export.symbolic_shape("batch")
  images = jax.ShapeDtypeStruct((batch, *run.info.image_shape), run.info.pixel_dtype)
  arrays = [jax.eval_shape(raw, x) for x in leaves]
  return jax.export.export(jax.jit(infer), platforms=PLATFORMS)(arrays, images)


def write(run: trained.Restored, path: str) -> None:
  """Writes `export(run)` and the model's arrays to the `.npz` file `path` (process 0; every
  process takes part in gathering each array from the devices that hold its pieces)."""
  exported = export(run)
  archive = zipfile.ZipFile(path, "w", allowZip64=True) if process.is_first() else None

  def put(name: str, array: np.ndarray) -> None:
    if archive is not None:
      with archive.open(f"{name}.npy", "w", force_zip64=True) as f:
        np.lib.format.write_array(f, array, allow_pickle=False)

  put("program", np.frombuffer(exported.serialize(), np.uint8))
  for i, array in enumerate(jax.tree.leaves(run.state)):
    put(f"array_{i}", multihost_utils.process_allgather(raw(array), tiled=True))
  if archive is not None:
    archive.close()


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  process.initialize()
  if not os.path.isdir(folder := os.path.dirname(os.path.abspath(FLAGS.out))):
    raise SystemExit(f"error: --out={FLAGS.out!r}: the folder {folder!r} does not exist; make "
                     "it, or give a path in a folder that does.")  # (before the restore)
  with process.exits():
    run = trained.Restored(FLAGS.workdir, FLAGS.step, runs_model=FLAGS.use_runs_model)
  if process.is_first():
    print(run.summary, file=sys.stderr)
  write(run, FLAGS.out)
  if not process.is_first():  # process 0 writes
    return
  beside = os.path.splitext(FLAGS.out)[0] + ".json"
  with open(beside, "w") as f:
    json.dump(dict(class_names=list(run.info.class_names), image_shape=list(run.info.image_shape),
                   pixel_dtype=run.info.pixel_dtype,
                   model_input=sources.model_input(run.info.pixel_dtype), step=run.step),
              f, indent=2)
  print(f"wrote {FLAGS.out} (the checkpoint of step {run.step}, for {', '.join(PLATFORMS)}) "
        f"and {beside} (the class names)")


if __name__ == "__main__":  # flags defined here: the functions above can be imported
  flags.DEFINE_string("workdir", None, "A training run's workdir.", required=True)
  flags.DEFINE_string("out", None, "The .npz file to write.", required=True)
  flags.DEFINE_string("step", None, "The checkpoint's step (default: the latest); best: the "
                      "best evaluation's (the run's config.best_metric).")
  flags.DEFINE_bool("use_runs_model", False, "Build the model with the run's own copy of "
                    "model.py (WORKDIR/model.py) where it differs from yours: this EXECUTES that "
                    "file's code; use it only on a workdir you trust.")
  app.run(main)
