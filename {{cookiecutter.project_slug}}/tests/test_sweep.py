"""sweep.py: a grid of runs, each train.py in a workdir of its own; stopped half-way and resumed;
its table; a SLURM array of the same runs."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import OWN

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRID = ("--grid=learning_rate=0.01,0.03", "--grid=weight_decay=0,1e-4")
NAMES = ["learning_rate=0.01,weight_decay=0", "learning_rate=0.01,weight_decay=1e-4",
         "learning_rate=0.03,weight_decay=0", "learning_rate=0.03,weight_decay=1e-4"]


def sweep(workdir, *flags: str) -> list[str]:
  return [sys.executable, "sweep.py", "--config=configs/tiny.py", f"--workdir={workdir}", *flags,
          "--", *OWN]


@pytest.mark.slow  # (four trainings, one twice)
def test_a_grid_of_runs_stopped_half_way_resumes_and_ends_with_its_table(tmp_path):
  """A 2 x 2 grid of the tiny config: SIGTERM to the sweep while its second run trains (it
  saves and stops, 143, and so does the sweep, saying how to resume); the same command again:
  the first run read as done, the second resumed from its checkpoint, then the rest; the table
  names each run's final and best evaluation, as each run's own log says them."""
  stopped = subprocess.Popen(sweep(tmp_path, *GRID), cwd=PROJECT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 300
    while not (tmp_path / NAMES[1] / "checkpoints" / "10").is_dir():
      assert time.monotonic() < deadline and stopped.poll() is None
      time.sleep(0.05)
    stopped.send_signal(signal.SIGTERM)
    _, err = stopped.communicate(timeout=120)
  finally:
    stopped.kill()
  assert stopped.returncode == 143, err[-3000:]
  assert err.strip().splitlines()[-1] == (f"sweep: stopped in run 2 of 4 ({NAMES[1]}), saved; the "
                                          "same command resumes the sweep."), err[-2000:]
  assert not (tmp_path / NAMES[2]).exists()
  done = subprocess.run(sweep(tmp_path, *GRID), cwd=PROJECT, capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert f"sweep: run 1 of 4, {NAMES[0]}: done ({tmp_path / 'sweep.json'})" in done.stderr
  step = re.search(r"Stopped by SIGTERM after step (\d+) of 23; saved checkpoint", err)[1]
  assert f"Resumed from the checkpoint of step {step} in {tmp_path / NAMES[1]}" in done.stderr
  record = json.loads((tmp_path / "sweep.json").read_text())
  table = done.stdout.strip().splitlines()
  assert table[0].split() == ["run", "final", "accuracy", "final", "loss", "best", "accuracy",
                              "(step)", "exit"] and len(table) == 5
  for name, line in zip(NAMES, table[1:], strict=True):
    final, best = record[name]["final"], record[name]["best"]
    log = (tmp_path / name / "sweep.log").read_text()
    assert f"Final eval: accuracy {final['accuracy']:.4f}, loss {final['loss']:.4f}" in log
    assert f"eval at step {best['step']}: loss {best['loss']:.4f}  accuracy " \
           f"{best['accuracy']:.4f}" in log
    assert line.split() == [name, f"{final['accuracy']:.4f}", f"{final['loss']:.4f}",
                            f"{best['accuracy']:.4f}", f"({best['step']})", "0"]
    assert record[name]["status"] == 0 and (tmp_path / name / "checkpoints").is_dir()


def test_a_slurm_array_holds_a_task_a_run(tmp_path):
  """--slurm writes an array job of the same runs (task i: run i's train.py and workdir), which
  bash parses; srun (here a stand-in that prints its arguments) runs the task's command."""
  sbatch = tmp_path / "sweep.sbatch"
  out = subprocess.run(sweep(tmp_path / "runs", *GRID, f"--slurm={sbatch}"), cwd=PROJECT,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0 and not (tmp_path / "runs").exists(), out.stderr[-2000:]
  text = sbatch.read_text()
  assert "#SBATCH --array=0-3" in text and "WANDB_RUN_GROUP=runs" in text
  assert subprocess.run(["bash", "-n", str(sbatch)]).returncode == 0
  (tmp_path / "bin").mkdir()
  (tmp_path / "bin" / "srun").write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
  (tmp_path / "bin" / "srun").chmod(0o755)
  task = subprocess.run(["bash", str(sbatch)], capture_output=True, text=True, timeout=60,
                        env=dict(os.environ, SLURM_ARRAY_TASK_ID="2",
                                 PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}"))
  assert task.stdout.splitlines() == [
      "python", "train.py", "--config=configs/tiny.py", *OWN, "--config.learning_rate=0.03",
      "--config.weight_decay=0", f"--workdir={tmp_path / 'runs' / NAMES[2]}"], task.stdout
  bad = subprocess.run(sweep(tmp_path, "--grid=learning_rate"), cwd=PROJECT, capture_output=True,
                       text=True, timeout=120)
  assert bad.returncode != 0 and "'learning_rate' is not KEY=VALUE" in bad.stderr
