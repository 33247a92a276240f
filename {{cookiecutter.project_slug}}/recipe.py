"""The recipe: how the model (model.py) is trained. Change it freely: the loss of one example,
the augmentation, the metrics, the optimizer and its learning rate live here, and nowhere else.

The machinery (training/steps.py) calls these and keeps what must stay exact whatever they
compute: it leaves the padding of partial batches out, sums over the global batch, divides by
the number of real examples, and skips a step whose loss or gradient is not finite. Each
function gets the whole config (frozen): a key you add to configs/default.py is read here as
`config.your_key`, with nothing to pass on. `config.recipe` names this module (the tests name
their own copy of it, as they do of model.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from clu import metrics

from {{cookiecutter.project_slug}}.data import augment as augmentations
from {{cookiecutter.project_slug}}.errors import ConfigError


def loss(logits_BK, labels_B, config, train: bool) -> jax.Array:
  """Each example's loss.

  Args:
    logits_BK: float32 logits.
    labels_B: integer labels.
    config: the run's config (`label_smoothing`).
    train: training's loss, with `config.label_smoothing` a (targets 1 - a on the label,
      a / classes on every class); else evaluation's (also training's `cross_entropy` metric),
      the plain cross-entropy.
  Returns:
    The losses, float32 `[B]`.
  """
  if train and config.label_smoothing:
    targets_BK = optax.smooth_labels(jax.nn.one_hot(labels_B, logits_BK.shape[-1]),
                                     config.label_smoothing)
    return optax.softmax_cross_entropy(logits_BK, targets_BK)
  return optax.softmax_cross_entropy_with_integer_labels(logits_BK, labels_B)


def augment(images_BHWC, keys_B, config) -> jax.Array:
  """Training's augmentation of a batch.

  In this order: a random resized crop (`augment_crop`; on the host instead for photos stored
  whole), a horizontal flip of half the images (`augment_flip`), a shift by up to
  `augment_max_shift` pixels each way (zero fill). (`randaugment`: on the host, before.)

  Args:
    images_BHWC: float images, pixels in [0, 1].
    keys_B: one random key an example, made from its place in the data stream alone (so any
      batching, device or process count, and any resume give it the same draw; for a draw of
      your own, fold a number above 3 into it, as the crop folds 1, the flip 2 and `mix` 3).
    config: the run's config.
  Returns:
    The augmented images, of the same shape.
  """
  if config.augment_crop:  # of a fraction of the area and an aspect in the configured ranges
    crop = functools.partial(augmentations.random_resized_crop, scale=config.augment_crop_scale,
                             ratio=config.augment_crop_ratio)
    images_BHWC = jax.vmap(lambda key, image: crop(jax.random.fold_in(key, 1), image))(
        keys_B, images_BHWC)
  if config.augment_flip:
    flips_B = jax.vmap(lambda key: jax.random.bernoulli(jax.random.fold_in(key, 2)))(keys_B)
    images_BHWC = jnp.where(flips_B[:, None, None, None], images_BHWC[:, :, ::-1], images_BHWC)
  if shift := config.augment_max_shift:
    _, height, width, channels = images_BHWC.shape
    # (random bits modulo the offsets: randint less its correction of a bias of ~2^-32)
    shifts_B2 = jax.vmap(lambda key: jax.random.bits(key, (2,)) % (2 * shift + 1))(keys_B)
    shifts_B2 = shifts_B2.astype(jnp.int32)
    padded_BHWC = jnp.pad(images_BHWC, ((0, 0), (shift, shift), (shift, shift), (0, 0)))
    images_BHWC = jax.vmap(lambda image, s: jax.lax.dynamic_slice(
        image, (s[0], s[1], 0), (height, width, channels)))(padded_BHWC, shifts_B2)
  return images_BHWC


def mix(images_BHWC, labels_B, mask_B, keys_B, config):
  """Mixup and CutMix, after `augment` (timm's Mixup: `mixup_alpha`, `cutmix_alpha`, the chance
  `mix_prob` that an image is mixed, `mix_switch_prob` that CutMix is the one, where both are
  on; DeiT's: 0.8, 1.0, 1.0, 0.5), each image drawn by its own key: each real example mixed with
  its neighbour in the batch (rows 2i and 2i + 1, on every path alike: `neighbours`) where that
  is real too; the padding never (nor a real example beside it).

  Returns:
    The images, the partners' labels `[B]` and each example's weight on its own label `[B]`:
    its loss is w x loss(label) + (1 - w) x loss(the partner's) (the step's, which calls this
    where either alpha is set), with label smoothing the cross-entropy of timm's mixed targets.
  """
  mix_pair = functools.partial(
      augmentations.mixup_cutmix, mixup_alpha=config.mixup_alpha,
      cutmix_alpha=config.cutmix_alpha, switch_prob=config.mix_switch_prob, prob=config.mix_prob)
  paired_B = mask_B & augmentations.neighbours(mask_B) & (jnp.arange(len(mask_B)) < len(
      mask_B) - len(mask_B) % 2)  # (an odd count's last row: alone)
  mixed_BHWC, weight_B = jax.vmap(lambda key, image, other, paired: mix_pair(
      jax.random.fold_in(key, 3), image, other, paired=paired))(
          keys_B, images_BHWC, augmentations.neighbours(images_BHWC), paired_B)
  return mixed_BHWC, augmentations.neighbours(labels_B), weight_B


# The metrics, evaluation's and training's: a name and a CLU metric of the step's outputs
# (`loss`, `cross_entropy`, `logits`, `labels` and `mask`, False on padding: a metric must leave
# those out, as CLU's do), each computing a scalar, which the log lines and TensorBoard show.
# Training adds the plain cross_entropy, the norms and the skipped steps (training/metrics.py).
METRICS = dict(loss=metrics.Average.from_output("loss"), accuracy=metrics.Accuracy)


def schedule(config, num_train_steps: int) -> optax.Schedule:
  """The learning rate of update n (n = 0, 1, ...): a linear warmup from 0 to the peak over
  `warmup_steps(config, ...)`, then `config.schedule` over the remaining steps (cosine and
  linear: to 0 at `num_train_steps`)."""
  peak, warmup = peak_learning_rate(config), warmup_steps(config, num_train_steps)
  decay_steps = max(num_train_steps - warmup, 1)
  decays = {"cosine": lambda: optax.cosine_decay_schedule(peak, decay_steps),
            "linear": lambda: optax.linear_schedule(peak, 0.0, decay_steps),
            "constant": lambda: optax.constant_schedule(peak)}
  decay = choose(decays, "schedule", config)()
  if not warmup:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def optimizer(config, num_train_steps: int) -> optax.GradientTransformation:
  """`config.optimizer` at the schedule's rates, after clipping the gradient's global norm to
  `grad_clip_norm` (when > 0). `momentum`: sgd's momentum (0: none), adam's and adamw's b1;
  `nesterov`: Nesterov's momentum (sgd), NAdam (adam, adamw). `weight_decay` acts on the weights
  only (big_vision's rule: the arrays named `kernel`, nnx.Linear's, Conv's and attention's; not
  biases, norms' scales, embeddings, nor arrays of your own named otherwise). adamw's is
  decoupled: optax multiplies it by the learning rate, so a step takes lr x weight_decay x w off
  each weight, as PyTorch's AdamW (0.05-0.1 is usual). adam's and sgd's is L2: weight_decay x w is
  added to the gradient, as PyTorch's `weight_decay` (1e-4-5e-4 is usual with sgd).
  `mu_dtype` (bfloat16: half the bytes) holds the first moment; adam's second moment stays
  float32: its update at b2 = 0.999 moves it by 0.1%, under bfloat16's 0.4% resolution."""
  rate, momentum, nesterov = schedule(config, num_train_steps), config.momentum, config.nesterov
  mu = config.get("mu_dtype") or None
  weights = lambda params: jax.tree_util.tree_map_with_path(  # noqa: E731
      lambda path, _: any(getattr(key, "key", None) == "kernel" for key in path), params)
  l2 = [optax.add_decayed_weights(config.weight_decay, mask=weights)] if config.weight_decay else []
  optimizers = {
      "adam": lambda: [*l2, optax.adam(rate, b1=momentum, nesterov=nesterov, mu_dtype=mu)],
      "adamw": lambda: [optax.adamw(rate, b1=momentum, weight_decay=config.weight_decay,
                                    mask=weights, nesterov=nesterov, mu_dtype=mu)],
      "sgd": lambda: [*l2, optax.sgd(rate, momentum=momentum or None, nesterov=nesterov,
                                     accumulator_dtype=mu)]}
  chain = choose(optimizers, "optimizer", config)()
  if config.grad_clip_norm:
    chain.insert(0, optax.clip_by_global_norm(config.grad_clip_norm))
  if (config.head_lr_multiplier != 1 or config.freeze_backbone
      or config.layer_decay not in (0, 1)):
    def init(params):  # (the parts the factors name, checked as the state is built)
      learning_rate_factors(params, config)
      return optax.EmptyState()

    chain.append(optax.GradientTransformation(init, lambda updates, state, params=None: (
        jax.tree.map(lambda u, f: u * f.astype(u.dtype), updates,
                     learning_rate_factors(updates, config)), state)))
  return optax.chain(*chain) if len(chain) > 1 else chain[0]


def learning_rate_factors(params, config):
  """Each parameter's factor on the learning rate (fine-tuning: configs/finetune.py), as NumPy
  arrays that broadcast against it: `head_lr_multiplier` on the head's (the arrays under an
  attribute named `head`); with `freeze_backbone`, 0 on every other; else with `layer_decay` d
  (BEiT's layer-wise decay, for ViTs) d^(L - i) on block i of L (under `blocks`: stacked on
  their first axis, as vit.py's, or numbered), d^(L + 1) on the embeddings and the stem (names
  holding `embed` or `stem`), 1 on the rest (the last norm). A model without the part that an
  option names raises ConfigError."""
  def names(path):
    return [getattr(key, "key", getattr(key, "name", None)) for key in path]

  paths = [(names(path), x) for path, x in jax.tree_util.tree_leaves_with_path(params)]
  blocks = [(n, x) for n, x in paths if n[0] == "blocks" and len(n) > 1]
  stacked = any(isinstance(n[1], str) for n, _ in blocks)
  depth = max([x.shape[0] if stacked else n[1] + 1 for n, x in blocks] or [0])
  decay = config.layer_decay or 1.0
  if (config.head_lr_multiplier != 1 or config.freeze_backbone) and not any(
      "head" in n for n, _ in paths):
    raise ConfigError("config.head_lr_multiplier and freeze_backbone act on the classifier, the "
                      "arrays under an attribute named `head`, which this model has none of; "
                      "name its classifier `self.head` (as model.py's and vit.py's).")
  if decay != 1 and not depth:
    raise ConfigError(f"config.layer_decay={config.layer_decay} decays the rates of the blocks, "
                      "the arrays under an attribute named `blocks` (vit.py's), which this model "
                      "has none of; name them so, or 0 turns it off.")

  def factor(path, x):
    path = names(path)
    if "head" in path:
      return np.asarray(config.head_lr_multiplier)
    if config.freeze_backbone:
      return np.asarray(0.0)
    if path[0] == "blocks" and stacked:  # [depth, ...]: a factor a block
      return (decay ** (depth - np.arange(depth))).reshape(-1, *[1] * (x.ndim - 1))
    if path[0] == "blocks":
      return np.asarray(decay ** (depth - path[1]))
    return np.asarray(decay ** (depth + 1) if any(w in str(path[0]) for w in ("embed", "stem"))
                      else 1.0)

  return jax.tree_util.tree_map_with_path(factor, params)


def peak_learning_rate(config) -> float:
  """`config.learning_rate`, scaled by the global batch over `config.base_batch_size`."""
  ratio = config.run.global_batch_size / config.base_batch_size
  scalings = {"none": 1.0, "linear": ratio, "sqrt": ratio**0.5}
  return config.learning_rate * choose(scalings, "lr_scaling", config)


def warmup_steps(config, num_train_steps: int) -> int:
  """`config.warmup_steps`, or `config.warmup_epochs` of the run's steps."""
  return config.warmup_steps or round(config.warmup_epochs * num_train_steps / config.num_epochs)


def choose(choices: dict, key: str, config):
  """`choices[config[key]]`; a name not among them is refused (before anything runs: rules.py).

  Args:
    choices: the choices, by name.
    key: the config's key that names one.
    config: the run's config.
  Returns:
    The choice named.
  """
  if config[key] not in choices:
    raise ConfigError(f"config.{key}={config[key]!r} is unknown; use one of {tuple(choices)}.")
  return choices[config[key]]
