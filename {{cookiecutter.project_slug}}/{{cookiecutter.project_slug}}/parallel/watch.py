"""A job's processes watched by what starts them (launch.py; under a cluster's launcher,
clusters/watched.py): when the job loses a process, JAX's distributed service (or gloo's
collective) stops the survivors with a C++ abort, 80-120 lines of stack dumps and no word of
which process was lost; `Watch`, reading a survivor's standard error, says it in one line.

  srun ... python clusters/watched.py train.py --workdir=...   # train.py, watched

train.py itself is one process a rank: nothing here runs inside it."""

import ctypes
import os
import re
import signal
import subprocess
import sys

# What a watcher passes on to its process (launch.py passes SIGTERM to each of its own).
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# What a survivor prints when the job lost a process: held back from the first such line, and
# said in one line (`lost_said`) if the process then fails, else passed on as it was.
HOLD = re.compile(rb"^(F\d{4} |E\d{4} .*coordination_service|\*\*\* Check failure stack|"
                  rb"Fatal Python error|terminate called after throwing)")
LOG_LINE = re.compile(rb"^[IW]\d{4} ")  # a plain log line: what was held was not the end
HOLD_MAX_BYTES = 1 << 20  # more held than this is passed on (a lost process's dump is ~10 KB)


class Watch:
  """A process's standard error passed on to `out` (bytes) line by line, its last words held
  back from the first line `HOLD` matches (at most `HOLD_MAX_BYTES`: then passed on); at its end
  (`end`) said in one line when they say that the job lost a process."""

  def __init__(self, out):
    self.out, self.held, self.held_bytes, self.partial = out, [], 0, bytearray()

  def feed(self, data: bytes) -> None:
    """Passes on, or holds, each line that `data` completes (b"": the stream's end)."""
    if data and b"\n" not in data and b"\r" not in data:  # a line not ended yet: kept, in
      self.partial += data  # place (not joined anew at every read: quadratic in a long line)
      return
    lines = bytes(self.partial + data).splitlines(keepends=True)
    self.partial = bytearray(
        lines.pop() if data and lines and not lines[-1].endswith(b"\n") else b"")
    for line in lines:
      if self.held and (LOG_LINE.match(line) or self.held_bytes > HOLD_MAX_BYTES):
        self.pass_on()  # (not the end, or more than a dump: passed on as it was)
      if self.held or HOLD.match(line):
        self.held.append(line)
        self.held_bytes += len(line)
      else:
        self.out.write(line)
    self.out.flush()

  def pass_on(self) -> None:
    self.out.write(b"".join(self.held))
    self.held, self.held_bytes = [], 0

  def end(self, returncode: int) -> str | None:
    """At the process's end (its `returncode`): the one `error:` line when what it held says the
    job lost a process (the held lines dropped); None, what it held passed on, otherwise."""
    self.feed(b"")
    said = lost_said(b"".join(self.held).decode(errors="replace")) if returncode else None
    if said is None:
      self.pass_on()
      self.out.flush()
    self.held, self.held_bytes = [], 0
    return said


def lost_said(held: str) -> str | None:
  """The one line for a process whose last words (`held`) say that the job lost a process,
  naming it where JAX's service does; None for any other end."""
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


def ending_with(parent: int) -> None:
  """What a watched process runs before its program (Linux): killed when `parent` (what started
  it) dies without passing a signal on (prctl's PR_SET_PDEATHSIG); ended at once if it has."""
  if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:
      os._exit(128 + signal.SIGKILL)


def exit_status(returncode: int) -> int:
  """A process's exit status as a shell gives it: 128 + N for one killed by signal N."""
  return 128 - returncode if returncode < 0 else returncode


def watched(command: list[str]) -> int:
  """Runs `command` (its own process group: a terminal's Ctrl-C reaches it once, from here),
  passing on the signals of `SIGNALS` and its standard error (`Watch`); it ends with this one.
  Returns its exit status (`exit_status`), or 1 after one line saying the job lost a process."""
  parent = os.getpid()
  child = subprocess.Popen(command, stderr=subprocess.PIPE, process_group=0,
                           preexec_fn=lambda: ending_with(parent))
  for signum in SIGNALS:
    signal.signal(signum, lambda signum, frame: child.send_signal(signum))
  watch = Watch(sys.stderr.buffer)
  while data := child.stderr.read1(1 << 16):
    watch.feed(data)
  if said := watch.end(child.wait()):
    print(said, file=sys.stderr, flush=True)
    return 1
  return exit_status(child.returncode)
