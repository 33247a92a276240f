"""The metrics that the steps merge: CLU collections summed over real examples only (padding is
masked out), merged across steps, devices and processes, and computed on the host."""

import flax
import jax
import jax.numpy as jnp
from clu import metrics


@flax.struct.dataclass
class Metrics(metrics.Collection):
  """Sums over real examples only (padding is masked out), merged across steps and devices."""

  loss: metrics.Average.from_output("loss")
  accuracy: metrics.Accuracy


@flax.struct.dataclass
class TrainLoss(metrics.Collection):
  """Training's: `loss` is the loss optimised (with label smoothing, when on) and
  `cross_entropy` the plain cross-entropy of the labels: evaluation's loss, to compare with."""

  loss: metrics.Average.from_output("loss")
  cross_entropy: metrics.Average.from_output("cross_entropy")
  accuracy: metrics.Accuracy


@flax.struct.dataclass
class NonFinite(metrics.Metric):
  """Training steps with a non-finite loss or gradient (their updates were not applied): how
  many of the merged steps, and the index among them of the first, or -1. Steps without a
  real example are not counted."""

  steps: jax.Array
  count: jax.Array
  first: jax.Array

  @classmethod
  def empty(cls):
    return cls(steps=jnp.array(0), count=jnp.array(0), first=jnp.array(-1))

  @classmethod
  def from_step(cls, finite, real=True):
    bad = real & ~finite
    return cls(steps=jnp.where(real, 1, 0), count=jnp.where(bad, 1, 0),
               first=jnp.where(bad, 0, -1))

  def merge(self, other):
    first = jnp.where(self.first >= 0, self.first,
                      jnp.where(other.first >= 0, self.steps + other.first, -1))
    return type(self)(self.steps + other.steps, self.count + other.count, first)

  def compute(self):
    return self.count


@flax.struct.dataclass
class StepAverage(metrics.Average):
  """The mean of a value over the merged steps that applied their update."""

  @classmethod
  def from_step(cls, value, applied):
    return cls(total=jnp.where(applied, value, 0.0).astype(jnp.float32),
               count=applied.astype(jnp.int32))


@flax.struct.dataclass
class TrainMetrics(metrics.Collection):
  """Metrics, the steps that were skipped, and the global norms (big_vision's) of the
  gradient (before any clipping), of the parameters and of the update as applied (their change),
  averaged over the steps that applied theirs. (CLU reads only a class's own fields.)"""

  loss: metrics.Average.from_output("loss")
  cross_entropy: metrics.Average.from_output("cross_entropy")
  accuracy: metrics.Accuracy
  nonfinite_steps: NonFinite
  l2_grads: StepAverage
  l2_params: StepAverage
  l2_updates: StepAverage


def with_confusion(num_classes: int) -> type[metrics.Collection]:
  """Metrics and the confusion matrix: counts of real examples `[true class, predicted class]`."""

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

  @flax.struct.dataclass
  class MetricsWithConfusion(metrics.Collection):
    loss: metrics.Average.from_output("loss")
    accuracy: metrics.Accuracy
    confusion: Confusion

  return MetricsWithConfusion
