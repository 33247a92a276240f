"""The step module's pieces: on-device preprocessing, skipped steps, their memory, the FLOP
count."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import owned, plain, plain_options, recipe_metrics
from flax import nnx
from shipped_model import create_model

from configs import default

from {{cookiecutter.project_slug}} import plan
from {{cookiecutter.project_slug}}.data import batches, sources
from {{cookiecutter.project_slug}}.parallel import sharding
from {{cookiecutter.project_slug}}.training import dispatch, flops, optim, steps


class Pixels:
  """A model whose logits are its input: `steps.forward` gives the images the model is given."""

  def __call__(self, images_BHWC):
    return images_BHWC


def prepared(batch, max_shift: int = 0, seed: int = 0, flip: bool = False, crop=None):
  """The train step's input (`steps.forward`'s) with the tests' recipe's augmentations as given
  (crop: (scale range, aspect range)); none given: the stored pixels as floats alone."""
  crop_keys = dict(augment_crop_scale=crop[0], augment_crop_ratio=crop[1]) if crop else {}
  config = plain(augment_max_shift=max_shift, seed=seed, augment_flip=flip,
                 augment_crop=bool(crop), **crop_keys)
  augment = plan.recipe_module(config).augment if max_shift or flip or crop else None
  return steps.forward(Pixels(), batch, config, augment)


def tiny_plan(config) -> plan.Plan:
  """The plan (`plan.make_plan`) of `config` resolved for this host's devices."""
  return plan.make_plan(plan.resolved(config))


def eval_options(config) -> dict:
  """The eval step's options, as `dispatch.make` gives them: the train step's but its collection."""
  options = dispatch.step_options(plan.make_plan(config))
  return dict(config=options["config"], recipe=options["recipe"])


def test_integer_pixels_are_divided_by_255_and_floats_kept():
  pixels = np.array([0, 51, 255], np.uint8).reshape(3, 1, 1, 1)
  np.testing.assert_allclose(prepared({"image": pixels}).ravel(), [0, 0.2, 1])
  floats = np.array([0.5, -2.0, np.nan], np.float32).reshape(3, 1, 1, 1)
  np.testing.assert_array_equal(prepared({"image": floats}), floats)


def test_random_shift_moves_pixels_by_stream_position():
  images = np.zeros((300, 8, 8, 1), np.uint8)
  images[:, 4, 4] = 255
  positions = np.arange(300, dtype=np.uint32)
  shift = jax.jit(functools.partial(prepared, max_shift=1, seed=0))
  shifted = np.asarray(shift({"image": images, "position": positions}))
  assert shifted.shape == images.shape and (shifted.sum(axis=(1, 2, 3)) == 1.0).all()
  moved_to = collections.Counter(tuple(np.argwhere(image[..., 0])[0]) for image in shifted)
  assert set(moved_to) == {(4 + dy, 4 + dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)}
  assert min(moved_to.values()) > 300 / 9 / 2  # roughly uniform
  # A function of the position (and seed) alone, not of the batch it is in:
  again = np.asarray(shift({"image": images[::-1], "position": positions[::-1]}))[::-1]
  np.testing.assert_array_equal(again, shifted)
  other_seed = jax.jit(functools.partial(prepared, max_shift=1, seed=1))
  assert (np.asarray(other_seed({"image": images, "position": positions})) != shifted).any()


def test_flops_of_the_default_cnn_step_equal_the_analytic_count():
  config = owned(default.get_config())
  config.steps_per_dispatch = 1
  splits, info = sources.get_datasets(config)
  model = create_model(config, info.image_shape, info.num_classes, nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))
  element = batches.train_batches(splits["train"], plan.resolved(config))[0]
  batch = jax.tree.map(lambda x: x[0], element)
  step = functools.partial(steps.train_step, graphdef, **plain_options(config, augment_max_shift=1))

  b, (c1, c2), classes = config.batch_size, config.model.features, info.num_classes
  assert (b, c1, c2, classes) == (128, 32, 64, 10) and info.image_shape == (8, 8, 1)
  conv1 = 2 * b * (8 * 8) * (3 * 3 * 1) * c1  # 3x3 SAME over 8x8x1 -> 8x8x32
  conv2 = 2 * b * (4 * 4) * (3 * 3 * c1) * c2  # after a 2x2 pool: 4x4x32 -> 4x4x64
  dense = 2 * b * (2 * 2 * c2) * classes  # after a 2x2 pool: 256 -> 10
  # Backward: every layer's weight gradient costs its forward again, and its input gradient
  # too, except the first layer's (the images need no gradient).
  expected = 2 * conv1 + 3 * conv2 + 3 * dense
  assert expected == 237_895_680
  assert flops.model_flops(step, state, recipe_metrics(config).train.empty(), batch) == expected

  # Gradient accumulation splits the batch, not the work; k steps cost k times one.
  accumulated = functools.partial(steps.train_step, graphdef, **plain_options(
      config, augment_max_shift=1, grad_accum_steps=4))
  running = recipe_metrics(config).train.empty()
  assert flops.model_flops(accumulated, state, running, batch) == expected
  k_steps = functools.partial(dispatch.k_steps, step)
  stacked = jax.tree.map(lambda x: jnp.stack([x] * 3), batch)
  running = recipe_metrics(config).train.empty()
  assert flops.model_flops(k_steps, state, running, stacked) == 3 * expected


def test_flops_counted_under_pmap_for_a_model_that_reduces_over_its_axis(tiny_config):
  """A BatchNorm synchronised over pmap's axis: its step is traced with that axis bound, and
  counts what the same model counts without it."""
  from test_parallel import batchnorm_state

  counts = {}
  for parallelism in ("spmd", "pmap"):
    tiny_config.parallelism = parallelism
    graphdef, state = batchnorm_state()
    speed = flops.Speed(graphdef, state, (8, 8, 1), plan.make_plan(plan.resolved(tiny_config)))
    counts[parallelism] = speed.flops_per_step
  assert counts["pmap"] == counts["spmd"] > 0


def test_the_train_step_shifts_each_example_as_its_stream_position_says(tiny_config):
  """A train step with random shifts = the same step without them on the images that
  `prepared` shifted for their stream positions: each example's shift is keyed by its
  position alone (not by the step, nor by its place in the batch: positions start at 640)."""
  from test_parallel import assert_trees_close, batches, initial_state

  graphdef, state = initial_state(tiny_config)
  batch = batches([64])[0]
  batch["position"] += 640
  shifted = prepared(batch, max_shift=1, seed=0)  # float pixels: kept as they are

  def step(batch, max_shift):
    return jax.jit(functools.partial(steps.train_step, graphdef, **plain_options(
        tiny_config, augment_max_shift=max_shift)))(
            state, recipe_metrics(tiny_config).train.empty(), batch)[0]

  assert_trees_close(step(batch, 1), step(dict(batch, image=shifted), 0), atol=1e-6)
  assert not np.array_equal(np.asarray(shifted), batch["image"] / 255)  # the shifts moved pixels


def test_a_skipped_step_leaves_the_whole_state_bitwise_unchanged(tiny_config):
  """A batch holding a NaN, and a batch of padding alone: parameters, Adam moments, counters and
  the RNG state (dropout) exactly as they were; the next good step is applied."""
  from test_parallel import DropoutCNN, batches, initial_state

  graphdef, state = initial_state(tiny_config, DropoutCNN(nnx.Rngs(0)))
  step = jax.jit(functools.partial(steps.train_step, graphdef, **plain_options(tiny_config)))
  good, padding = batches([64, 0])
  nan = dict(good, image=good["image"].astype(np.float32))
  nan["image"][5, 2, 2] = np.nan
  running = recipe_metrics(tiny_config).train.empty()
  for batch in (nan, padding):
    after, running = step(state, running, batch)
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(after), strict=True):
      x, y = (jax.random.key_data(v) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else v
              for v in (x, y))
      assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
  assert (int(running.nonfinite_steps.count), int(running.nonfinite_steps.steps)) == (1, 1)
  after, _ = step(state, running, good)
  assert int(after[1]["step"][...]) == 1
  assert not np.array_equal(after[0]["dense"]["kernel"][...], state[0]["dense"]["kernel"][...])


def test_every_backends_forms_give_the_same_state_and_metrics(tiny_config):
  """Each backend's forms of the step (`dispatch.backend_forms`): the stock one, the TPU's
  (skipping a step by selecting each leaf's old value), the CPU's (cpu.py: under lax.cond) and
  the GPU's (gpu.py: selecting, the norms over the leaves laid end to end) give the same state
  and metrics, bit for bit (the norms in one: to float32's rounding): 4 steps with dropout (PRNG
  keys in the state), a NaN in step 2 and a batch of padding alone in step 3."""
  from test_parallel import DropoutCNN, as_numpy, batches, initial_state

  data = [dict(b, image=b["image"].astype(np.float32) / 255) for b in batches([64, 20, 0, 37])]
  data[1]["image"][3] = np.nan
  results = {}
  for form in ("cpu", "tpu", "gpu"):
    graphdef, state = initial_state(tiny_config, DropoutCNN(nnx.Rngs(0)))
    step = jax.jit(dispatch.backend_forms(functools.partial(
        steps.train_step, graphdef, **dispatch.step_options(plan.make_plan(tiny_config))),
        form, tiny_config))
    running = recipe_metrics(tiny_config).train.empty()
    for batch in data:
      state, running = step(state, running, batch)
    results[form] = ([as_numpy(x) for x in jax.tree.leaves(state)], dispatch.summarize(running))
    assert int(nnx.merge(graphdef, state)[1].step[...]) == 2  # steps 1 and 4 were applied
  cond, cond_metrics = results.pop("cpu")
  for form, (select, select_metrics) in results.items():
    assert all(a.tobytes() == b.tobytes() for a, b in zip(cond, select, strict=True))
    assert select_metrics["nonfinite_steps"] == 1
    for name, value in cond_metrics.items():  # the norms over one buffer: summed in another order
      rel = 1e-6 if form == "gpu" and name.startswith("l2_") else 0
      assert select_metrics[name] == pytest.approx(value, nan_ok=True, rel=rel, abs=0), name


@pytest.mark.slow  # (compiles each backend's programs)
def test_a_model_of_stock_layers_gets_each_backends_forms(tiny_config):
  """The shipped ResNet, written with nnx.max_pool and nnx.BatchNorm alone: the GPU's train step
  (`dispatch.one_batch_steps` for "gpu") takes the max pool's gradient by slices (no
  select-and-scatter: gpu.max_pool) and BatchNorm's sums in two stages (gpu.sums), the TPU's
  XLA's own; and nnx.max_pool is itself again after tracing."""
  from test_parallel import batches

  from {{cookiecutter.project_slug}}.backends import gpu

  tiny_config.model.name, tiny_config.model.width = "resnet18", 4
  run_plan = plan.make_plan(plan.resolved(tiny_config))
  graphdef, state = nnx.split(optim.build_state(run_plan, (8, 8, 1), 10, 3))
  running, batch = recipe_metrics(tiny_config).train.empty(), batches([64])[0]
  programs = {}
  for platform in ("gpu", "tpu"):
    train, _ = dispatch.one_batch_steps(run_plan, platform)
    programs[platform] = str(jax.make_jaxpr(functools.partial(train, graphdef))(
        state, running, batch))
  assert "select_and_scatter_add" in programs["tpu"] and "reduce_window_max" in programs["tpu"]
  assert "select_and_scatter_add" not in programs["gpu"]
  assert "reduce_window_max" not in programs["gpu"]
  assert programs["gpu"].count("custom_vjp_call") > programs["tpu"].count("custom_vjp_call")
  assert nnx.max_pool is gpu.STOCK_MAX_POOL


@pytest.mark.slow  # (the compiled program's memory, as the aot tests')
@pytest.mark.parametrize("parallelism", ["spmd", "fsdp"])
def test_skipping_a_step_keeps_no_second_copy_of_the_state(tiny_config, parallelism):
  """Compiled (not run) for an MLP whose parameters and Adam moments take 6.6 MB: the step's
  temporary memory is no more than that of a bare update that never skips, plus a tenth of the
  state a device holds. (Selecting between the updated state and the old one after the update
  held a second copy: on spmd the whole state, against two thirds of it for the bare update:
  the gradients and their all-reduced copy.)"""
  from test_parallel import MLP, batches, initial_state, stacked

  tiny_config.parallelism, tiny_config.steps_per_dispatch = parallelism, 1
  graphdef, state = initial_state(tiny_config, MLP(512, 3, nnx.Rngs(0)))
  assert sum(x.nbytes for x in jax.tree.leaves(state)) > 6e6
  mesh = sharding.make_mesh(tiny_config)
  placed = sharding.place_state(state, mesh, tiny_config.fsdp_min_size)
  compiled = dispatch.make(graphdef, plan.make_plan(tiny_config), mesh)
  batch = compiled.put_batch(stacked(batches([64]), 1)[0])
  running = compiled.empty(recipe_metrics(tiny_config).train)
  step = compiled.train.lower(placed, running, batch).compile()

  def bare_update(state, batch):  # the gradient, the update and their norms, nothing else
    model, optimizer = nnx.merge(graphdef, state)
    batch = jax.tree.map(lambda x: x[0], batch)
    loss_fn = functools.partial(steps.loss_and_metrics, **plain_options(tiny_config))
    grads, _ = nnx.grad(loss_fn, has_aux=True)(model, batch)
    updates = optimizer.update(model, grads)
    norms = [optax.tree.norm(tree) for tree in (grads, nnx.state(model, nnx.Param), updates)]
    return nnx.state((model, optimizer)), norms

  bare = jax.jit(bare_update, donate_argnums=0, out_shardings=(sharding.state_shardings(
      state, mesh, tiny_config.fsdp_min_size), None)).lower(placed, batch).compile()
  held = sharding.bytes_per_device(placed)
  step_temp, bare_temp = (c.memory_analysis().temp_size_in_bytes for c in (step, bare))
  print(f"{parallelism}: temp {step_temp / 1e6:.2f} MB, the bare update's {bare_temp / 1e6:.2f} "
        f"MB; the state {held / 1e6:.2f} MB a device")
  assert step_temp <= bare_temp + 0.1 * held


def test_augmentation_keys_are_not_parameter_initialisation_keys():
  """The shift of stream position p does not come from the p-th key of nnx.Rngs(seed), which
  initialised the parameters (the same randomness twice), and stays a function of seed and
  position alone (the test above)."""
  images = np.zeros((300, 8, 8, 1), np.uint8)
  images[:, 4, 4] = 255
  positions = np.arange(300, dtype=np.uint32)
  for seed in (0, 1):
    shifted = np.asarray(jax.jit(functools.partial(prepared, max_shift=1, seed=seed))(
        {"image": images, "position": positions}))
    # The pixel at (4, 4) lands at (5 - s0, 5 - s1) for the offsets s in [0, 2] (1 = no shift).
    applied = np.array([5 - np.argwhere(image[..., 0])[0] for image in shifted])
    rngs = nnx.Rngs(seed)
    from_params_keys = np.array([jax.random.bits(rngs.params(), (2,)) % 3 for _ in positions])
    # Independent streams agree on a position 1 time in 9; the same stream, always.
    assert (applied == from_params_keys).all(axis=1).mean() < 0.25


PHOTO = dict(flip=True, crop=((0.3, 1.0), (3 / 4, 4 / 3)))


def test_flips_and_crops_depend_on_the_seed_and_the_stream_position_alone():
  """The same image at the same position: the same result in another batch, at another place
  (another process, a resumed run: the position is all that they share); another seed or
  position, another result. Flipping a flipped image gives the original back."""
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (64, 12, 12, 3), dtype=np.uint8)
  positions = np.arange(1000, 1064, dtype=np.uint32)
  augmented = jax.jit(functools.partial(prepared, seed=3, **PHOTO))
  out = np.asarray(augmented({"image": images, "position": positions}))
  assert out.shape == images.shape and out.dtype == np.float32
  order = rng.permutation(64)[:16]  # another, smaller batch, in another order
  again = np.asarray(augmented({"image": images[order], "position": positions[order]}))
  np.testing.assert_array_equal(again, out[order])
  other_seed = jax.jit(functools.partial(prepared, seed=4, **PHOTO))
  assert (np.asarray(other_seed({"image": images, "position": positions})) != out).any(axis=(
      1, 2, 3)).all()
  shifted = np.asarray(augmented({"image": images, "position": positions + 1}))
  assert (shifted != out).any(axis=(1, 2, 3)).all()

  flip = jax.jit(functools.partial(prepared, seed=3, flip=True))
  floats = images / np.float32(255)
  once = np.asarray(flip({"image": floats, "position": positions}))
  mirrored = (once == floats[:, :, ::-1]).all(axis=(1, 2, 3))
  assert ((once == floats).all(axis=(1, 2, 3)) | mirrored).all()
  assert 16 < mirrored.sum() < 48  # about half
  np.testing.assert_array_equal(flip({"image": once, "position": positions}), floats)


def test_a_crop_of_the_whole_image_is_the_image_and_smaller_crops_zoom_in():
  """scale (1, 1), ratio (1, 1): the crop is the image, resampled in place. A crop of a quarter
  of a checkerboard of 16 x 16 squares, zoomed x2, is another image, within the board's
  values."""
  board = np.kron(np.array([[0.0, 1.0], [1.0, 0.0]], np.float32), np.ones((16, 16), np.float32))
  batch = {"image": np.repeat(board[None, :, :, None], 8, axis=0),
           "position": np.arange(8, dtype=np.uint32)}
  crop = jax.jit(prepared, static_argnames="crop")  # (one program, not op by op)
  whole = crop(batch, crop=((1.0, 1.0), (1.0, 1.0)))
  np.testing.assert_allclose(whole, batch["image"], atol=1e-6)
  quarter = np.asarray(crop(batch, crop=((0.25, 0.25), (1.0, 1.0))))
  assert not np.allclose(quarter, batch["image"])  # zoomed in: no longer the board
  assert quarter.min() >= -1e-6 and quarter.max() <= 1 + 1e-6  # (no zero fill beyond the edge)


def test_evaluation_uses_the_moving_average(tiny_config):
  """With a moving average in the state, eval_step's metrics are those of a model holding the
  average's parameters; training leaves the average between the start and the parameters."""
  from test_parallel import batches

  tiny_config.ema_decay = 0.5
  graphdef, state = nnx.split(optim.build_state(tiny_plan(tiny_config), (8, 8, 1), 10, 10))
  batch = batches([64])[0]
  state, _ = jax.jit(functools.partial(steps.train_step, graphdef,
                                       **plain_options(tiny_config, ema_decay=0.5)))(
      state, recipe_metrics(tiny_config).train.empty(), batch)
  model, average = state[0], state[2]
  # One step from equal values: the average moved halfway to the parameters.
  start = nnx.split(optim.build_state(tiny_plan(tiny_config), (8, 8, 1), 10, 10))[1][0]
  for p, a, s in zip(jax.tree.leaves(model), jax.tree.leaves(average), jax.tree.leaves(start),
                     strict=True):
    np.testing.assert_allclose(a, 0.5 * s + 0.5 * p, rtol=1e-6, atol=1e-7)
  evaluate = jax.jit(functools.partial(steps.eval_step, graphdef, **eval_options(tiny_config)))
  got = evaluate(state, recipe_metrics(tiny_config).eval.empty(), batch).compute()
  as_average = nnx.State(dict(state))
  as_average[0] = average
  expected = evaluate(as_average, recipe_metrics(tiny_config).eval.empty(), batch).compute()
  plain = dict(state)
  no_average = evaluate(nnx.State({**plain, 2: model}), recipe_metrics(tiny_config).eval.empty(),
                        batch).compute()
  assert float(got["loss"]) == float(expected["loss"])
  assert float(got["loss"]) != float(no_average["loss"])


def test_the_moving_average_warms_up_and_is_kept_in_float32(tiny_config):
  """ema_decay 0.9999 with its warmup: the average moves by 1 - min(0.9999, (1 + n) / (10 + n))
  at update n (0.9 of the way at the first). With bfloat16 parameters it is kept in float32,
  where a step of 1e-4 of the difference moves it (in bfloat16 it would round to nothing)."""
  from test_parallel import batches

  def floats(tree):
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]

  def check_steps(decays):
    nonlocal state, running
    step = jax.jit(functools.partial(steps.train_step, graphdef,
                                     **dispatch.step_options(plan.make_plan(tiny_config))))
    for decay, batch in zip(decays, batches([64] * len(decays)), strict=True):
      before = [np.asarray(x) for x in floats(state[2])]
      state, running = step(state, running, batch)
      for old, new, param in zip(before, floats(state[2]), floats(state[0]), strict=True):
        assert not np.array_equal(new, old)
        np.testing.assert_allclose(new, decay * old + (1 - decay) * np.asarray(param, np.float32),
                                   rtol=1e-6, atol=1e-7)

  tiny_config.ema_decay = 0.9999
  graphdef, state = nnx.split(optim.build_state(tiny_plan(tiny_config), (8, 8, 1), 10, 10))
  running = recipe_metrics(tiny_config).train.empty()
  check_steps([0.1, 2 / 11, 3 / 12])
  tiny_config.ema_warmup, tiny_config.model.param_dtype = False, "bfloat16"
  graphdef, state = nnx.split(optim.build_state(tiny_plan(tiny_config), (8, 8, 1), 10, 10))
  assert {x.dtype for x in floats(state[0]["dense"])} == {jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for x in floats(state[2])} == {jnp.dtype(jnp.float32)}
  check_steps([0.9999])


def test_training_logs_the_plain_cross_entropy_beside_the_smoothed_loss(tiny_config):
  """With label smoothing the training loss is the smoothed one; `cross_entropy` is the plain
  cross-entropy (evaluation's loss) of the same examples, and without smoothing the two agree."""
  from test_parallel import batches

  batch = batches([40])[0]
  results, tiny_config.augment_max_shift = {}, 0  # (eval's images: no shift)
  for smoothing in (0.0, 0.2):
    tiny_config.label_smoothing = smoothing
    graphdef, state = nnx.split(optim.build_state(tiny_plan(tiny_config), (8, 8, 1), 10, 10))
    step = jax.jit(functools.partial(steps.train_step, graphdef,
                                     **dispatch.step_options(plan.make_plan(tiny_config))))
    _, running = step(state, recipe_metrics(tiny_config).train.empty(), batch)
    results[smoothing] = dispatch.summarize(running)
  evaluated = jax.jit(functools.partial(steps.eval_step, graphdef, **eval_options(tiny_config)))(
      state, recipe_metrics(tiny_config).eval.empty(), batch).compute()  # the same start: logits
  for summary in results.values():
    assert summary["cross_entropy"] == pytest.approx(float(evaluated["loss"]), rel=1e-6)
  assert results[0.0]["loss"] == results[0.0]["cross_entropy"]
  assert abs(results[0.2]["loss"] - results[0.2]["cross_entropy"]) > 1e-4


def test_label_smoothing_is_the_cross_entropy_of_the_smoothed_targets_of_real_examples():
  """a = 0.1 over 4 classes: the target of the label 1 - a + a / 4, of the others a / 4; the
  padding (mask False) is left out."""

  class Fixed:  # logits that do not depend on the images
    def __call__(self, images):
      return jnp.tile(jnp.array([[2.0, 0.0, -1.0, 0.5]]), (images.shape[0], 1))

  batch = {"image": jnp.zeros((3, 1, 1, 1)), "label": jnp.array([0, 3, 2]),
           "mask": jnp.array([True, True, False]), "position": jnp.arange(3)}
  loss_sum, _ = steps.loss_and_metrics(Fixed(), batch, **plain_options(label_smoothing=0.1))
  log_p = np.log(np.exp([2.0, 0.0, -1.0, 0.5]) / np.exp([2.0, 0.0, -1.0, 0.5]).sum())
  expected = sum(-(np.full(4, 0.1 / 4) + 0.9 * np.eye(4)[label]) @ log_p for label in (0, 3))
  assert float(loss_sum) == pytest.approx(expected, rel=1e-6)
  unsmoothed, _ = steps.loss_and_metrics(Fixed(), batch, **plain_options())
  assert float(unsmoothed) == pytest.approx(-log_p[0] - log_p[3], rel=1e-6)
