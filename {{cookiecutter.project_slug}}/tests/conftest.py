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

import contextlib
import fcntl
import io
import json
import os
import subprocess
import sys

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

# The tests' own models and recipe, whatever model.py and recipe.py hold: shipped_model.py and
# shipped_recipe.py (the hook's copies of them as the template shipped them), named by `owned`
# configs and `OWN`, importable by every process that the tests start.
# tests/test_your_model.py tests model.py and recipe.py themselves.
TESTS = os.path.join(PROJECT, "tests")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (TESTS, os.environ.get("PYTHONPATH"))))
SHIPPED_MODEL, SHIPPED_RECIPE = "shipped_model", "shipped_recipe"
# The same, on a command line.
OWN = (f"--config.model.module={SHIPPED_MODEL}", f"--config.recipe={SHIPPED_RECIPE}")

import pytest  # noqa: E402
from absl import flags  # noqa: E402

from {{cookiecutter.project_slug}}.training import trained  # noqa: E402

flags.FLAGS.mark_as_parsed()  # absl flags are parsed by app.run in train.py, not under pytest


def owned(config):
  """`config` (changed in place, and returned) on the tests' own models and recipe
  (shipped_model.py, shipped_recipe.py): model.py's place taken, another module's (vit.py) kept."""
  if config.model.get("module", "model") == "model":
    config.model.module = SHIPPED_MODEL
  config.recipe = SHIPPED_RECIPE
  return config


# The train step's options off: no augmentation, label smoothing, accumulation or average.
PLAIN = dict(augment_max_shift=0, augment_flip=False, augment_crop=False, label_smoothing=0.0,
             grad_accum_steps=1, ema_decay=0.0, ema_warmup=False, seed=0)


def plain(config=None, **changes):
  """A copy of `config` (default: tiny.py's, `owned`) with `PLAIN` and then `changes`."""
  from configs import tiny

  config = (config or owned(tiny.get_config())).copy_and_resolve_references()
  config.update(dict(PLAIN, **changes))
  return config


def plain_options(config=None, **changes):
  """`steps.train_step`'s options (`dispatch.step_options`) of `plain(config, **changes)`."""
  from {{cookiecutter.project_slug}} import plan
  from {{cookiecutter.project_slug}}.training import dispatch

  return dispatch.step_options(plan.make_plan(plain(config, **changes)))


def recipe_metrics(config):
  """The metric collections (`metrics.of`) of the recipe module that `config` names (with the
  examples' mean class weight where it sets class weights, as `plan.make_plan`'s)."""
  from {{cookiecutter.project_slug}} import plan

  return plan.make_plan(config).metrics


# The recipe's options, all on (off in configs/default.py): the runs of `two_epochs` check that
# they keep every path, resume and process count exact. The global batch: 8 x 8 devices = 64,
# as tiny.py's; its peak learning rate 2 x tiny.py's.
RECIPE = dict(optimizer="adamw", weight_decay=0.05, per_device_batch_size=8, lr_scaling="linear",
              base_batch_size=32, warmup_steps=10, schedule="linear", label_smoothing=0.1,
              grad_clip_norm=1.0, ema_decay=0.9, augment_flip=True, augment_crop=True,
              augment_crop_scale=(0.5, 1.0))


def two_epochs(parallelism):
  """The tiny config with the `RECIPE`, for 2 epochs (45 steps), every checkpoint kept, on
  `parallelism`."""
  from configs import tiny

  config = owned(tiny.get_config())
  config.update(RECIPE)
  config.num_epochs, config.max_checkpoints_to_keep, config.parallelism = 2, 10, parallelism
  config.fsdp_min_size = 0  # fsdp: split every leaf of the tiny CNN that divides over 8
  return config


@pytest.fixture(scope="session")
def shared_tmp(tmp_path_factory):
  """A temporary directory that every pytest-xdist worker of this session sees."""
  if os.environ.get("PYTEST_XDIST_WORKER"):
    return tmp_path_factory.getbasetemp().parent  # the workers' common temporary directory
  return tmp_path_factory.getbasetemp()


def made_once(directory, name: str, make) -> tuple:
  """`make(directory / name)`, called once for all pytest-xdist workers, by the first that
  asks (the others wait for it): (that path, what `make` returned, through JSON)."""
  done = directory / f"{name}.json"
  with open(directory / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if not done.exists():
      done.write_text(json.dumps(make(directory / name)))
  return directory / name, json.loads(done.read_text())


class StraightRuns:
  """`two_epochs` on each path, uninterrupted: `runs[parallelism]` is (workdir, eval metrics).
  Several tests resume these runs, or compare other runs with them (reading, never writing,
  them). Each run is made on first use, once for all workers (`made_once`)."""

  def __init__(self, directory):
    self.directory = directory

  def __getitem__(self, parallelism):
    import train

    return made_once(self.directory, f"straight_{parallelism}", lambda workdir: (
        train.train_and_evaluate(two_epochs(parallelism), str(workdir))))


@pytest.fixture(scope="session")
def straight_runs(shared_tmp):
  return StraightRuns(shared_tmp)


# The class names that the tests' Hugging Face and TFDS copies of the digits carry.
DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def reads_as_the_digits(config) -> tuple[dict, dict]:
  """`config` (a Hugging Face or TFDS copy of the digits) is valid and its data is described as
  the digits: 8x8x1 uint8, DIGIT_NAMES, 1437 + 360 examples. Returns its sources and the digits'
  own, to compare."""
  from configs import default

  from {{cookiecutter.project_slug}} import rules
  from {{cookiecutter.project_slug}}.data import sources

  rules.validate_config(config)
  splits, info = sources.get_datasets(config)
  assert (info.image_shape, info.num_classes, info.class_names, info.pixel_dtype) == (
      (8, 8, 1), 10, DIGIT_NAMES, "uint8")
  assert info.num_examples == {"train": 1437, "eval": 360}
  return splits, sources.get_datasets(default.get_config())[0]


def trains_as_written(config, workdir, splits: dict, class_names) -> dict:
  """A run of `config` in `workdir` (its eval metrics, returned) ends as a run on the same
  `splits` ({split: (images, labels)}, in the same order) written by write_arrayrecord.py; its
  data.json keeps `class_names`, and evaluate.py on its eval split gives its accuracy."""
  import pytest

  import evaluate
  import train
  import write_arrayrecord

  from {{cookiecutter.project_slug}}.data import sources

  metrics = train.train_and_evaluate(config, str(workdir / "run"))
  write_arrayrecord.write_dataset(str(workdir / "records"), splits)
  config.dataset, config.data_dir = "arrayrecord", str(workdir / "records")
  written = train.train_and_evaluate(config, str(workdir / "written"))
  assert written["accuracy"] == metrics["accuracy"]
  assert written["loss"] == pytest.approx(metrics["loss"], abs=1e-6)
  run = trained.Restored(str(workdir / "run"))
  assert run.info.class_names == class_names
  source = sources.get_datasets(run.config)[0]["eval"]
  assert evaluate.evaluate(run, source)["accuracy"] == metrics["accuracy"]
  return metrics


def run_main(module, *args: str) -> subprocess.CompletedProcess:
  """`python MODULE.py --flag=value...` in this process (no interpreter and JAX to start):
  absl parses each flag (the values restored after) and `module.main` runs. Its output and
  exit status as subprocess.run gives them; an exit with a message ends stderr with it, as
  Python prints it. (Each script's own entry point also runs as a real process, in some test.)"""
  from absl.testing import flagsaver

  out, err, code = io.StringIO(), io.StringIO(), 0
  with flagsaver.flagsaver(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    for arg in args:  # (not flags.FLAGS(argv): that checks train.py's required flags too)
      name, has_value, value = arg.removeprefix("--").partition("=")
      flags.FLAGS[name].parse(value if has_value else "true")  # (a bare --flag: a boolean)
    try:
      module.main([f"{module.__name__}.py"])
    except SystemExit as exit:
      code = exit.code if isinstance(exit.code, int) else 1
      if exit.code is not None and not isinstance(exit.code, int):
        print(exit.code, file=err)
  return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def own_mount_namespace():
  """Skips the test unless `unshare -m` (root) can give a process file systems of its own."""
  if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
    pytest.skip("needs `unshare -m` (root) to give the run file systems of its own")


def alive(pid: int) -> bool:
  """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


@pytest.fixture
def tiny_config():
  """configs/tiny.py on the tests' own models (`owned`), its steps per dispatch chosen as
  train_and_evaluate chooses them (1 here)."""
  from configs import tiny

  from {{cookiecutter.project_slug}} import plan

  config = owned(tiny.get_config())
  config.steps_per_dispatch = plan.steps_per_dispatch(config)
  return config


@pytest.fixture(autouse=True)
def records_counted_afresh():
  """Each test counts the bad records it reads from zero (the count is a process's, and a test
  process runs many tests: batches.count_bad_records)."""
  name = "{{cookiecutter.project_slug}}.data.batches"
  if batches := sys.modules.get(name):  # (once read)
    batches._records.clear()


def held_while_more_go_through(elements, config, monkeypatch, keys: tuple[str, ...],
                               held: int = 3) -> int:
  """Reads `elements` through `config`'s worker processes onto the devices, the first `held`
  kept placed while the rest go through, each equal (`keys`) to the same element read in this
  process, the kept ones checked last. Returns how many /dev/shm files the units came in."""
  import functools

  import numpy as np

  from {{cookiecutter.project_slug}}.data import input_pipeline, shm
  from {{cookiecutter.project_slug}}.parallel import sharding

  expected = [elements[e] for e in range(len(elements))]
  files, receive = set(), shm.receive

  def same(got, want: dict, key: str) -> None:  # (packed crops: the bytes they fill)
    if key != "image" or "filled" not in want:
      return np.testing.assert_array_equal(np.asarray(got), want[key])
    for g, n in enumerate(want["filled"][0]):
      np.testing.assert_array_equal(np.asarray(got)[0, g, :n], want["image"][0, g, :n])

  def counted(unit):
    files.update(os.stat(os.path.join(shm.DIRECTORY, value.name)).st_ino
                 for value in unit.values() if isinstance(value, shm.Shared))
    return receive(unit)

  monkeypatch.setattr(shm, "receive", counted)
  put = functools.partial(sharding.global_batch, mesh=sharding.make_mesh(config))
  iterator, kept = input_pipeline.as_iterator(elements, config, put=put), []
  try:
    for e, element in enumerate(iterator):
      if e < held:
        kept.append(element)
      else:
        for key in keys:
          same(element[key], expected[e], key)
      del element
    for e, element in enumerate(kept):
      for key in keys:
        same(element[key], expected[e], key)
  finally:
    iterator.close()
  return len(files)
