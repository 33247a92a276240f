"""Never stuck (README): a run either makes progress or ends, in one line, saying why. The
watchdog (training/stopping.py) bounds every wait and honours a signal in every phase; the
compilation cache is off where a process of several would hang loading from it (process.py).
Each test starts processes (the slow tier, by the README's rule) but one; the slowest run the
README's own multi-process command. CI runs this file first, both tiers, on the newest JAX as
the README installs it (.ci/run), so that a release that hangs fails there in minutes."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import ml_collections
import pytest
from conftest import OWN, alive
from test_multiprocess import descendants

from {{cookiecutter.project_slug}} import process
from {{cookiecutter.project_slug}}.training import stopping

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WAITING = """
import sys, time
import ml_collections
from {{cookiecutter.project_slug}}.training import stopping
stopping.Watchdog.GRACE_S = 1
config = ml_collections.ConfigDict(dict(watchdog_compile_s=60, watchdog_floor_s={floor},
                                        watchdog_factor=3.0))
with stopping.Watchdog(config):
  stopping.at_exit(lambda: print("released", file=sys.stderr, flush=True))
  stopping.phase({what!r}, {kind!r})
  print("waiting", flush=True)
  time.sleep(120)
"""


def waiting(what: str, kind: str | None, floor: float = 60) -> subprocess.Popen:
  """A process whose main thread waits (sleeps) in one phase under a watchdog; once it says so."""
  p = subprocess.Popen([sys.executable, "-c", WAITING.format(what=what, kind=kind, floor=floor)],
                       cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  assert p.stdout.readline() == "waiting\n", p.communicate(timeout=30)
  return p


def ended(p: subprocess.Popen, within: float) -> tuple[float, list[str]]:
  """The seconds `p` took to end (at most `within`), and the lines of its standard error."""
  start = time.monotonic()
  try:
    _, stderr = p.communicate(timeout=within)
  finally:
    p.kill()
  return time.monotonic() - start, stderr.splitlines()


@pytest.mark.slow
def test_a_wait_past_its_bound_ends_the_process_in_one_line():
  """A call that does not return within its bound (the floor, 1 s: nothing slower seen yet): the
  process ends within a second of it, exit 75, in one line naming the wait and the bound's flags,
  its claim released first."""
  p = waiting("the call of steps 11-20", "call", floor=1)
  elapsed, lines = ended(p, within=30)
  assert p.returncode == stopping.HUNG_EXIT, lines
  error, released = lines  # (the line first, then what `at_exit` named)
  assert released == "released"
  assert error.startswith("error: the call of steps 11-20 has not finished after 1 s"), error
  assert "--config.watchdog_floor_s=1" in error and "--config.watchdog_factor=3" in error
  assert elapsed < 1 + 5, elapsed  # (its bound, and the thread's second)


def test_the_bound_of_a_wait_follows_the_slowest_of_its_kind():
  config = ml_collections.ConfigDict(dict(watchdog_compile_s=100, watchdog_floor_s=2,
                                          watchdog_factor=20.0))
  watchdog = stopping.Watchdog(config)  # (not entered: no thread, no handlers)
  assert watchdog.bound(None) == 100 and watchdog.bound("call") == 2
  watchdog.phase("a call", "call")
  time.sleep(0.2)
  watchdog.phase("a save", "save")  # the call's time recorded
  assert 0.2 <= watchdog.slowest["call"] < 1
  assert watchdog.bound("call") == pytest.approx(20 * watchdog.slowest["call"])
  assert watchdog.bound("save") == 2  # nothing slower seen of its kind
  watchdog.phase(None)
  assert watchdog.deadline() is None  # waiting for nothing: no bound
  config.watchdog_floor_s = 0
  assert stopping.Watchdog(config).bound("call") == 0  # 0: off


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_compiling_ends_the_process_at_once(signum):
  """SIGTERM or Ctrl-C while the main thread is in a compile (here: asleep, as inside XLA, where
  Python's handlers cannot run): the watchdog's thread ends the process within a second, with
  128 + the signal, its claim released, and one line."""
  p = waiting("compiling the training step", None)
  p.send_signal(signum)
  elapsed, lines = ended(p, within=30)
  assert p.returncode == 128 + signum and elapsed < 5, (elapsed, lines)  # (not the 120 s)
  assert len(lines) == 2 and lines[1] == "released", lines
  assert lines[0].startswith(f"Stopped by {signal.Signals(signum).name} while compiling the "
                             "training step: nothing new to save"), lines


@pytest.mark.slow
def test_a_signal_during_a_save_waits_for_it_and_a_second_ends_at_once():
  """A signal while a checkpoint is written leaves it to finish (the stop is for saving); a
  second signal ends the process at once, saying so."""
  p = waiting("saving checkpoint 20", "save")
  p.send_signal(signal.SIGINT)
  time.sleep(0.5)  # (the watchdog wakes at once on a signal: it has seen it)
  assert p.poll() is None
  p.send_signal(signal.SIGINT)
  elapsed, lines = ended(p, within=30)
  assert p.returncode == 130 and elapsed < 5, (elapsed, lines)
  assert lines[0].startswith("error: a second SIGINT: ended while saving checkpoint 20, without "
                             "saving"), lines


@pytest.mark.slow
def test_a_call_that_does_not_return_after_a_signal_ends_after_the_grace():
  """SIGTERM during a call: the loop would stop after it, having saved; a call that does not
  return within the grace (1 s here; 30 s by default) ends the process, 143, in one line."""
  p = waiting("the call of steps 11-20", "call")
  p.send_signal(signal.SIGTERM)
  elapsed, lines = ended(p, within=30)
  assert p.returncode == 143 and 1 <= elapsed < 1 + 5, (elapsed, lines)
  assert lines[0].startswith("Stopped by SIGTERM: the call of steps 11-20 had not finished 1 s "
                             "after it; ended without saving"), lines


GUARDED = """
import jax
from absl import flags
from {{cookiecutter.project_slug}} import process
flags.FLAGS.mark_as_parsed()
for version in ("0.12.0.1", "0.12.1"):
  process.jaxlib_version = lambda: version
  process.no_cache_where_it_hangs()
  print(version, jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache)
"""


@pytest.mark.slow
def test_the_cache_is_off_for_a_process_of_several_on_a_jaxlib_that_hangs():
  """process.no_cache_where_it_hangs (what a process of several does before it joins): on jaxlib
  0.12.0.1 JAX's cache is kept; on 0.12.1 it is off, the one JAX_COMPILATION_CACHE_DIR names
  too, said once."""
  out = subprocess.run([sys.executable, "-c", GUARDED], cwd=PROJECT,
                       env={**os.environ, "JAX_COMPILATION_CACHE_DIR": "/tmp/a_cache"},
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.splitlines() == ["0.12.0.1 /tmp/a_cache True", "0.12.1 /tmp/a_cache False"]
  assert out.stderr.count("The compilation cache is off for this run") == 1, out.stderr


# Bounds that end a hung run of the tests' size in two minutes, not the defaults' half hour.
BOUNDS = ("--config.watchdog_compile_s=120", "--config.watchdog_floor_s=60")


def launch(workdir, cache, *overrides: str) -> subprocess.Popen:
  """The README's multi-process command (2 processes of 4 CPU devices, configs/default.py), on
  the compilation cache in `cache` as a user has it: the config's, not the tests' environment
  (every program kept, however quick to compile)."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")
         and k != "JAX_COMPILATION_CACHE_DIR"}
  return subprocess.Popen(
      [sys.executable, "launch.py", "--num_processes=2", "--devices_per_process=4",
       "--timeout=400", "--", "--config=configs/default.py", f"--workdir={workdir}",
       f"--config.compilation_cache_dir={cache}", "--config.compilation_cache_min_seconds=0",
       *BOUNDS, *overrides],
      cwd=PROJECT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finished(p: subprocess.Popen, timeout: float = 400) -> str:
  try:
    return p.communicate(timeout=timeout)[1]
  finally:
    for pid in [p.pid, *descendants(p.pid)]:
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def wait_for(path, launcher: subprocess.Popen, seconds: float = 300) -> None:
  deadline = time.monotonic() + seconds
  while not path.exists():
    assert time.monotonic() < deadline and launcher.poll() is None, finished(launcher, 5)[-3000:]
    time.sleep(0.1)


@pytest.mark.slow
def test_the_readme_two_process_command_twice_on_one_warm_cache_then_sigterm_and_resume(
    tmp_path):
  """The README's 2-process command, twice on one cache (the second: every program in it), each
  ending 0; then SIGTERM to launch.py mid-run (143, saved) and the same command, which resumes
  and ends 0. On a jaxlib where loading hangs (jaxlib 0.12.1) the cache is off, said once."""
  cache = tmp_path / "cache"
  hangs = process.jaxlib_version() in process.CACHE_HANGS_WITH_SEVERAL_PROCESSES
  for run in ("first", "second"):
    stderr = finished(launch(tmp_path / run, cache, "--config.num_epochs=2"))
    assert "Final eval" in stderr, f"{run} run:\n{stderr[-3000:]}"
    assert stderr.count("The compilation cache is off") == (1 if hangs else 0)
    assert hangs or any(cache.iterdir())  # (the second run loads from it)
  longer = ("--config.num_epochs=30", "--config.checkpoint_every_steps=20")
  launcher = launch(tmp_path / "stopped", cache, *longer)
  wait_for(tmp_path / "stopped" / "checkpoints" / "20", launcher)
  launcher.send_signal(signal.SIGTERM)
  stderr = finished(launcher)
  assert launcher.returncode == 143 and "Stopped by SIGTERM after step" in stderr, stderr[-3000:]
  resumed = launch(tmp_path / "stopped", cache, *longer)
  stderr = finished(resumed)
  assert resumed.returncode == 0 and "Final eval" in stderr, stderr[-3000:]


@pytest.mark.slow
def test_a_process_stopped_mid_run_ends_the_job_in_one_line_within_the_bound_then_resumes(
    tmp_path):
  """Process 1 of launch.py's 2 stopped (SIGSTOP) while training: process 0 waits in a collective
  that process 1 never enters, past its watchdog's bound (10 s here): it ends in one line naming
  the call, exit 75, and launch.py ends process 1 and exits 75, within the bound + 30 s, no
  process left. The same command then resumes from the latest checkpoint."""
  command = [sys.executable, "launch.py", "--num_processes=2", "--devices_per_process=4",
             "--timeout=400", "--", "--config=configs/tiny.py", *OWN, f"--workdir={tmp_path}",
             "--config.num_epochs=500", "--config.watchdog_floor_s=10",
             "--config.watchdog_factor=3", "--heartbeat_timeout_seconds=100"]
  launcher = subprocess.Popen(command, cwd=PROJECT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
  wait_for(tmp_path / "checkpoints" / "10", launcher)
  below = descendants(launcher.pid)
  process_1 = next(pid for pid in below
                   if b"--process_id=1\0" in open(f"/proc/{pid}/cmdline", "rb").read())
  os.kill(process_1, signal.SIGSTOP)
  stopped = time.monotonic()
  stderr = finished(launcher, timeout=120)
  elapsed = time.monotonic() - stopped
  print(f"launch.py ended {elapsed:.1f} s after process 1 was stopped")
  assert launcher.returncode == stopping.HUNG_EXIT, stderr[-3000:]
  errors = [line for line in stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and errors[0].startswith("error: process 0 of 2: the "), errors
  assert "has not finished after 10 s" in errors[0], errors
  assert elapsed <= 10 + 30, elapsed
  assert not [pid for pid in below if alive(pid)]
  latest = max(int(d.name) for d in (tmp_path / "checkpoints").iterdir() if d.name.isdigit())
  again = subprocess.Popen(command, cwd=PROJECT, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
  wait_for(tmp_path / "checkpoints" / str(latest + 10), again)  # resumed, and training on
  again.send_signal(signal.SIGTERM)
  stderr = finished(again)
  assert again.returncode == 143, stderr[-3000:]
  assert f"Resumed from the checkpoint of step {latest}" in stderr


@pytest.mark.slow
def test_sigterm_while_compiling_ends_the_run_within_seconds_and_lets_its_workdir_go(tmp_path):
  """SIGTERM at the 'compiling the steps' line (a new run: nothing to save; the cache off, so
  that it compiles): train.py ends within 30 s (here, well under: the watchdog does not wait for
  the compile), exit 143, in one line, its claim on the workdir released."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  p = subprocess.Popen([sys.executable, "train.py", "--config=configs/tiny.py", *OWN,
                        f"--workdir={tmp_path}", "--config.compilation_cache_dir="],
                       cwd=PROJECT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       text=True)
  for line in p.stderr:
    if "compiling the steps" in line:
      break
  p.send_signal(signal.SIGTERM)
  elapsed, lines = ended(p, within=60)
  print(f"train.py ended {elapsed:.2f} s after SIGTERM")
  assert p.returncode == 143 and elapsed < 30, lines[-20:]
  assert lines[-1].startswith("Stopped by SIGTERM while compiling the "), lines[-5:]
  assert not (tmp_path / "claimed.json").exists()
