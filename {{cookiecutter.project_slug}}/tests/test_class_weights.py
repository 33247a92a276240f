"""Class weights (config.class_weights, runs.with_class_weights, steps.py): the loss a weighted
mean over the real examples, equal on every path; 'balanced' from the data's class counts."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from shipped_model import create_model
from test_parallel import assert_trees_close, batches, run

from {{cookiecutter.project_slug}} import errors, plan
from {{cookiecutter.project_slug}}.data import sources
from {{cookiecutter.project_slug}}.training import runs


def weighted(tiny_config, class_weights):
  """The tiny config resolved, its `run.class_weights` as train.py sets them from the data."""
  tiny_config.class_weights = class_weights
  config = plan.resolved(tiny_config)
  run_plan = runs.with_class_weights(plan.make_plan(config), sources.get_datasets(config)[1])
  return run_plan.config.as_configdict()


def test_balanced_weights_are_n_over_k_times_each_class_count(tiny_config):
  config = weighted(tiny_config, "balanced")
  labels = sources.get_datasets(config)[0]["train"].labels
  counts = np.bincount(labels, minlength=10)
  np.testing.assert_allclose(config.run.class_weights, len(labels) / (10 * counts), rtol=1e-12)
  assert weighted(tiny_config, "1,2," * 4 + "1,2").run.class_weights == (1.0, 2.0) * 5
  with pytest.raises(errors.ConfigError, match=r"config.class_weights='1,2' holds 2 weights; "
                     r"the data has 10 classes: give one a class, or 'balanced'."):
    weighted(tiny_config, "1,2")


def test_the_step_takes_the_weighted_mean_of_the_real_examples_losses(tiny_config):
  """SGD on a batch of 20 real examples and 44 of padding, weights 1..10 by class: the update is
  the rate times the gradient of sum(w_y loss_y) / sum(w_y) over the real examples, computed
  here by hand; every path (spmd, fsdp, pmap) takes one device's step; the mean weight of the
  examples is logged (`train_weight`)."""
  config = weighted(tiny_config, ",".join(str(k) for k in range(1, 11)))
  config.fsdp_min_size, config.augment_max_shift = 0, 0
  data = batches([20])
  model = create_model(config, (8, 8, 1), 10, nnx.Rngs(0))
  graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)))
  copy = lambda: jax.tree.map(jnp.copy, state)  # (the steps donate it)  # noqa: E731
  single, metrics = run(config, "single", data, graphdef, copy())
  for parallelism in ("spmd", "fsdp", "pmap"):
    assert_trees_close(run(config, parallelism, data, graphdef, copy())[0], single, atol=1e-6)
  before = create_model(config, (8, 8, 1), 10, nnx.Rngs(0))
  before.train()
  images = jnp.asarray(data[0]["image"][:20], jnp.float32) / 255
  labels = data[0]["label"][:20]
  weight = np.arange(1.0, 11.0, dtype=np.float32)[labels]

  def weighted_mean(model):
    losses = optax.softmax_cross_entropy_with_integer_labels(model(images), labels)
    return jnp.sum(weight * losses) / weight.sum()

  grads = nnx.grad(weighted_mean)(before)
  stepped = nnx.merge(graphdef, single)[0]
  for p, g, new in zip(*(jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (before, grads,
                                                                              stepped)),
                       strict=True):
    np.testing.assert_allclose(new, p - 0.1 * g, rtol=1e-5, atol=1e-7)
  assert metrics["weight"] == pytest.approx(weight.mean(), rel=1e-6)
  assert metrics["examples"] == 20
