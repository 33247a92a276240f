"""benchmark.py's measurements of the host: what handing the training state to a compiled call
costs (`measure_dispatch`), and the default run as a whole process (`measure_default_run`)."""

import re
import statistics
import subprocess
import sys
import tempfile
import time

import jax
from flax import nnx

from .. import plan
from ..training import dispatch, optim


def measure_default_run(is_tiny: bool, project: str, env: dict[str, str]) -> dict:
  """`python train.py --config=configs/default.py` (tiny.py with --tiny) as a whole process,
  cold: no persistent compilation cache. Its wall time, what its log says of it, and the time
  from the start to its first-calls line (the start-up: imports, data, state, compiling).

  Args:
    is_tiny: tiny.py's config instead.
    project: the project's folder, where it runs.
    env: its environment (less the compilation cache).
  """
  name = "tiny" if is_tiny else "default"
  env = {k: v for k, v in env.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  with tempfile.TemporaryDirectory() as workdir:
    start = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "train.py", f"--config=configs/{name}.py", f"--workdir={workdir}",
         "--config.compilation_cache_dir="], cwd=project,
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log, startup_s = [], None
    for line in process.stderr:  # the log, as it comes
      log.append(line)
      if startup_s is None and "first calls (" in line:
        startup_s = time.perf_counter() - start
    wall_s = time.perf_counter() - start
  if process.wait(timeout=600):
    raise RuntimeError(f"the {name} run failed:\n{''.join(log)[-3000:]}")
  log = "".join(log)
  train_s, eval_s = map(float, re.search(r"first calls .*: train ([\d.]+) s, eval ([\d.]+) s",
                                         log).groups())
  return dict(config=f"configs/{name}.py", wall_s=wall_s, startup_s=startup_s,
              first_train_call_s=train_s, first_eval_call_s=eval_s,
              steps_per_dispatch=int(re.search(r"examples, (\d+) per call", log)[1]),
              accuracy=float(re.findall(r"Final eval: accuracy ([\d.]+)", log)[-1]))


def measure_dispatch(config, is_tiny: bool, ema_decay: float, calls: int = 200) -> dict:
  """The host time of a call that hands the ResNet-50 training state (`config`:
  configs/imagenet.py's; with --tiny the ResNet-18) to a compiled function and gets it back (as a
  step does; the function does nothing): as an nnx.State, and as the flat list of arrays that the
  loop holds (`dispatch.make`'s put_state); without and with the moving average. {} when
  model.py (yours) has no such ResNet.

  Args:
    config: configs/imagenet.py's.
    is_tiny: the ResNet-18 instead.
    ema_decay: the moving average's.
    calls: the calls whose median is taken.
  """
  config = config.copy_and_resolve_references()
  config.model.name = "resnet18" if is_tiny else "resnet50"
  if config.model.name not in getattr(plan.model_module(config), "MODELS", ()):
    return {}
  fn = jax.jit(lambda tree: tree, donate_argnums=0)  # every array handed over and back, in place
  result = dict(model=config.model.name)
  for ema, suffix in ((0.0, ""), (ema_decay, "_ema")):
    config.ema_decay = ema
    run_plan = plan.make_plan(plan.resolved(config))
    tree = nnx.split(optim.build_state(run_plan, (224, 224, 3), 1000, 1000))[1]
    result[f"arrays{suffix}"] = len(jax.tree.leaves(tree))
    for name in ("state", "flat"):
      if name == "flat":
        tree = dispatch.Flat(jax.tree.leaves(tree))
      tree = jax.block_until_ready(fn(tree))  # compiled (the arrays donated: use what comes back)
      times = []
      for _ in range(calls // 10 if is_tiny else calls):
        start = time.perf_counter()
        tree = fn(tree)
        times.append(time.perf_counter() - start)
      result[f"{name}{suffix}_ms"] = 1e3 * statistics.median(times)
  return result
