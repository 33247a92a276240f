"""Runs train.py (or, with --script, evaluate.py, predict.py or export.py) as several processes
on this machine, to try multi-process runs.

  python launch.py --num_processes=2 --devices_per_process=4 -- \
      --config=configs/default.py --workdir=/tmp/run
  python launch.py --num_processes=2 --devices_per_process=4 --script=evaluate.py -- \
      --workdir=/tmp/run

Each process gets `--coordinator_address=127.0.0.1:PORT --num_processes=N --process_id=I`
(JAX's distributed runtime, bound to the loopback interface only) and, with
--devices_per_process, that many virtual CPU devices; with --gpus_per_process, that many of this
machine's GPUs (CUDA_VISIBLE_DEVICES) and an even share of the cores it may run on (its input's
workers among them): an 8-GPU host as one process a GPU, each main process feeding its own
(README.md, "Eight GPUs on one host"). Each is one process (`python train.py`);
launch.py watches its standard error (parallel/watch.py: when the job loses a process, one line
instead of the survivors' stack dumps). When a process fails, the others are stopped; every
process is bounded by --timeout. SIGTERM, SIGINT or SIGHUP to launch.py (what
`timeout`, `kill`, Ctrl-C or a closed terminal send) is passed on to every process as SIGTERM:
train.py saves at one step and exits 143, and so does launch.py. A SIGKILL of launch.py, which
it cannot pass on, ends every process at once (Linux: the kernel kills them with it; the newest
checkpoint saved before stays whole). On a real cluster use its launcher instead, each process
under clusters/watched.py (clusters/ and README.md): every entry point finds SLURM, Open MPI and
Cloud TPU pods (distributed.py).
"""

import os
import re
import selectors
import signal
import subprocess
import sys
import time

import portpicker
from absl import app, flags

from {{cookiecutter.project_slug}}.parallel import distributed, watch

_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "How many processes.")
_DEVICES = flags.DEFINE_integer("devices_per_process", None, "Virtual CPU devices per process.")
_GPUS = flags.DEFINE_integer("gpus_per_process", None, "GPUs per process (CUDA_VISIBLE_DEVICES), "
                             "each with an even share of the cores.")
_TIMEOUT = flags.DEFINE_integer("timeout", 3600, "Seconds before every process is stopped.")
_SCRIPT = flags.DEFINE_string("script", "train.py", "The program each process runs.")


# After a process fails, the others get SIGTERM (train.py saves what it can), then SIGKILL after
# this many seconds: one whose peer died may wait in a collective that never completes.
GRACE_SECONDS = 10


PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # to every process, as SIGTERM


def launch(train_args: list[str], num_processes: int, devices_per_process: int | None = None,
           timeout: float = 3600, script: str = "train.py", gpus_per_process: int | None = None
           ) -> int:
  """Starts the processes (each one process: `python SCRIPT`), waits for them, watching their
  standard error (`wait`); when one fails (or the timeout passes), stops the others (SIGTERM,
  then SIGKILL after GRACE_SECONDS); a signal of `PASSED_ON` is passed on to each as SIGTERM, and
  they are waited for (to the timeout).

  Args:
    train_args: the script's arguments (each process's).
    num_processes: the processes.
    devices_per_process: each one's virtual CPU devices; None: the platform's own.
    timeout: the seconds it waits for them.
    script: what each runs.
    gpus_per_process: each one's GPUs (CUDA_VISIBLE_DEVICES); None: not set.
  Returns:
    The first failed process's exit status (`watch.exit_status`), 124 on the timeout, 143 after
    a signal passed on, or 0.
  """
  env = dict(os.environ)
  shares = gpu_shares(num_processes, gpus_per_process) if gpus_per_process else None
  if devices_per_process:
    env["JAX_PLATFORMS"] = "cpu"
    others = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{others} --xla_force_host_platform_device_count={devices_per_process}"
  address = f"127.0.0.1:{portpicker.pick_unused_port()}"
  received, processes = [], []

  def pass_on(signum, frame):
    if not received:
      print(f"launch.py: {signal.Signals(signum).name}; passed on to every process as SIGTERM "
            "(each saves and stops)", file=sys.stderr, flush=True)
    received.append(signum)
    for p in processes:
      if p.poll() is None:
        p.terminate()

  previous, parent = {signum: signal.signal(signum, pass_on) for signum in PASSED_ON}, os.getpid()

  def start(i: int):
    own = dict(env, CUDA_VISIBLE_DEVICES=shares[i][0]) if shares else env
    cores = shares[i][1] if shares else None

    def in_child():
      watch.ending_with(parent)
      if cores:
        os.sched_setaffinity(0, cores)

    return subprocess.Popen([sys.executable, script, *train_args,
                             f"--coordinator_address={address}",
                             f"--num_processes={num_processes}", f"--process_id={i}"], env=own,
                            stderr=subprocess.PIPE, preexec_fn=in_child)

  processes += [start(i) for i in range(num_processes)]
  if received:  # (one that came while they started)
    pass_on(received[0], None)
  try:
    return wait(processes, timeout, received)
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)


def gpu_shares(num_processes: int, gpus_per_process: int) -> list[tuple[str, list[int]]]:
  """Each process's GPUs (a CUDA_VISIBLE_DEVICES value: `gpus_per_process` of those this
  machine's lists, else of 0, 1, ...) and cores (an even share of those this process may run
  on). Raises SystemExit, in one line, for more GPUs than the machine lists."""
  listed = os.environ.get("CUDA_VISIBLE_DEVICES")
  gpus = ([g.strip() for g in listed.split(",") if g.strip()] if listed is not None else
          [str(g) for g in range(distributed.visible_gpus(os.environ))])
  if len(gpus) < num_processes * gpus_per_process:
    raise SystemExit(f"error: {num_processes} processes of {gpus_per_process} GPUs need "
                     f"{num_processes * gpus_per_process}; this machine shows {len(gpus)} "
                     "(CUDA_VISIBLE_DEVICES, else /dev/nvidia*): give fewer --num_processes or "
                     "--gpus_per_process.")
  cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
  per = max(len(cores) // num_processes, 1)
  return [(",".join(gpus[i * gpus_per_process:(i + 1) * gpus_per_process]),
           cores[i * per:(i + 1) * per] or cores) for i in range(num_processes)]


def wait(processes: list, timeout: float, received: list) -> int:
  """`launch`'s wait for its processes, passing on their standard error (a `watch.Watch` each: a
  survivor's dump after the job lost a process is one line).

  Args:
    processes: the processes.
    timeout: the seconds it waits.
    received: the signals passed on to them so far.
  Returns:
    As `launch`'s.
  """
  deadline, status, stopping_since, said = time.monotonic() + timeout, 0, None, False
  watches = [watch.Watch(sys.stderr.buffer) for _ in processes]
  selector = selectors.DefaultSelector()
  for p, w in zip(processes, watches, strict=True):
    selector.register(p.stderr, selectors.EVENT_READ, w)
  while running := [p for p in processes if p.poll() is None]:  # (polls every process)
    failed = [(i, p.returncode) for i, p in enumerate(processes) if p.returncode not in (None, 0)]
    if received:  # stopping on a signal: each saves and exits, within the timeout
      for p in running if time.monotonic() > deadline else ():
        p.kill()
    elif (failed or time.monotonic() > deadline) and stopping_since is None:
      status = watch.exit_status(failed[0][1]) if failed else 124
      why = f"process {failed[0][0]} exited with status {status}" if failed else "timed out"
      print(f"launch.py: {why}; stopping the others", file=sys.stderr, flush=True)
      said = bool(failed)
      for p in running:
        p.terminate()  # SIGTERM: train.py saves what it can and exits
      stopping_since = time.monotonic()
    elif stopping_since is not None and time.monotonic() > stopping_since + GRACE_SECONDS:
      for p in running:
        p.kill()
    read(selector, 0.1)
  drained = time.monotonic() + 5  # (what is left in the pipes; a worker may hold one open)
  while selector.get_map() and time.monotonic() < drained:
    read(selector, 0.1)
  for p, w in zip(processes, watches, strict=True):
    if (lost := w.end(p.returncode)) and not said:  # the loss said once, by the first to see it
      print(lost, file=sys.stderr, flush=True)
      said = True
  if received and not status:
    return 128 + signal.SIGTERM
  return status or next((watch.exit_status(p.returncode) for p in processes if p.returncode), 0)


def read(selector, timeout: float) -> None:
  """Feeds what the processes wrote within `timeout` to their watches; a stream that ended is
  let go."""
  for key, _ in selector.select(timeout):
    if data := os.read(key.fileobj.fileno(), 1 << 16):
      key.data.feed(data)
    else:
      selector.unregister(key.fileobj)


def main(argv):
  for flag in (_NUM_PROCESSES, _DEVICES, _GPUS):
    if flag.value is not None and flag.value < 1:  # (0 processes would end 0, having done nothing)
      raise SystemExit(f"error: --{flag.name}={flag.value}: give 1 or more.")
  sys.exit(launch(argv[1:], _NUM_PROCESSES.value, _DEVICES.value, _TIMEOUT.value, _SCRIPT.value,
                  _GPUS.value))


if __name__ == "__main__":
  app.run(main)
