"""Every test runs on the CPU backend with 8 virtual devices, on any host: JAX_PLATFORMS=cpu
and the device count are set here, before JAX is imported, and inherited by subprocesses.
tests/test_accelerator.py runs on the host's real accelerator instead, in subprocesses given
the environment as it was before (`ACCELERATOR_ENV`).

The tests check what the programs compute, not how fast their machine code runs: XLA:CPU
compiles them without its backend (LLVM) optimisations, 2-4x faster to compile
(--xla_backend_optimization_level=0; the same for every test and subprocess, so every
comparison is between programs compiled alike).

Compiled programs are shared by every test and subprocess through JAX's persistent compilation
cache in `.pytest_cache/d/jax_compilation_cache` (every program, however quick to compile), and
kept for the next run: `pytest --cache-clear` starts cold. Set JAX_COMPILATION_CACHE_DIR to
use another directory.
"""

import fcntl
import json
import os

ACCELERATOR_ENV = dict(os.environ)
PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["JAX_PLATFORMS"] = "cpu"
for flag in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"):
  if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(PROJECT, ".pytest_cache", "d", "jax_compilation_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import pytest  # noqa: E402
from absl import flags  # noqa: E402

flags.FLAGS.mark_as_parsed()  # absl flags are parsed by app.run in train.py, not under pytest


# The recipe's options, all on (off in configs/default.py): the runs of `two_epochs` check that
# they keep every path, resume and process count exact. The global batch: 8 x 8 devices = 64,
# as tiny.py's; its peak learning rate 2 x tiny.py's.
RECIPE = dict(optimizer="adamw", per_device_batch_size=8, lr_scaling="linear", base_batch_size=32,
              warmup_steps=10, schedule="linear", label_smoothing=0.1, grad_clip_norm=1.0,
              ema_decay=0.9, augment_flip=True, augment_crop=True, augment_crop_scale=(0.5, 1.0))


def two_epochs(parallelism):
  """The tiny config with the `RECIPE`, for 2 epochs (45 steps), every checkpoint kept, on
  `parallelism`."""
  from configs import tiny

  config = tiny.get_config()
  config.update(RECIPE)
  config.num_epochs, config.max_checkpoints_to_keep, config.parallelism = 2, 10, parallelism
  config.fsdp_min_size = 0  # fsdp: split every leaf of the tiny CNN that divides over 8
  return config


@pytest.fixture(scope="session")
def straight_runs(tmp_path_factory):
  """`two_epochs` on each path, uninterrupted: {parallelism: (workdir, eval metrics)}. Several
  tests resume these runs, or compare other runs with them (reading, never writing, them).
  Made once per session, in this process; under pytest-xdist once for all workers, by the
  first that asks (the others wait for it, then read its workdirs)."""
  import steps
  import train

  shared = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    shared = shared.parent  # the workers' common temporary directory
  done = shared / "straight_runs.json"
  with open(shared / "straight_runs.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if not done.exists():
      metrics = {}
      for parallelism in steps.PARALLELISMS:
        workdir = shared / f"straight_{parallelism}"
        metrics[parallelism] = train.train_and_evaluate(two_epochs(parallelism), str(workdir))
      done.write_text(json.dumps(metrics))
    metrics = json.loads(done.read_text())
  return {parallelism: (shared / f"straight_{parallelism}", metrics[parallelism])
          for parallelism in steps.PARALLELISMS}


@pytest.fixture
def tiny_config():
  """configs/tiny.py, its steps per dispatch chosen as train_and_evaluate chooses them (1 here)."""
  import steps
  from configs import tiny

  config = tiny.get_config()
  config.steps_per_dispatch = steps.steps_per_dispatch(config)
  return config
