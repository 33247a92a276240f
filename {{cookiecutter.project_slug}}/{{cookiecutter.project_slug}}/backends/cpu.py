"""The CPU's form of the train step (dispatch.py puts it in while a CPU's step is traced; gpu.py
says how): a step left as it was is skipped under lax.cond, not by selecting each leaf, which
XLA:CPU does with a second copy of the state (tests/test_steps.py)."""

import jax
import jax.numpy as jnp

from ..training import steps


def forms() -> list:
  """(module, name, form) for each stock function whose place this module's form takes."""
  return [(steps, "update_if", update_if)]


def update_if(applied, update, current, old):
  """steps.update_if under lax.cond: `update(current)` where `applied`, else `old` and norms of 0.

  Args:
    applied: whether the step is applied (a boolean scalar).
    update: current -> (updated state, norms).
    current: the state as the forward pass left it.
    old: the state before the step.
  """
  zeros = jax.tree.map(lambda n: jnp.zeros(n.shape, n.dtype), jax.eval_shape(update, current)[1])
  return jax.lax.cond(applied, lambda current, _: update(current), lambda _, old: (old, zeros),
                      current, old)
