"""vit.py, the ViT of configs/vit.py: its large-model options change no number they should not
(remat, scan: rounding alone), it trains alike on every path, and
bfloat16 first moments halve them and train as float32's do."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import plain
from flax import nnx
from test_parallel import as_numpy, batches, run

import train

from {{cookiecutter.project_slug}} import plan
from {{cookiecutter.project_slug}}.training import optim

pytestmark = pytest.mark.slow  # (each test compiles a ViT's steps several times)


def small_vit(**changes):
  """tiny.py's plain config on vit.py's ViT-Ti, two blocks, of 2x2 patches of the 8x8 digits,
  with Dropout (0.1) after its layers."""
  config = plain(**changes)
  config.model.update(module="vit", name="vit_ti", patch=2, depth=2, dropout=0.1)
  return config


def trained(config, data):
  """The state after one spmd step a batch of `data` from the config's initial state."""
  config.steps_per_dispatch = 1
  run_plan = plan.make_plan(plan.resolved(config))
  graphdef, state = nnx.split(optim.build_state(run_plan, (8, 8, 1), 10, len(data)))
  return run(config, "spmd", data, graphdef, state)[0]


def assert_leaves_near(a, b, rel: float = 1e-6):
  """Each leaf of `a` within `rel` of `b`'s, normwise (||a - b|| <= rel x max(||b||, 1)): float32
  summed in another order, where attention's nearly cancelling sums leave an entry or two of a
  kernel past an elementwise 1e-6 (1.09e-6, one of 73,728, measured on spmd)."""
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b),
                          strict=True):
    x, y = as_numpy(x).astype(np.float64), as_numpy(y).astype(np.float64)
    assert np.linalg.norm(x - y) <= rel * max(np.linalg.norm(y), 1.0), jax.tree_util.keystr(path)


def test_remat_and_scan_change_the_steps_by_rounding_alone():
  """5 steps (one of a partial batch) with each block's activations kept, recomputed ('block')
  or recomputed but the matmuls' (a jax.checkpoint_policies policy), and with the blocks under
  nnx.scan or unrolled (one layout of the parameters for both): the same state within 1e-6
  (`assert_leaves_near`).
  Not bit for bit: XLA compiles a recomputed LayerNorm's mean and variance into other fusions,
  summed in another order (a block of matmuls, GELU and softmax alone is bitwise). SGD: Adam
  would blow the rounding of gradients that are zero in exact arithmetic (attention's key bias)
  up to whole steps."""
  data = batches([64, 64, 20, 64, 64])
  kept = trained(small_vit(optimizer="sgd"), data)
  for remat in ("block", "dots_with_no_batch_dims_saveable"):
    assert_leaves_near(trained(small_vit(optimizer="sgd", remat=remat), data), kept)
  config = small_vit(optimizer="sgd")
  config.model.scan = False
  assert_leaves_near(trained(config, data), kept)
  assert kept[0]["blocks"]["mlp_in"]["kernel"].shape == (2, 192, 768)  # [depth, in, out]


def test_a_vit_trains_alike_on_one_device_spmd_pmap_and_fsdp():
  """The small ViT (attention, LayerNorm, its blocks scanned) over a padded batch: spmd, pmap and
  fsdp (every leaf split) give one device's state (`assert_leaves_near`; SGD: see above), without
  dropout (pmap draws each device's own masks: test_parallel.py). With it, pmap draws a stack of
  keys a device (one a block) and trains."""
  def state_of(config):
    config.steps_per_dispatch = 1
    run_plan = plan.make_plan(plan.resolved(config))
    return nnx.split(optim.build_state(run_plan, (8, 8, 1), 10, 3))

  config = small_vit(fsdp_min_size=0, optimizer="sgd")
  config.model.dropout = 0.0
  graphdef, state = state_of(config)
  copy = lambda: jax.tree.map(jnp.copy, state)  # (the steps donate it)  # noqa: E731
  data = batches([64, 20, 64])
  single, single_metrics = run(config, "single", data, graphdef, copy())
  for parallelism in ("spmd", "pmap", "fsdp"):
    got, metrics = run(config, parallelism, data, graphdef, copy())
    assert_leaves_near(got, single)
    assert metrics["examples"] == 148 and metrics["accuracy"] == single_metrics["accuracy"]
  dropped = small_vit(optimizer="sgd")
  _, metrics = run(dropped, "pmap", data, *state_of(dropped))
  assert metrics["examples"] == 148 and np.isfinite(metrics["loss"])


def test_bfloat16_first_moments_halve_them_and_train_as_float32s(tmp_path):
  """config.mu_dtype='bfloat16': AdamW's mu in bfloat16 (nu float32): the state smaller by two
  bytes a parameter, exactly; the small ViT trained on the digits (3 epochs) ends within 1% of
  float32's eval loss."""
  def state_bytes(config):
    run_plan = plan.make_plan(plan.resolved(config))
    state = nnx.state(nnx.eval_shape(lambda: optim.build_state(run_plan, (8, 8, 1), 10, 10)))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))

  config = small_vit(optimizer="adamw", weight_decay=0.05, learning_rate=1e-3, num_epochs=3,
                     batch_size=128)
  halved = small_vit(optimizer="adamw", weight_decay=0.05, learning_rate=1e-3, num_epochs=3,
                     batch_size=128, mu_dtype="bfloat16")
  run_plan = plan.make_plan(plan.resolved(config))
  params = nnx.state(nnx.eval_shape(
      lambda: optim.build_state(run_plan, (8, 8, 1), 10, 10)[0]), nnx.Param)
  num_params = sum(x.size for x in jax.tree.leaves(params))
  assert state_bytes(config) - state_bytes(halved) == 2 * num_params
  losses = [train.train_and_evaluate(c, str(tmp_path / name))["loss"]
            for name, c in (("float32", config), ("bfloat16", halved))]
  print(f"eval loss: float32 moments {losses[0]:.4f}, bfloat16 first moments {losses[1]:.4f}")
  assert losses[1] == pytest.approx(losses[0], rel=0.01)
