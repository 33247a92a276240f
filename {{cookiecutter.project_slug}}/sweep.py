"""A sweep: one config over a grid (or a list) of values, each a run of train.py in a workdir of
its own named by its values, one after another on this machine, or as a SLURM array (--slurm).

  python sweep.py --config=configs/default.py --workdir=sweeps/lr_wd \
      --grid=learning_rate=1e-3,3e-3 --grid=weight_decay=0,1e-4 -- --config.num_epochs=20
  python sweep.py --config=configs/default.py --workdir=sweeps/two \
      --run="learning_rate=1e-3 weight_decay=0" --run="learning_rate=3e-3 weight_decay=1e-4"
  python sweep.py ... --slurm=sweep.sbatch && sbatch sweep.sbatch   # a task a run

--grid=KEY=V1,V2,...: every combination of the values of each KEY given; --run="KEY=V ...": the
runs given (instead). Flags after `--` go to every run. Each run is `python train.py` (its own
process, its log on this terminal and in WORKDIR/NAME/sweep.log), W&B's runs grouped by the
sweep (WANDB_RUN_GROUP). SIGTERM or Ctrl-C reaches the run, which saves and stops, and the sweep
stops with it; the same command resumes it (a finished run is read from WORKDIR/sweep.json, the
one cut short resumes from its checkpoint). At the end: a table of each run's final and best
evaluation (WORKDIR/sweep.json holds it too).
"""

import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys

from absl import app, flags

from {{cookiecutter.project_slug}}.parallel import watch

_CONFIG = flags.DEFINE_string("config", None, "train.py's config file.", required=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The sweep's directory: a workdir a run.",
                               required=True)
_GRID = flags.DEFINE_multi_string("grid", [], "KEY=V1,V2,...: a config key's values (the runs: "
                                  "every combination).")
_RUN = flags.DEFINE_multi_string("run", [], "'KEY=V KEY=V': one run's values (instead of --grid).")
_SLURM = flags.DEFINE_string("slurm", "", "Write a SLURM array job to this file (a task a run) "
                             "instead of running here.")

EVAL_LINE = re.compile(r"eval at step (\d+): loss ([\d.]+)  accuracy ([\d.]+)")
FINAL_LINE = re.compile(r"Final eval: accuracy ([\d.]+), loss ([\d.]+), on (\d+) examples")


def runs_of(grid: list[str], listed: list[str]) -> list[dict[str, str]]:
  """The runs' values, in order: every combination of the --grid values, or the --run lists."""
  def pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not (sep and key and value):
      raise app.UsageError(f"{text!r} is not KEY=VALUE (e.g. learning_rate=1e-3)")
    return key.removeprefix("--config.").removeprefix("config."), value

  if grid and listed:
    raise app.UsageError("give --grid or --run, not both")
  if listed:
    return [dict(pair(part) for part in shlex.split(run)) for run in listed]
  axes = [(key, values.split(",")) for key, values in map(pair, grid)]
  return [dict(zip([key for key, _ in axes], values, strict=True))
          for values in itertools.product(*[values for _, values in axes])]


def name_of(values: dict[str, str]) -> str:
  """A run's name and folder: its values, `key=value,...` (a path's separators made `_`)."""
  return ",".join(f"{key}={value}" for key, value in values.items()).replace(os.sep, "_")


def command(values: dict[str, str], workdir: str, extra: list[str]) -> list[str]:
  return [sys.executable, "train.py", f"--config={_CONFIG.value}", *extra,
          *[f"--config.{key}={value}" for key, value in values.items()], f"--workdir={workdir}"]


def results_of(log: str) -> dict:
  """A run's final evaluation and its best (by accuracy), from its log lines (sweep.log)."""
  evals = [(float(acc), int(step), float(loss)) for step, loss, acc in EVAL_LINE.findall(log)]
  final = FINAL_LINE.findall(log)
  best = max(evals, key=lambda e: (e[0], -e[1]), default=None)
  return dict(final=final and dict(accuracy=float(final[-1][0]), loss=float(final[-1][1])),
              best=best and dict(accuracy=best[0], step=best[1], loss=best[2]))


def run_here(runs: list[dict], extra: list[str]) -> int:
  """Runs each run not yet done, one after another; returns the exit status (0: all done)."""
  record = os.path.join(_WORKDIR.value, "sweep.json")
  done = json.load(open(record)) if os.path.exists(record) else {}
  env = dict(os.environ, WANDB_RUN_GROUP=os.path.basename(os.path.abspath(_WORKDIR.value)))
  for i, values in enumerate(runs, 1):
    name = name_of(values)
    workdir = os.path.join(_WORKDIR.value, name)
    if done.get(name, {}).get("final"):
      print(f"sweep: run {i} of {len(runs)}, {name}: done ({record})", file=sys.stderr)
      continue
    os.makedirs(workdir, exist_ok=True)
    log = os.path.join(workdir, "sweep.log")
    print(f"sweep: run {i} of {len(runs)}, {name}: {shlex.join(command(values, workdir, extra))}"
          f" (its log also in {log})", file=sys.stderr, flush=True)
    status = run_one(command(values, workdir, extra), log, env)
    done[name] = dict(values=values, workdir=workdir, status=status,
                      **results_of(open(log).read()))
    with open(record, "w") as f:
      json.dump(done, f, indent=2)
    if status in (128 + signal.SIGTERM, 128 + signal.SIGINT):
      print(f"sweep: stopped in run {i} of {len(runs)} ({name}), saved; the same command "
            "resumes the sweep.", file=sys.stderr)
      return status
  print(table([done[name_of(values)] for values in runs]))
  return 0 if all(done[name_of(v)]["status"] == 0 for v in runs) else 1


def run_one(argv: list[str], log: str, env: dict) -> int:
  """Runs `argv` (its own process group: a terminal's Ctrl-C reaches it once, from here; it ends
  with the sweep, watch.ending_with), its output on this terminal and appended to `log`;
  SIGTERM, SIGINT and SIGHUP to the sweep passed on to it (it saves and stops); returns its exit
  status (128 + N: stopped by signal N)."""
  parent = os.getpid()
  with open(log, "a") as out:
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                               text=True, bufsize=1, process_group=0,
                               preexec_fn=lambda: watch.ending_with(parent))
    handlers = {signum: signal.signal(signum, lambda signum, _: process.send_signal(signum))
                for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
      for line in process.stdout:
        sys.stderr.write(line)
        out.write(line)
      return watch.exit_status(process.wait())
    finally:
      for signum, handler in handlers.items():
        signal.signal(signum, handler)


def table(results: list[dict]) -> str:
  """The runs' final and best evaluations, a line each."""
  width, nan = max(len(name_of(r["values"])) for r in results), float("nan")
  lines = ["run".ljust(width) + "  final accuracy  final loss  best accuracy (step)  exit"]
  for r in results:
    final, best = r.get("final") or {}, r.get("best") or {}
    lines.append(f"{name_of(r['values']).ljust(width)}  {final.get('accuracy', nan):>14.4f}  "
                 f"{final.get('loss', nan):>10.4f}  {best.get('accuracy', nan):>13.4f} "
                 f"({best.get('step', '-')})      {r['status']}")
  return "\n".join(lines)


def slurm_array(runs: list[dict], extra: list[str]) -> str:
  """A SLURM array job, a task a run (edit its #SBATCH lines: a task's GPUs, time, partition)."""
  lines = [shlex.join(command(values, os.path.join(_WORKDIR.value, name_of(values)), extra)[1:])
           for values in runs]
  return "\n".join([
      "#!/bin/bash", "#SBATCH --job-name=sweep", f"#SBATCH --array=0-{len(runs) - 1}",
      "#SBATCH --ntasks=1", "#SBATCH --gpus-per-task=1", "#SBATCH --signal=B:TERM@300",
      f"#SBATCH --output={os.path.join(os.path.abspath(_WORKDIR.value), 'task-%a.out')}",
      f"# {len(runs)} runs of {_CONFIG.value} (python sweep.py --slurm); a requeue resumes each.",
      f"export WANDB_RUN_GROUP={shlex.quote(os.path.basename(os.path.abspath(_WORKDIR.value)))}",
      "RUNS=(", *[f"  {shlex.quote(line)}" for line in lines], ")",
      'eval "exec srun python ${RUNS[$SLURM_ARRAY_TASK_ID]}"', ""])


def main(argv):
  runs = runs_of(_GRID.value, _RUN.value)
  if not runs:
    raise app.UsageError("give the runs: --grid=KEY=V1,V2 (repeatable) or --run='KEY=V ...'")
  names = [name_of(values) for values in runs]
  if len(set(names)) != len(names):
    raise app.UsageError(f"two runs have the same values: {names}")
  if _SLURM.value:
    with open(_SLURM.value, "w") as f:
      f.write(slurm_array(runs, argv[1:]))
    print(f"sweep: wrote {_SLURM.value}, an array of {len(runs)} tasks; sbatch {_SLURM.value}")
    return 0
  os.makedirs(_WORKDIR.value, exist_ok=True)
  return run_here(runs, argv[1:])


if __name__ == "__main__":
  app.run(lambda argv: sys.exit(main(argv)))
