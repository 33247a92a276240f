"""Fine-tuning (`config.init_from`): a new run whose model starts as another run's latest
checkpoint, or as pretrained weights (pretrained.py)."""

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx

from ..errors import ConfigError
from .checkpoints import absolute, checkpoint_manager, shapes
from .damaged import damage, leaf_name


def init_from(source: str, abstract, init, run=None, image_shape=()):
  """Fine-tuning: a function like `init` whose model parameters and batch statistics are those of
  a run's latest checkpoint (its moving average's, when it kept one); the optimizer is fresh.
  Leaves of another shape (a classifier for other classes) stay fresh and are logged; a leaf
  absent on either side raises ConfigError before anything is read.

  Args:
    source: the run's workdir (`config.init_from`), or pretrained weights (pretrained.py).
    abstract: the state's abstract value.
    init: builds the state.
    run, image_shape: pretrained weights': `config.run` (the input's statistics) and the
      images' [H, W, C] (said where they differ from the weights').
  """
  from . import pretrained  # (its own reading: a file of weights, or the Hub's)

  if pretrained.is_weights(source):
    return pretrained.init_from(source, abstract, init, run, image_shape)
  checkpoints = checkpoint_manager(absolute(source), create=False)
  step = checkpoints.latest_step()
  if step is None:
    raise ConfigError(f"config.init_from={source!r} holds no checkpoint yet.")
  there = shapes(checkpoints.item_metadata(step)["state"])
  # The model's leaves (0/; 1/: the optimizer's), or its moving average's (2/), named as ours.
  prefix = "2/" if any(name.startswith("2/") for name in there) else "0/"
  saved = {"0/" + n[2:]: s for n, s in there.items() if n.startswith(prefix)}
  ours = {n: s for n, s in shapes(abstract).items() if n.startswith("0/")}
  for name in sorted(saved.keys() ^ ours.keys()):
    there = "in the checkpoint but not in this model" if name in saved else (
        "in this model but not in the checkpoint")
    raise ConfigError(f"config.init_from={source!r}: {name.removesuffix('/value')[2:]} is "
                      f"{there} (a missing or extra layer); only the shapes of leaves may "
                      "differ.")
  learned = {name for path, v in jax.tree_util.tree_leaves_with_path(
      abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
      if isinstance(v, (nnx.Param, nnx.BatchStat))
      and (name := f"{leaf_name(path)}/value").startswith("0/")}
  fresh = sorted(name for name in learned if saved[name] != ours[name])
  logging.info("Fine-tuning from step %d of %s%s%s", step, source,
               " (its moving average)" if prefix == "2/" else "", "; initialised afresh "
               "(another shape): " + ", ".join(f"{n.removesuffix('/value')[2:]} {saved[n]} -> "
                                               f"{ours[n]}" for n in fresh) if fresh else "")
  copied = learned - set(fresh)
  targets = {leaf_name(path): x for path, x in jax.tree_util.tree_leaves_with_path(abstract)}

  def build():
    item, restore_args = {}, {}
    for name in copied:  # nested dicts of the leaves to read, each into its shards
      target = targets[name]
      *parents, last = (prefix + name[2:]).split("/")
      node, args = item, restore_args
      for key in parents:
        node, args = node.setdefault(key, {}), args.setdefault(key, {})
      node[last] = target
      args[last] = ocp.ArrayRestoreArgs(sharding=target.sharding, global_shape=target.shape,
                                        dtype=target.dtype)
    read, why = damage(lambda s: checkpoints.restore(s, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item, restore_args=restore_args, partial_restore=True))
    )["state"], step)
    if why is not None:
      raise ConfigError(f"config.init_from={source!r}: its checkpoint {step} {why}; start from "
                        "an intact run.")

    def take(path, x):
      name = leaf_name(path)
      if name.startswith("2/"):  # the moving average (config.ema_decay) starts as the model
        name = "0/" + name[2:]
      if name not in copied:
        return x
      leaf = read
      for key in (prefix + name[2:]).split("/"):
        leaf = leaf[key]
      return jnp.array(leaf, x.dtype)  # its own buffer (the model and its average: two)

    return jax.tree_util.tree_map_with_path(take, init())

  return build
