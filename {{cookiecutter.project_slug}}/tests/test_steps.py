"""The step module's pieces: on-device preprocessing and the FLOP count."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import input_pipeline
import steps
import train
from configs import default
from model import create_model


def test_integer_pixels_are_divided_by_255_and_floats_kept():
  pixels = np.array([0, 51, 255], np.uint8).reshape(3, 1, 1, 1)
  np.testing.assert_allclose(steps.prepare_images({"image": pixels}).ravel(), [0, 0.2, 1])
  floats = np.array([0.5, -2.0, np.nan], np.float32).reshape(3, 1, 1, 1)
  np.testing.assert_array_equal(steps.prepare_images({"image": floats}), floats)


def test_random_shift_moves_pixels_by_stream_position():
  images = np.zeros((300, 8, 8, 1), np.uint8)
  images[:, 4, 4] = 255
  positions = np.arange(300, dtype=np.uint32)
  shift = jax.jit(functools.partial(steps.prepare_images, max_shift=1, seed=0))
  shifted = np.asarray(shift({"image": images, "position": positions}))
  assert shifted.shape == images.shape and (shifted.sum(axis=(1, 2, 3)) == 1.0).all()
  moved_to = collections.Counter(tuple(np.argwhere(image[..., 0])[0]) for image in shifted)
  assert set(moved_to) == {(4 + dy, 4 + dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)}
  assert min(moved_to.values()) > 300 / 9 / 2  # roughly uniform
  # A function of the position (and seed) alone, not of the batch it is in:
  again = np.asarray(shift({"image": images[::-1], "position": positions[::-1]}))[::-1]
  np.testing.assert_array_equal(again, shifted)
  other_seed = jax.jit(functools.partial(steps.prepare_images, max_shift=1, seed=1))
  assert (np.asarray(other_seed({"image": images, "position": positions})) != shifted).any()


def test_flops_of_the_default_cnn_step_equal_the_analytic_count():
  config = default.get_config()
  splits, info = input_pipeline.get_datasets(config)
  model = create_model(config, info.image_shape, info.num_classes, nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))
  element = input_pipeline.train_batches(splits["train"], config)[0]
  batch = jax.tree.map(lambda x: x[0], element)
  step = functools.partial(steps.train_step, graphdef, max_shift=1)

  b, (c1, c2), classes = config.batch_size, config.model.features, info.num_classes
  assert (b, c1, c2, classes) == (128, 32, 64, 10) and info.image_shape == (8, 8, 1)
  conv1 = 2 * b * (8 * 8) * (3 * 3 * 1) * c1  # 3x3 SAME over 8x8x1 -> 8x8x32
  conv2 = 2 * b * (4 * 4) * (3 * 3 * c1) * c2  # after a 2x2 pool: 4x4x32 -> 4x4x64
  dense = 2 * b * (2 * 2 * c2) * classes  # after a 2x2 pool: 256 -> 10
  # Backward: every layer's weight gradient costs its forward again, and its input gradient
  # too, except the first layer's (the images need no gradient).
  expected = 2 * conv1 + 3 * conv2 + 3 * dense
  assert expected == 237_895_680
  assert steps.model_flops(step, state, steps.TrainMetrics.empty(), batch) == expected

  # Gradient accumulation splits the batch, not the work; k steps cost k times one.
  accumulated = functools.partial(step, grad_accum_steps=4)
  assert steps.model_flops(accumulated, state, steps.TrainMetrics.empty(), batch) == expected
  k_steps = steps.scanned(step)
  stacked = jax.tree.map(lambda x: jnp.stack([x] * 3), batch)
  assert steps.model_flops(k_steps, state, steps.TrainMetrics.empty(), stacked) == 3 * expected


def test_flops_counted_under_pmap_for_a_model_that_reduces_over_its_axis(tiny_config):
  """A BatchNorm synchronised over pmap's axis: its step is traced with that axis bound, and
  counts what the same model counts without it."""
  from test_parallel import batchnorm_state

  counts = {}
  for parallelism in ("spmd", "pmap"):
    tiny_config.parallelism = parallelism
    graphdef, state = batchnorm_state(parallelism)
    counts[parallelism] = train.Speed(graphdef, state, (8, 8, 1), tiny_config).flops_per_step
  assert counts["pmap"] == counts["spmd"] > 0


def test_augmentation_keys_are_not_parameter_initialisation_keys():
  """The shift of stream position p does not come from the p-th key of nnx.Rngs(seed), which
  initialised the parameters (the same randomness twice), and stays a function of seed and
  position alone (the test above)."""
  images = np.zeros((300, 8, 8, 1), np.uint8)
  images[:, 4, 4] = 255
  positions = np.arange(300, dtype=np.uint32)
  for seed in (0, 1):
    shifted = np.asarray(jax.jit(functools.partial(steps.prepare_images, max_shift=1, seed=seed))(
        {"image": images, "position": positions}))
    # The pixel at (4, 4) lands at (5 - s0, 5 - s1) for the offsets s in [0, 2] (1 = no shift).
    applied = np.array([5 - np.argwhere(image[..., 0])[0] for image in shifted])
    rngs = nnx.Rngs(seed)
    from_params_keys = np.array([jax.random.randint(rngs.params(), (2,), 0, 3) for _ in positions])
    # Independent streams agree on a position 1 time in 9; the same stream, always.
    assert (applied == from_params_keys).all(axis=1).mean() < 0.25
