"""Nothing lost: stopped, killed or fed bad input, a run resumes exactly or refuses cleanly."""

import asyncio
import gc
import glob
import json
import logging
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import OWN, own_mount_namespace, two_epochs

import train
from write_arrayrecord import write_dataset

from {{cookiecutter.project_slug}} import plan, rules
from {{cookiecutter.project_slug}}.data import batches, sources
from {{cookiecutter.project_slug}}.training import (
  damaged,
  dispatch,
  metrics,
  report,
  stopping,
)

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ)  # 8 CPU devices (conftest.py)

# Runs train_and_evaluate on the tiny config (with JSON overrides) and records every training
# batch the pipeline makes that holds a real example: its number and a hash of its contents.
# With no read-ahead (read_threads=0) batches are made exactly when the loop takes them.
DRIVER = """
import hashlib, json, sys
from absl import flags, logging
flags.FLAGS.mark_as_parsed()
logging.set_verbosity(logging.INFO)
import train
from {{cookiecutter.project_slug}}.data import batches
from configs import tiny
from conftest import owned
workdir, overrides, record_path = sys.argv[1:]
config = owned(tiny.get_config())
config.update(json.loads(overrides))
record = open(record_path, "a")
make_unit = batches.LoadUnit.__call__
def recorded(self, u):  # (in memory, without workers: a unit is an element, [k, batch, ...])
  unit = make_unit(self, u)
  for i in range(len(unit["mask"]) if self.shuffle_seed is not None else 0):  # training's
    batch = {key: value[i] for key, value in unit.items()}
    if batch["mask"].any():
      digest = hashlib.sha1(b"".join(batch[k].tobytes() for k in sorted(batch)))
      print(u * self.steps_per_element + i, digest.hexdigest(), file=record, flush=True)
  return unit
batches.LoadUnit.__call__ = recorded
from {{cookiecutter.project_slug}}.training import stopping
try:
  result = train.train_and_evaluate(config, workdir)
except stopping.Stopped as stopped:
  sys.exit(stopped.exit_code)
print("RESULT", json.dumps(result))
"""


def start(workdir, overrides, record):
  return subprocess.Popen([sys.executable, "-c", DRIVER, str(workdir), json.dumps(overrides),
                           str(record)], cwd=PROJECT, env=ENV, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def finish(process, timeout=300):
  stdout, stderr = process.communicate(timeout=timeout)
  return process.returncode, stdout, stderr


def recorded(path):
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [tuple(line.split()) for line in f]


def final_state(workdir):
  """The latest checkpoint's state, as {path: array}."""
  with ocp.CheckpointManager(os.path.join(workdir, "checkpoints")) as checkpoints:
    step = checkpoints.latest_step()
    state = checkpoints.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore()))["state"]
  return step, {jax.tree_util.keystr(p): np.asarray(x)
                for p, x in jax.tree_util.tree_leaves_with_path(state)}


def wait_for(condition, process, timeout=120):
  deadline = time.monotonic() + timeout
  while not condition():
    assert process.poll() is None, process.communicate()[1][-3000:]
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.005)


NO_READ_AHEAD = dict(read_threads=0, prefetch_batches=0, prefetch_to_device=0)


@pytest.mark.slow
@pytest.mark.parametrize("read_ahead, k", [(False, 1), (False, 5), (True, 5)],
                         ids=["no-read-ahead-k1", "no-read-ahead-k5", "prefetching-k5"])
def test_sigterm_mid_epoch_then_resume_is_bitwise_identical(tmp_path, read_ahead, k):
  overrides = dict(num_epochs=8, checkpoint_every_steps=50, steps_per_dispatch=k,
                   **({} if read_ahead else NO_READ_AHEAD))
  num_steps = -(-8 * 1437 // 64)  # 8 passes over the digits' 1437 training images
  straight = start(tmp_path / "straight", overrides, tmp_path / "straight.txt")
  code, stdout, stderr = finish(straight)
  assert code == 0, stderr[-3000:]

  interrupted = start(tmp_path / "run", overrides, tmp_path / "first.txt")
  wait_for(lambda: len(recorded(tmp_path / "first.txt")) >= 40, interrupted)
  interrupted.send_signal(signal.SIGTERM)
  code, _, stderr = finish(interrupted)
  assert code == 143, stderr[-3000:]
  stopped_at, _ = final_state(tmp_path / "run")
  assert f"Stopped by SIGTERM after step {stopped_at} of {num_steps}" in stderr
  assert stopped_at * 64 % 1437 and stopped_at % 50  # mid-epoch, between regular saves

  resumed = start(tmp_path / "run", overrides, tmp_path / "second.txt")
  code, stdout_resumed, stderr = finish(resumed)
  assert code == 0, stderr[-3000:]
  assert f"Resumed from the checkpoint of step {stopped_at}" in stderr

  # The batches the two runs made: each as in the uninterrupted run, and the resumed run
  # starts with the batch after the last one the stopped run trained on.
  expected = recorded(tmp_path / "straight.txt")
  first, second = recorded(tmp_path / "first.txt"), recorded(tmp_path / "second.txt")
  if read_ahead:  # batches made by threads, out of order, and a few never trained on
    made = {**dict(first), **dict(second)}
    assert all(dict(expected)[number] == digest for number, digest in made.items())
    assert {int(n) for n, _ in first} >= set(range(stopped_at))
    assert min(int(n) for n, _ in second) == stopped_at
  else:  # batches are made exactly when taken: the same sequence, each batch exactly once
    assert second == expected[stopped_at:]
    assert first + second == expected and len(expected) == num_steps
  step_a, state_a = final_state(tmp_path / "straight")
  step_b, state_b = final_state(tmp_path / "run")
  assert step_a == step_b == num_steps and state_a.keys() == state_b.keys()
  for name in state_a:
    np.testing.assert_array_equal(state_a[name], state_b[name], err_msg=name)
  assert stdout_resumed.splitlines()[-1] == stdout.splitlines()[-1]  # same eval metrics


@pytest.mark.slow
def test_sigkill_while_saving_resumes_from_the_previous_complete_checkpoint(tmp_path):
  # A larger model, so that a checkpoint takes long enough to be killed in the middle.
  overrides = dict(model={"features": (128, 256)}, num_epochs=2, checkpoint_every_steps=10)
  straight = start(tmp_path / "straight", overrides, tmp_path / "straight.txt")
  killed = start(tmp_path / "run", overrides, tmp_path / "run.txt")
  checkpoint_dir = tmp_path / "run" / "checkpoints"

  def writing_second_checkpoint():
    return checkpoint_dir.exists() and any(
        "tmp" in p.name and not p.name.startswith("10.") for p in checkpoint_dir.iterdir())

  wait_for(writing_second_checkpoint, killed)
  killed.kill()
  killed.wait(timeout=60)
  half_written = [p.name for p in checkpoint_dir.iterdir() if "tmp" in p.name]
  assert half_written, "the kill came too late to catch a checkpoint being written"
  with ocp.CheckpointManager(checkpoint_dir) as checkpoints:
    assert checkpoints.latest_step() == 10  # the half-written one is not a checkpoint

  resumed = start(tmp_path / "run", overrides, tmp_path / "run.txt")
  code, stdout, stderr = finish(resumed)
  assert code == 0, stderr[-3000:]
  assert "Resumed from the checkpoint of step 10" in stderr
  code, stdout_straight, stderr = finish(straight)
  assert code == 0, stderr[-3000:]
  _, state_a = final_state(tmp_path / "straight")
  _, state_b = final_state(tmp_path / "run")
  for name in state_a:
    np.testing.assert_array_equal(state_a[name], state_b[name], err_msg=name)


@pytest.mark.slow
def test_same_config_and_seed_give_the_same_bits(straight_runs, tmp_path):
  """conftest's spmd run, run again here: the same metrics and the same final state, bit for
  bit (the first may have run in another process: pytest-xdist's other worker)."""
  workdir, metrics = straight_runs["spmd"]
  assert train.train_and_evaluate(two_epochs("spmd"), str(tmp_path)) == metrics
  _, state_a = final_state(workdir)
  _, state_b = final_state(tmp_path)
  for name in state_a:
    np.testing.assert_array_equal(state_a[name], state_b[name], err_msg=name)


def digits_with_a_nan(directory, tiny_config):
  """The digits as ArrayRecord files, with one training image made of NaNs."""
  splits, _ = sources.get_datasets(tiny_config)
  images = splits["train"].images / np.float32(255)  # float pixels go to the model as they are
  images[100] = np.nan
  write_dataset(str(directory), {"train": (images, splits["train"].labels),
                                 "eval": (splits["eval"].images / np.float32(255),
                                          splits["eval"].labels)})
  tiny_config.dataset, tiny_config.data_dir = "arrayrecord", str(directory)
  elements = batches.train_batches(sources.get_datasets(tiny_config)[0]["train"],
                                          plan.resolved(tiny_config))
  images = np.stack([batch["image"] for batch in elements])  # [batches, ...]
  return next(b + 1 for b in range(len(images)) if np.isnan(images[b]).any())


@pytest.mark.slow
def test_a_stop_signal_on_an_eval_step_saves_first_and_leaves_the_evaluation(
    tiny_config, tmp_path, monkeypatch):
  """SIGTERM during step 10 of 23, an eval step (and no regular checkpoint step): the run saves
  step 10, evaluates nothing (the grace period is for saving) and stops; resumed, it ends."""
  tiny_config.checkpoint_every_steps = 1000
  evaluated, evaluate, update = [], dispatch.evaluate, report.Progress.update

  def recording_evaluate(*args, **kwargs):
    evaluated.append(True)
    return evaluate(*args, **kwargs)

  def update_then_signal(self, step):
    update(self, step)
    if step == 10:
      os.kill(os.getpid(), signal.SIGTERM)

  monkeypatch.setattr(dispatch, "evaluate", recording_evaluate)
  monkeypatch.setattr(report.Progress, "update", update_then_signal)
  with pytest.raises(stopping.Stopped, match="Stopped by SIGTERM after step 10 of 23"):
    train.train_and_evaluate(tiny_config, str(tmp_path / "run"))
  assert evaluated == [] and final_state(tmp_path / "run")[0] == 10
  monkeypatch.setattr(report.Progress, "update", update)
  result = train.train_and_evaluate(tiny_config, str(tmp_path / "run"))
  assert result["examples"] == 360 and len(evaluated) == 2  # steps 20 and 23


@pytest.mark.slow  # (a full training; fast: a skipped step, test_steps.py)
def test_nonfinite_loss_stops_naming_the_step_and_the_last_good_checkpoint(tiny_config, tmp_path):
  tiny_config.checkpoint_every_steps = 5
  bad_step = digits_with_a_nan(tmp_path / "data", tiny_config)
  with pytest.raises(stopping.NonFiniteLoss, match=f"at step {bad_step};") as error:
    train.train_and_evaluate(tiny_config, str(tmp_path / "run"))
  last_good = (bad_step - 1) // 5 * 5
  assert re.search(rf"the latest checkpoint, step {last_good} in \S+, was saved before it\.",
                   str(error.value)), str(error.value)
  last_step, state = final_state(tmp_path / "run")
  assert last_step == last_good and all(np.isfinite(x).all() for x in state.values()
                                        if x.dtype.kind == "f")
  tiny_config.checkpoint_every_steps = 100  # none before the bad step: said, not "step None"
  with pytest.raises(stopping.NonFiniteLoss, match=f"at step {bad_step};") as error:
    train.train_and_evaluate(tiny_config, str(tmp_path / "afresh"))
  assert "and no checkpoint was saved before it (in " in str(error.value), str(error.value)


@pytest.mark.slow  # (fast: test_steps.py skips a step by selection and under cond alike)
def test_nonfinite_steps_can_be_skipped(tiny_config, tmp_path):
  digits_with_a_nan(tmp_path / "data", tiny_config)
  tiny_config.skip_nonfinite_steps = True
  result = train.train_and_evaluate(tiny_config, str(tmp_path / "run"))
  assert result["examples"] == 360 and np.isfinite(result["loss"])
  _, state = final_state(tmp_path / "run")
  assert all(np.isfinite(x).all() for x in state.values() if x.dtype.kind == "f")


# A step's `metrics.NonFinite` (steps, count, first), as the train step makes it: a finite step, a
# non-finite one, one of padding alone (counted as no step; test_steps.py's
# test_a_skipped_step_leaves_the_whole_state_bitwise_unchanged checks the step's own).
FINITE, NOT_FINITE, PADDING = (1, 0, -1), (1, 1, 0), (0, 0, -1)


def step_flag(fields: tuple):
  return metrics.NonFinite(*map(jax.numpy.array, fields))


def test_nonfinite_steps_are_counted_and_the_first_found_however_merged():
  finite = [True, True, False, True, False, True]  # steps 0-5; 2 and 4 not finite
  flags = [step_flag(FINITE if ok else NOT_FINITE) for ok in finite]
  one_by_one = metrics.NonFinite.empty()
  for flag in flags:
    one_by_one = one_by_one.merge(flag)
  halves = flags[0].merge(flags[1]).merge(flags[2]).merge(
      flags[3].merge(flags[4]).merge(flags[5]))  # merged in two windows, then together
  late = metrics.NonFinite.empty().merge(flags[3]).merge(flags[4])  # a window from step 3 on
  for merged in (one_by_one, halves):
    assert (int(merged.steps), int(merged.count), int(merged.first)) == (6, 2, 2)
  assert (int(late.count), int(late.first)) == (1, 1)
  padding_first = step_flag(PADDING).merge(flags[2])
  assert (int(padding_first.steps), int(padding_first.count), int(padding_first.first)) == (1, 1, 0)
  clean = metrics.NonFinite.empty().merge(flags[0]).merge(flags[1])
  assert (int(clean.count), int(clean.first)) == (0, -1)


def damage_checkpoint(directory, how: str) -> None:
  """Damages checkpoint `directory` as disks and copies do: bytes `garbled` in its largest data
  file, that file `truncated` to half, its data folder `missing`, its metadata file
  (`no_metadata`), or one bit of one float flipped (`bit_flipped`: the state written again as
  Orbax writes it, its checksums kept: damage that no read of the data notices); its checksum
  file garbled (`checksums_garbled`) or JSON of another type (`checksums_a_list`)."""
  if how == "bit_flipped":
    flip_a_bit(pathlib.Path(directory))
    return
  if how.startswith("checksums_"):
    checksums = pathlib.Path(directory) / "checksums" / "metadata"
    checksums.write_text("[1, 2, 3]" if how == "checksums_a_list" else
                         checksums.read_text()[:40] + "\x00\xff garbled")
    return
  data = sorted(glob.glob(os.path.join(directory, "state", "ocdbt.process_*", "d", "*")),
                key=os.path.getsize)
  if how == "no_metadata":
    os.remove(os.path.join(directory, "state", "_METADATA"))
    return
  if how == "missing":
    shutil.rmtree(os.path.dirname(data[-1]))
    return
  size = os.path.getsize(data[-1])
  with open(data[-1], "r+b") as f:
    if how == "garbled":
      f.seek(size // 4)
      f.write(b"\xff" * (size // 2))
    else:
      f.truncate(size // 2)


def flip_a_bit(checkpoint: pathlib.Path) -> None:
  """Checkpoint directory `checkpoint`'s state rewritten with the lowest bit of 0/dense/kernel's
  first entry flipped; the rest of the checkpoint (its checksums) as it was."""
  step = int(checkpoint.name)
  with ocp.CheckpointManager(checkpoint.parent) as checkpoints:
    state = checkpoints.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore()))["state"]

  def flip(path, x):
    if damaged.leaf_name(path) != "0/dense/kernel/value":
      return x
    x = np.array(x)
    x.view(np.uint32).flat[0] ^= 1
    return jax.numpy.asarray(x)  # (written as the run writes its arrays)

  state = jax.tree_util.tree_map_with_path(flip, state)
  with ocp.CheckpointManager(checkpoint.parent.parent / "rewritten") as checkpoints:
    checkpoints.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
  shutil.rmtree(checkpoint / "state")
  shutil.move(checkpoint.parent.parent / "rewritten" / str(step) / "state", checkpoint / "state")
  shutil.rmtree(checkpoint.parent.parent / "rewritten")


def save_nonfinite(workdir, step: int) -> None:
  """A checkpoint of `step` that reads back fine but holds NaNs: the latest one's state with the
  dense kernel made NaN, in the model and its moving average (what a run that diverged
  unchecked would have saved)."""
  with ocp.CheckpointManager(os.path.join(workdir, "checkpoints")) as checkpoints:
    state = checkpoints.restore(checkpoints.latest_step(), args=ocp.args.Composite(
        state=ocp.args.StandardRestore()))["state"]
    state = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.numpy.full_like(x, np.nan)
        if damaged.leaf_name(path) in ("0/dense/kernel/value", "2/dense/kernel/value") else x,
        state)
    checkpoints.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))


def test_the_other_failed_reads_of_a_damaged_checkpoint_are_not_reported_again(caplog):
  """Orbax reads a checkpoint's arrays as asyncio tasks: when one fails (what `damaged.damage`
  names), asyncio reports each other failed one whenever it is collected, with its traceback.
  Those from Orbax's code are dropped; any other's is kept."""
  def failed_future(filename: str) -> None:  # (dropped, never retrieved, when this returns)
    loop = asyncio.new_event_loop()
    future = loop.create_future()
    try:
      exec(compile("raise ValueError('FAILED_PRECONDITION: Error reading')", filename, "exec"))
    except ValueError as e:
      future.set_exception(e)
    loop.close()

  failed_future(os.path.join("site-packages", "orbax", "checkpoint", "serialization.py"))
  gc.collect()
  assert not [r for r in caplog.records if r.name == "asyncio"]
  failed_future(os.path.join("site-packages", "yours", "reader.py"))
  gc.collect()
  assert [r.getMessage().splitlines()[0] for r in caplog.records if r.name == "asyncio"] == [
      "Future exception was never retrieved"]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["garbled", "truncated", "missing", "no_metadata", "bit_flipped",
                                 "nonfinite", "checksums_garbled", "checksums_a_list"])
def test_a_damaged_checkpoint_is_named_kept_aside_and_the_run_ends_as_if_undamaged(
    straight_runs, tmp_path, caplog, how):
  """The latest checkpoint of a finished run damaged (or, `nonfinite`, a later one holding a
  NaN): the same command names it in one warning, moves it to damaged_checkpoints/ (kept), resumes
  from the newest intact one and ends with the state of the run never damaged, bitwise."""
  straight, _ = straight_runs["spmd"]
  workdir = tmp_path / "run"
  shutil.copytree(straight, workdir)
  last, want = final_state(workdir)
  steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  if how == "nonfinite":
    bad, resumed_from = last + 5, last
    save_nonfinite(workdir, bad)
  else:
    bad, resumed_from = last, steps[-2]
    damage_checkpoint(workdir / "checkpoints" / str(bad), how)
  caplog.set_level(logging.INFO)
  result = train.train_and_evaluate(two_epochs("spmd"), str(workdir))
  assert result["examples"] == 360
  gc.collect()  # (asyncio reports a failed read's other futures when they are collected)
  said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  reason = {"nonfinite": "restores to non-finite values (0/dense/kernel)",
            "bit_flipped": "is not what was saved (0/dense/kernel differs from its checksum)",
            "checksums_garbled": "has a damaged checksum file (checksums/metadata: ",
            "checksums_a_list": "has a damaged checksum file (checksums/metadata: a list)",
            }.get(how, "cannot be read (")
  assert len(said) == 1 and said[0].startswith(f"checkpoint {bad} in {workdir} {reason}"), said
  assert said[0].endswith(f": kept in {workdir}/damaged_checkpoints/{bad}; resuming from an "
                          "older one"), said
  assert f"Resumed from the checkpoint of step {resumed_from} in {workdir}" in caplog.text
  assert (workdir / "damaged_checkpoints" / str(bad) / "state").is_dir()
  step, got = final_state(workdir)
  assert step == last and got.keys() == want.keys()
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.slow
def test_a_checkpoint_without_checksums_is_restored_unchecked_in_one_line(straight_runs, tmp_path,
                                                                          caplog):
  """The latest checkpoint saved without checksums (an older version's: its checksums/ gone): the
  same command restores it, saying in one warning that it was not checked, and ends as the run
  never stopped, bitwise."""
  straight, _ = straight_runs["spmd"]
  workdir = tmp_path / "run"
  shutil.copytree(straight, workdir)
  last, want = final_state(workdir)
  shutil.rmtree(workdir / "checkpoints" / str(last) / "checksums")
  caplog.set_level(logging.INFO)
  assert train.train_and_evaluate(two_epochs("spmd"), str(workdir))["examples"] == 360
  said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert said == [f"checkpoint {last} in {workdir}/checkpoints holds no checksums (an older "
                  "version saved it): restored unchecked"], said
  step, got = final_state(workdir)
  assert step == last and not (workdir / "damaged_checkpoints").exists()
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.slow
def test_damage_that_cannot_be_put_aside_is_one_line_naming_both(tmp_path):
  """A finished run's latest checkpoint garbled, its checkpoints/ a read-only mount of its own
  (whence nothing moves): the same command stops in one `error:` line naming the damage and why
  it could not be moved, exit 1, the checkpoint kept."""
  own_mount_namespace()
  workdir = tmp_path / "run"
  train_py = [sys.executable, "train.py", "--config=configs/tiny.py", *OWN,
              f"--workdir={workdir}", "--config.num_epochs=1"]
  done = subprocess.run(train_py, cwd=PROJECT, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  last = max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  damage_checkpoint(workdir / "checkpoints" / str(last), "garbled")
  read_only = (f"mount --bind {workdir}/checkpoints {workdir}/checkpoints && mount -o "
               f"remount,bind,ro {workdir}/checkpoints")
  out = subprocess.run(["unshare", "-m", "sh", "-c", f"{read_only} && {' '.join(train_py)}"],
                       cwd=PROJECT, capture_output=True, text=True, timeout=300)
  lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
  assert out.returncode == 1 and len(lines) == 1, out.stderr[-3000:]
  assert lines[0].startswith(f"error: checkpoint {last} in {workdir} cannot be read ("), lines
  assert ", and it cannot be put aside (OSError: " in lines[0], lines  # (EXDEV: another mount)
  assert (workdir / "checkpoints" / str(last) / "state").is_dir()


@pytest.mark.slow
def test_a_step_damaged_twice_is_kept_twice_and_all_damaged_is_refused_again(straight_runs,
                                                                             tmp_path, caplog):
  """The latest checkpoint damaged, put aside, saved again by the resumed run and damaged again:
  kept beside the first (<step>.2). Every checkpoint damaged: the run stops in one line, and the
  same command again is refused in one line (never a silent start from step 0) until the damaged
  ones are moved away."""
  straight, _ = straight_runs["spmd"]
  workdir = tmp_path / "run"
  shutil.copytree(straight, workdir)
  last, _ = final_state(workdir)
  for _ in range(2):
    damage_checkpoint(workdir / "checkpoints" / str(last), "garbled")
    train.train_and_evaluate(two_epochs("spmd"), str(workdir))
  aside = workdir / damaged.DAMAGED
  assert sorted(p.name for p in aside.iterdir()) == [str(last), f"{last}.2"]
  assert f"kept in {aside}/{last}.2; resuming from an older one" in caplog.text
  for checkpoint in (workdir / "checkpoints").iterdir():
    if checkpoint.name.isdigit():
      damage_checkpoint(checkpoint, "no_metadata")
  with pytest.raises(rules.ConfigError, match=r"^no checkpoint in .* can be restored"):
    train.train_and_evaluate(two_epochs("spmd"), str(workdir))
  with pytest.raises(rules.ConfigError) as refused:
    train.train_and_evaluate(two_epochs("spmd"), str(workdir))
  assert str(refused.value) == (
      f"workdir {str(workdir)!r} holds no checkpoint but those put aside as damaged in {aside} "
      "(the log of the run that put them aside said why): this run would start over from step "
      f"0. To start over here, remove or rename {aside}; or use a new --workdir.")


@pytest.mark.slow
def test_the_tools_take_the_newest_intact_checkpoint_and_refuse_a_damaged_one(
    straight_runs, tmp_path):
  """evaluate.py (as predict.py and export.py read a run: trained.Restored) on a run whose latest
  checkpoint holds a NaN: the newest intact one, said; that step asked for: one line, exit 1,
  never a printed nan. init_from that run: one line."""
  straight, metrics = straight_runs["spmd"]
  workdir = tmp_path / "run"
  shutil.copytree(straight, workdir)
  last, _ = final_state(workdir)
  save_nonfinite(workdir, last + 5)
  listed = ", ".join(sorted((p.name for p in (workdir / "checkpoints").iterdir()
                             if p.name.isdigit()), key=int))
  for args, code in (([], 0), ([f"--step={last + 5}"], 1)):
    out = subprocess.run([sys.executable, "evaluate.py", f"--workdir={workdir}", *args],
                         cwd=PROJECT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == code, out.stderr[-3000:]
    assert "nan" not in out.stdout
    if code:
      assert out.stderr.strip().splitlines()[-1] == (
          f"error: checkpoint {last + 5} in {str(workdir)!r} restores to non-finite values "
          f"(dense/kernel); give another --step (the checkpoints: {listed}).")
    else:
      assert f"checkpoint {last + 5} in {workdir} restores to non-finite values" in out.stderr
      assert f"step {last}: loss {metrics['loss']:.4f}" in out.stdout, out.stdout
  out = subprocess.run([sys.executable, "train.py", "--config=configs/tiny.py", *OWN,
                        f"--workdir={tmp_path / 'fine'}", f"--config.init_from={workdir}"],
                       cwd=PROJECT, env=ENV, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == (
      f"error: config.init_from={str(workdir)!r}: its checkpoint {last + 5} restores to "
      "non-finite values (2/dense/kernel); start from an intact run."), out.stderr[-3000:]
