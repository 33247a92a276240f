"""Writes a run's model, with its trained parameters inside, as a serialised `jax.export`
artifact that runs with nothing but `jax` and `numpy` (no flax, no project code).

  python export.py --workdir=workdir --out=model.jax  # also model.json: the class names

The function: images as the run stored them (uint8, or the floats a float data set holds:
`pixel_dtype` in model.json) `[batch, height, width, channels]` (any batch size) -> float32
class probabilities `[batch, classes]`, computed as predict.py computes them, lowered for the CPU,
CUDA, ROCm and TPU. Load it with `jax.export.deserialize` (README: Use the trained model).
"""

import json
import os
import sys

import jax
from absl import app, flags, logging
from jax.experimental import multihost_utils

import distributed
import input_pipeline
import runs

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
# The parameters are constants of the exported program, which jax.export serialises into one
# flatbuffer: at most 2 GiB (flatbuffers' MAX_BUFFER_SIZE), less room for the program itself.
MAX_MODEL_BYTES = 2**31 - 2**26
LIMIT_WHY = ("an exported artifact holds (its parameters are constants of its program, "
             "serialised in one flatbuffer of at most 2 GiB); use the checkpoint itself "
             "(runs.Restored, as predict.py does)")


FLAGS = flags.FLAGS


def export(run: runs.Restored) -> jax.export.Exported:
  """The inference function of `run`'s checkpoint, its parameters as constants."""
  # On the host, whole (gathered from every device and process): the program's constants.
  state = multihost_utils.process_allgather(run.state, tiled=True)
  infer = jax.jit(lambda images: runs.probabilities(run.graphdef, state, images))
  batch, = jax.export.symbolic_shape("batch")
  images = jax.ShapeDtypeStruct((batch, *run.info.image_shape), run.info.pixel_dtype)
  return jax.export.export(infer, platforms=PLATFORMS)(images)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  distributed.initialize()
  try:
    run = runs.Restored(FLAGS.workdir, FLAGS.step, limit=(MAX_MODEL_BYTES, LIMIT_WHY))
  except runs.ConfigError as e:
    raise SystemExit(f"error: {e}") from None
  if distributed.is_first():
    print(run.summary, file=sys.stderr)
  exported = export(run)  # every process: its shards of the parameters go into the gather
  if not distributed.is_first():  # process 0 writes
    return
  with open(FLAGS.out, "wb") as f:
    f.write(exported.serialize())
  beside = os.path.splitext(FLAGS.out)[0] + ".json"
  with open(beside, "w") as f:
    json.dump(dict(class_names=list(run.info.class_names), image_shape=list(run.info.image_shape),
                   pixel_dtype=run.info.pixel_dtype,
                   model_input=input_pipeline.model_input(run.info.pixel_dtype), step=run.step),
              f, indent=2)
  print(f"wrote {FLAGS.out} (the checkpoint of step {run.step}, for {', '.join(PLATFORMS)}) "
        f"and {beside} (the class names)")


if __name__ == "__main__":  # flags defined here: the functions above can be imported
  flags.DEFINE_string("workdir", None, "A training run's workdir.", required=True)
  flags.DEFINE_string("out", None, "The file to write.", required=True)
  flags.DEFINE_integer("step", None, "The checkpoint's step (default: the latest).")
  app.run(main)
