"""Several processes on JAX's distributed runtime (over 127.0.0.1) = one process, exactly."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import portpicker
import pytest
from conftest import OWN, RECIPE, alive
from test_train import read_scalars

from {{cookiecutter.project_slug}}.training import trained

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(workdir, processes: int, *overrides: str,
          own: bool = True) -> dict[str, dict[int, float]]:
  """Runs train.py on 8 CPU devices in all (1 x 8 or 2 x 4), on the tests' own model and
  recipe (`own`; else model.py and recipe.py); returns its scalars."""
  args = ["--config=configs/tiny.py", *(OWN if own else ()), f"--workdir={workdir}", *overrides]
  if processes == 1:
    command = [sys.executable, "train.py", *args]
    env = dict(os.environ)  # 8 devices (conftest.py)
  else:
    command = [sys.executable, "launch.py", f"--num_processes={processes}",
               f"--devices_per_process={8 // processes}", "--timeout=400", "--", *args]
    env = dict(os.environ)
  out = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True,
                       timeout=450)
  assert out.returncode == 0, out.stderr[-4000:]
  assert "[Gloo]" not in out.stdout + out.stderr  # (gloo's connection lines: --verbosity=1)
  return read_scalars(str(workdir))


def assert_same_run(multi, single):
  assert sorted(multi["train_loss"]) == sorted(single["train_loss"])
  for step, loss in single["train_loss"].items():
    assert multi["train_loss"][step] == pytest.approx(loss, abs=1e-5), step
  assert multi["train_examples"] == single["train_examples"]
  assert multi["eval_examples"] == single["eval_examples"]
  for step, accuracy in single["eval_accuracy"].items():
    assert multi["eval_accuracy"][step] == pytest.approx(accuracy, abs=1e-6), step
    assert multi["eval_loss"][step] == pytest.approx(single["eval_loss"][step], abs=1e-5), step


@pytest.mark.slow
def test_two_processes_train_like_the_straight_spmd_run(straight_runs, tmp_path):
  """2 processes of 4 devices over loopback train like one process of 8: the same losses,
  accuracies and example counts at every step as conftest's spmd run (2 epochs, in-process),
  with the recipe's options on (a per-device batch of 8: the global batch of 8 devices)."""
  multi = train(tmp_path, 2, "--config.parallelism=spmd", "--config.num_epochs=2",
                "--config.max_checkpoints_to_keep=10", "--config.fsdp_min_size=0",
                *[f"--config.{key}={value}" for key, value in RECIPE.items()])
  assert_same_run(multi, read_scalars(str(straight_runs["spmd"][0])))
  assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1  # only process 0 writes
  # Its workdir describes itself: evaluate.py's set-up, from the workdir alone, in this process
  # (8 devices), reproduces the final evaluation of the two processes.
  import evaluate

  from {{cookiecutter.project_slug}}.data import sources

  run = trained.Restored(str(tmp_path))
  assert run.step == 45
  result = evaluate.evaluate(run, sources.get_datasets(run.config)[0]["eval"])
  assert result["examples"] == multi["eval_examples"][45] == 360
  assert result["accuracy"] == pytest.approx(multi["eval_accuracy"][45], abs=1e-6)
  assert result["loss"] == pytest.approx(multi["eval_loss"][45], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 5])  # steps per dispatch
@pytest.mark.parametrize("parallelism", ["spmd", "pmap"])
def test_two_processes_train_like_one(tmp_path, parallelism, k):
  """With Dropout (the CNN's, before its classifier): a process reads the rows of the global
  batch that its devices hold, so every example meets the same mask in both runs (on pmap too:
  each device draws by its index, and holds the same rows)."""
  overrides = (f"--config.parallelism={parallelism}", f"--config.steps_per_dispatch={k}",
               "--config.model.dropout=0.3")
  single = train(tmp_path / "one", 1, *overrides)
  multi = train(tmp_path / "two", 2, *overrides)
  assert_same_run(multi, single)
  assert set(single["eval_examples"].values()) == {360}
  # Only process 0 writes metrics: one events file.
  assert len(list((tmp_path / "two").glob("events.out.tfevents.*"))) == 1


@pytest.mark.slow
@pytest.mark.parametrize("parallelism, processes", [("spmd", 1), ("spmd", 2), ("pmap", 2),
                                                    ("fsdp", 2)])
def test_shares_from_workers_train_like_elements_read_in_one_gather(tmp_path, parallelism,
                                                                     processes):
  """A Grain worker a process: each local device's share of an element made there, sent in
  shared memory and put on its device as it is, trains exactly as the digits gathered in
  memory by one process, without workers."""
  overrides = (f"--config.parallelism={parallelism}", "--config.steps_per_dispatch=5",
               "--config.fsdp_min_size=0")
  single = train(tmp_path / "one", 1, *overrides)
  assert_same_run(train(tmp_path / "workers", processes, *overrides, "--config.num_workers=1"),
                  single)


@pytest.mark.slow
def test_photos_resized_on_the_devices_train_alike_on_every_path(tmp_path):
  """Photos stored whole (120 JPEGs and PNGs of 3 sizes at shorter side 36, crops at 32), cut on
  the host and resized on the devices, with the crop and the flip: pmap, fsdp, and 2 processes
  of a worker each train exactly as spmd on one process; resized on the host, the same run
  learns alike (its pixels within one level of 255 of these)."""
  from test_image_folder import convert, write_photos

  write_photos(tmp_path / "photos", sizes=((40, 56), (56, 40), (44, 44)), per_class=40)
  done = convert(f"--out_dir={tmp_path / 'data'}", f"--image_folder={tmp_path / 'photos'}",
                 "--image_size=32", "--resize_shorter=36", "--eval_fraction=0.25")
  assert done.returncode == 0, done.stderr
  photos = ("--config.dataset=arrayrecord", f"--config.data_dir={tmp_path / 'data'}",
            "--config.augment_crop=True", "--config.augment_flip=True", "--config.batch_size=16",
            "--config.num_epochs=3", "--config.fsdp_min_size=0", "--config.eval_every_steps=6")
  single = train(tmp_path / "spmd", 1, *photos, "--config.num_workers=0")
  assert set(single["eval_examples"].values()) == {30} and single["train_examples"]
  for name, processes, overrides in (("pmap", 1, ("--config.parallelism=pmap",)),
                                     ("fsdp", 1, ("--config.parallelism=fsdp",)),
                                     ("two", 2, ("--config.num_workers=1",))):
    assert_same_run(train(tmp_path / name, processes, *photos, *overrides), single)
  on_host = train(tmp_path / "host", 1, *photos, "--config.resize_on_device=False")
  last = max(single["eval_loss"])
  assert on_host["eval_loss"][last] == pytest.approx(single["eval_loss"][last], rel=0.02)


@pytest.mark.slow
def test_two_processes_train_like_one_under_fsdp(tmp_path):
  """The state split over each process's 4 devices (a 2 x 4 mesh: hybrid sharding, replicated
  across the processes), or over all 8 (each shard on one process; Orbax writes both): the
  run of one process with the state split over its 8 devices."""
  fsdp = ("--config.parallelism=fsdp", "--config.fsdp_min_size=0")
  single = train(tmp_path / "one", 1, *fsdp)
  for fsdp_devices in (4, 8):
    multi = train(tmp_path / str(fsdp_devices), 2, *fsdp, f"--config.fsdp_devices={fsdp_devices}")
    assert_same_run(multi, single)


@pytest.mark.slow
def test_uneven_eval_split_counts_every_example_once(tmp_path):
  """1001 eval examples over 2 processes of batch 32: 501 and 500 real ones, same step count."""
  overrides = ["--config.dataset=synthetic", "--config.synthetic.image_shape=(8,8,1)",
               "--config.synthetic.num_train=256", "--config.synthetic.num_eval=1001",
               "--config.batch_size=64"]
  single = train(tmp_path / "one", 1, *overrides)
  multi = train(tmp_path / "two", 2, *overrides)
  assert set(multi["eval_examples"].values()) == {1001}
  assert_same_run(multi, single)


@pytest.mark.slow
def test_resume_with_another_number_of_processes(tmp_path):
  """The step-20 checkpoint of a 2-process run, resumed by 1 process, ends like a 1-process run."""
  overrides = ["--config.num_epochs=2", "--config.max_checkpoints_to_keep=10"]
  single = train(tmp_path / "one", 1, *overrides)
  train(tmp_path / "two", 2, *overrides)
  shutil.copytree(tmp_path / "two" / "checkpoints" / "20",
                  tmp_path / "resumed" / "checkpoints" / "20")
  resumed = train(tmp_path / "resumed", 1, *overrides)
  assert sorted(resumed["train_loss"]) == [s for s in sorted(single["train_loss"]) if s > 20]
  for step, loss in resumed["train_loss"].items():
    assert loss == pytest.approx(single["train_loss"][step], abs=1e-5), step
  last = max(single["eval_loss"])
  assert resumed["eval_loss"][last] == pytest.approx(single["eval_loss"][last], abs=1e-5)
  assert resumed["eval_accuracy"][last] == pytest.approx(single["eval_accuracy"][last], abs=1e-6)


def four_devices(**env) -> dict[str, str]:
  """The environment of a process of 4 CPU devices (the other XLA flags kept: conftest.py)."""
  return {**os.environ, "XLA_FLAGS": os.environ["XLA_FLAGS"].replace("count=8", "count=4"),
          "JAX_PLATFORMS": "cpu", **env}


def start_pair(workdir, heartbeat: int | None = 10, watched: bool = False, **env):
  """Two train.py processes of 4 CPU devices, training long enough to be interrupted
  (`heartbeat`: their --heartbeat_timeout_seconds; None: the default); `watched`: each under
  clusters/watched.py, as the clusters' files run them."""
  env = four_devices(**env)
  beat = [f"--heartbeat_timeout_seconds={heartbeat}"] if heartbeat else []
  address = f"127.0.0.1:{portpicker.pick_unused_port()}"
  watcher = ["clusters/watched.py"] if watched else []
  processes = [subprocess.Popen(
      [sys.executable, *watcher, "train.py", "--config=configs/tiny.py", *OWN,
       f"--workdir={workdir}", "--config.num_epochs=500", f"--coordinator_address={address}",
       "--num_processes=2", f"--process_id={i}", *beat],
      cwd=PROJECT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
      for i in range(2)]
  deadline = time.monotonic() + 300
  while not (workdir / "checkpoints" / "10").is_dir():  # training is under way
    assert time.monotonic() < deadline and all(p.poll() is None for p in processes)
    time.sleep(0.1)
  return processes


def stop_all(processes):
  for p in processes:
    if p.poll() is None:
      p.kill()


@pytest.mark.slow
def test_launch_stops_everything_soon_after_any_process_dies(tmp_path):
  """launch.py's process 1 SIGKILLed while training: launch.py stops process 0 (SIGTERM, then
  SIGKILL) and exits with the dead process's status (128 + 9) within 15 s, saying which died in
  one line, no survivor's abort dump and no second line of the loss (launch.py watches each
  process's standard error); no process of the run is left."""
  children = []
  launcher = subprocess.Popen(
      [sys.executable, "launch.py", "--num_processes=2", "--devices_per_process=4",
       "--timeout=400", "--", "--config=configs/tiny.py", *OWN, f"--workdir={tmp_path}",
       "--config.num_epochs=500"],
      cwd=PROJECT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 300
    while not (tmp_path / "checkpoints" / "10").is_dir():  # training is under way
      assert time.monotonic() < deadline and launcher.poll() is None
      time.sleep(0.1)
    children = [int(pid) for pid in subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(launcher.pid)], capture_output=True,
        text=True).stdout.split()]
    process_1 = next(pid for pid in children
                     if b"--process_id=1\0" in open(f"/proc/{pid}/cmdline", "rb").read())
    os.kill(process_1, signal.SIGKILL)
    killed = time.monotonic()
    _, stderr = launcher.communicate(timeout=60)
    elapsed = time.monotonic() - killed
  finally:
    for pid in [launcher.pid, *children]:
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
  assert launcher.returncode == 128 + signal.SIGKILL, stderr[-3000:]
  assert "launch.py: process 1 exited with status 137; stopping the others" in stderr
  errors = [line for line in stderr.splitlines() if line.startswith("error:")]
  assert len(errors) <= 1, stderr[-3000:]  # (process 0's own, if its stop could not save)
  for dump in ("Fatal Python error", "Check failure stack trace", "Terminating process"):
    assert dump not in stderr, stderr[-3000:]
  assert elapsed <= 15, elapsed
  assert not [pid for pid in children if alive(pid)]
  print(f"launch.py exited {elapsed:.1f} s after process 1 was killed")


def descendants(pid: int) -> list[int]:
  """The processes below `pid`: its children, theirs, ..."""
  children = [int(c) for c in subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)],
                                             capture_output=True, text=True).stdout.split()]
  return children + [d for child in children for d in descendants(child)]


def launched_and_training(tmp_path) -> tuple[subprocess.Popen, list[int]]:
  """launch.py's 2 processes training (their 10th step's checkpoint written), and every process
  below launch.py."""
  launcher = subprocess.Popen(
      [sys.executable, "launch.py", "--num_processes=2", "--devices_per_process=4",
       "--timeout=400", "--", "--config=configs/tiny.py", *OWN, f"--workdir={tmp_path}",
       "--config.num_epochs=500"],
      cwd=PROJECT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 300
  while not (tmp_path / "checkpoints" / "10").is_dir():  # training is under way
    assert time.monotonic() < deadline and launcher.poll() is None, launcher.stderr.read()[-3000:]
    time.sleep(0.1)
  return launcher, descendants(launcher.pid)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_launch_reaches_every_process_which_saves_and_stops(tmp_path, signum):
  """SIGTERM or SIGHUP to launch.py (what `timeout`, `kill` or a closed terminal sends): passed
  on to both processes, which stop at one step and save it; each exits 143, and launch.py too;
  no process is left. A rank is one process: launch.py has 2 below it, not 4."""
  launcher, below = launched_and_training(tmp_path)
  assert len(below) == 2, [open(f"/proc/{pid}/cmdline").read() for pid in below]
  try:
    launcher.send_signal(signum)
    _, stderr = launcher.communicate(timeout=120)
  finally:
    for pid in [launcher.pid, *below]:
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
  assert launcher.returncode == 143, stderr[-3000:]
  assert f"launch.py: {signal.Signals(signum).name}; passed on to every process" in stderr
  stops = re.findall(r"Stopped by SIGTERM after step (\d+)", stderr)
  steps = sorted(int(d.name) for d in (tmp_path / "checkpoints").iterdir() if d.name.isdigit())
  assert not [pid for pid in below if alive(pid)]
  print(f"stopped: {stops}; checkpoints {steps}")
  assert steps[-1] > 10 and set(stops) == {str(steps[-1])}, (stops, steps, stderr[-3000:])


@pytest.mark.slow
def test_a_sigkill_of_launch_ends_every_process_it_started(tmp_path):
  """SIGKILL of launch.py (nothing it can pass on): every process below it ends within 15 s (the
  kernel kills each with it: prctl's PR_SET_PDEATHSIG), none trains on as an orphan."""
  launcher, below = launched_and_training(tmp_path)
  try:
    launcher.kill()
    launcher.wait(timeout=10)
    killed, deadline = time.monotonic(), time.monotonic() + 60
    while [pid for pid in below if alive(pid)] and time.monotonic() < deadline:
      time.sleep(0.1)
    elapsed = time.monotonic() - killed
  finally:
    for pid in below:
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
  print(f"every process of launch.py's ended {elapsed:.1f} s after its SIGKILL")
  assert elapsed <= 15 and len(below) >= 2, (elapsed, below)


@pytest.mark.slow
def test_sigterm_to_one_process_stops_all_at_the_same_step(tmp_path):
  """SIGTERM to process 1 alone: each process catches SIGTERM itself (its watchdog's, from its
  first line: JAX's preemption service, which would take it from Python, is off) and they agree,
  at the next log step, to stop there together and save."""
  processes = start_pair(tmp_path)
  try:
    processes[1].send_signal(signal.SIGTERM)
    stderrs = [p.communicate(timeout=120)[1] for p in processes]
  finally:
    stop_all(processes)
  assert [p.returncode for p in processes] == [143, 143], stderrs[0][-3000:]
  stops = [line for err in stderrs for line in err.splitlines() if "Stopped by SIGTERM" in line]
  assert len(stops) == 2
  step = int(stops[0].split("after step ")[1].split()[0])
  assert all(f"after step {step} of" in line for line in stops)  # both at the same step
  assert step % 5 == 0  # a log step
  assert (tmp_path / "checkpoints" / str(step)).is_dir()


@pytest.mark.slow
def test_ctrl_c_on_two_processes_saves_as_sigterm_does(tmp_path):
  """Ctrl-C (SIGINT to every process, as a terminal or srun sends it): both stop at the step they
  agree on, save it, and exit 130."""
  processes = start_pair(tmp_path)
  try:
    for p in processes:
      p.send_signal(signal.SIGINT)
    stderrs = [p.communicate(timeout=120)[1] for p in processes]
  finally:
    stop_all(processes)
  assert [p.returncode for p in processes] == [130, 130], stderrs[0][-3000:]
  assert all("Traceback" not in err for err in stderrs)
  stops = [line for err in stderrs for line in err.splitlines() if "Stopped by SIGINT" in line]
  step = int(stops[0].split("after step ")[1].split()[0])
  assert len(stops) == 2 and all(f"after step {step} of" in line for line in stops)
  assert (tmp_path / "checkpoints" / str(step)).is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("victim, heartbeat, within", [(0, 10, 60), (1, 10, 60), (1, None, 120)])
def test_when_a_process_dies_the_other_stops_in_one_line(tmp_path, victim, heartbeat, within):
  """Two processes as the clusters' files run them (each under clusters/watched.py); SIGKILL to
  one (a host lost: its watcher and so the process under it): the survivor ends with one
  `error:` line saying that the job lost a process (naming it where JAX's distributed service
  does), exit 1, no abort dump, within the heartbeat's bound (10 s; JAX's default, 100 s). (Its
  watcher holds the dump back: JAX's service aborts the survivor, gloo may abort it at once, a
  save under way fails.)"""
  processes = start_pair(tmp_path, heartbeat, watched=True)
  try:
    processes[victim].kill()
    killed_at = time.monotonic()
    survivor = processes[1 - victim]
    _, stderr = survivor.communicate(timeout=within + 60)
    elapsed = time.monotonic() - killed_at
  finally:
    stop_all(processes)
  errors = [line for line in stderr.splitlines() if line.startswith("error:")]
  print(f"process {1 - victim} stopped {elapsed:.1f}s after process {victim} was killed: "
        f"{errors}")
  assert survivor.returncode == 1 and len(errors) == 1, stderr[-3000:]
  assert "the job lost" in errors[0]
  assert "lost process" not in errors[0] or f"lost process {victim} (" in errors[0]
  for dump in ("Fatal Python error", "Check failure stack trace", "Terminating process",
               "Traceback"):
    assert dump not in stderr, stderr[-3000:]
  assert elapsed < within


@pytest.mark.slow
def test_a_job_that_does_not_form_ends_in_one_line_naming_the_address(tmp_path):
  """Process 1 of 2 started alone (no process 0, so no coordinator at the address): it says at
  once that it waits, and after --join_timeout_seconds ends with one line naming the address,
  exit 1, without JAX's abort dump (whose own timeout comes 30 s later)."""
  address = f"127.0.0.1:{portpicker.pick_unused_port()}"
  started = time.monotonic()
  proc = subprocess.run(
      [sys.executable, "train.py", "--config=configs/tiny.py", f"--workdir={tmp_path}",
       f"--coordinator_address={address}", "--num_processes=2", "--process_id=1",
       "--join_timeout_seconds=5"], cwd=PROJECT, env=four_devices(), capture_output=True,
      text=True, timeout=120)
  elapsed = time.monotonic() - started
  print(f"process 1 alone ended {elapsed:.1f} s after it started (--join_timeout_seconds=5)")
  assert proc.returncode == 1 and elapsed < 30, proc.stderr[-3000:]
  assert f"Joining the job at {address} as process 1 of 2; waiting up to 5 s" in proc.stderr
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert errors == [f"error: the job at {address} did not form within 5 s (process 1 of 2 "
                    "waited): start every process, process 0 (which hosts the coordinator) "
                    "among them, and check that this host reaches that address and port."]
  for dump in ("Fatal Python error", "Check failure stack trace", "Terminating process"):
    assert dump not in proc.stderr, proc.stderr[-3000:]
  assert not os.listdir(tmp_path)  # nothing written


@pytest.mark.slow
def test_a_process_killed_after_a_checkpoint_then_the_same_command_resumes_exactly(tmp_path):
  """SIGKILL to process 1 (a node lost) once checkpoint 10 is written: process 0 stops with an
  error within 45 s (JAX's heartbeat, 10 s here; 100 s by default); the same 2-process command
  then resumes from the last complete checkpoint and ends with the state and the final metrics
  of a 2-process run never stopped."""
  run = ["--config.num_epochs=2", "--config.checkpoint_every_steps=5",
         "--config.max_checkpoints_to_keep=20", "--heartbeat_timeout_seconds=10"]
  straight = train(tmp_path / "straight", 2, *run)
  address = f"127.0.0.1:{portpicker.pick_unused_port()}"
  processes = [subprocess.Popen(
      [sys.executable, "train.py", "--config=configs/tiny.py", *OWN,
       f"--workdir={tmp_path / 'run'}", *run, f"--coordinator_address={address}",
       "--num_processes=2", f"--process_id={i}"], cwd=PROJECT, env=four_devices(),
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]
  try:
    deadline = time.monotonic() + 300
    while not (tmp_path / "run" / "checkpoints" / "10").is_dir():
      assert time.monotonic() < deadline and all(p.poll() is None for p in processes)
      time.sleep(0.05)
    processes[1].kill()
    killed_at = time.monotonic()
    _, stderr = processes[0].communicate(timeout=120)
    elapsed = time.monotonic() - killed_at
  finally:
    stop_all(processes)
  print(f"process 0 stopped {elapsed:.1f} s after process 1 was killed (SIGKILL)")
  assert processes[0].returncode != 0 and elapsed < 45, stderr[-3000:]
  resumed = train(tmp_path / "run", 2, *run)
  last = max(straight["eval_accuracy"])
  for name in ("eval_accuracy", "eval_loss", "eval_examples"):
    assert resumed[name][last] == straight[name][last], name
  step, state = saved_arrays(tmp_path / "run")
  straight_step, straight_state = saved_arrays(tmp_path / "straight")
  assert step == straight_step and len(state) == len(straight_state)
  for got, want in zip(state, straight_state, strict=True):
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_a_checkpoint_damaged_in_one_process_files_is_put_aside_by_both(tmp_path):
  """fsdp over the 2 processes' 8 devices: each process writes its own shards (ocdbt.process_0,
  ocdbt.process_1) and reads them back. The newest checkpoint's process-1 files garbled: process
  1 alone fails to read them, yet both give the same verdict, put it aside and resume from the
  checkpoint before, ending with the state of the run never damaged, bitwise. (The default CNN's
  width: shards of 1 KiB or less are kept inside the merged index, not in the processes' files.)"""
  fsdp = ("--config.parallelism=fsdp", "--config.fsdp_min_size=0",
          "--config.max_checkpoints_to_keep=10", "--config.model.features=(32,64)")
  train(tmp_path / "straight", 2, *fsdp)
  workdir = tmp_path / "run"
  shutil.copytree(tmp_path / "straight", workdir)
  last, want = saved_arrays(workdir)
  process_1 = workdir / "checkpoints" / str(last) / "state" / "ocdbt.process_1" / "d"
  files = sorted(process_1.iterdir(), key=lambda path: path.stat().st_size)
  assert files, "process 1 wrote no data files"
  with open(files[-1], "r+b") as f:
    size = files[-1].stat().st_size
    f.seek(size // 4)
    f.write(b"\xff" * (size // 2))
  done = subprocess.run(
      [sys.executable, "launch.py", "--num_processes=2", "--devices_per_process=4",
       "--timeout=400", "--", "--config=configs/tiny.py", *OWN, f"--workdir={workdir}",
       *fsdp], cwd=PROJECT, capture_output=True, text=True, timeout=450)
  assert done.returncode == 0, done.stderr[-4000:]
  for said in (f"checkpoint {last} in {workdir} cannot be read on process 1: kept in "  # 0's
               f"{workdir}/damaged_checkpoints/{last}; resuming from an older one",
               f"checkpoint {last} in {workdir} cannot be read ("):  # process 1's, with its error
    assert done.stderr.count(said) == 1, done.stderr[-4000:]
  assert (workdir / "damaged_checkpoints" / str(last) / "state").is_dir()
  step, got = saved_arrays(workdir)
  assert step == last and len(got) == len(want)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(a, b)


def saved_arrays(workdir) -> tuple[int, list[np.ndarray]]:
  """The latest checkpoint's step and leaves, read as NumPy arrays (whatever devices wrote it)."""
  with ocp.CheckpointManager(workdir / "checkpoints") as checkpoints:
    step = checkpoints.latest_step()
  path = workdir / "checkpoints" / str(step) / "state"
  checkpointer = ocp.PyTreeCheckpointer()
  tree = checkpointer.metadata(path)
  tree = getattr(tree, "item_metadata", None) or tree
  as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                          getattr(tree, "tree", tree))
  return step, jax.tree.leaves(checkpointer.restore(path, args=ocp.args.PyTreeRestore(
      restore_args=as_numpy)))


def run_pair(workdirs, env=None, timeout=300):
  """train.py (tiny config) as 2 processes of 4 CPU devices, process i with workdirs[i]; given
  `env` (a function of i), with no coordinator flags. Returns their (returncode, stderr)."""
  address = f"127.0.0.1:{portpicker.pick_unused_port()}"
  flags = lambda i: [] if env else [f"--coordinator_address={address}",  # noqa: E731
                                    "--num_processes=2", f"--process_id={i}"]
  processes = [subprocess.Popen(
      [sys.executable, "train.py", "--config=configs/tiny.py", *OWN,
       f"--workdir={workdirs[i]}", *flags(i)], cwd=PROJECT, stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE, text=True,
      env=four_devices(**(env(i) if env else {}))) for i in range(2)]
  try:
    stderrs = [p.communicate(timeout=timeout)[1] for p in processes]
    return [(p.returncode, err) for p, err in zip(processes, stderrs, strict=True)]
  finally:
    stop_all(processes)


@pytest.mark.slow
def test_a_slurm_job_joins_by_itself(tmp_path):
  """Two tasks of a SLURM job step (its variables, as srun sets them; the coordinator on
  127.0.0.1) find each other through JAX's own detection, without coordinator flags."""
  port = portpicker.pick_unused_port()
  slurm = lambda i: {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "127.0.0.1",  # noqa: E731
                     "SLURM_NTASKS": "2", "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i),
                     "JAX_COORDINATOR_PORT": str(port),
                     "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{port}"}
  results = run_pair([tmp_path, tmp_path], env=slurm)
  assert [code for code, _ in results] == [0, 0], results[0][1][-3000:]
  assert "8 cpu devices in 2 processes" in results[0][1]
  scalars = read_scalars(str(tmp_path))
  assert set(scalars["eval_examples"].values()) == {360}


@pytest.mark.slow
def test_processes_that_see_different_checkpoints_stop_with_one_error(tmp_path):
  """Hosts whose workdirs are not shared: process 0 sees a checkpoint (step 10), process 1
  none. Both stop before training, with one line naming the fix, instead of diverging."""
  train(tmp_path / "one", 1)
  shutil.copytree(tmp_path / "one" / "checkpoints" / "10", tmp_path / "a" / "checkpoints" / "10")
  results = run_pair([tmp_path / "a", tmp_path / "b"])
  for code, stderr in results:
    last = stderr.strip().splitlines()[-1]
    assert code == 1 and last.startswith("error: the workdir is not shared by the processes: "
                                         "their latest checkpoints in "), stderr[-3000:]
    assert "are 10 (process 0), None (process 1); give every process the same --workdir" in last


def run_script(processes: int, script: str, *args: str) -> subprocess.CompletedProcess:
  """`python SCRIPT ARGS` as 1 process of 8 CPU devices, or 2 of 4 (launch.py --script)."""
  command = [sys.executable, script, *args] if processes == 1 else [
      sys.executable, "launch.py", f"--num_processes={processes}",
      f"--devices_per_process={8 // processes}", "--timeout=250", f"--script={script}", "--",
      *args]
  done = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-4000:]
  return done


@pytest.mark.slow
def test_evaluate_predict_and_export_on_two_processes(straight_runs, tmp_path):
  """evaluate.py, predict.py and export.py as 2 processes of 4 devices on the fsdp run's
  checkpoint (its parameters split over all 8 devices: each process restores its shards) give
  what 1 process of 8 gives, printed once; export.py writes one artifact, which answers as
  predict.py does. (Under load, these processes come to their first collective far apart:
  joined.connect_cpu_collectives.)"""
  import jax
  import numpy as np
  from PIL import Image

  from configs import tiny

  from {{cookiecutter.project_slug}}.data import sources

  workdir = tmp_path / "run"
  shutil.copytree(straight_runs["fsdp"][0], workdir)  # evaluate.py writes into it
  images = sources.get_datasets(tiny.get_config())[0]["eval"].images[:11]
  (folder := tmp_path / "images").mkdir()
  for i, image in enumerate(images):
    Image.fromarray(image[..., 0]).save(folder / f"{i:02d}.png")
  (folder / "99.png").write_bytes(b"not an image")

  # (What precedes the tool's own output on stdout: gloo, the CPU's collectives, printing its
  # connections from C++, in pieces.)
  one, two = (run_script(n, "evaluate.py", f"--workdir={workdir}").stdout for n in (1, 2))
  one, two = one[one.index("step 45: "):], two[two.index("step 45: "):]
  first_line = re.compile(r"step 45: loss (\S+)  accuracy (\S+)  \(360 examples\)\n")
  (loss_1, accuracy_1), (loss_2, accuracy_2) = (first_line.match(o).groups() for o in (one, two))
  assert accuracy_2 == accuracy_1 and float(loss_2) == pytest.approx(float(loss_1), abs=1e-4)
  # Per-class accuracies and the confusion matrix (counts): the same text, printed once.
  assert two.split("\n", 1)[1] == one.split("\n", 1)[1]
  assert two.count("step 45: ") == two.count("confusion matrix") == 1
  assert len(list((workdir / "evaluate").glob("events.out.tfevents.*"))) == 2  # one a run

  args = f"--workdir={workdir}", "--json", "--batch_size=8", str(folder)
  one, two = (run_script(n, "predict.py", *args) for n in (1, 2))
  predicted = [[json.loads(line) for line in o.stdout.splitlines() if line.startswith("{")]
               for o in (one, two)]
  assert [p["path"] for p in predicted[1]] == [str(folder / f"{i:02d}.png") for i in range(11)]
  for a, b in zip(*predicted, strict=True):
    assert a["class"] == b["class"] and a["probability"] == pytest.approx(b["probability"],
                                                                         abs=1e-5)
  for o in (one, two):
    assert o.stderr.count("skipped ") == 2 and o.stderr.strip().splitlines()[-1] == (
        "classified 11 images with the checkpoint of step 45; skipped 1 unreadable file")

  done = run_script(2, "export.py", f"--workdir={workdir}", f"--out={tmp_path / 'model.npz'}")
  assert done.stdout.count("wrote ") == 1
  artifact = np.load(tmp_path / "model.npz")
  exported = jax.export.deserialize(bytearray(artifact["program"]))
  arrays = [artifact[f"array_{i}"].view(a.dtype) for i, a in enumerate(exported.in_avals[:-1])]
  probs = np.asarray(exported.call(arrays, images))
  assert [p["class"] for p in predicted[1]] == [str(c) for c in probs.argmax(-1)]
  np.testing.assert_allclose(probs.max(-1), [p["probability"] for p in predicted[1]], atol=1e-5)


LATE_PROCESS = """
import os, sys, time
sys.path.insert(0, os.getcwd())  # the project
import jax, jax.numpy as jnp, numpy as np
from absl import flags
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from {{cookiecutter.project_slug}} import process
from {{cookiecutter.project_slug}}.parallel import sharding
flags.FLAGS(sys.argv)
process.initialize()
if jax.process_index() == 1:
  time.sleep(35)  # longer than gloo waits to connect a group of devices (30 s)
multihost_utils.sync_global_devices("late")  # one device a process, as Orbax's barriers
mesh = sharding.make_mesh()
ones = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), np.ones(4))
total = float(jax.jit(jnp.sum, out_shardings=sharding.replicated(mesh))(ones))
print(f"sum {total}")  # one string: the two processes' unbuffered prints interleave word by word
"""


@pytest.mark.slow
def test_a_process_35_s_late_at_its_first_collective_is_waited_for(tmp_path):
  """What a process still compiling under load does: the collectives of both device groups
  were connected when the processes joined (joined.connect_cpu_collectives), so the other
  waits for it instead of failing ("Gloo context initialization failed: ... timed out")."""
  (tmp_path / "late.py").write_text(LATE_PROCESS)
  done = run_script(2, str(tmp_path / "late.py"))
  assert done.stdout.count("sum 8.0") == 2, done.stdout + done.stderr[-3000:]


def test_launch_gives_each_process_its_gpus_and_a_share_of_the_cores(tmp_path):
  """launch.py --gpus_per_process=2 on a machine listing 4 GPUs (CUDA_VISIBLE_DEVICES=4,5,6,7):
  process 0 is given GPUs 4,5 and process 1 GPUs 6,7, each half the cores (README's 8-GPU host:
  one process a GPU); 3 processes of 2: one line, and nothing started."""
  probe = tmp_path / "probe.py"
  probe.write_text("import os, sys\nprint('probe', os.environ['CUDA_VISIBLE_DEVICES'], "
                   "sorted(os.sched_getaffinity(0)), sys.argv[-1], file=sys.stderr)\n")
  env = dict(os.environ, CUDA_VISIBLE_DEVICES="4,5,6,7")
  launch = [sys.executable, "launch.py", "--gpus_per_process=2", f"--script={probe}"]
  done = subprocess.run([*launch, "--num_processes=2"], cwd=PROJECT, env=env,
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-3000:]
  cores = sorted(os.sched_getaffinity(0))
  half = len(cores) // 2
  assert sorted(line for line in done.stderr.splitlines() if line.startswith("probe")) == [
      f"probe 4,5 {cores[:half] or cores} --process_id=0",
      f"probe 6,7 {cores[half:2 * half] or cores} --process_id=1"], done.stderr
  refused = subprocess.run([*launch, "--num_processes=3"], cwd=PROJECT, env=env,
                           capture_output=True, text=True, timeout=120)
  assert refused.returncode == 1 and "probe" not in refused.stderr
  assert refused.stderr.strip().splitlines()[-1] == (
      "error: 3 processes of 2 GPUs need 6; this machine shows 4 (CUDA_VISIBLE_DEVICES, else "
      "/dev/nvidia*): give fewer --num_processes or --gpus_per_process."), refused.stderr


@pytest.mark.parametrize("flag", ["--num_processes=0", "--num_processes=-1",
                                  "--devices_per_process=0", "--gpus_per_process=0"])
def test_launch_refuses_a_count_below_one_in_one_line(flag):
  """launch.py --num_processes=0 (or -1) ended 0 having started and said nothing: a count below
  one is now one `error:` line and a non-zero exit, before anything starts."""
  done = subprocess.run([sys.executable, "launch.py", flag, "--", "--config=configs/tiny.py",
                         "--workdir=unused"], cwd=PROJECT, capture_output=True, text=True,
                        timeout=60)
  assert done.returncode == 1, done.stderr
  assert done.stderr.strip().splitlines() == [f"error: {flag}: give 1 or more."], done.stderr
