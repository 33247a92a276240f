"""A process of a job of several, watched by a parent of its own: when the job loses a process,
JAX's distributed service (or gloo's collective) stops the survivors with a C++ abort, 80-120
lines of stack dumps and no word of which process was lost; the parent says it in one line.

train.py, one of several processes (process.start), runs its own command again as a
child and only passes on: its standard error, line by line; the signals it gets (SIGTERM, SIGINT,
...); its exit status. The child ends with the parent (a SIGKILL of the parent ends both)."""

import os
import re
import signal
import subprocess
import sys

SUPERVISED = "NNX_DP_SUPERVISOR"  # in the child: its parent's process id
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# What a survivor prints when the job lost a process: held back from the first such line, and
# said in one line (`lost_said`) if the child then aborts, else passed on as it was.
HOLD = re.compile(rb"^(F\d{4} |E\d{4} .*coordination_service|\*\*\* Check failure stack|"
                  rb"Fatal Python error|terminate called after throwing)")
LOG_LINE = re.compile(rb"^[IW]\d{4} ")  # a plain log line: what was held was not the end


def supervise() -> None:
  """Returns in the child (ending it with its parent); in the parent, runs the child and exits
  with its status, or 1 with one `error:` line when the job lost a process."""
  if parent := os.environ.get(SUPERVISED):
    end_with_the_parent(int(parent))
    return
  arguments = sys.orig_argv[len(sys.orig_argv) - len(sys.argv) + 1:]
  run = sys.argv[0] in ("-c", *sys.orig_argv) and arguments == sys.argv[1:]
  if not run:  # (its main called from Python, not run as a command: nothing to run again)
    return
  # (In a process group of its own: a terminal's Ctrl-C reaches it once, passed on from here.)
  child = subprocess.Popen([sys.executable, *sys.orig_argv[1:]], stderr=subprocess.PIPE,
                           env=dict(os.environ, **{SUPERVISED: str(os.getpid())}),
                           process_group=0)
  for signum in SIGNALS:
    signal.signal(signum, lambda signum, frame: child.send_signal(signum))
  held = []
  for line in child.stderr:
    if held and LOG_LINE.match(line):  # (an error that did not end the process)
      pass_on(held)
      held = []
    if held or HOLD.match(line):
      held.append(line)
    else:
      pass_on([line])
  status = child.wait()
  said = lost_said(b"".join(held).decode(errors="replace")) if status and held else None
  if said is None:
    pass_on(held)
    sys.exit(128 - status if status < 0 else status)
  print(said, file=sys.stderr, flush=True)
  sys.exit(1)


def pass_on(lines: list[bytes]) -> None:
  sys.stderr.buffer.write(b"".join(lines))
  sys.stderr.buffer.flush()


def lost_said(held: str) -> str | None:
  """The one line for a child whose last words (`held`) say that the job lost a process, naming
  it where JAX's service does; None for any other end."""
  resume = ("so this one stopped too; once every process can run, the same command on each "
            "resumes from the last checkpoint.")
  if lost := re.search(r"stopped sending heartbeats\):\n((?:[\d, ]+\n)+)", held):
    numbers = ", ".join(re.findall(r"\d+", lost.group(1)))
    return (f"error: the job lost process {numbers} (no heartbeat from it: killed, out of "
            f"memory, or its host gone), {resume}")
  if status := re.search(r"detected fatal errors.*?absl::Status: ([^\n]+)", held, re.DOTALL):
    return f"error: the job lost a process (JAX's distributed service: {status.group(1)}), {resume}"
  if gloo := re.search(r"instance of '(gloo::\w+)'", held):
    return (f"error: the job lost a process (a collective's peer went away: {gloo.group(1)}), "
            f"{resume}")
  return None


def end_with_the_parent(parent: int) -> None:
  """The kernel ends this process when its parent ends (Linux; elsewhere nothing is done)."""
  if sys.platform != "linux":
    return
  import ctypes

  pr_set_pdeathsig = 1
  ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)
  if os.getppid() != parent:  # (it ended before the call)
    os._exit(1)
