"""Mixup and CutMix (recipe.mix, data/augment.py): pairs of real examples only, timm's targets,
the same numbers on spmd, fsdp, pmap and one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from scipy import stats
from shipped_model import create_model
from test_parallel import assert_trees_close, batches, run

from {{cookiecutter.project_slug}} import plan
from {{cookiecutter.project_slug}}.data import augment
from {{cookiecutter.project_slug}}.training import steps


def mixing(config, mixup=0.8, cutmix=1.0, prob=1.0, switch=0.5):
  config.mixup_alpha, config.cutmix_alpha, config.mix_prob, config.mix_switch_prob = (
      mixup, cutmix, prob, switch)
  return config


def test_neighbours_swap_rows_in_pairs():
  assert np.asarray(augment.neighbours(jnp.arange(6))).tolist() == [1, 0, 3, 2, 5, 4]
  assert np.asarray(augment.neighbours(jnp.arange(5))).tolist() == [1, 0, 3, 2, 4]
  images = jnp.arange(4 * 2 * 2 * 1).reshape(4, 2, 2, 1)
  np.testing.assert_array_equal(augment.neighbours(images), images[jnp.array([1, 0, 3, 2])])


@pytest.mark.parametrize("alpha", [0.8, 1.0])  # DeiT's mixup's and CutMix's
def test_beta_draws_follow_beta_and_loop_on_nothing(alpha):
  """augment.beta: Beta(alpha, alpha) by Kolmogorov-Smirnov over 20,000 draws, and no loop in
  its program (jax.random.beta's gamma draws loop until every example's is accepted)."""
  draw = lambda key: augment.beta(key, alpha)  # noqa: E731
  draws = np.asarray(jax.jit(jax.vmap(draw))(jax.random.split(jax.random.key(0), 20000)))
  assert stats.kstest(draws, stats.beta(alpha, alpha).cdf).pvalue > 0.01
  program = str(jax.make_jaxpr(jax.vmap(draw))(jax.random.split(jax.random.key(0), 4)))
  assert "while" not in program and "gamma" not in program, program
  assert float(augment.beta(jax.random.key(0), 0.0)) == 1.0


@pytest.mark.parametrize("mixup, cutmix", [(0.8, 0.0), (0.0, 1.0)])
def test_mixup_blends_and_cutmix_pastes_a_box_whose_area_is_the_weight(mixup, cutmix):
  """Mixup: lam x + (1 - lam) other, lam drawn per image; CutMix: every pixel is the image's or
  the other's, the other's a rectangle covering exactly 1 - the weight of the area."""
  images = jax.random.uniform(jax.random.key(1), (2, 16, 16, 3))
  weights, boxes = [], 0
  for n in range(64):
    mixed, weight = augment.mixup_cutmix(jax.random.key(n), images[0], images[1], mixup, cutmix,
                                         switch_prob=0.5, prob=1.0)
    mixed, weight = np.asarray(mixed), float(weight)
    weights.append(weight)
    if cutmix:
      other = np.all(mixed == np.asarray(images[1]), axis=-1)
      assert np.all(other | np.all(mixed == np.asarray(images[0]), axis=-1))
      assert other.mean() == pytest.approx(1 - weight, abs=1e-6)
      rows, cols = np.nonzero(other)
      if len(rows):  # a rectangle: its bounding box is all the other's
        assert other[rows.min():rows.max() + 1, cols.min():cols.max() + 1].all()
        boxes += 1
    else:
      np.testing.assert_allclose(mixed, weight * images[0] + (1 - weight) * images[1], atol=1e-6)
  # Beta(a, a): a mean of 1/2; CutMix's boxes clipped at the edges leave more of the image
  low, high = (0.5, 0.85) if cutmix else (0.3, 0.7)
  assert len(set(weights)) > (15 if cutmix else 60) and low < np.mean(weights) < high
  assert not cutmix or boxes > 40
  _, unmixed = augment.mixup_cutmix(jax.random.key(0), images[0], images[1], mixup, cutmix, 0.5,
                                    prob=0.0)
  assert float(unmixed) == 1.0


@pytest.mark.parametrize("real", [20, 21])
def test_the_step_mixes_real_examples_only_and_its_loss_is_timms_mixed_targets(tiny_config, real):
  """A batch of 20 (or 21) real examples and the rest padding (white, where the real ones are
  darker): each real example mixed with its real neighbour (the 21st, beside padding, alone), none
  with the padding; the step's summed loss is the cross-entropy of timm's targets (w x
  smooth(label) + (1 - w) x smooth(the partner's label)) over the real examples, computed here
  by hand from the mixed images, and the padding's loss is left out."""
  config = mixing(tiny_config)
  config.label_smoothing, config.augment_max_shift = 0.1, 0
  batch = batches([real])[0]
  batch["image"] = (batch["image"] // 2).astype(np.uint8)
  batch["image"][real:] = 255
  config = plan.resolved(config)
  recipe = plan.make_plan(config).recipe
  model = create_model(config, (8, 8, 1), 10, nnx.Rngs(0))
  model.eval()  # (the tiny model's dropout off: the hand's forward pass is the step's)
  seen = {}

  def capture(images_BHWC, labels_B, mask_B, keys_B, config):
    seen["mixed"] = recipe_mix(images_BHWC, labels_B, mask_B, keys_B, config)
    return seen["mixed"]

  recipe_mix = recipe.mix
  recipe.mix = capture
  try:
    loss_sum, metrics = steps.loss_and_metrics(model, batch, config, recipe,
                                               plan.make_plan(config).metrics.train_loss)
  finally:
    recipe.mix = recipe_mix
  mixed_BHWC, other_labels_B, weight_B = (np.asarray(x) for x in seen["mixed"])
  partner_B = np.arange(64) ^ 1
  np.testing.assert_array_equal(other_labels_B, batch["label"][partner_B])
  assert np.all(weight_B[20:] == 1) and np.all(mixed_BHWC[20:] == np.where(
      np.arange(64)[20:, None, None, None] < real,
      batch["image"][20:].astype(np.float32) / np.float32(255), 1.0))  # (alone)
  assert mixed_BHWC[:20].max() < 0.51  # no real example took a pixel of the (white) padding
  assert 0 < weight_B[:20].min() and weight_B[:20].max() <= 1 and len(set(weight_B[:20])) > 10
  logits_BK = model(jnp.asarray(mixed_BHWC))
  smooth = lambda labels: optax.smooth_labels(jax.nn.one_hot(labels, 10), 0.1)  # noqa: E731
  targets_BK = (weight_B[:, None] * smooth(batch["label"])
                + (1 - weight_B[:, None]) * smooth(batch["label"][partner_B]))
  by_hand = optax.softmax_cross_entropy(logits_BK, targets_BK)[:real].sum()
  assert float(loss_sum) == pytest.approx(float(by_hand), rel=1e-5)
  assert int(metrics.loss.count) == real


def test_mixing_trains_alike_on_spmd_fsdp_pmap_and_one_device(tiny_config):
  """Mixup and CutMix on, batches with padding (20 real of 64), two steps a call: every path
  pairs and draws as one device does (neighbours lie on one device; each draw is keyed by its
  example's place in the stream)."""
  config = mixing(tiny_config)
  config.fsdp_min_size = 0
  data = batches([64, 20, 64])
  single, single_metrics = run(config, "single", data)
  spmd, spmd_metrics = run(config, "spmd", data, k=2)
  fsdp, _ = run(config, "fsdp", data, k=2)
  assert_trees_close(spmd, single, atol=1e-6)
  assert_trees_close(fsdp, single, atol=1e-6)
  assert spmd_metrics["examples"] == single_metrics["examples"] == 148
  assert spmd_metrics["loss"] == pytest.approx(single_metrics["loss"], abs=1e-6)
  unmixed, unmixed_metrics = run(mixing(config, 0.0, 0.0), "single", data)
  assert abs(unmixed_metrics["loss"] - single_metrics["loss"]) > 1e-3  # (it did mix)
  pmap, pmap_metrics = run(mixing(config), "pmap", data, k=2)
  assert_trees_close(pmap, single, atol=1e-6)
  assert pmap_metrics["loss"] == pytest.approx(single_metrics["loss"], abs=1e-6)
