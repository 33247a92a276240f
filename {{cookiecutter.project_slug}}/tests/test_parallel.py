"""pmap = sharded jit = one device: same parameters from the same weights and batches."""

import functools
import itertools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from conftest import recipe_metrics, two_epochs
from flax import nnx
from jax.sharding import PartitionSpec as P
from shipped_model import create_model

import aot

from {{cookiecutter.project_slug}} import layers, plan
from {{cookiecutter.project_slug}}.parallel import pmap, sharding
from {{cookiecutter.project_slug}}.training import dispatch, optim, steps

NUM_DEVICES = 8
PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One optimizer for every test: equal models then have equal graphdefs, and tests share the
# steps compiled for them (`compiled_steps`).
ADAM, SGD = optax.adam(1e-2), optax.sgd(0.1)


def initial_state(config, model=None):
  model = model or create_model(config, (8, 8, 1), 10, nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, ADAM, wrt=nnx.Param)
  return nnx.split((model, optimizer))


def batches(num_real: list[int], size: int = 64):
  """One batch per entry, holding that many real examples followed by masked padding."""
  rng = np.random.default_rng(0)
  out = []
  for i, n in enumerate(num_real):
    batch = {"image": np.zeros((size, 8, 8, 1), np.uint8), "label": np.zeros(size, np.int32),
             "mask": np.arange(size) < n,
             "position": np.arange(i * size, (i + 1) * size, dtype=np.uint32)}
    batch["image"][:n] = rng.integers(0, 256, (n, 8, 8, 1))
    batch["label"][:n] = rng.integers(0, 10, n)
    out.append(batch)
  return out


def stacked(batch_list, k: int):
  """The batches in groups of k, stacked `[k, batch, ...]`; the last group padded with batches
  of padding alone, as the input pipeline pads the end of the stream."""
  padding = {**jax.tree.map(np.zeros_like, batch_list[0])}
  batch_list = batch_list + [padding] * (-len(batch_list) % k)
  return [jax.tree.map(lambda *xs: np.stack(xs), *batch_list[i:i + k])
          for i in range(0, len(batch_list), k)]


def single_step(config, graphdef):
  """One device's train step (BatchNorm's groups: the graphdef's, `batchnorm_state`'s)."""
  return jitted_single_step(graphdef, tuple(dispatch.step_options(plan.make_plan(config)).items()))


@functools.cache
def jitted_single_step(graphdef, options):
  return jax.jit(functools.partial(steps.train_step, graphdef, **dict(options)))


@functools.cache
def compiled_steps(graphdef, config: ml_collections.FrozenConfigDict,
                   unroll=None) -> tuple[dispatch.Steps, jax.sharding.Mesh]:
  """`dispatch.make` for a graphdef and a config, made once per test session."""
  mesh = sharding.make_mesh(config)
  return dispatch.make(graphdef, plan.make_plan(config), mesh, unroll), mesh


def steps_for(config, parallelism, graphdef, k=1, unroll=None):
  """The steps of `config` (whole: a key you add for recipe.py reaches the step) on
  `parallelism`, k steps a call."""
  config.parallelism, config.steps_per_dispatch = parallelism, k
  return compiled_steps(graphdef, ml_collections.FrozenConfigDict(config), unroll)


def run(config, parallelism, batch_list, graphdef=None, state=None, k=1, unroll=None):
  """One train step per batch: on one device one call each, or on 8 devices with spmd, pmap or
  fsdp, k steps a call (`unroll`: see dispatch.make). Returns the state and the summary of the
  steps' merged metrics."""
  if graphdef is None:
    graphdef, state = initial_state(config)
  if parallelism == "single":
    step = single_step(config, graphdef)
    state, running = jax.device_put((state, recipe_metrics(config).train.empty()), jax.devices()[0])
    for batch in batch_list:
      state, running = step(state, running, batch)
    return state, dispatch.summarize(running)
  compiled, mesh = steps_for(config, parallelism, graphdef, k, unroll)
  state = compiled.put_state(sharding.place_state(state, mesh, config.fsdp_min_size))
  running = compiled.empty(recipe_metrics(config).train)
  for group in stacked(batch_list, k):
    state, running = compiled.train(state, running, compiled.put_batch(group))
    jax.block_until_ready(state)  # as the training loop does on the CPU: never queue collectives
  return compiled.get_state(state), dispatch.summarize(running)


def as_numpy(x):
  """The values of an array, or the raw data of PRNG keys."""
  return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)


def assert_trees_close(a, b, atol):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b),
                          strict=True):
    np.testing.assert_allclose(as_numpy(x), as_numpy(y), atol=atol, rtol=0,
                               err_msg=jax.tree_util.keystr(path))


# 20 real examples in a batch of 64 on 8 devices (8 per device): devices 0-1 full, device 2
# holds 4, devices 3-7 hold none.
@pytest.mark.parametrize("k, num_real", [  # k: steps per dispatch; 2 pads the last call
    (2, [64, 20, 64]),
    # (fast: k = 2 padding the last call equals k = 1 on spmd and pmap, k_steps' test)
    *[pytest.param(*case, marks=pytest.mark.slow) for case in (
        (1, [64, 20, 64]), (2, [20, 37, 1]), (1, [64, 64, 64]), (2, [64, 64, 64]),
        (1, [20, 37, 1]))]])
def test_pmap_equals_spmd_equals_single_device(tiny_config, k, num_real):
  data = batches(num_real)
  single, single_metrics = run(tiny_config, "single", data)
  spmd, spmd_metrics = run(tiny_config, "spmd", data, k=k)
  pmap, pmap_metrics = run(tiny_config, "pmap", data, k=k)
  assert_trees_close(spmd, single, atol=1e-6)
  assert_trees_close(pmap, single, atol=1e-6)
  for result in (single_metrics, spmd_metrics, pmap_metrics):  # merged over the three steps
    assert result["examples"] == sum(num_real) and result["nonfinite_steps"] == 0
    assert result["loss"] == pytest.approx(single_metrics["loss"], abs=1e-6)
    assert result["accuracy"] == single_metrics["accuracy"]
  step_counter = pmap[1]["step"][...]
  assert step_counter.dtype == jnp.uint32 and int(step_counter) == 3  # never averaged


# (fast: a 4 x 2 mesh, the state split within groups of devices; 2 x 4 and one group of 8: slow)
@pytest.mark.parametrize("fsdp_devices", [2, *[pytest.param(n, marks=pytest.mark.slow)
                                               for n in (4, 8)]])
def test_fsdp_equals_spmd_equals_single_device(tiny_config, fsdp_devices):
  """The state split over groups of 2, 4 or 8 devices (a 4 x 2, 2 x 4 or 1 x 8 mesh), a padded
  batch among the three, two steps a call: the same state as one device and as spmd."""
  tiny_config.fsdp_devices, tiny_config.fsdp_min_size = fsdp_devices, 0  # split every leaf
  data = batches([64, 20, 64])
  single, single_metrics = run(tiny_config, "single", data)
  spmd, _ = run(tiny_config, "spmd", data, k=2)
  fsdp, fsdp_metrics = run(tiny_config, "fsdp", data, k=2)
  assert_trees_close(fsdp, single, atol=1e-6)
  assert_trees_close(fsdp, spmd, atol=1e-6)
  assert fsdp_metrics["examples"] == 148 and fsdp_metrics["accuracy"] == single_metrics["accuracy"]
  assert fsdp_metrics["loss"] == pytest.approx(single_metrics["loss"], abs=1e-6)
  split = 0
  for path, x in jax.tree_util.tree_leaves_with_path(fsdp):  # each leaf where it should be
    divisible = any(d % fsdp_devices == 0 for d in x.shape)
    assert (x.sharding.spec != P()) == divisible, jax.tree_util.keystr(path)
    if divisible:
      assert x.addressable_shards[0].data.size == x.size // fsdp_devices
      split += 1
  # Every kernel and bias (and their Adam mu and nu) but, over 4 or 8, the dense bias [10].
  assert split == 3 * (6 if fsdp_devices == 2 else 5)


@pytest.mark.slow  # (fast: each path = one device, the tests above, with the recipe off)
def test_every_path_equals_one_device_with_the_recipe_on(straight_runs):
  """conftest's RECIPE (adamw on the weights only, warmup, clipping, label smoothing, flips,
  crops, the moving average): spmd, pmap and fsdp over 8 devices give the state and the
  metrics, norms included, of one device, over a padded batch. fsdp splits the average like
  the parameters. (k steps a call with the recipe on: test_train.py's resume with another k.)
  The config of the straight runs: their compiled steps serve here (JAX's cache)."""
  for parallelism in ("spmd", "pmap", "fsdp"):
    straight_runs[parallelism]  # (made first: their programs are in the compilation cache)
  config = two_epochs("spmd")
  config.steps_per_dispatch = 1
  run_plan = plan.make_plan(plan.resolved(config))
  graphdef, state = nnx.split(optim.build_state(run_plan, (8, 8, 1), 10, 45))
  assert len(state) == 3  # model, optimizer, average
  data = batches([64, 20, 64])
  copy = lambda: jax.tree.map(jnp.copy, state)  # (the steps donate it)  # noqa: E731
  single, single_metrics = run(config, "single", data, graphdef, copy())
  assert single_metrics["l2_grads"] > 0 and single_metrics["l2_updates"] > 0
  for parallelism in ("spmd", "pmap", "fsdp"):
    got, metrics = run(config, parallelism, data, graphdef, copy())
    assert_trees_close(got, single, atol=1e-6)
    assert metrics["examples"] == 148 and metrics["accuracy"] == single_metrics["accuracy"]
    for name in ("loss", "l2_grads", "l2_params", "l2_updates"):
      assert metrics[name] == pytest.approx(single_metrics[name], rel=1e-6), name
  for param, average in zip(jax.tree.leaves(got[0]), jax.tree.leaves(got[2]), strict=True):
    assert average.sharding == param.sharding  # (fsdp's)
  # The average moved towards the parameters, from the initial ones.
  kernel = lambda model: np.asarray(model["dense"]["kernel"][...])  # noqa: E731
  assert not np.array_equal(kernel(got[2]), kernel(state[0]))
  assert not np.array_equal(kernel(got[2]), kernel(got[0]))


def test_fsdp_keeps_one_share_of_a_large_state_per_device(tiny_config):
  """A CNN whose parameters and Adam moments take 113 MB: on each of 8 devices, 1/8 of it."""
  tiny_config.parallelism, tiny_config.model.features = "fsdp", (1024, 1024)
  _, state = initial_state(tiny_config, create_model(tiny_config, (8, 8, 1), 10, nnx.Rngs(0)))
  whole = sum(x.nbytes for x in jax.tree.leaves(state))
  assert whole >= 100e6
  for fsdp_devices in (8, 4):
    tiny_config.fsdp_devices = fsdp_devices
    placed = sharding.place_state(state, sharding.make_mesh(tiny_config),
                                  tiny_config.fsdp_min_size)
    per_device = sharding.bytes_per_device(placed)
    print(f"fsdp over {fsdp_devices}: {per_device / 1e6:.2f} MB a device of {whole / 1e6:.2f} MB")
    assert per_device <= whole * (1 / fsdp_devices + 0.05)
    assert per_device >= whole / fsdp_devices  # nothing lost: the shards hold it all


# (fast: pmap's accumulation equals spmd's bit for bit, accumulation_sums_in_the_same_order)
@pytest.mark.parametrize("parallelism", ["spmd", *[pytest.param(p, marks=pytest.mark.slow)
                                                    for p in ("single", "pmap")]])
def test_gradient_accumulation_equals_one_large_batch(tiny_config, parallelism):
  data = batches([64, 50, 64])  # includes a padded batch
  tiny_config.grad_accum_steps = 1
  expected, _ = run(tiny_config, parallelism, data)
  tiny_config.grad_accum_steps = 4  # micro-batches of 16: 2 examples per device each
  accumulated, _ = run(tiny_config, parallelism, data)
  assert_trees_close(accumulated, expected, atol=1e-6)


def test_accumulation_sums_in_the_same_order_on_spmd_and_pmap(tiny_config):
  """With micro-batches, pmap sums each one's gradient over the devices before adding them up,
  as XLA partitions spmd's step: the same numbers in the same order, the same bits. (Summed the
  other way round they part by rounding, 4e-8 after 3 steps here, which training amplifies:
  with each device's own BatchNorm statistics, ResNet-18's losses differed by 2e-3 at step 5.)"""
  tiny_config.grad_accum_steps, tiny_config.batch_norm_devices = 2, 1
  data = batches([64, 20, 64])
  spmd, spmd_metrics = run(tiny_config, "spmd", data, *batchnorm_state(ADAM, groups=NUM_DEVICES))
  pmap, pmap_metrics = run(tiny_config, "pmap", data, *batchnorm_state(ADAM, groups=NUM_DEVICES))
  assert_trees_close(pmap, spmd, atol=0)
  assert pmap_metrics == spmd_metrics


@pytest.mark.parametrize("model", ["cnn", "dropout"])  # dropout: the state holds PRNG keys
def test_replicate_and_unreplicate(tiny_config, model):
  _, state = initial_state(tiny_config, DropoutCNN(nnx.Rngs(0)) if model == "dropout" else None)
  replicated = pmap.replicate(state)
  for x, r in zip(jax.tree.leaves(state), jax.tree.leaves(replicated), strict=True):
    assert r.shape == (NUM_DEVICES, *x.shape) and r.dtype == x.dtype
    assert len(r.addressable_shards) == NUM_DEVICES
    assert {s.device for s in r.addressable_shards} == set(jax.local_devices())
    for shard in r.addressable_shards:
      np.testing.assert_array_equal(as_numpy(shard.data)[0], as_numpy(x))
  back = pmap.unreplicate(replicated)
  assert [x.dtype for x in jax.tree.leaves(back)] == [x.dtype for x in jax.tree.leaves(state)]
  assert_trees_close(back, state, atol=0)


# Replicates a 32 MiB leaf over 8 CPU devices (whose memory is the host's); prints the rise of
# the process's peak memory during `replicate` (Linux's VmHWM, reset just before), and the bytes
# on one device, in copies of the leaf.
REPLICATE = """
import re
import jax, numpy as np
from {{cookiecutter.project_slug}}.parallel import sharding
from {{cookiecutter.project_slug}}.parallel import pmap
x = jax.device_put(np.arange(8 * 2**20, dtype=np.float32), jax.devices()[0])
kib = lambda field: int(re.search(field + r":\\s+(\\d+)", open("/proc/self/status").read())[1])
open("/proc/self/clear_refs", "w").write("5")  # the peak is now the current memory
before = kib("VmRSS")
replicated = jax.block_until_ready(pmap.replicate(x))
print((kib("VmHWM") - before) * 1024 / x.nbytes, sharding.bytes_per_device(replicated) / x.nbytes)
"""


@pytest.mark.slow  # (a process)
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux's /proc only")
def test_replicate_holds_one_copy_per_device():
  """Never a device with more than its one copy: at most one copy per device and one on the
  host at the peak. (Broadcasting on device 0 first held 8 copies there: a peak of 17.)"""
  done = subprocess.run([sys.executable, "-c", REPLICATE], cwd=PROJECT, capture_output=True,
                        text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-3000:]
  peak_copies, copies_per_device = map(float, done.stdout.split())
  print(f"peak: {peak_copies:.2f} copies more")
  assert copies_per_device == 1
  assert peak_copies <= NUM_DEVICES + 1


def test_shard_batch_round_trip_and_error():
  batch = {"image": np.arange(64 * 3).reshape(64, 3), "label": np.arange(64)}
  sharded = pmap.shard_batch(batch, 8)
  assert sharded["image"].shape == (8, 8, 3) and sharded["label"].shape == (8, 8)
  np.testing.assert_array_equal(sharded["label"][2], np.arange(16, 24))  # contiguous pieces
  back = pmap.unshard_batch(sharded)
  np.testing.assert_array_equal(back["image"], batch["image"])
  with pytest.raises(ValueError, match="a batch of 60 examples does not split over 8 devices"):
    pmap.shard_batch({"label": np.arange(60)}, 8)


class DropoutCNN(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(64, 10, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, images):
    return self.dense(self.dropout(images.reshape(images.shape[0], -1)))


def test_dropout_gives_the_same_numbers_on_spmd_fsdp_and_one_device_not_pmap(tiny_config):
  """spmd and fsdp draw one dropout mask for the global batch, as one device does (JAX's
  random bits do not depend on the sharding). pmap folds the device index into the keys: each
  device draws its own masks, and the state stays replicated (README: Use your own model)."""
  tiny_config.fsdp_min_size = 0
  data = batches([64, 20])
  fresh = lambda: initial_state(tiny_config, DropoutCNN(nnx.Rngs(0)))  # noqa: E731 (donated)
  results = {parallelism: run(tiny_config, parallelism, data, *fresh())[0]
             for parallelism in ("single", "spmd", "fsdp")}
  assert_trees_close(results["spmd"], results["single"], atol=1e-6)
  assert_trees_close(results["fsdp"], results["single"], atol=1e-6)

  graphdef, state = fresh()
  compiled, _ = steps_for(tiny_config, "pmap", graphdef)
  replicated, running = compiled.put_state(state), compiled.empty(recipe_metrics(tiny_config).train)
  for group in stacked(data, 1):
    replicated, running = compiled.train(replicated, running, compiled.put_batch(group))
  for leaf in jax.tree.leaves(replicated):
    per_device = as_numpy(leaf)
    assert (per_device == per_device[:1]).all()  # still identical on every device
  kernel = lambda state: np.asarray(state[0]["dense"]["kernel"][...])  # noqa: E731
  assert np.abs(kernel(compiled.get_state(replicated)) - kernel(results["single"])).max() > 1e-3

  @functools.partial(jax.pmap, axis_name=pmap.PMAP_AXIS)
  def dropout_masks(state, images):
    model, _ = nnx.merge(graphdef, state)
    pmap.fold_in_device_index(model, pmap.PMAP_AXIS)
    return model.dropout(images) != 0

  masks = np.asarray(dropout_masks(compiled.put_state(fresh()[1]), jnp.ones((NUM_DEVICES, 4, 64))))
  assert len({m.tobytes() for m in masks}) == NUM_DEVICES  # every device its own mask


class BatchNormCNN(nnx.Module):
  """layers.BatchNorm as model.py uses it: no axis_name (under pmap the step gives it pmap's)."""

  def __init__(self, rngs):
    self.conv = nnx.Conv(1, 4, kernel_size=(3, 3), use_bias=False, rngs=rngs)  # BN has one
    self.norm = layers.BatchNorm(4, momentum=0.9, rngs=rngs)
    self.dense = nnx.Linear(8 * 8 * 4, 10, rngs=rngs)

  def __call__(self, images, example_mask=None):  # the steps pass the batch's mask here
    x = nnx.relu(self.norm(self.conv(images), mask=example_mask))
    return self.dense(x.reshape(x.shape[0], -1))


class StockBatchNormCNN(BatchNormCNN):
  """A plain nnx.BatchNorm, called without the mask (`layers.masked` makes it layers.BatchNorm)."""

  def __init__(self, rngs):
    super().__init__(rngs)
    self.norm = nnx.BatchNorm(4, momentum=0.9, rngs=rngs)

  def __call__(self, images):
    x = nnx.relu(self.norm(self.conv(images)))
    return self.dense(x.reshape(x.shape[0], -1))


class AxisNamingCNN(StockBatchNormCNN):
  """A plain nnx.BatchNorm that names pmap's axis as Flax's pmap examples name it: 'batch'."""

  axis = "batch"

  def __init__(self, rngs):
    super().__init__(rngs)
    self.norm = nnx.BatchNorm(4, momentum=0.9, axis_name=self.axis, rngs=rngs)


class OtherAxisCNN(AxisNamingCNN):
  axis = "devices"


def test_a_batchnorm_naming_pmaps_axis_trains_on_pmap_and_is_refused_in_one_line_elsewhere(
    tiny_config):
  """A model.py whose nnx.BatchNorm names pmap's axis: its check (`optim.check_model`, run under
  pmap's axis as the step is) passes and 3 padded steps on pmap give the state of the same model
  without the name (which the step gives pmap's axis), bit for bit; on spmd and fsdp the check
  stops in one line naming the axis and the fix; on pmap, a name that is not pmap's ('devices')
  is refused in one line that names pmap's."""
  from types import SimpleNamespace

  from {{cookiecutter.project_slug}}.errors import ConfigError

  data = batches([64, 20, 64])
  expected, _ = run(tiny_config, "pmap", data, *batchnorm_state(SGD, StockBatchNormCNN))
  got, metrics = run(tiny_config, "pmap", data, *batchnorm_state(SGD, AxisNamingCNN))
  assert metrics["nonfinite_steps"] == 0 and metrics["examples"] == 148
  assert_trees_close(got, expected, atol=0)
  info = SimpleNamespace(image_shape=(8, 8, 1), num_classes=10, class_names=None)
  for parallelism, model_class in (("pmap", AxisNamingCNN), ("spmd", AxisNamingCNN),
                                   ("fsdp", AxisNamingCNN), ("pmap", OtherAxisCNN)):
    model = SimpleNamespace(__file__=__file__, create_model=lambda config, image_shape, classes,
                            rngs, model_class=model_class: model_class(nnx.Rngs(0)))
    config = plan.resolved(ml_collections.ConfigDict(dict(tiny_config, parallelism=parallelism)))
    run_plan = plan.make_plan(config)._replace(model=model)
    if model_class is AxisNamingCNN and parallelism == "pmap":
      optim.check_model(run_plan, info)
      continue
    with pytest.raises(ConfigError) as refused:
      optim.check_model(run_plan, info)
    message = str(refused.value)
    assert "\n" not in message and f"names the axis '{model_class.axis}'" in message and (
        "drop its axis_name=" in message), message
    assert ("pmap's is 'batch'" if parallelism == "pmap" else "parallelism=pmap") in message, (
        message)


def batchnorm_state(optimizer=None, model_class=BatchNormCNN, groups=1):
  """The model and its optimizer, split; its BatchNorm's statistics over `groups` groups of
  devices (as `optim.create_model` makes them of `config.batch_norm_devices`)."""
  model = layers.masked(model_class(nnx.Rngs(0)), groups)
  return nnx.split((model, nnx.Optimizer(model, optimizer or ADAM, wrt=nnx.Param)))


@pytest.mark.parametrize("model_class", [BatchNormCNN, StockBatchNormCNN])
@pytest.mark.parametrize("parallelism", ["spmd", "pmap"])
def test_batchnorm_leaves_the_padding_out(tiny_config, parallelism, model_class):
  """Padded batches give the BatchNorm statistics and gradients of their real examples alone,
  on one device: the same running statistics and the same parameters after 3 SGD steps. (With
  20 real examples of 64 on 8 devices, pmap's devices 3-7 hold none.) pmap's statistics are
  those of the global batch: synchronised over its axis, padding left out. Alike for a plain
  nnx.BatchNorm that the model does not pass the mask to, made layers.BatchNorm by
  `layers.masked` (what train.py builds)."""
  num_real = [64, 20, 64]
  data = batches(num_real)
  real_only = [jax.tree.map(lambda x, n=n: x[:n], batch)
               for batch, n in zip(data, num_real, strict=True)]
  expected, _ = run(tiny_config, "single", real_only, *batchnorm_state(SGD, model_class))
  got, metrics = run(tiny_config, parallelism, data, *batchnorm_state(SGD, model_class))
  assert metrics["nonfinite_steps"] == 0 and metrics["examples"] == sum(num_real)
  assert_trees_close(got, expected, atol=1e-6)
  assert float(jnp.abs(got[0]["norm"]["mean"][...]).max()) > 0


class PlainBatchNormMLP(nnx.Module):
  """A model.py of stock layers: nnx.BatchNorm called without the mask, with no axis of its own."""

  def __init__(self, rngs):
    self.hidden = nnx.Linear(8 * 8, 16, rngs=rngs)
    self.norm = nnx.BatchNorm(16, momentum=0.5, rngs=rngs)
    self.out = nnx.Linear(16, 10, rngs=rngs)

  def __call__(self, images):
    return self.out(nnx.relu(self.norm(self.hidden(images.reshape(images.shape[0], -1)))))


def test_a_plain_nnx_batchnorm_takes_the_global_batchs_statistics_on_pmap_too(tiny_config):
  """Under pmap a stock nnx.BatchNorm is given the devices' axis (`pmap.batch_norm_over_devices`):
  3 SGD steps (a padded batch among them, its padding in the statistics alike everywhere) take
  the same parameters and running statistics on pmap as on spmd and one device."""
  data = batches([64, 20, 64])
  model = PlainBatchNormMLP(nnx.Rngs(0))
  state = nnx.split((model, nnx.Optimizer(model, SGD, wrt=nnx.Param)))
  copy = lambda: jax.tree.map(jnp.copy, state[1])  # (the steps donate it)  # noqa: E731
  single, single_metrics = run(tiny_config, "single", data, state[0], copy())
  for parallelism in ("spmd", "pmap"):
    got, metrics = run(tiny_config, parallelism, data, state[0], copy())
    assert_trees_close(got, single, atol=1e-6)
    assert metrics["loss"] == pytest.approx(single_metrics["loss"], abs=1e-6)
  assert float(jnp.abs(single[0]["norm"]["mean"][...]).max()) > 0


def grouped_batch_norm(x, mask, weights, groups, parallelism):
  """A layers.BatchNorm of `groups` with `weights` (scale, bias) on `x`: one array (jit), or
  pmap's 8 devices a share each. Its output and running statistics."""
  norm = layers.BatchNorm(x.shape[-1], momentum=0.5, rngs=nnx.Rngs(0),
                         axis_name=pmap.PMAP_AXIS if parallelism == "pmap" else None)
  norm.scale[...], norm.bias[...] = weights
  norm.groups = groups
  graphdef, state = nnx.split(norm)

  def call(state, x, mask):
    norm = nnx.merge(graphdef, state)
    y = norm(x, mask=mask)
    return y, norm.mean[...], norm.var[...]

  if parallelism == "jit":
    return jax.jit(call)(state, x, mask)
  shares = lambda a: a.reshape(NUM_DEVICES, -1, *a.shape[1:])  # noqa: E731
  y, mean, var = jax.pmap(call, axis_name=pmap.PMAP_AXIS, in_axes=(None, 0, 0))(
      state, shares(x), shares(mask))
  return y.reshape(x.shape), mean[0], var[0]


@pytest.mark.parametrize("parallelism", ["jit", "pmap"])
@pytest.mark.parametrize("groups", [8, 4, 1])
def test_batchnorm_normalises_each_group_by_its_real_examples(parallelism, groups):
  """With `groups` g each of g equal slices of the batch (a device's share, a
  group of devices' under pmap) is normalised as nnx.BatchNorm normalises that slice alone,
  padding left out; a padded example comes out as the bias (a slice of padding alone too: no
  NaN); the running statistics are the global batch's real examples', whatever the groups."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(2.0, 3.0, (32, 3, 3, 4)), jnp.float32)
  mask = np.arange(32) % 3 != 0
  mask[-4:] = False  # the last device's share: padding alone
  weights = (jnp.asarray(rng.normal(size=4), jnp.float32),
             jnp.asarray(rng.normal(size=4), jnp.float32))
  y, mean, var = grouped_batch_norm(x, jnp.asarray(mask), weights, groups, parallelism)

  def flax_batch_norm(x, real):  # nnx.BatchNorm itself on `x`'s `real` examples
    norm = nnx.BatchNorm(x.shape[-1], momentum=0.5, rngs=nnx.Rngs(0))
    norm.scale[...], norm.bias[...] = weights
    return norm(x, mask=real.reshape(-1, 1, 1, 1)), norm.mean[...], norm.var[...]

  size = 32 // groups
  for first in range(0, 32, size):
    part, real = slice(first, first + size), mask[first:first + size]
    if real.any():
      expected, *_ = flax_batch_norm(x[part], real)
      np.testing.assert_allclose(y[part][real], expected[real], atol=2e-5, rtol=0)
  np.testing.assert_array_equal(y[~mask], np.broadcast_to(weights[1], y[~mask].shape))
  _, global_mean, global_var = flax_batch_norm(x, mask)
  np.testing.assert_allclose(mean, global_mean, atol=1e-5, rtol=0)
  np.testing.assert_allclose(var, global_var, atol=1e-4, rtol=0)
  assert float(jnp.abs(global_mean).min()) > 0.4  # (moved from 0 by half the batch's mean)


@pytest.mark.parametrize("batch_norm_devices", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_batchnorm_over_groups_of_devices_is_the_same_on_every_path(tiny_config,
                                                                     batch_norm_devices):
  """config.batch_norm_devices = 1 (each device its own statistics) or 2: 3 padded SGD steps
  (20 real examples of 64: devices 3-7 hold none) give the same state on spmd, fsdp and pmap
  (psum over groups of devices) as on one device whose step splits each batch into as many
  groups; not the state of the global batch's statistics."""
  tiny_config.fsdp_min_size, tiny_config.batch_norm_devices = 0, batch_norm_devices
  data = batches([64, 20, 64])
  groups = NUM_DEVICES // batch_norm_devices
  graphdef, state = batchnorm_state(SGD, groups=groups)
  step = single_step(tiny_config, graphdef)
  expected, running = jax.device_put((state, recipe_metrics(tiny_config).train.empty()),
                                     jax.devices()[0])
  for batch in data:
    expected, running = step(expected, running, batch)
  for parallelism in ("spmd", "fsdp", "pmap"):
    got, got_metrics = run(tiny_config, parallelism, data, *batchnorm_state(SGD, groups=groups))
    assert got_metrics["nonfinite_steps"] == 0 and got_metrics["examples"] == 148
    assert_trees_close(got, expected, atol=1e-6)
  tiny_config.batch_norm_devices = 0
  global_statistics, _ = run(tiny_config, "spmd", data, *batchnorm_state(SGD))
  kernel = lambda state: np.asarray(state[0]["conv"]["kernel"][...])  # noqa: E731
  assert np.abs(kernel(global_statistics) - kernel(expected)).max() > 1e-4


class NormStack(nnx.Module):
  """`depth` convolutions, each followed by layers.BatchNorm."""

  def __init__(self, depth, rngs):
    self.convs = nnx.List([nnx.Conv(1 if i == 0 else 4, 4, kernel_size=(3, 3), use_bias=False,
                                    rngs=rngs) for i in range(depth)])
    self.norms = nnx.List([layers.BatchNorm(4, rngs=rngs) for _ in range(depth)])
    self.dense = nnx.Linear(8 * 8 * 4, 10, rngs=rngs)

  def __call__(self, images, example_mask=None):
    x = images
    for conv, norm in zip(self.convs, self.norms, strict=True):
      x = nnx.relu(norm(conv(x), mask=example_mask))
    return self.dense(x.reshape(x.shape[0], -1))


@pytest.mark.slow  # (the compiled program's structure, as the aot tests')
def test_a_devices_own_statistics_add_no_all_reduce_a_layer(tiny_config):
  """The spmd step's all-reduces (compiled for 8 devices): with the global batch's statistics
  each BatchNorm layer adds its own (its statistics, forward and backward); with each device's
  own (batch_norm_devices=1) the count does not grow with the layers: what is left to reduce
  (the running statistics, the gradient) XLA combines into the same few."""
  counts = {}
  for devices, depth in itertools.product((0, 1), (1, 3)):
    tiny_config.batch_norm_devices = devices
    model = layers.masked(NormStack(depth, nnx.Rngs(0)), NUM_DEVICES // (devices or NUM_DEVICES))
    graphdef, state = nnx.split((model, nnx.Optimizer(model, SGD, wrt=nnx.Param)))
    compiled, mesh = steps_for(tiny_config, "spmd", graphdef)
    program = compiled.train.lower(
        compiled.put_state(sharding.place_state(state, mesh, tiny_config.fsdp_min_size)),
        compiled.empty(recipe_metrics(tiny_config).train),
        compiled.put_batch(stacked(batches([64]), 1)[0]))
    counts[devices, depth] = aot.count_collectives(program.compile().as_text())["all-reduce"]
  assert counts[0, 3] >= counts[0, 1] + 4, counts  # 2 more layers: 2 all-reduces each at least
  assert counts[1, 3] == counts[1, 1] < counts[0, 1], counts


@pytest.mark.parametrize("parallelism", ["spmd", pytest.param("pmap", marks=pytest.mark.slow)])
def test_accumulation_with_batchnorm_and_micro_batches_without_a_real_example(tiny_config,
                                                                             parallelism):
  """Batches of 2 real examples in 4 micro-batches (micro-batch j holds examples j, j + 4, ...:
  two hold none) give no NaN, and the state of 2 micro-batches, which group the two examples
  as the 4 do: the empty ones add nothing and move no BatchNorm statistic."""
  data = batches([2, 2])
  results = {}
  for accum in (2, 4):
    tiny_config.grad_accum_steps = accum
    results[accum] = run(tiny_config, parallelism, data, *batchnorm_state(SGD))
  (two, _), (four, four_metrics) = results[2], results[4]
  assert four_metrics["nonfinite_steps"] == 0 and four_metrics["examples"] == 4
  assert all(np.isfinite(as_numpy(x)).all() for x in jax.tree.leaves(four)
             if not jnp.issubdtype(x.dtype, jax.dtypes.prng_key))
  assert_trees_close(four, two, atol=1e-6)
  assert int(four[1]["step"][...]) == 2


@pytest.mark.parametrize("parallelism, variant", [
    ("spmd", "plain"), ("pmap", "accumulation_dropout_nonfinite"),
    pytest.param("pmap", "plain", marks=pytest.mark.slow),  # (each path and variant once above)
    pytest.param("spmd", "accumulation_dropout_nonfinite", marks=pytest.mark.slow)])
def test_k_steps_in_one_call_equal_k_single_calls(tiny_config, parallelism, variant):
  """3 batches (two padded) as 2 calls of k=2 (the second padded with a batch of padding
  alone) = 3 calls of k=1: the same state and merged metrics. The second variant has every
  part of a step that the loop could get wrong at once: 2 micro-batches, dropout (the state
  holds PRNG keys) and a NaN in batch 1 (its update is skipped, and counted)."""
  data = batches([64, 20, 37])
  hard = variant != "plain"
  new_model = lambda: DropoutCNN(nnx.Rngs(0)) if hard else None  # noqa: E731
  if hard:
    tiny_config.grad_accum_steps = 2
    data = [dict(b, image=b["image"].astype(np.float32) / 255) for b in data]
    data[1]["image"][3] = np.nan
  expected, expected_metrics = run(tiny_config, parallelism, data,
                                   *initial_state(tiny_config, new_model()))
  got, metrics = run(tiny_config, parallelism, data, *initial_state(tiny_config, new_model()), k=2)
  assert_trees_close(got, expected, atol=1e-6)
  assert metrics["examples"] == expected_metrics["examples"] == 64 + 20 + 37
  # (a non-finite step's loss enters the merged metrics: NaN on both sides then)
  assert metrics["loss"] == pytest.approx(expected_metrics["loss"], abs=1e-6, nan_ok=True)
  assert metrics["accuracy"] == expected_metrics["accuracy"]
  assert metrics["nonfinite_steps"] == expected_metrics["nonfinite_steps"] == (1 if hard else 0)
  assert int(got[1]["step"][...]) == (2 if hard else 3)


class MLP(nnx.Module):
  """Dense layers only: XLA:CPU runs their gradients as fast inside a loop as outside."""

  def __init__(self, width, depth, rngs, in_features=64, num_classes=10):
    widths = (in_features, *[width] * depth)
    self.layers = nnx.List([nnx.Linear(widths[i], widths[i + 1], rngs=rngs) for i in range(depth)])
    self.out = nnx.Linear(widths[-1], num_classes, rngs=rngs)

  def __call__(self, images):
    x = images.reshape(images.shape[0], -1)
    for layer in self.layers:
      x = nnx.relu(layer(x))
    return self.out(x)


@pytest.mark.parametrize("parallelism", ["spmd", pytest.param("pmap", marks=pytest.mark.slow)])
def test_rolled_loop_equals_single_calls(tiny_config, parallelism):
  """The k steps of a call as a rolled lax.scan (what a GPU or TPU compiles; the CPU unrolls
  them): 4 batches (two padded) as 2 calls of k=3 = 4 calls of k=1."""
  data = batches([64, 20, 64, 37])
  expected, expected_metrics = run(tiny_config, parallelism, data,
                                   *initial_state(tiny_config, MLP(32, 2, nnx.Rngs(0))))
  graphdef, state = initial_state(tiny_config, MLP(32, 2, nnx.Rngs(0)))
  tiny_config.parallelism, tiny_config.steps_per_dispatch = parallelism, 3
  mesh = sharding.make_mesh(tiny_config)
  compiled = dispatch.make(graphdef, plan.make_plan(tiny_config), mesh, unroll=False)
  placed = compiled.put_state(sharding.place_state(state, mesh))
  lowered = compiled.train.lower(placed, compiled.empty(recipe_metrics(tiny_config).train),
                                 compiled.put_batch(stacked(data, 3)[0]))
  assert "stablehlo.while" in lowered.as_text()  # a loop, not k copies of the step
  got, got_metrics = run(tiny_config, parallelism, data, graphdef, state, k=3, unroll=False)
  assert_trees_close(got, expected, atol=1e-6)
  assert got_metrics["examples"] == expected_metrics["examples"] == 64 + 20 + 64 + 37
  assert got_metrics["loss"] == pytest.approx(expected_metrics["loss"], abs=1e-6)
  assert got_metrics["accuracy"] == expected_metrics["accuracy"]
  assert got_metrics["nonfinite_steps"] == 0 and int(got[1]["step"][...]) == 4


class FakeTpu:
  """What mesh_utils reads of a device: its id, slice, platform and kind."""

  platform, device_kind = "cpu", "fake"

  def __init__(self, id, slice_index):
    self.id, self.slice_index = id, slice_index

  def __repr__(self):
    return f"{self.slice_index}/{self.id}"


@pytest.mark.parametrize("shape", [(8,), (4, 2)])  # spmd ('data'); fsdp ('data', 'fsdp')
def test_devices_on_two_slices_split_the_data_axis_across_slices(shape):
  """Multi-slice TPU (jax.make_mesh refuses it): the 'data' axis spans the slices, any 'fsdp'
  group stays within one (only the gradient all-reduce crosses the slower network)."""
  devices = [FakeTpu(i, slice_index=i // 4) for i in range(8)]
  assert sharding.num_slices(devices) == 2
  grid = sharding.device_grid(shape, devices)
  assert grid.shape == shape
  slice_of = np.vectorize(lambda d: d.slice_index)(grid)
  assert (slice_of[: shape[0] // 2] == 0).all() and (slice_of[shape[0] // 2:] == 1).all()
  assert sorted(d.id for d in grid.flat) == list(range(8))


@pytest.mark.parametrize("parallelism, fsdp_devices", [("spmd", 0), ("fsdp", 0), ("fsdp", 2)])
def test_one_slice_mesh_is_jax_make_mesh(tiny_config, parallelism, fsdp_devices):
  tiny_config.parallelism, tiny_config.fsdp_devices = parallelism, fsdp_devices
  mesh = sharding.make_mesh(tiny_config)
  f = fsdp_devices or 8
  expected = (jax.make_mesh((8,), ("data",)) if parallelism == "spmd" else
              jax.make_mesh((8 // f, f), ("data", "fsdp")))
  assert mesh.axis_names == expected.axis_names
  assert (mesh.devices == expected.devices).all()
  assert set(mesh.axis_types) == {jax.sharding.AxisType.Auto}


@pytest.mark.parametrize("units", [1, 8])
def test_packed_crops_are_placed_a_device_each_on_every_path(units):
  """Photos' crops packed a device each (`batches.pack`), in one unit or in a unit a device (as
  the workers send them): placed for spmd (`sharding.global_batch`) and pmap (`pmap.pmap_batch`),
  each device holds its own crops' bytes, padded back to its room, and the rows around them."""
  from {{cookiecutter.project_slug}}.data import batches

  rng = np.random.default_rng(0)
  k, batch, largest = 2, 16, (6, 5, 3)
  crops = np.empty(k * batch, object)
  crops[:] = [rng.integers(0, 256, (rng.integers(1, 7), rng.integers(1, 6), 3), np.uint8)
              for _ in range(k * batch)]
  per_unit = batch // units
  rows = np.arange(k * batch).reshape(k, units, per_unit)  # (batch row b of unit u: u * per_unit)
  shares = []
  for u in range(units):
    mine = crops[rows[:, u].reshape(-1)]
    share = batches.pack(mine, np.arange(len(mine)), (k, per_unit, *largest), NUM_DEVICES // units)
    shares.append(share | {"mask": np.ones((k, per_unit), bool),
                           "box": np.zeros((k, per_unit, 6), np.float32)})
  want = np.concatenate([share["image"] for share in shares], axis=1)[0]  # [devices, room]
  filled = np.concatenate([share["filled"] for share in shares], axis=1)[0]
  local = shares[0] if units == 1 else shares
  placed = {"spmd": np.asarray(sharding.global_batch(local, sharding.make_mesh())["image"])[0],
            "pmap": np.asarray(pmap.pmap_batch(local)["image"])[:, 0, 0]}
  for name, image in placed.items():
    assert image.shape == want.shape, name
    for device, n in enumerate(filled):
      np.testing.assert_array_equal(image[device, :n], want[device, :n], err_msg=name)
  assert filled.sum() == sum(crop.size for crop in crops)
