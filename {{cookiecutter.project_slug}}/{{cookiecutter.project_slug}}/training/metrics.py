"""The metrics that the steps merge: CLU collections summed over real examples only (padding is
masked out), merged across steps, devices and processes, and computed on the host."""

import functools
from typing import NamedTuple

import flax
import jax
import jax.numpy as jnp
from clu import metrics


@flax.struct.dataclass
class NonFinite(metrics.Metric):
  """Training steps with a non-finite loss or gradient (their updates were not applied): how
  many of the merged steps, and the index among them of the first, or -1. Steps without a
  real example are not counted. A step's (`steps.train_step`): steps 1 (0 without a real
  example), count 1 if it was not finite, first 0 if so."""

  steps: jax.Array
  count: jax.Array
  first: jax.Array

  @classmethod
  def empty(cls):
    return cls(steps=jnp.array(0), count=jnp.array(0), first=jnp.array(-1))

  def merge(self, other):
    first = jnp.where(self.first >= 0, self.first,
                      jnp.where(other.first >= 0, self.steps + other.first, -1))
    return type(self)(self.steps + other.steps, self.count + other.count, first)

  def compute(self):
    return self.count


class Collections(NamedTuple):
  """The metric collections of a recipe: evaluation's, the forward pass's in training, and
  training's whole (`train_step`'s)."""

  eval: type[metrics.Collection]  # the recipe's METRICS
  train_loss: type[metrics.Collection]  # and `cross_entropy`: the loss of evaluation, to compare
  train: type[metrics.Collection]  # and the skipped steps and the global norms (below)
  confusion: functools.partial  # num_classes -> eval's and the confusion matrix (`with_confusion`)


@functools.cache
def of(recipe, weighted: bool = False) -> Collections:
  """The collections of `recipe` (the run's recipe module: one set per recipe, made once).
  Training's adds to its METRICS the plain cross-entropy (when a smoothed loss is optimised, the
  loss of evaluation to compare with), the steps skipped, and the global norms (big_vision's) of
  the gradient (before any clipping), of the parameters and of the update as applied, averaged
  over the steps that applied theirs (`steps.train_step`); `weighted` (class weights), the mean
  weight of the examples (`weight`: its sum is the step's divisor)."""
  fields = recipe.METRICS
  train_loss = dict(fields, cross_entropy=metrics.Average.from_output("cross_entropy"),
                    **({"weight": metrics.Average.from_output("weight")} if weighted else {}))
  return Collections(
      eval=metrics.Collection.create(**fields),
      train_loss=metrics.Collection.create(**train_loss),
      train=metrics.Collection.create(**train_loss, nonfinite_steps=NonFinite,
                                      l2_grads=metrics.Average, l2_params=metrics.Average,
                                      l2_updates=metrics.Average),
      confusion=functools.partial(with_confusion, recipe))


def with_confusion(recipe, num_classes: int) -> type[metrics.Collection]:
  """Evaluation's metrics and the confusion matrix: counts of real examples `[true class,
  predicted class]`."""

  @flax.struct.dataclass
  class Confusion(metrics.Metric):
    counts: jax.Array

    @classmethod
    def empty(cls):
      return cls(jnp.zeros((num_classes, num_classes), jnp.int32))

    @classmethod
    def from_model_output(cls, logits, labels, mask, **_):
      predicted = jnp.argmax(logits, axis=-1)
      return cls(cls.empty().counts.at[labels, predicted].add(mask.astype(jnp.int32)))

    def merge(self, other):
      return type(self)(self.counts + other.counts)

    def compute(self):
      return self.counts

  return metrics.Collection.create(**of(recipe).eval.__annotations__, confusion=Confusion)
