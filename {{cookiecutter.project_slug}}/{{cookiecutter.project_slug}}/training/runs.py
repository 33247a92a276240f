"""A run's config (`prepare`) and its workdir: config.json (the run's config), data.json (the data's
description), a copy of its model.py, its checkpoints (checkpoints.py: `Checkpoints`). A run
started again in its workdir resumes it, and keeps its config but for what plan.FREE_ON_RESUME
names. (Reading a trained run back: trained.py.)"""

import atexit
import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import time

import jax
import ml_collections
from absl import logging
from etils import epath

from .. import errors, plan, rules
from ..data import sources
from ..plan import CONFIG_FILE, Plan
from . import stopping
from .checkpoints import Checkpoints, absolute, checkpoint_manager

CLAIM_FILE = "claimed.json"  # the run that holds the workdir (`Claim`)
STALE_AFTER_S = 900  # a claim not renewed for this long (a hung run, a host gone) is stale
DATA_FILE = "data.json"
MODEL_FILE = "model.py"  # the source of the run's model module (config.model.module), as trained


def prepare(config: ml_collections.ConfigDict, workdir: str) -> tuple[Plan, str]:
  """The run's plan (`plan.make_plan`: the modules its config names, made once) and workdir. Its
  config is `config` checked and frozen, with what it comes to on these devices under
  `config.run` (`plan.resolved`: k, the global batch and a device's share) and, when `workdir`
  holds a run, that run's own config (`plan.resumed`; changes logged); the workdir an absolute
  path (a bucket's as it is)."""
  rules.validate_config(config, workdir)
  workdir = absolute(workdir)
  config = plan.resolved(config, resuming=(saved_config(workdir), workdir))
  return plan.make_plan(ml_collections.FrozenConfigDict(config)), workdir


def with_class_weights(run_plan: Plan, info: sources.DatasetInfo) -> Plan:
  """The plan with `config.run.class_weights`, the loss's weight of each class (steps.py: a
  weighted mean), where `config.class_weights` is set: its numbers, or for 'balanced' N / (K x
  n_k) of the training split's class counts (scikit-learn's; 0 for a class without examples)."""
  config, given = run_plan.config, run_plan.config.get("class_weights", "")
  if not given:
    return run_plan
  counts, classes = info.class_counts, info.num_classes
  if given == "balanced" and not counts:
    raise errors.ConfigError(
        f"config.class_weights='balanced' needs the training split's class counts, which "
        f"config.dataset={config.dataset!r} does not give; give {classes} weights, one a class.")
  weights = (tuple(sum(counts) / (len(counts) * n) if n else 0.0 for n in counts)
             if given == "balanced" else tuple(float(w) for w in given.split(",")))
  if len(weights) != classes:
    raise errors.ConfigError(f"config.class_weights={given!r} holds {len(weights)} weights; the "
                             f"data has {classes} classes: give one a class, or 'balanced'.")
  config = ml_collections.ConfigDict(config)  # (a frozen one's copy)
  with config.unlocked():
    config.run.class_weights = weights
  return run_plan._replace(config=ml_collections.FrozenConfigDict(config))


def start_or_resume(workdir: str, config, info: sources.DatasetInfo, abstract, init
                    ) -> tuple[Checkpoints, int, object]:
  """Starts a run in its workdir, or resumes it, and writes the workdir's description
  (`write_description`).

  Args:
    workdir: the run's workdir.
    config: the run's config (`config.init_from`: a run to fine-tune from, read first, so that
      a mismatch stops the run before its workdir is touched: finetune.py).
    info: the data's DatasetInfo.
    abstract: the state's abstract value (shapes, dtypes, shardings).
    init: builds the state.
  Returns:
    The run's `checkpoints.Checkpoints`, the step it starts from, and its state: the workdir's
    latest checkpoint's, else `init`'s.
  """
  if config.init_from:
    from .finetune import init_from

    init = init_from(config.init_from, abstract, init, config.run, info.image_shape)
  claim = Claim(workdir)
  stopping.at_exit(claim.close)  # (however the watchdog ends the process)
  try:
    saved = Checkpoints(workdir, config, claim)
    first_step, state = saved.restore_or_init(abstract, init)
    write_description(workdir, config, info)
  except BaseException:  # (a checkpoint refused, say: the workdir let go as it was)
    claim.close()
    raise
  return saved, first_step, state


class Claim:
  """This run's hold on its workdir, taken before anything is written there (by process 0, of a
  local workdir): `CLAIM_FILE` names the holder's host, process id and its start, created
  exclusively (two runs started at once: one holds it), renewed as the loop checks its saves
  (`renew`) and removed however the run ends (`close`; at the latest as its process exits). A run
  on a workdir held by another stops in one line naming the holder; a claim whose process is gone
  (on this host) or is another program now (its start differs: a process id reused), or not
  renewed for `STALE_AFTER_S`, is stale: said, and taken over."""

  def __init__(self, workdir: str):
    self.path, self.renewed = os.path.join(workdir, CLAIM_FILE), 0.0
    self.held = jax.process_index() == 0 and "://" not in workdir
    if not self.held:
      return
    self.since = datetime.datetime.now().isoformat(timespec="seconds")
    made = "made"
    try:
      os.makedirs(workdir, exist_ok=True)
      made, directory = "written", os.open(workdir, os.O_RDONLY)
      try:  # (the check and the take one run at a time, where the file system locks)
        with contextlib.suppress(OSError):
          fcntl.flock(directory, fcntl.LOCK_EX)
        self.take(workdir)
      finally:
        os.close(directory)
    except OSError as e:
      self.held = False
      fix = ("free space on its file system, or use another --workdir" if e.errno == errno.ENOSPC
             else "give a directory that this user can write")
      raise errors.ConfigError(f"--workdir={workdir!r} cannot be {made} "
                               f"({errors.one_line(e)}); {fix}.") from None
    atexit.register(self.close)

  def take(self, workdir: str) -> None:
    holder = self.holder()
    if holder and (why := stale(holder)):
      if holder.get("pid") != os.getpid():
        logging.warning("workdir %s was held by process %s on %s since %s, %s: taken over",
                        workdir, holder.get("pid"), holder.get("host"), holder.get("since"), why)
      with contextlib.suppress(FileNotFoundError):
        os.remove(self.path)
      holder = None
    if holder is None:
      with contextlib.suppress(FileExistsError):  # (unless another run took it since)
        return self.renew(force=True)
      holder = self.holder() or {}
    age = time.time() - holder.get("renewed", 0)
    raise errors.ConfigError(
        f"workdir {workdir!r} is in use by another run: process {holder.get('pid')} on "
        f"{holder.get('host')}, since {holder.get('since')} (renewed {age:.0f} s ago); let it "
        f"end or stop it, or use another --workdir (a claim not renewed for {STALE_AFTER_S} s "
        "is taken over).")

  def holder(self) -> dict | None:
    try:
      with open(self.path) as f:
        holder = json.load(f)
    except FileNotFoundError:
      return None
    except (OSError, ValueError):
      return {"pid": "?", "host": "?", "since": "?", "unreadable": True}
    return holder if isinstance(holder, dict) else {"unreadable": True}

  def renew(self, force: bool = False) -> None:
    """Writes the claim anew, at most once a minute; the first time (`force`) only where there is
    none (raising FileExistsError), and raising OSError where it cannot be written (later, a
    claim that cannot be written ages: the saves say why)."""
    if not self.held or (not force and time.time() - self.renewed < 60):
      return
    self.renewed, written = time.time(), f"{self.path}.{os.getpid()}"
    claim = dict(host=socket.gethostname(), pid=os.getpid(), started=started(os.getpid()),
                 since=self.since, renewed=self.renewed)
    try:
      with open(written, "w") as f:
        json.dump(claim, f)
      try:  # (the first time linked, which only a path that is not there takes)
        (os.link if force else os.replace)(written, self.path)
      except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP):  # (a file system without links)
          raise
        os.replace(written, self.path)
    except OSError:
      if force:
        raise
    finally:
      with contextlib.suppress(OSError):
        os.remove(written)

  def close(self) -> None:
    """Lets the workdir go (the claim removed, if it is still this process's)."""
    if self.held and (self.holder() or {}).get("pid") == os.getpid():
      os.remove(self.path)
    self.held = False


def started(pid) -> str | None:
  """When process `pid` started, as this boot's id and its start in clock ticks (Linux's /proc);
  None where that cannot be read (another system, no such process)."""
  try:
    with open("/proc/sys/kernel/random/boot_id") as boot, open(f"/proc/{int(pid)}/stat") as stat:
      return f"{boot.read().strip()}:{stat.read().rsplit(')', 1)[1].split()[19]}"
  except (OSError, ValueError, IndexError, TypeError):
    return None


def stale(holder: dict) -> str | None:
  """Why a claim (`Claim.holder`) no longer holds its workdir, or None while it does."""
  if holder.get("unreadable"):
    return "in a claim that cannot be read"
  if holder.get("host") == socket.gethostname():
    if holder.get("pid") == os.getpid():
      return "this process's own"
    try:
      os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
      return "which is no longer running"
    except (PermissionError, KeyError, ValueError, TypeError):
      pass
    if holder.get("started") and started(holder["pid"]) not in (None, holder["started"]):
      return "whose process id is another program's now (the run ended; the id was reused)"
  try:
    age = time.time() - float(holder.get("renewed", 0))
  except (TypeError, ValueError):  # ("renewed": "yesterday": not a claim this project wrote)
    return "in a claim that cannot be read"
  return f"not renewed for {age:.0f} s" if age > STALE_AFTER_S else None


def write_description(workdir: str, config, info: sources.DatasetInfo) -> None:
  """Writes what `trained.Restored` needs besides a checkpoint, whatever model.py comes to hold
  (process 0): config.json, data.json and a copy of the model's source, `MODEL_FILE`.

  Args:
    workdir: the run's workdir.
    config: the run's config.
    info: the data's DatasetInfo.
  """
  if jax.process_index() != 0:
    return
  names = info.class_names or tuple(str(i) for i in range(info.num_classes))
  data = dict(image_shape=list(info.image_shape), num_classes=info.num_classes,
              class_names=list(names), pixel_dtype=info.pixel_dtype,
              model_input=sources.model_input(info.pixel_dtype),
              crops_on_host=info.crops_on_host)
  (epath.Path(workdir) / CONFIG_FILE).write_text(config.to_json(indent=2))
  (epath.Path(workdir) / DATA_FILE).write_text(json.dumps(data, indent=2))
  module = sys.modules[config.model.get("module", "model")]  # (imported: the model is built)
  source, copy = epath.Path(module.__file__).read_text(), epath.Path(workdir) / MODEL_FILE
  if copy.exists() and copy.read_text() != source:  # a resume, its leaves the same
    logging.warning("%s has changed since this run last started; it goes on with it as it is "
                    "now (its leaves are the same), and %s now holds it", module.__file__, copy)
  copy.write_text(source)


def saved_config(workdir: str) -> dict | None:
  """The resolved config (a dict) of the run that a start in `workdir` resumes: that of its
  config.json when the workdir holds a checkpoint, else None (a new run)."""
  path = epath.Path(workdir)
  if not (path / CONFIG_FILE).exists() or not (path / "checkpoints").exists():
    return None
  with contextlib.closing(checkpoint_manager(workdir, create=False)) as checkpoints:
    if checkpoints.latest_step() is None:
      return None
  return json.loads((path / CONFIG_FILE).read_text())
