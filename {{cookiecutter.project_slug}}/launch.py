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


def launch(train_args: list[str], num_processes: int, devices_per_process: int | None = None,
           timeout: float = 3600, script: str = "train.py") -> int:
  """Starts the processes, waits for them; returns the first non-zero exit status, or 0."""
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
  deadline = time.monotonic() + timeout
  status = 0
  while any(p.poll() is None for p in processes):
    failed = [p.returncode for p in processes if p.returncode not in (None, 0)]
    if (failed or time.monotonic() > deadline) and not status:
      status = failed[0] if failed else 124
      print(f"launch.py: {'a process failed' if failed else 'timed out'}; stopping the others",
            file=sys.stderr)
      for p in processes:
        if p.poll() is None:
          p.terminate()  # SIGTERM: train.py saves what it can and exits
    time.sleep(0.1)
  return status or next((p.returncode for p in processes if p.returncode), 0)


def main(argv):
  sys.exit(launch(argv[1:], _NUM_PROCESSES.value, _DEVICES.value, _TIMEOUT.value, _SCRIPT.value))


if __name__ == "__main__":
  app.run(main)
