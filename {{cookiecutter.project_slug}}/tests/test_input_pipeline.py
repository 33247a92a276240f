import errno
import functools
import glob
import logging
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest
from conftest import held_while_more_go_through, run_main

import train
import write_arrayrecord
from write_arrayrecord import write_dataset

from {{cookiecutter.project_slug}} import plan, rules
from {{cookiecutter.project_slug}}.data import (
    arrayrecord,
    batches,
    input_pipeline,
    shm,
    sources,
)
from {{cookiecutter.project_slug}}.parallel import pmap, sharding


def numbered(n: int) -> sources.ArraySource:
  """n examples whose label is their index, so we can tell exactly which ones a batch holds."""
  images = np.arange(1, n + 1, dtype=np.uint8).reshape(n, 1, 1, 1)
  return sources.ArraySource(images, np.arange(n, dtype=np.int32))


def eval_batches(source, batch_size, k=1, **process):
  config = ml_collections.ConfigDict(dict(batch_size=batch_size, per_device_batch_size=0,
                                          steps_per_dispatch=k, num_workers=0))
  return batches.eval_batches(source, plan.resolved(config), **process)


def unstacked(elements) -> list[dict]:
  """Elements of k stacked batches -> the batches, in order."""
  return [{key: value[i] for key, value in element.items()}
          for element in elements for i in range(len(element["mask"]))]


def real_labels(batch) -> list[int]:
  return batch["label"][batch["mask"]].tolist()


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("n, batch_size", [(77, 16), (64, 16), (5, 8)])
def test_every_example_once_padding_masked(n, batch_size, k):
  elements = list(eval_batches(numbered(n), batch_size, k))
  num_batches = -(-n // batch_size)
  assert len(elements) == -(-num_batches // k)
  assert [len(e["mask"]) for e in elements[:-1]] == [k] * (len(elements) - 1)
  batches = unstacked(elements)
  assert len(batches) == num_batches  # the last element: only the batches left
  assert all(b["mask"].any() for b in batches)  # no batch of padding alone
  assert all(b["image"].shape == (batch_size, 1, 1, 1) for b in batches)
  assert all(b["image"].dtype == np.uint8 for b in batches)  # as stored
  assert [label for b in batches for label in real_labels(b)] == list(range(n))
  assert batches[-1]["mask"].sum() == n - (num_batches - 1) * batch_size
  for b in batches:
    assert not b["label"][~b["mask"]].any()  # padding is zeros
    assert not b["image"][~b["mask"]].any()


@pytest.mark.parametrize("n, batch_size, processes", [(1001, 64, 2), (77, 16, 4), (9, 4, 2)])
def test_processes_split_each_global_batch(n, batch_size, processes):
  single = unstacked(eval_batches(numbered(n), batch_size, 3))
  per_process = [unstacked(eval_batches(numbered(n), batch_size, 3,
                                        rows=block(p, processes, batch_size)))
                 for p in range(processes)]
  assert {len(batches) for batches in per_process} == {len(single)}  # same step count everywhere
  for step, batch in enumerate(single):
    parts = [batches[step] for batches in per_process]
    assert all(part["label"].shape == (batch_size // processes,) for part in parts)
    assert sorted(sum((real_labels(part) for part in parts), [])) == real_labels(batch)


def test_train_stream_is_a_fresh_seeded_permutation_each_epoch(tiny_config):
  tiny_config.num_epochs, tiny_config.batch_size = 3, 16
  n = 50
  epochs = [real_labels(b) for b in unstacked(batches.train_batches(numbered(n),
                                                                           plan.resolved(tiny_config)))]
  labels = sum(epochs, [])
  assert len(labels) == 3 * n
  per_epoch = [labels[i * n:(i + 1) * n] for i in range(3)]
  assert all(sorted(epoch) == list(range(n)) for epoch in per_epoch)
  assert per_epoch[0] != per_epoch[1] != per_epoch[2]
  again = unstacked(batches.train_batches(numbered(n), plan.resolved(tiny_config)))
  assert sum((real_labels(b) for b in again), []) == labels
  tiny_config.seed += 1
  other = unstacked(batches.train_batches(numbered(n), plan.resolved(tiny_config)))
  assert sum((real_labels(b) for b in other), []) != labels


@pytest.mark.parametrize("first_step", [0, 5, 7])  # 7: inside an element of k=5 batches
def test_resumed_stream_starts_at_the_batch_after_the_last_step(tiny_config, first_step):
  tiny_config.num_epochs, tiny_config.batch_size = 2, 16  # 13 batches: elements of 5, 5, 3 + 2
  k = tiny_config.steps_per_dispatch = 5
  everything = unstacked(batches.train_batches(numbered(100), plan.resolved(tiny_config)))
  resumed = unstacked(input_pipeline.as_iterator(
      batches.train_batches(numbered(100), plan.resolved(tiny_config), first_step),
      tiny_config))
  skipped = first_step % k  # batches of the first element already trained on: all padding
  assert len(resumed) == len(everything) - first_step + skipped
  assert not any(b["mask"].any() for b in resumed[:skipped])
  for a, b in zip(everything[first_step:], resumed[skipped:], strict=True):
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])


def block(p: int, processes: int, batch_size: int) -> tuple[int, ...]:
  """Process p's rows of each global batch, as `sharding.process_rows` gives them on a mesh whose
  processes hold consecutive devices."""
  local = batch_size // processes
  return tuple(range(p * local, (p + 1) * local))


def test_training_batches_do_not_depend_on_the_process_count(tiny_config):
  """Shuffle and stream positions (which key the augmentation, on the device) are functions of
  the position in the stream: 2 processes together produce exactly the global batches of 1, row
  for row (a model's random draws, keyed by row, fall on the same examples)."""
  tiny_config.batch_size = 64
  source = sources.ArraySource(
      np.random.default_rng(0).integers(0, 256, (100, 8, 8, 1), dtype=np.uint8), np.arange(100))
  config = plan.resolved(tiny_config)
  single = list(batches.train_batches(source, config))
  parts = [list(batches.train_batches(source, config, rows=block(p, 2, 64)))
           for p in range(2)]
  for step, element in enumerate(single):
    for key in element:
      joined = np.concatenate([parts[0][step][key], parts[1][step][key]], axis=1)
      np.testing.assert_array_equal(joined, element[key])
  # Rows of another order (a mesh whose processes' devices alternate): read where they sit.
  rows = tuple(r for r in range(64) if r // 8 % 2)
  odd = list(batches.train_batches(source, plan.resolved(tiny_config), rows=rows))
  for step, element in enumerate(single):
    for key in element:
      np.testing.assert_array_equal(odd[step][key], element[key][:, list(rows)])


@pytest.mark.parametrize("processes", [1, 2])
def test_a_worker_reads_one_devices_share_of_an_element(tiny_config, processes):
  """What a Grain worker builds and sends is a unit: one device's share of each of an element's k
  batches (`[k, 64 / 8 devices / processes, ...]`), which that device takes as it is; the
  elements stacked from the units are those read a whole element at a time, in training and in
  evaluation, for k = 1 and 5. Without workers a unit is the whole element (one gather)."""
  tiny_config.batch_size, tiny_config.num_epochs, tiny_config.num_workers = 64, 2, 0
  k = tiny_config.steps_per_dispatch
  elements = batches.train_batches(numbered(150), plan.resolved(tiny_config))
  assert elements.units[0]["mask"].shape == (k, 64)
  tiny_config.num_workers = 1
  source = numbered(150)
  for k in (1, 5):
    tiny_config.steps_per_dispatch = k
    for name, trim in (("train_batches", False), ("eval_batches", True)):
      rows = block(processes - 1, processes, 64) if processes > 1 else None
      elements = getattr(batches, name)(source, plan.resolved(tiny_config), rows=rows)
      assert elements.shares == 8
      kept = min(k, -(-150 // 64)) if trim else k  # evaluation: the batches there are
      assert elements.units[0]["image"].shape == (kept, 64 // 8 // processes, 1, 1, 1)
      whole = batches.LoadUnit(  # an element a unit
          source, 64, 1 if trim else 2, None if trim else tiny_config.seed, k, trim=trim,
          rows=rows)
      expected = batches.Elements(whole)
      assert len(elements) == len(expected) == -(-(150 if trim else 300) // 64 // k)
      for got, want in zip(elements, expected, strict=True):
        for key in want:
          np.testing.assert_array_equal(got[key], want[key])


@pytest.mark.parametrize("parallelism", ["spmd", "fsdp", "pmap"])
def test_an_elements_shares_are_placed_as_the_element_itself(tiny_config, parallelism):
  """The 8 shares of an element (what workers send), each put on its own device, make the same
  arrays, shard for shard on the same devices, as the element stacked on the host and split by
  JAX: on spmd's mesh, fsdp's 2 x 4 and pmap's devices."""
  tiny_config.num_workers, tiny_config.batch_size, tiny_config.steps_per_dispatch = 1, 64, 3
  tiny_config.parallelism, tiny_config.fsdp_devices = parallelism, 4
  elements = batches.train_batches(numbered(150), plan.resolved(tiny_config))
  assert elements.shares == 8
  if parallelism == "pmap":
    put = pmap.pmap_batch
  else:
    put = functools.partial(sharding.global_batch, mesh=sharding.make_mesh(tiny_config))
  for e in range(len(elements)):
    shares = [elements.units[e * 8 + r] for r in range(8)]
    placed, stacked = put(shares), put(elements[e])
    for key, want in stacked.items():
      assert placed[key].shape == want.shape and placed[key].sharding == want.sharding
      for got_shard, want_shard in zip(placed[key].addressable_shards, want.addressable_shards,
                                       strict=True):
        assert got_shard.device == want_shard.device and got_shard.index == want_shard.index
        np.testing.assert_array_equal(np.asarray(got_shard.data), np.asarray(want_shard.data))


def test_a_unit_goes_through_shared_memory_into_a_file_given_back_and_a_full_one_pickled(
    monkeypatch, caplog):
  """A worker's unit: its large arrays in /dev/shm, read back equal by the main process, which
  gives the file back once nothing maps it; the worker writes its next units into that file (a
  smaller one, then one of the same size through its mapping), read back equal; with /dev/shm
  full, the arrays travel as they are, said once, and no file is left."""
  outbox = shm.Outbox(prefix := shm.iterator_prefix())
  unit = {"image": np.arange(4 * 64 * 64 * 3, dtype=np.uint32).reshape(4, 64, 64, 3),
          "mask": np.ones(4, bool)}
  sent = outbox(unit)
  assert isinstance(sent["image"], shm.Shared) and sent["mask"] is unit["mask"]  # (small)
  received = shm.receive(sent)
  np.testing.assert_array_equal(received["image"], unit["image"])
  (path,) = glob.glob(f"{shm.DIRECTORY}/{prefix}-*")
  assert os.path.basename(path) == sent["image"].name  # in use: as sent
  inode, image = os.stat(path).st_ino, received["image"]
  del received
  assert os.path.basename(path) == sent["image"].name  # a view of it still held
  del image
  (path,) = glob.glob(f"{shm.DIRECTORY}/{prefix}-*")
  assert f"-{shm.GIVEN_BACK}" in os.path.basename(path)
  smaller = {"image": unit["image"][:2][::-1].copy(), "mask": np.ones(2, bool)}
  sent = outbox(smaller)
  (path,) = glob.glob(f"{shm.DIRECTORY}/{prefix}-*")
  assert os.path.basename(path) == sent["image"].name and os.stat(path).st_ino == inode
  assert os.path.getsize(path) == smaller["image"].nbytes
  np.testing.assert_array_equal(shm.receive(sent)["image"], smaller["image"])

  def full(fd, data):
    raise OSError(errno.ENOSPC, "No space left on device")

  again = {"image": smaller["image"][::-1] + 1, "mask": np.ones(2, bool)}  # the same size:
  with monkeypatch.context() as patch:  # copied through the worker's mapping, not written
    patch.setattr(os, "write", full)
    sent = outbox(again)
  (path,) = glob.glob(f"{shm.DIRECTORY}/{prefix}-*")
  assert os.path.basename(path) == sent["image"].name and os.stat(path).st_ino == inode
  np.testing.assert_array_equal(shm.receive(sent)["image"], again["image"])
  caplog.set_level(logging.WARNING)
  monkeypatch.setattr(os, "write", full)
  for _ in range(2):
    assert outbox(unit)["image"] is unit["image"]
  assert [r.getMessage() for r in caplog.records] == [
      f"{shm.DIRECTORY} is full ([Errno 28] No space left on device): units travel pickled, "
      "slower; give it more room (Docker: --shm-size=16g or --ipc=host)"]
  assert not glob.glob(f"{shm.DIRECTORY}/{prefix}-*")


@pytest.mark.slow  # (a worker process: the unit's own test above is the fast tier's)
def test_what_the_devices_hold_keeps_its_file_and_what_they_let_go_is_written_again(
    tiny_config, monkeypatch):
  """With a worker, the devices' arrays made from a unit's shared memory (the CPU's without a
  copy) keep its file from the worker's next units: 3 elements placed and held while 9 more go
  through are still what they were; the files the devices let go are written again (fewer files
  than units)."""
  tiny_config.num_workers, tiny_config.batch_size, tiny_config.steps_per_dispatch = 1, 64, 1
  tiny_config.num_epochs = 4
  images = np.random.default_rng(0).integers(0, 255, (192, 16, 16, 3), dtype=np.uint8)
  elements = batches.train_batches(sources.ArraySource(images, np.arange(192) % 10),
                                   plan.resolved(tiny_config))
  assert len(elements) == 12 and elements.shares == 8  # a unit: 8 x 16 x 16 x 3, in /dev/shm
  files = held_while_more_go_through(elements, tiny_config, monkeypatch, ("image", "label", "mask"))
  print(f"{files} files for {12 * 8} units")
  assert 24 <= files < 12 * 8, files  # the held 3 elements' 24 at least; reused


# A run that holds its lock (shm.hold_run_lock) and makes one unit, then waits to be killed.
RUN_THAT_MAKES_A_UNIT = """
import mmap, os, sys, time
from {{cookiecutter.project_slug}}.data import shm
shm.DIRECTORY = sys.argv[1]
prefix = shm.iterator_prefix()
with open(os.path.join(shm.DIRECTORY, prefix + "-1-0"), "wb") as f:
  f.write(bytes(2**20))
with open(os.path.join(shm.DIRECTORY, f"sem.mp-{shm.RUN}"), "wb+") as f:  # (as sem_open's)
  f.write(bytes(32))
  f.flush()
  semaphore = mmap.mmap(f.fileno(), 32)
print(shm.RUN, flush=True)
time.sleep(120)
"""


def test_what_a_killed_run_left_is_removed_by_the_next_run_and_a_live_runs_kept(
    tmp_path, monkeypatch, caplog):
  """Two runs (real processes) hold their locks and make a unit and a semaphore each (mapped, as
  multiprocessing's); one is SIGKILLed: the next run removes that one's unit, semaphore and
  lock, says so in one line, and keeps the live run's."""
  monkeypatch.setattr(shm, "DIRECTORY", str(tmp_path))
  runs = [subprocess.Popen([sys.executable, "-c", RUN_THAT_MAKES_A_UNIT, str(tmp_path)],
                           stdout=subprocess.PIPE, text=True) for _ in range(2)]
  try:
    killed, alive = [run.stdout.readline().strip() for run in runs]
    runs[0].kill()
    runs[0].wait(timeout=60)
    caplog.set_level(logging.WARNING)
    shm.remove_leftovers.cache_clear()
    shm.remove_leftovers()
    assert [r.getMessage() for r in caplog.records] == [
        f"removed 1 unit (1 MiB) and 1 semaphore that 1 run no longer running left in {tmp_path}"]
    assert not glob.glob(f"{tmp_path}/{shm.PREFIX}-{killed}*")
    assert not os.path.exists(f"{tmp_path}/sem.mp-{killed}")
    assert len(glob.glob(f"{tmp_path}/{shm.PREFIX}-{alive}*")) == 2  # its lock and its unit
    assert os.path.exists(f"{tmp_path}/sem.mp-{alive}")
  finally:
    for run in runs:
      run.kill()
      run.wait(timeout=60)


@pytest.mark.parametrize("fraction", [0.2, 0.37])
def test_the_digits_are_scikit_learns_held_out_as_its_train_test_split_does(tiny_config,
                                                                           fraction):
  """The digits the package ships, without scikit-learn: its images and labels, held out as
  `train_test_split(..., test_size, random_state=0, stratify=labels)` holds them out, in its
  order (scikit-learn: the test extras' alone)."""
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split

  digits = load_digits()
  images = np.round(digits.images * (255 / 16)).astype(np.uint8)[..., None]
  train_x, eval_x, train_y, eval_y = train_test_split(
      images, digits.target.astype(np.int32), test_size=fraction, random_state=0,
      stratify=digits.target)
  tiny_config.eval_fraction = fraction
  splits, _ = sources.get_datasets(tiny_config)
  for split, (x, y) in (("train", (train_x, train_y)), ("eval", (eval_x, eval_y))):
    np.testing.assert_array_equal(splits[split].images, x)
    np.testing.assert_array_equal(splits[split].labels, y)


def test_digits_split(tiny_config):
  splits, info = sources.get_datasets(tiny_config)
  assert info.image_shape == (8, 8, 1) and info.num_classes == 10
  assert info.num_examples == {"train": 1437, "eval": 360}
  images = splits["eval"].take(np.arange(360))["image"]
  assert images.dtype == np.uint8 and images.min() == 0 and images.max() == 255


def test_synthetic_images_are_uint8(tiny_config):
  tiny_config.dataset = "synthetic"
  splits, info = sources.get_datasets(tiny_config)
  element = batches.train_batches(splits["train"], plan.resolved(tiny_config))[0]
  assert element["image"].dtype == np.uint8
  assert element["image"].shape == (tiny_config.steps_per_dispatch, tiny_config.batch_size,
                                    *info.image_shape)


def test_arrayrecord_round_trip(tmp_path, tiny_config):
  """Shards written by write_arrayrecord.py are read back, example by example, by the pipeline."""
  rng = np.random.default_rng(0)
  arrays = {split: (rng.integers(0, 256, (n, 6, 5, 3), dtype=np.uint8),
                    rng.integers(0, 4, n).astype(np.int32)) for split, n in
            (("train", 53), ("eval", 11))}
  write_dataset(str(tmp_path), arrays, num_shards=3)
  assert len(arrayrecord.arrayrecord_paths(str(tmp_path), "train")) == 3
  tiny_config.dataset, tiny_config.data_dir = "arrayrecord", str(tmp_path)
  splits, info = sources.get_datasets(tiny_config)
  assert info.image_shape == (6, 5, 3)
  assert info.num_classes == int(max(y.max() for _, y in arrays.values())) + 1
  assert info.num_examples == {"train": 53, "eval": 11}
  for split, (images, labels) in arrays.items():
    read = splits[split].take(np.arange(len(labels)))
    np.testing.assert_array_equal(read["image"], images)
    np.testing.assert_array_equal(read["label"], labels)
  batch = unstacked(batches.eval_batches(splits["eval"], plan.resolved(tiny_config)))[0]
  np.testing.assert_array_equal(batch["image"][:11], arrays["eval"][0])  # still uint8


def features(tmp_path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """[N, 30] feature vectors and their labels, by split, also saved as tmp_path/features.npz."""
  rng = np.random.default_rng(0)
  splits = {split: (rng.integers(0, 256, (n, 30)).astype(np.uint8), rng.integers(0, 3, n))
            for split, n in (("train", 40), ("eval", 8))}
  np.savez(tmp_path / "features.npz", **{f"{s}_images": x for s, (x, _) in splits.items()},
           **{f"{s}_labels": y for s, (_, y) in splits.items()})
  return splits


def test_write_arrayrecord_refuses_features_naming_the_reshape(tmp_path):
  """[N, F] feature arrays are refused in one line that names the reshape and the shift to turn
  off, with nothing written."""
  features(tmp_path)
  out = run_main(write_arrayrecord, f"--out_dir={tmp_path / 'refused'}",
                 f"--npz={tmp_path / 'features.npz'}")
  assert out.returncode == 1 and out.stderr.strip().splitlines() == [
      "error: train_images is [40, 30]; images must be [N, H, W, C]. For feature vectors [N, F], "
      "store them as [N, 1, F, 1] (`x.reshape(len(x), 1, -1, 1)`) and train with "
      "--config.augment_max_shift=0 (no shifts along the features)."], out.stderr
  assert not (tmp_path / "refused").exists()


@pytest.mark.slow
def test_features_stored_as_the_refusal_says_train(tmp_path, tiny_config):
  write_dataset(str(tmp_path / "data"), {s: (x.reshape(len(x), 1, -1, 1), y)
                                         for s, (x, y) in features(tmp_path).items()})
  tiny_config.dataset, tiny_config.data_dir = "arrayrecord", str(tmp_path / "data")
  tiny_config.augment_max_shift, tiny_config.num_epochs, tiny_config.batch_size = 0, 1, 8
  result = train.train_and_evaluate(tiny_config, str(tmp_path / "workdir"))
  assert result["examples"] == 8 and np.isfinite(result["loss"])


@pytest.mark.parametrize("case", ["int64", "dark", "too_large", "missing_key"])
def test_write_arrayrecord_checks_the_pixels(tmp_path, case):
  """Integer pixels that fit 0..255 are written as uint8; pixels far below 255 (the digits'
  raw 0..16) get a warning; others, and an .npz without a key, stop with one line."""
  rng = np.random.default_rng(0)
  high = {"int64": 256, "dark": 17, "too_large": 300, "missing_key": 256}[case]
  arrays = {}
  for split, n in (("train", 20), ("eval", 6)):
    arrays[f"{split}_images"] = rng.integers(0, high, (n, 4, 4, 1)).astype(
        np.uint8 if case == "dark" else np.int64)
    arrays[f"{split}_labels"] = rng.integers(0, 3, n)
  if case == "missing_key":
    del arrays["eval_labels"]
  np.savez(tmp_path / "mine.npz", **arrays)
  out = run_main(write_arrayrecord, f"--out_dir={tmp_path / 'data'}",
                 f"--npz={tmp_path / 'mine.npz'}")
  lines = out.stderr.strip().splitlines()
  if case in ("too_large", "missing_key"):
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert lines[0] == ("error: train_images hold integers from 0 to 299, which do not fit "
                        "uint8; scale them to 0..255 (or store floats, given to the model as "
                        "they are)." if case == "too_large" else
                        f"error: {tmp_path / 'mine.npz'} has no eval_labels; it must hold "
                        "train_images, train_labels, eval_images, eval_labels.")
    assert not (tmp_path / "data").exists()
    return
  assert out.returncode == 0, out.stderr
  warned = [line for line in lines if line.startswith("warning: ")]
  assert len(warned) == (2 if case == "dark" else 0), out.stderr
  if case == "dark":
    assert warned[0].startswith("warning: train_images are at most 16 of 255; the step divides")
  config = ml_collections.ConfigDict(dict(dataset="arrayrecord", data_dir=str(tmp_path / "data")))
  splits, _ = sources.get_datasets(config)
  read = splits["train"].take(np.arange(20))["image"]
  assert read.dtype == np.uint8
  np.testing.assert_array_equal(read, arrays["train_images"])


@pytest.mark.parametrize("dataset, cores, expected", [
    ("digits", 16, 0), ("synthetic", 16, 0), ("arrayrecord", 16, 15), ("arrayrecord", 4, 3),
    ("arrayrecord", 1, 1), ("tfds", 224, 223)])
def test_workers_chosen_from_the_cores(tiny_config, monkeypatch, dataset, cores, expected):
  monkeypatch.setattr(batches, "available_cpus", lambda: cores)
  tiny_config.dataset = dataset
  assert tiny_config.num_workers == -1  # the default: chosen
  assert batches.default_workers(tiny_config) == expected
  tiny_config.num_workers = 2
  assert batches.default_workers(tiny_config) == 2


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_workers_follow_the_cores_this_process_may_use(tiny_config, monkeypatch):
  """On a 16-core node, a process bound to one core (a SLURM task, taskset) starts one worker,
  not 15."""
  monkeypatch.setattr(os, "cpu_count", lambda: 16)  # the node
  tiny_config.dataset = "arrayrecord"
  allowed = os.sched_getaffinity(0)
  os.sched_setaffinity(0, {min(allowed)})
  try:
    assert batches.default_workers(tiny_config) == 1
  finally:
    os.sched_setaffinity(0, allowed)
  assert os.sched_getaffinity(0) == allowed


NPZ_SOURCE = '''
"""A data source of one's own: arrays in an .npz file (config.data_dir), held in memory."""
import numpy as np

from {{cookiecutter.project_slug}}.data.sources import ArraySource, Loaded


def load(config):
  arrays = np.load(config.data_dir)
  return Loaded({"train": ArraySource(arrays["x_train"], arrays["y_train"]),
                 "eval": ArraySource(arrays["x_test"], arrays["y_test"])},
                arrays["x_train"].shape[1:], int(arrays["y_train"].max()) + 1)


def describe(config):
  return None  # (known once loaded)


def check(config):
  if not config.data_dir.endswith(".npz"):
    return f"config.data_dir={config.data_dir!r} is not an .npz file."
  return None
'''


def test_a_new_data_source_is_a_module_and_one_line(tiny_config, tmp_path, monkeypatch):
  """An .npz source: its module (load, describe, check) and its line in SOURCES; the config is
  checked by it, the data described by reading it, and batched as any other."""
  from {{cookiecutter.project_slug}} import plan

  (tmp_path / "npz_source.py").write_text(NPZ_SOURCE)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setitem(sources.SOURCES, "npz", sources.Source("npz_source", reads_data_dir=True))
  digits, _ = sources.get_datasets(tiny_config)
  np.savez(tmp_path / "digits.npz", x_train=digits["train"].images, y_train=digits["train"].labels,
           x_test=digits["eval"].images, y_test=digits["eval"].labels)
  tiny_config.dataset, tiny_config.data_dir = "npz", str(tmp_path / "digits.npz")
  rules.validate_config(tiny_config)
  splits, info = sources.get_datasets(tiny_config)
  assert (info.image_shape, info.num_classes, info.num_examples) == ((8, 8, 1), 10, {
      "train": 1437, "eval": 360})
  assert sources.describe(tiny_config) == info
  elements = batches.eval_batches(splits["eval"], plan.resolved(tiny_config))
  assert sum(int(element["mask"].sum()) for element in elements) == 360
  tiny_config.data_dir = str(tmp_path)
  with pytest.raises(rules.ConfigError, match=r"config.data_dir='.*' is not an .npz file."):
    rules.validate_config(tiny_config)


# Written from sources.Split's docstring and the README alone (#80): a file source that can fail.
CSV_SOURCE = '''
"""A data source of one's own: a CSV of image paths and labels (config.data_dir: the file; the
paths relative to it), its last 40 rows the eval split; grey images of 8x8, read a batch at a
time (sources.Split)."""
import csv
import os

import numpy as np
from PIL import Image

from {{cookiecutter.project_slug}}.data.sources import Loaded


class CsvSplit:
  crops = None  # images as they are stored

  def __init__(self, rows, root, name):
    self.rows, self.root, self.name = rows, root, name

  def __len__(self):
    return len(self.rows)

  def take(self, indices, positions=None, empty=None):
    images, failed = np.zeros((len(indices), 8, 8, 1), np.uint8), {}
    for j, i in enumerate(indices):
      try:
        with Image.open(os.path.join(self.root, self.rows[i][0])) as image:
          images[j, ..., 0] = np.asarray(image.convert("L"))
      except OSError as e:
        failed[j] = f"{self.rows[i][0]}: {e}"
    labels = np.array([int(self.rows[i][1]) for i in indices], np.int32)
    return {"image": images, "label": labels, "failed": failed}


def load(config):
  with open(config.data_dir, newline="") as f:
    rows = [(row["path"], row["label"]) for row in csv.DictReader(f)]
  root = os.path.dirname(config.data_dir)
  return Loaded({"train": CsvSplit(rows[:-40], root, "csv train"),
                 "eval": CsvSplit(rows[-40:], root, "csv eval")}, (8, 8, 1), 10)


def describe(config):
  return None  # (known once loaded)


def check(config):
  if not config.data_dir.endswith(".csv"):
    return f"config.data_dir={config.data_dir!r} is not a .csv file."
  return None
'''


def test_a_csv_source_of_image_files_written_from_the_protocol(tiny_config, tmp_path, monkeypatch,
                                                               caplog):
  """A CSV of image paths and labels (`CSV_SOURCE`, written from sources.Split alone): 120 PNG
  files of the digits, one of the eval split's not an image. Described by reading it, its eval
  split batched with that one masked out and named (by the split's name and row), and a run
  trains on it to the end: every other example counted once."""
  from PIL import Image

  (tmp_path / "csv_source.py").write_text(CSV_SOURCE)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setitem(sources.SOURCES, "csv", sources.Source("csv_source", reads_data_dir=True))
  digits, _ = sources.get_datasets(tiny_config)
  rows = ["path,label"]
  for i in range(120):
    Image.fromarray(digits["train"].images[i, ..., 0]).save(tmp_path / f"{i}.png")
    rows.append(f"{i}.png,{digits['train'].labels[i]}")
  (tmp_path / "100.png").write_text("not an image")  # eval row 20
  (tmp_path / "images.csv").write_text("\n".join(rows) + "\n")
  tiny_config.dataset, tiny_config.data_dir = "csv", str(tmp_path / "images.csv")
  rules.validate_config(tiny_config)
  splits, info = sources.get_datasets(tiny_config)
  assert (info.image_shape, info.num_classes, info.num_examples) == ((8, 8, 1), 10, {
      "train": 80, "eval": 40})
  np.testing.assert_array_equal(splits["train"].take(np.arange(3))["image"],
                                digits["train"].images[:3])
  with caplog.at_level(logging.WARNING):
    elements = batches.eval_batches(splits["eval"], plan.resolved(tiny_config))
  assert sum(int(element["mask"].sum()) for element in elements) == 39
  assert "skipped csv eval row 20, unreadable (100.png: " in caplog.text, caplog.text
  tiny_config.num_epochs = 1
  result = train.train_and_evaluate(tiny_config, str(tmp_path / "workdir"))
  assert result["examples"] == 39


def test_a_batch_larger_than_the_training_set_is_said_in_one_line(tiny_config, caplog):
  """A global batch of 2048 on the digits' 1,437 training examples: said in one line, with how
  often a step holds each example and the batch that fits (a multiple of the 8 devices)."""
  tiny_config.batch_size = 2048
  with caplog.at_level(logging.WARNING):
    data = input_pipeline.Input(plan.resolved(tiny_config))
  lines = [r.getMessage() for r in caplog.records if "than the training set" in r.getMessage()]
  assert lines == ["the global batch of 2048 is larger than the training set's 1437 examples: a "
                   f"step holds each about 1.4 times ({data.num_train_steps} steps in all); "
                   "--config.batch_size=1432 fits it"], lines
  data.close()
