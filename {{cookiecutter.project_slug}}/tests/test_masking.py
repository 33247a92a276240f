"""Padding and masking are exact: padded examples change no gradient, no metric, no count."""

import contextlib
import functools

import jax
import numpy as np
import optax
import pytest
from conftest import plain_options, recipe_metrics
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from shipped_model import create_model

import train

from {{cookiecutter.project_slug}} import layers, plan
from {{cookiecutter.project_slug}}.data import batches, input_pipeline, sources
from {{cookiecutter.project_slug}}.errors import ConfigError
from {{cookiecutter.project_slug}}.parallel import sharding
from {{cookiecutter.project_slug}}.training import dispatch, optim, steps


def model_and_optimizer(config, image_shape=(8, 8, 1), num_classes=10):
  model = create_model(config, image_shape, num_classes, nnx.Rngs(0))
  return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def digits_batch(n: int, padded_to: int):
  rng = np.random.default_rng(1)
  batch = {"image": np.zeros((padded_to, 8, 8, 1), np.float32),
           "label": np.zeros((padded_to,), np.int32), "mask": np.zeros((padded_to,), bool),
           "position": np.arange(padded_to, dtype=np.uint32)}
  batch["image"][:n] = rng.random((n, 8, 8, 1), dtype=np.float32)
  batch["label"][:n] = rng.integers(0, 10, n)
  batch["mask"][:n] = True
  return batch


def max_abs_diff(a, b) -> float:
  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in pairs)


def test_padded_gradient_equals_unpadded_gradient(tiny_config):
  model, _ = model_and_optimizer(tiny_config)
  padded = digits_batch(77, 128)  # 77 real examples on 8 devices: the last 3 devices hold none
  real = {k: v[:77] for k, v in padded.items()}

  def mean_loss(model, images, labels):
    logits = model(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  expected = nnx.jit(nnx.grad(mean_loss))(model, real["image"], real["label"])  # one program

  mesh = sharding.make_mesh()
  graphdef, state = nnx.split(model)

  @jax.jit
  def masked_grad(state, batch):
    grads, metrics = nnx.grad(steps.loss_and_metrics, has_aux=True)(
        nnx.merge(graphdef, state), batch, **plain_options(tiny_config))
    return jax.tree.map(lambda g: g / metrics.loss.count, grads), metrics

  grads, metrics = masked_grad(jax.device_put(state, sharding.replicated(mesh)),
                               jax.device_put(padded, NamedSharding(mesh, P(sharding.DATA_AXIS))))
  assert int(metrics.loss.count) == 77
  assert max_abs_diff(grads, expected) < 1e-6
  unmasked, _ = masked_grad(state, {**padded, "mask": np.ones(128, bool)})
  assert max_abs_diff(unmasked, expected) > 1e-3  # the padding would matter if not masked


def test_train_step_on_padded_batch_equals_step_on_real_examples(tiny_config):
  padded = digits_batch(77, 128)
  real = {k: v[:77] for k, v in padded.items()}
  graphdef, state = nnx.split(model_and_optimizer(tiny_config))

  one_device = jax.jit(functools.partial(steps.train_step, graphdef,
                                         **plain_options(tiny_config, augment_max_shift=1)))
  expected, expected_metrics = one_device(state, recipe_metrics(tiny_config).train.empty(), real)

  tiny_config.augment_max_shift, tiny_config.seed = 1, 0  # shifts keyed by position: the same
  compiled = dispatch.make(graphdef, plan.make_plan(tiny_config), sharding.make_mesh())
  placed = compiled.put_state(state)
  new_state, running = compiled.train(placed, compiled.empty(recipe_metrics(tiny_config).train),
                                      compiled.put_batch(jax.tree.map(lambda x: x[None], padded)))
  assert max_abs_diff(compiled.get_state(new_state), expected) < 1e-6
  assert int(running.loss.count) == int(expected_metrics.loss.count) == 77
  assert abs(float(running.loss.compute()) - float(expected_metrics.loss.compute())) < 1e-6


def test_eval_counts_every_example_once(tiny_config):
  """1001 examples, batch 64 on 8 devices: 15 full elements and one with 41 real examples, in
  calls of 5 elements (the last call: one batch, then four of padding alone)."""
  tiny_config.dataset, tiny_config.steps_per_dispatch = "synthetic", 5
  tiny_config.synthetic.update(image_shape=(8, 8, 1), num_classes=10, num_eval=1001)
  config = plan.resolved(tiny_config)
  splits, info = sources.get_datasets(config)
  model, optimizer = model_and_optimizer(config)
  graphdef, state = nnx.split((model, optimizer))
  compiled = dispatch.make(graphdef, plan.make_plan(config), sharding.make_mesh())
  elements = batches.eval_batches(splits["eval"], config)
  with contextlib.closing(input_pipeline.as_iterator(elements, config)) as iterator:
    result = dispatch.summarize(dispatch.evaluate(compiled, compiled.put_state(state), iterator,
                                                  len(elements), config,
                                                  recipe_metrics(config).eval))
  assert result["examples"] == 1001

  examples = splits["eval"].take(np.arange(1001))
  images, labels = examples["image"] / 255, examples["label"]  # stored as uint8
  logits = model(images)
  expected_loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  expected_accuracy = (logits.argmax(-1) == labels).mean()
  assert abs(result["loss"] - float(expected_loss)) < 1e-5
  assert abs(result["accuracy"] - float(expected_accuracy)) < 1e-6


def with_wrapper(call):
  """A decorator, as users write them (functools.wraps)."""

  @functools.wraps(call)
  def wrapped(*args, **kwargs):
    return call(*args, **kwargs)

  return wrapped


class NormNoMask(nnx.Module):
  """BatchNorm, and a __call__ that cannot take the mask."""

  def __init__(self, image_shape, num_classes, rngs):
    self.norm = layers.BatchNorm(image_shape[-1], rngs=rngs)
    self.dense = nnx.Linear(int(np.prod(image_shape)), num_classes, rngs=rngs)

  def __call__(self, images):
    return self.dense(self.norm(images).reshape(images.shape[0], -1))


class StockNorm(NormNoMask):
  """nnx.BatchNorm, called without the mask."""

  def __init__(self, image_shape, num_classes, rngs):
    super().__init__(image_shape, num_classes, rngs)
    self.norm = nnx.BatchNorm(image_shape[-1], rngs=rngs)


class MyBatchNorm(nnx.BatchNorm):
  """A BatchNorm of a model.py's own."""


class OwnNorm(NormNoMask):
  """A BatchNorm of its own class, called without the mask."""

  def __init__(self, image_shape, num_classes, rngs):
    super().__init__(image_shape, num_classes, rngs)
    self.norm = MyBatchNorm(image_shape[-1], rngs=rngs)


class DecoratedNorm(NormNoMask):
  @with_wrapper
  def __call__(self, images, example_mask=None):
    return self.dense(self.norm(images, mask=example_mask).reshape(images.shape[0], -1))


class KeywordsNorm(NormNoMask):
  def __call__(self, images, **kwargs):
    return self.dense(self.norm(images, mask=kwargs.get("example_mask")).reshape(
        images.shape[0], -1))


def test_the_mask_reaches_every_batchnorm_and_one_it_cannot_reach_is_named(tiny_config):
  """The mask goes to a __call__ with an example_mask parameter, behind a decorator too, or
  taking **kwargs, and to a layers.BatchNorm called without it (`layers.BATCH_MASK`), a plain
  nnx.BatchNorm made one by `layers.masked` too: their statistics are those of the real
  examples. A BatchNorm of the model's own class, which it cannot reach, gets one warning that
  names the layer and the fix."""
  batch = digits_batch(5, padded_to=8)
  batch["image"][5:] = 100.0  # padding far from the data: it would move the mean
  means = {}
  for cls in (DecoratedNorm, KeywordsNorm, NormNoMask, StockNorm, OwnNorm):
    model = layers.masked(cls((8, 8, 1), 10, nnx.Rngs(0)))
    assert layers.takes_mask(cls) == (cls in (DecoratedNorm, KeywordsNorm))
    steps.forward(model, {"image": jax.numpy.asarray(batch["image"]), "mask": batch["mask"]}, None)
    means[cls] = float(model.norm.mean[...][0])
  real_mean = 0.01 * batch["image"][:5].mean()  # momentum 0.99: one step from 0
  np.testing.assert_allclose([means[c] for c in (DecoratedNorm, KeywordsNorm, NormNoMask,
                                                 StockNorm)], real_mean, rtol=1e-5)
  np.testing.assert_allclose(means[OwnNorm], 0.01 * batch["image"].mean(), rtol=1e-5)  # 100s
  warning = steps.mask_warning(OwnNorm((8, 8, 1), 10, nnx.Rngs(0)))
  assert "OwnNorm holds MyBatchNorm at norm" in warning and "layers.BatchNorm" in warning
  assert steps.mask_warning(layers.masked(StockNorm((8, 8, 1), 10, nnx.Rngs(0)))) is None
  assert steps.mask_warning(NormNoMask((8, 8, 1), 10, nnx.Rngs(0))) is None
  assert steps.mask_warning(create_model(tiny_config, (8, 8, 1), 10, nnx.Rngs(0))) is None


def test_a_batchnorm_the_mask_cannot_reach_trains_with_one_warning(tiny_config, tmp_path,
                                                                  monkeypatch, caplog):
  monkeypatch.setattr(optim, "create_model", lambda config, image_shape, num_classes, rngs:
                      OwnNorm(image_shape, num_classes, rngs))
  tiny_config.eval_every_steps = tiny_config.checkpoint_every_steps = 1000
  result = train.train_and_evaluate(tiny_config, str(tmp_path))
  assert result["examples"] == 360 and np.isfinite(result["loss"])
  warnings = [r.getMessage() for r in caplog.records if "holds MyBatchNorm" in r.getMessage()]
  assert len(warnings) == 1 and "example_mask=None" in warnings[0], warnings


class FlaxNorm(NormNoMask):
  """A BatchNorm of the model's own class, given the mask."""

  def __init__(self, image_shape, num_classes, rngs):
    super().__init__(image_shape, num_classes, rngs)
    self.norm = MyBatchNorm(image_shape[-1], rngs=rngs)

  def __call__(self, images, example_mask=None):
    mask = None if example_mask is None else example_mask[:, None, None, None]
    return self.dense(self.norm(images, mask=mask).reshape(images.shape[0], -1))


def test_statistics_of_groups_of_devices_refuse_a_batchnorm_of_the_models_own_class(
    tiny_config, tmp_path, monkeypatch):
  """config.batch_norm_devices is layers.BatchNorm's (which a plain nnx.BatchNorm is made): a
  model holding a subclass of nnx.BatchNorm of its own, whose statistics would stay the global
  batch's, stops as it is built, naming the layer and the fix; with batch_norm_devices=0 it
  trains, in the same workdir."""
  monkeypatch.setattr(plan.model_module(tiny_config), "create_model",  # (model.py's)
                      lambda config, image_shape, num_classes, rngs:
                      FlaxNorm(image_shape, num_classes, rngs))
  tiny_config.eval_every_steps = tiny_config.checkpoint_every_steps = 1000
  tiny_config.batch_norm_devices = 1
  with pytest.raises(ConfigError, match=r"FlaxNorm holds MyBatchNorm at norm, .*use "
                                        r"layers.BatchNorm"):
    train.train_and_evaluate(tiny_config, str(tmp_path))
  assert not any(tmp_path.iterdir())  # refused as the model is built, before anything is written
  tiny_config.batch_norm_devices = 0  # the fix, in the same workdir
  assert train.train_and_evaluate(tiny_config, str(tmp_path))["examples"] == 360
