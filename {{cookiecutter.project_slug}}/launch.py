"""Runs train.py (or, with --script, evaluate.py, predict.py or export.py) as several processes
on this machine, to try multi-process runs.

  python launch.py --num_processes=2 --devices_per_process=4 -- \
      --config=configs/default.py --workdir=/tmp/run
  python launch.py --num_processes=2 --devices_per_process=4 --script=evaluate.py -- \
      --workdir=/tmp/run

Each process gets `--coordinator_address=127.0.0.1:PORT --num_processes=N --process_id=I`
(JAX's distributed runtime, bound to the loopback interface only) and, with
--devices_per_process, that many virtual CPU devices. When a process fails, the others are
stopped; every process is bounded by --timeout. On a real cluster use its launcher instead
(see README.md): every entry point finds SLURM, Open MPI and Cloud TPU pods (distributed.py).
"""

import os
import re
import subprocess
import sys
import time

import portpicker
from absl import app, flags

_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "How many processes.")
_DEVICES = flags.DEFINE_integer("devices_per_process", None, "Virtual CPU devices per process.")
_TIMEOUT = flags.DEFINE_integer("timeout", 3600, "Seconds before every process is stopped.")
_SCRIPT = flags.DEFINE_string("script", "train.py", "The program each process runs.")


# After a process fails, the others get SIGTERM (train.py saves what it can), then SIGKILL after
# this many seconds: one whose peer died may wait in a collective that never completes.
GRACE_SECONDS = 10


def exit_status(returncode: int) -> int:
  """A process's exit status as a shell gives it: 128 + N for one killed by signal N."""
  return 128 - returncode if returncode < 0 else returncode


def launch(train_args: list[str], num_processes: int, devices_per_process: int | None = None,
           timeout: float = 3600, script: str = "train.py") -> int:
  """Starts the processes, waits for them; when one fails (or the timeout passes), stops the
  others (SIGTERM, then SIGKILL after GRACE_SECONDS). Returns the first failed process's exit
  status (`exit_status`), 124 on the timeout, or 0."""
  env = dict(os.environ)
  if devices_per_process:
    env["JAX_PLATFORMS"] = "cpu"
    others = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{others} --xla_force_host_platform_device_count={devices_per_process}"
  address = f"127.0.0.1:{portpicker.pick_unused_port()}"
  processes = [
      subprocess.Popen([sys.executable, script, *train_args, f"--coordinator_address={address}",
                        f"--num_processes={num_processes}", f"--process_id={i}"], env=env)
      for i in range(num_processes)
  ]
  deadline, status, stopping_since = time.monotonic() + timeout, 0, None
  while running := [p for p in processes if p.poll() is None]:  # (polls every process)
    failed = [(i, p.returncode) for i, p in enumerate(processes) if p.returncode not in (None, 0)]
    if (failed or time.monotonic() > deadline) and stopping_since is None:
      status = exit_status(failed[0][1]) if failed else 124
      why = f"process {failed[0][0]} exited with status {status}" if failed else "timed out"
      print(f"launch.py: {why}; stopping the others", file=sys.stderr)
      for p in running:
        p.terminate()  # SIGTERM: train.py saves what it can and exits
      stopping_since = time.monotonic()
    elif stopping_since is not None and time.monotonic() > stopping_since + GRACE_SECONDS:
      for p in running:
        p.kill()
    time.sleep(0.1)
  return status or next((exit_status(p.returncode) for p in processes if p.returncode), 0)


def main(argv):
  sys.exit(launch(argv[1:], _NUM_PROCESSES.value, _DEVICES.value, _TIMEOUT.value, _SCRIPT.value))


if __name__ == "__main__":
  app.run(main)
