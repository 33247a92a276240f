"""FLOPs of the train step, counted in its jaxpr (the matrix products and convolutions, forward
and backward: the same on every backend, whatever the compiler fuses or hands to a library),
and from them FLOP/s and model FLOP utilisation (MFU) against the chips' peak (chips.py)."""

import functools
import math

import jax
import jax.numpy as jnp
from jax.extend import core as jex

from ..parallel import chips
from . import dispatch, steps


def _inner_jaxprs(params):
  for value in params.values():
    for v in value if isinstance(value, tuple) else (value,):
      if isinstance(v, (jex.ClosedJaxpr, jex.Jaxpr)):
        yield v.jaxpr if isinstance(v, jex.ClosedJaxpr) else v


def _flops(jaxpr) -> int:
  """Multiply-adds x 2 of every dot_general and conv_general_dilated in `jaxpr`, counting
  nested jaxprs (a scan's body once per iteration, the largest branch of a cond)."""
  total = 0
  for eqn in jaxpr.eqns:
    out = eqn.outvars[0].aval.shape
    if eqn.primitive.name == "dot_general":
      (contracting, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2 * math.prod(out) * math.prod(lhs[d] for d in contracting)
    elif eqn.primitive.name == "conv_general_dilated":
      rhs = eqn.invars[1].aval.shape
      _, rhs_spec, _ = eqn.params["dimension_numbers"]  # rhs: out feature, in feature, spatial
      # A strided convolution's input gradient dilates its input (lhs_dilation): of those
      # products, only 1 in prod(lhs_dilation) is not by an inserted zero.
      total += (2 * math.prod(out) * math.prod(rhs[d] for d in rhs_spec[1:])
                // math.prod(eqn.params["lhs_dilation"]))
    inner = [_flops(sub) for sub in _inner_jaxprs(eqn.params)]
    if eqn.primitive.name == "cond":
      total += max(inner, default=0)
    else:
      total += sum(inner) * eqn.params.get("length", 1)  # scan: its length; others: once
  return total


def model_flops(fn, *args, axis_env=None) -> int:
  """FLOPs of the matrix products and convolutions of `fn(*args)` (forward and backward), from
  its jaxpr: the same on every backend, whatever the compiler fuses or hands to a library.

  Args:
    fn: the function.
    *args: its arguments (abstract values will do).
    axis_env: the named axes that `fn`'s collectives use, with their sizes (pmap's).
  """
  return _flops(jax.make_jaxpr(fn, axis_env=axis_env)(*args).jaxpr)


class Speed:
  """FLOP/s and model FLOP utilisation (MFU) from the FLOPs of the step's matrix products and
  convolutions, counted in its jaxpr (the same on every backend).

  Args:
    graphdef: the state's graph.
    state: the state (or its abstract value).
    image_shape: the stored images' [H, W, C].
    run_plan: the run's plan.
    devices: the devices whose peak the FLOP/s are measured against; None: all.
  """

  def __init__(self, graphdef, state, image_shape, run_plan, devices=None):
    # Under pmap, traced with its axis (of size 1: the global batch on one device), for models
    # whose layers name it (BatchNorm).
    config = run_plan.config
    axis = "batch" if config.parallelism == "pmap" else None  # (pmap.PMAP_AXIS)
    # (The crop's resampling is left out: it is a matrix product, but not the model's.)
    step = functools.partial(steps.train_step, graphdef, **dispatch.step_options(
        run_plan, crop_on_device=False))
    spec = lambda shape, dtype: jax.ShapeDtypeStruct((config.run.global_batch_size, *shape), dtype)  # noqa: E731
    batch = {"image": spec(image_shape, jnp.uint8), "label": spec((), jnp.int32),
             "mask": spec((), jnp.bool_), "position": spec((), jnp.uint32)}  # one global batch
    self.flops_per_step = model_flops(
        step, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state),
        run_plan.metrics.train.empty(), batch, axis_env=[(axis, 1)] if axis else None)
    devices = devices or jax.devices()
    peak = config.peak_flops_per_device or chips.peak_flops(devices[0].device_kind)
    self.peak = peak * len(devices)

  def report(self, steps_per_sec: float) -> dict[str, float]:
    achieved = self.flops_per_step * steps_per_sec
    return {"flops_per_sec": achieved, **({"mfu": achieved / self.peak} if self.peak else {})}
