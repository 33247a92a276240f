"""The train and eval steps, how each parallelism compiles them, and the evaluation loop.

This module holds the steps on one batch, as the math: the forward pass, the masked loss, the
gradient, the update. dispatch.py compiles them for each parallelism, k a call, and runs the
evaluation loop.

A batch: image [B, H, W, C] (the stored dtype), label [B], mask [B] (False on padding), position
[B] (each example's place in the stream: it keys the augmentation), and box [B, 6] where the
images are photos' crops that the devices resize (`forward`). Suffixes name axes: B the batch,
H, W, C an image's, K the classes. A batch of padding alone changes nothing."""

import functools

import jax
import jax.numpy as jnp
from clu import metrics as clu_metrics
from flax import nnx

from .. import layers
from ..data import augment as augment_ops
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
  """The model's float32 logits `[B, K]` of a batch. Its input: the stored pixels as float32
  (integers divided by 255, floats as they are; photos' crops cut on the host, with a "box",
  resized first to `config.run.image_shape`), in training augmented by `augment` (the
  recipe's) with one key an example, made from the seed and its place in the data stream alone
  (so any batching, device or process count, and any resume draw the same for it). The mask
  (`batch["mask"]`) reaches every layers.BatchNorm (`layers.batch_mask`), and the model when it
  takes one (`takes_mask`)."""
  images_BHWC = batch["image"].astype(jnp.float32)
  if "box" in batch:  # (sources.DatasetInfo.canvas)
    images_BHWC = augment_ops.resize_crops(images_BHWC, batch["box"], config.run.image_shape[:2])
  if jnp.issubdtype(batch["image"].dtype, jnp.integer):
    images_BHWC = images_BHWC / 255.0
  if augment is not None:
    with jax.ensure_compile_time_eval():  # (a constant of the program: one hash fewer in it)
      key = jax.random.fold_in(jax.random.key(config.seed), AUGMENT_STREAM)
    keys_B = jax.vmap(lambda position: jax.random.fold_in(key, position))(batch["position"])
    images_BHWC = augment(images_BHWC, keys_B, config)
  masked = {"example_mask": batch["mask"]} if layers.takes_mask(type(model)) else {}
  with layers.batch_mask(batch.get("mask")):  # (every layers.BatchNorm's, unless given its own)
    return model(images_BHWC, **masked).astype(jnp.float32)


def loss_and_metrics(model, batch, config, recipe, collection, train: bool = True):
  """The SUM of the real examples' losses (the recipe's, in float32; normalised later by the
  global count), and `collection` (a CLU collection's class) of their metrics. In training
  (`train`) the images are augmented and the loss is training's. The recipe's loss of one
  example is the padding's too: masked out here, whatever it is."""
  logits_BK = forward(model, batch, config, recipe.augment if train else None)
  cross_entropy_B = recipe.loss(logits_BK, batch["label"], config, train=False)
  losses_B = (recipe.loss(logits_BK, batch["label"], config, train=True) if train
              else cross_entropy_B)
  loss_sum = jnp.sum(jnp.where(batch["mask"], losses_B, 0.0))
  step_metrics = collection.single_from_model_output(
      loss=losses_B, cross_entropy=cross_entropy_B, logits=logits_BK, labels=batch["label"],
      mask=batch["mask"])
  return loss_sum, step_metrics


def micro_batches(batch, num: int):
  """`[batch, ...]` -> `[num, batch // num, ...]`, micro-batch j holding examples j, j + num, ...
  (every device an equal share of each)."""
  return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, num, *x.shape[1:]), 0, 1), batch)


def accumulated_gradients(grad_fn, model, batch, num_micro_batches: int, axis_name=None):
  """`grad_fn(model, batch)` (the gradient of the summed loss, and metrics), summed over `batch`
  in `num_micro_batches` pieces run in one loop (gradient accumulation). A piece without a real
  example (over all devices under pmap) adds nothing and leaves the model's state (BatchNorm
  statistics, RNG counters) as it was. Under pmap (`axis_name`) the sums are those of every
  device: each piece's summed over the devices before the pieces are added up, the order in which
  XLA sums spmd's, so the two agree to the bit (summed after, they part by rounding, which
  training amplifies)."""
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
    if axis_name is not None:  # summed over the devices micro-batch by micro-batch, as spmd's
      real, grads_and_metrics = jax.lax.psum((real, grads_and_metrics), axis_name)
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


def sum_of_squares(tree, flat: bool = False, carried: bool = True) -> jax.Array:
  """The sum of the squares of every entry of `tree`, in float32: over its leaves laid end to end
  (`flat`: one reduction, where the leaves are whole on each device), or one reduction a leaf
  (fsdp: each leaf split over the devices, never gathered). `carried`: the leaves are the state's
  or its update's (the loop carries them), not the gradient's."""
  leaves = jax.tree.leaves(tree)
  if flat and len(leaves) > 1:
    # The state's read as the update wrote them (the barrier: fused into the update, the
    # concatenation made it write each kernel and momentum twice, and XLA copy the carried ones:
    # 106 copies a step; the gradient's behind it took 55 kernels more), a convolution's kernel
    # ([H, W, in, out]) out-channel major, as the GPU keeps it (read row-major, each took a
    # transposing kernel: 159 a ResNet-50 step).
    laid_out = [jnp.moveaxis(x, -1, 0) if x.ndim == 4 else x
                for x in (jax.lax.optimization_barrier(leaves) if carried else leaves)]
    leaves = [jnp.concatenate([x.astype(jnp.float32).ravel() for x in laid_out])]
  return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)



# What the moving average of the parameters averages: every Param, and BatchNorm's statistics.
AVERAGED = (nnx.Param, nnx.BatchStat)


def train_step(graphdef, state, running, batch, *, config, recipe, collection,
               batch_norm_groups=1, axis_name=None, skip_by="select", norms_of="kept",
               flat_norms=False, batch_norm_one_pass=False, max_pool_by_slices=False):
  """One optimizer step on one batch, in train mode (`model.train()`): returns the state and
  `running` with this step's metrics. The gradient is the real examples' summed over their
  number, both global (`gradients`); a non-finite step or a batch of padding alone leaves the
  state as it was (`update_or_keep`). `skip_by`, `norms_of`, `flat_norms`, `batch_norm_one_pass`,
  `max_pool_by_slices`: the backend's form (dispatch.STEP_FORMS); the other keywords:
  `dispatch.step_options`."""
  old_state = jax.tree.map(lambda x: x, state)  # kept for a step that changes nothing
  model, optimizer, *average = nnx.merge(graphdef, state)
  model.train()
  model.set_attributes(layers.BatchNorm, groups=batch_norm_groups, one_pass=batch_norm_one_pass,
                       raise_if_not_found=False)
  with layers.pooling_by_slices(max_pool_by_slices):
    grads, step_metrics = gradients(model, batch, config, recipe, collection, axis_name)
  count = step_metrics.loss.count
  # One reduction for both: the squared norm of the summed gradient (for the metrics), which
  # is not finite when an entry is not (nor when it overflows float32: a gradient beyond 1e19).
  flat = flat_norms and config.parallelism != "fsdp"  # (fsdp's leaves: never gathered)
  grads_squared = sum_of_squares(grads, flat, carried=False)
  finite = jnp.isfinite(step_metrics.loss.total) & jnp.isfinite(grads_squared)
  real = count > 0

  def update(current):  # the optimizer step, on the state as the forward pass left it
    model, optimizer, *average = nnx.merge(graphdef, current)
    n = optimizer.step[...].astype(jnp.float32)  # the updates before this one
    updates = optimizer.update(model, jax.tree.map(lambda g: g / jnp.maximum(count, 1), grads))
    move_averages(average, model, n, config)
    return nnx.state((model, optimizer, *average)), sum_of_squares(updates, flat)

  new_state, measured, updates_squared = update_or_keep(
      finite & real, update, nnx.state((model, optimizer, *average)), old_state, skip_by,
      norms_of)
  params_squared = sum_of_squares(nnx.state(nnx.merge(graphdef, measured)[0], nnx.Param), flat)
  norms = dict(l2_grads=jnp.sqrt(grads_squared) / jnp.maximum(count, 1),
               l2_params=jnp.sqrt(params_squared), l2_updates=jnp.sqrt(updates_squared))
  return new_state, running.merge(step_summary(type(running), step_metrics, real, finite, norms))


def gradients(model, batch, config, recipe, collection, axis_name=None):
  """The gradient of the batch's summed loss and the forward pass's metrics (`collection`),
  summed over every device (pmap: `axis_name`; spmd sums them itself); with
  `config.grad_accum_steps` > 1 accumulated over that many pieces of the batch. Random layers
  draw one mask over the global batch, by row, on spmd and fsdp; on pmap each device its own
  (`pmap.fold_in_device_index`). BatchNorm takes the global batch's statistics on every path
  (pmap: `pmap.batch_norm_over_devices`)."""
  grad_fn = nnx.grad(functools.partial(loss_and_metrics, config=config, recipe=recipe,
                                       collection=collection), has_aux=True)
  if axis_name is not None:
    from ..parallel import pmap  # (the pmap path alone)

    restore_keys = pmap.fold_in_device_index(model, axis_name)
    pmap.batch_norm_over_devices(model, axis_name)
  if config.grad_accum_steps > 1:
    grads, step_metrics = accumulated_gradients(grad_fn, model, batch, config.grad_accum_steps,
                                                axis_name)
  else:
    grads, step_metrics = grad_fn(model, batch)
    if axis_name is not None:
      grads, step_metrics = jax.lax.psum((grads, step_metrics), axis_name)
  if axis_name is not None:
    restore_keys()
  return grads, step_metrics


def move_averages(average: list, model, n, config) -> None:
  """Moves the moving average (`average`: [] or [the averaged model]) of `AVERAGED` variables
  towards `model`'s by 1 - `ema_decay`, or with `ema_warmup` by 1 - min(`ema_decay`, (1 + n) /
  (10 + n)) at update n (as TensorFlow's)."""
  decay = config.ema_decay
  if config.ema_warmup:
    decay = jnp.minimum(decay, (1 + n) / (10 + n))
  for ema in average:
    nnx.update(ema, jax.tree.map(lambda e, m: decay * e + (1 - decay) * m.astype(e.dtype),
                                 nnx.state(ema, AVERAGED), nnx.state(model, AVERAGED)))


def update_or_keep(applied, update, current, old_state, skip_by: str, norms_of: str):
  """`update(current)` -> (state, squared norm of the update) where `applied`, else `old_state`
  and 0: by selection (`skip_by='select'`: no conditional, which a GPU would sync on) or under
  `lax.cond` ('cond'). Returns the new state, the state whose parameters' norm is reported (the
  new one, `norms_of='kept'`, or the updated one before the choice, 'updated') and the update's
  squared norm."""
  if skip_by == "select":
    updated, updates_squared = update(current)
    new_state = jax.tree.map(lambda new, old: jnp.where(applied, new, old), updated, old_state)
    return new_state, updated if norms_of == "updated" else new_state, updates_squared
  new_state, updates_squared = jax.lax.cond(
      applied, lambda current, _: update(current), lambda _, old: (old, jnp.float32(0)),
      current, old_state)
  return new_state, new_state, updates_squared


def step_summary(train_metrics, step_metrics, real, finite, norms: dict):
  """A training step's metrics (`train_metrics`: `metrics.Collections.train`): the forward
  pass's, whether the step was non-finite (a step of padding alone is not counted), and the
  global norms (the gradient's before clipping), averaged over the steps that applied theirs."""
  applied, bad = finite & real, real & ~finite
  return train_metrics(
      **vars(step_metrics), nonfinite_steps=NonFinite(
          steps=jnp.where(real, 1, 0), count=jnp.where(bad, 1, 0), first=jnp.where(bad, 0, -1)),
      **{name: clu_metrics.Average(total=jnp.where(applied, norm, 0.0),
                                   count=applied.astype(jnp.int32))
         for name, norm in norms.items()})


def eval_step(graphdef, state, running, batch, *, config, recipe, axis_name=None):
  """Metrics of the model: the first object of the state (model, optimizer), (model,) or
  (model, optimizer, average), the moving average in the last."""
  objects = nnx.merge(graphdef, state)
  model = objects[2] if len(objects) > 2 else objects[0]
  model.eval()
  _, step_metrics = loss_and_metrics(model, batch, config, recipe, type(running), train=False)
  if axis_name is not None:
    step_metrics = jax.lax.psum(step_metrics, axis_name)
  return running.merge(step_metrics)


def probabilities(graphdef, state, images_BHWC, mask_B=None) -> jax.Array:
  """Class probabilities (float32 `[batch, classes]`) of stored images, as evaluation computes
  the logits (eval mode, the mask given when the model takes one)."""
  model = nnx.merge(graphdef, state)
  model.eval()
  mask_B = jnp.ones(images_BHWC.shape[:1], bool) if mask_B is None else mask_B
  logits_BK = forward(model, {"image": images_BHWC, "mask": mask_B}, None)
  return jax.nn.softmax(logits_BK, axis=-1)
