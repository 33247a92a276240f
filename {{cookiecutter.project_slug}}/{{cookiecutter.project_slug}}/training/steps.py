"""The train and eval steps on one batch, as the math: the forward pass, the masked loss, the
gradient over the real examples, the update, the metrics. No backend, no parallelism here:
dispatch.py composes them for each (a backend's forms: backends/; pmap: pmap.on_devices;
photos' crops resized first) and compiles them, k a call.

A batch: image [B, H, W, C] (the stored dtype, or float32 where dispatch.py resized photos'
crops first), label [B], mask [B] (False on padding), position [B] (each example's place in the
stream: it keys the augmentation). Suffixes name axes: B the batch, H, W, C an image's, K the
classes. A batch of padding alone changes nothing."""

import functools

import jax
import jax.numpy as jnp
from clu import metrics as clu_metrics
from flax import nnx

from .. import layers
from .metrics import NonFinite


def mask_warning(model) -> str | None:
  """A warning for a model holding a BatchNorm that the mask cannot reach (not layers.BatchNorm,
  which `layers.masked` makes of a plain nnx.BatchNorm), else None."""
  if layers.takes_mask(type(model)) or not (unmasked := layers.unmasked(model)):
    return None
  return (f"warning: {type(model).__name__} holds {', '.join(unmasked)}, whose batch statistics "
          "include the padding of partial batches; make it layers.BatchNorm, or give __call__ "
          "an example_mask=None parameter and pass it on (model.py's docstring)")


# Folded into the seed's key before the stream positions: the augmentation keys are then none of
# the keys that `nnx.Rngs(seed)` hands out (fold_in(key(seed), n), n = 0, 1, ...).
AUGMENT_STREAM = 0x61756720  # b"aug "


def forward(model, batch, config, augment=None) -> jax.Array:
  """The model's float32 logits `[B, K]` of a batch's pixels as float32 (integers / 255),
  augmented, normalised where `config.run.input_mean` is set (pretrained weights' statistics).

  Each example's augmentation key comes from the seed and its place in the stream alone (any
  batching, device or process count, or resume draws the same). The mask reaches every
  layers.BatchNorm (`layers.BATCH_MASK`), and the model when it takes one.

  Args:
    model: the model, in train or eval mode.
    batch: one batch (the module's docstring).
    config: the run's config (its seed keys the augmentation).
    augment: the recipe's `augment`, in training; None: the images as they are.
  """
  images_BHWC = batch["image"].astype(jnp.float32)
  if jnp.issubdtype(batch["image"].dtype, jnp.integer):
    images_BHWC = images_BHWC / 255.0
  if augment is not None:
    with jax.ensure_compile_time_eval():  # (a constant of the program: one hash fewer in it)
      key = jax.random.fold_in(jax.random.key(config.seed), AUGMENT_STREAM)
    keys_B = jax.vmap(lambda position: jax.random.fold_in(key, position))(batch["position"])
    images_BHWC = augment(images_BHWC, keys_B, config)
  if config is not None and config.get("run", {}).get("input_mean"):  # (x - mean) / std
    mean_C, std_C = (jnp.asarray(config.run[key]) for key in ("input_mean", "input_std"))
    if images_BHWC.shape[-1] != mean_C.shape[0]:  # gray images, RGB statistics: their mean
      mean_C, std_C = mean_C.mean(keepdims=True), std_C.mean(keepdims=True)
    images_BHWC = (images_BHWC - mean_C) / std_C
  masked = {"example_mask": batch["mask"]} if layers.takes_mask(type(model)) else {}
  token = layers.BATCH_MASK.set(batch.get("mask"))  # every layers.BatchNorm's, unless given one
  try:
    return model(images_BHWC, **masked).astype(jnp.float32)
  finally:
    layers.BATCH_MASK.reset(token)


def loss_and_metrics(model, batch, config, recipe, collection, train: bool = True):
  """The float32 sum of a batch's real examples' losses (normalised later by the global count),
  and `collection` of their metrics; the padding's losses are masked out, whatever they are.

  Args:
    model: the model.
    batch: one batch (the module's docstring).
    config: the run's config.
    recipe: the recipe module (its `loss` and `augment`).
    collection: the CLU collection class of the metrics.
    train: whether the images are augmented and the loss is training's.
  """
  augment, mixed = recipe.augment if train else None, []  # (mixed: the partners' labels, weights)
  if train and (config.get("mixup_alpha") or config.get("cutmix_alpha")):  # then recipe.mix

    def augment(images_BHWC, keys_B, config):
      images_BHWC, *pairs = recipe.mix(recipe.augment(images_BHWC, keys_B, config),
                                       batch["label"], batch["mask"], keys_B, config)
      mixed.extend(pairs)
      return images_BHWC

  logits_BK = forward(model, batch, config, augment)
  cross_entropy_B = recipe.loss(logits_BK, batch["label"], config, train=False)
  losses_B = (recipe.loss(logits_BK, batch["label"], config, train=True) if train
              else cross_entropy_B)
  if mixed:  # w x loss(label) + (1 - w) x loss(the partner's)
    other_labels_B, weight_B = mixed
    losses_B = weight_B * losses_B + (1 - weight_B) * recipe.loss(
        logits_BK, other_labels_B, config, train=True)
  weights = {}  # class weights: each loss times its class's (train_step divides by their sum)
  if train and config.get("run", {}).get("class_weights"):
    weights["weight"] = jnp.asarray(config.run.class_weights, jnp.float32)[batch["label"]]
    losses_B = losses_B * weights["weight"]
  loss_sum = jnp.sum(jnp.where(batch["mask"], losses_B, 0.0))
  step_metrics = collection.single_from_model_output(
      loss=losses_B, cross_entropy=cross_entropy_B, logits=logits_BK, labels=batch["label"],
      mask=batch["mask"], **weights)
  return loss_sum, step_metrics


def micro_batches(batch, num: int):
  """`[batch, ...]` -> `[num, batch // num, ...]`, micro-batch j holding examples j, j + num, ...
  (every device an equal share of each)."""
  return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, num, *x.shape[1:]), 0, 1), batch)


def accumulated_gradients(grad_fn, model, batch, num_micro_batches: int, sum_devices=None):
  """`grad_fn`'s gradient and metrics summed over a batch's pieces, in one loop (accumulation).

  A piece without a real example (over all devices under pmap) adds nothing and leaves the
  model's state (BatchNorm statistics, RNG counters) as it was. Each piece's sums are summed over
  the devices before the pieces are added up, the order in which XLA sums spmd's: the two agree
  to the bit (summed after, they part by rounding, which training amplifies).

  Args:
    grad_fn: (model, batch) -> (the gradient of the summed loss, metrics).
    model: the model; its state is left as the last piece with a real example left it.
    batch: one batch (the module's docstring).
    num_micro_batches: the number of pieces (`micro_batches`).
    sum_devices: pmap's sum over the devices; None where the arrays are global (jit).
  """
  micro = micro_batches(batch, num_micro_batches)
  # A forward pass changes BatchNorm's statistics and the RNG counters, never the parameters:
  # only that part of the model is carried from micro-batch to micro-batch.
  changes = nnx.Not(nnx.Param)
  graphdef, params, changing = nnx.split(model, nnx.Param, changes)

  def add_micro_batch(carry, micro_batch):
    changing, sums = carry
    model = nnx.merge(graphdef, params, changing, copy=True)  # `changing` stays as it was
    grads_and_metrics = grad_fn(model, micro_batch)
    real = jnp.sum(micro_batch["mask"], dtype=jnp.int32)
    if sum_devices is not None:  # summed over the devices micro-batch by micro-batch, as spmd's
      real, grads_and_metrics = sum_devices((real, grads_and_metrics))
    keep = lambda new, old: jnp.where(real > 0, new, old)  # noqa: E731
    sums = jax.tree.map(lambda total, x: total + keep(x, jnp.zeros_like(x)), sums,
                        grads_and_metrics)
    return (jax.tree.map(keep, nnx.state(model, changes), changing), sums), None

  first = jax.tree.map(lambda x: x[0], micro)
  shapes = jax.eval_shape(lambda changing, batch: grad_fn(
      nnx.merge(graphdef, params, changing, copy=True), batch), changing, first)
  zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
  (changing, sums), _ = jax.lax.scan(add_micro_batch, (changing, zeros), micro)
  nnx.update(model, changing)
  return sums


def sum_of_squares(tree) -> jax.Array:
  """The gradient's squared global norm, in float32: one reduction a leaf (gpu.py's: one)."""
  return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))


def state_sums_of_squares(updates, params) -> tuple:
  """The squared global norms of an update and of the parameters it made (gpu.py's: its own)."""
  return sum_of_squares(updates), sum_of_squares(params)


def update_if(applied, update, current, old):
  """`update(current)` (-> (updated state, (the update's squared norm, _))) where the boolean
  `applied`, else `old`, leaf by leaf: no conditional to wait on (cpu.py's: lax.cond). Returns
  the state kept and (the update's squared norm, the kept parameters'): read from the state kept,
  a TPU's program is smallest (aot.py: 2,475 kernels a v5e:2x4 ResNet-50 step, not 2,552)."""
  updated, (updates_squared, _) = update(current)
  kept = jax.tree.map(lambda new, old: jnp.where(applied, new, old), updated, old)
  return kept, (updates_squared, sum_of_squares(nnx.filter_state(kept[0], nnx.Param)))


AVERAGED = (nnx.Param, nnx.BatchStat)  # what the moving average averages: BatchNorm's stats too


def train_step(graphdef, state, running, batch, *, config, recipe, collection, sum_devices=None):
  """One train-mode step on the real examples' mean loss, and the moving average (none where it
  is not finite or the batch is padding alone); returns the new state and `running` merged.

  Args:
    graphdef, state: the split (model, optimizer[, average]).
    running, batch: the training metrics so far; one batch (the module's docstring).
    config, recipe, collection: `dispatch.step_options`.
    sum_devices: pmap's sum over the devices of their shares; None where arrays are global (jit).
  """
  model, optimizer, *average = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
  model.train()
  if config.get("freeze_batch_norm"):  # BatchNorm on its running statistics, left as they are
    model.set_attributes(nnx.BatchNorm, use_running_average=True, raise_if_not_found=False)
  grads, step_metrics = gradients(model, batch, config, recipe, collection, sum_devices)
  weights = getattr(step_metrics, "weight", None)  # (class weights: the mean over their sum)
  count = step_metrics.loss.count if weights is None else weights.total
  grads_squared = sum_of_squares(grads)
  # Not finite where an entry of the gradient is not (or overflows float32: beyond 1e19).
  finite = jnp.isfinite(step_metrics.loss.total) & jnp.isfinite(grads_squared)

  def update(current):  # the optimizer step on the state as the forward pass left it
    model, optimizer, *average = nnx.merge(graphdef, current)
    n = optimizer.step[...].astype(jnp.float32)  # the updates before this one
    updates = optimizer.update(model, jax.tree.map(lambda g: g / jnp.maximum(count, 1), grads))
    for ema in average:  # (config.ema_decay's)
      move_average(ema, model, n, config)
    return (nnx.state((model, optimizer, *average)),
            state_sums_of_squares(updates, nnx.state(model, nnx.Param)))

  new_state, squares = update_if(finite & (count > 0), update,
                                 nnx.state((model, optimizer, *average)), state)
  return new_state, running.merge(step_summary(type(running), step_metrics, finite,
                                               (grads_squared, *squares)))


def gradients(model, batch, config, recipe, collection, sum_devices=None):
  """The gradient of a batch's summed loss and the forward pass's metrics (`collection`), over
  every device (`sum_devices`: pmap's sum; None where the arrays are global, jit): the `model`
  in train mode, with `grad_accum_steps` > 1 accumulated over that many pieces."""
  grad_fn = nnx.grad(functools.partial(loss_and_metrics, config=config, recipe=recipe,
                                       collection=collection), has_aux=True)
  if config.grad_accum_steps > 1:
    return accumulated_gradients(grad_fn, model, batch, config.grad_accum_steps, sum_devices)
  grads_and_metrics = grad_fn(model, batch)
  return grads_and_metrics if sum_devices is None else sum_devices(grads_and_metrics)


def move_average(ema, model, n, config) -> None:
  """Moves `ema` (a copy of the model: its `AVERAGED` variables) towards `model`'s after the
  update, in place, by 1 - `config.ema_decay`, or with `ema_warmup` by 1 - min(`ema_decay`,
  (1 + n) / (10 + n)), n the updates before this one."""
  decay = config.ema_decay
  if config.ema_warmup:
    decay = jnp.minimum(decay, (1 + n) / (10 + n))
  nnx.update(ema, jax.tree.map(lambda e, m: decay * e + (1 - decay) * m.astype(e.dtype),
                               nnx.state(ema, AVERAGED), nnx.state(model, AVERAGED)))


def step_summary(train_metrics, step_metrics, finite, squares):
  """A training step's metrics: the forward pass's, the non-finite count (padding alone: not
  counted), the norms (averaged over the steps that applied theirs).

  Args:
    train_metrics: the collection class (`metrics.Collections.train`).
    step_metrics: the forward pass's metrics.
    finite: whether the step was finite.
    squares: the squared global norms of the summed gradient (unclipped), update, parameters.
  """
  count = step_metrics.loss.count
  real = count > 0
  applied, bad = finite & real, real & ~finite
  grads, updates, params = (jnp.sqrt(s) for s in squares)
  norms = dict(l2_grads=grads / jnp.maximum(count, 1), l2_params=params, l2_updates=updates)
  return train_metrics(
      **vars(step_metrics), nonfinite_steps=NonFinite(
          steps=jnp.where(real, 1, 0), count=jnp.where(bad, 1, 0), first=jnp.where(bad, 0, -1)),
      **{name: clu_metrics.Average(total=jnp.where(applied, norm, 0.0),
                                   count=applied.astype(jnp.int32))
         for name, norm in norms.items()})


def eval_step(graphdef, state, running, batch, *, config, recipe, sum_devices=None):
  """`running` merged with the eval metrics of one batch.

  Args:
    graphdef: the graph of (model, optimizer), (model,) or (model, optimizer, average).
    state: their state; the moving average is evaluated where there is one, else the model.
    running: the eval metrics so far.
    batch: one batch (the module's docstring).
    config: the run's config.
    recipe: the recipe module.
    sum_devices: as train_step's.
  """
  objects = nnx.merge(graphdef, state)
  model = objects[2] if len(objects) > 2 else objects[0]
  model.eval()
  _, step_metrics = loss_and_metrics(model, batch, config, recipe, type(running), train=False)
  return running.merge(step_metrics if sum_devices is None else sum_devices(step_metrics))


def probabilities(graphdef, state, images_BHWC, mask_B=None, config=None) -> jax.Array:
  """Class probabilities (float32 `[B, K]`) of stored images, as evaluation computes the logits.

  Args:
    graphdef: the model's graph.
    state: its state.
    images_BHWC: images as stored.
    mask_B: False on padding (given to a model that takes a mask); None: all real.
    config: the run's config (its input's normalisation); None: none.
  """
  model = nnx.merge(graphdef, state)
  model.eval()
  mask_B = jnp.ones(images_BHWC.shape[:1], bool) if mask_B is None else mask_B
  logits_BK = forward(model, {"image": images_BHWC, "mask": mask_B}, config)
  return jax.nn.softmax(logits_BK, axis=-1)
