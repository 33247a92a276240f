"""The exceptions that end a run, at the bottom of the imports, each turned into the process's
end by process.exits: a config, flag or path that cannot work (rules.py, the model's check, the
workdir's readers), data that cannot train (the sources), a failed save (checkpoints.saving), a
non-finite step and a stop (stopping.py); and the command line's: a config file or a
--config.KEY that is not there, in one line (`parse_flags`)."""

import difflib
import glob
import importlib.util
import os
import signal
import traceback

import ml_collections
from absl import app, flags
from ml_collections import config_flags


class ConfigError(ValueError):
  """A config, flag or path that cannot work; the message names the key, the value and the fix."""


class BadData(ValueError):
  """Data that cannot train (too many records unreadable, one class); the message names the
  first problem and the fix."""


class SaveFailed(Exception):
  """A checkpoint could not be written; the message names the directory, the error and the fix."""


class NonFiniteLoss(FloatingPointError):
  """A training step had a non-finite loss or gradient (its update was not applied)."""


class Stopped(Exception):  # noqa: N818 (a stop, not an error)
  """The run stopped early, after saving the checkpoint of its last step; the same command
  resumes it.

  Args:
    by: the signal's number, or what else stopped it.
    step: the last step.
    num_steps: the run's.
    workdir: where the checkpoint is.
  """

  def __init__(self, by: int | str, step: int, num_steps: int, workdir: str):
    self.by, self.step = by, step
    name = signal.Signals(by).name if isinstance(by, int) else by
    super().__init__(f"Stopped by {name} after step {step} of {num_steps}; saved checkpoint "
                     f"{step} in {workdir}. Run the same command again to resume.")

  @property
  def exit_code(self) -> int:
    """128 + the signal, as shells expect (130: Ctrl-C; a preemption notice: SIGTERM's 143)."""
    return 128 + (self.by if isinstance(self.by, int) else signal.SIGTERM)


def where(error: BaseException, path: str) -> str:
  """`path:LINE`: the line of the file `path` (a user's model.py) where `error` was raised or
  last passed through (a SyntaxError's own line); `path` alone when it never did. The path is
  said as `shown` says it."""
  if isinstance(error, SyntaxError) and error.filename and error.lineno:
    if os.path.abspath(error.filename) == os.path.abspath(path):
      return f"{shown(path)}:{error.lineno}"
  lines = [line for frame, line in traceback.walk_tb(error.__traceback__)
           if os.path.abspath(frame.f_code.co_filename) == os.path.abspath(path)]
  return f"{shown(path)}:{lines[-1]}" if lines else shown(path)


def shown(path: str) -> str:
  """`path` relative to the working directory when it lies under it, else as it is."""
  relative = os.path.relpath(path)
  return path if relative.startswith("..") else relative


def one_line(error: BaseException, limit: int = 400) -> str:
  """`error` as `Type: message` on one line (its whitespace collapsed), at most `limit` long."""
  message = " ".join(str(error).split())
  if isinstance(error, SyntaxError):
    message = error.msg
  text = f"{type(error).__name__}: {message}" if message else type(error).__name__
  return text if len(text) <= limit else text[:limit - 3] + "..."


def unknown_key(argv) -> str | None:
  """The first --config.KEY of `argv` that its --config=FILE[:ARG] does not have, with the
  closest key of that level that it has (difflib), as one line; None when they all exist."""
  file = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
  if file is None and "--config" in argv[:-1]:  # (--config FILE)
    file = argv[argv.index("--config") + 1]
  if file is None:
    return None
  path, _, arg = file.partition(":")
  spec = importlib.util.spec_from_file_location("config_file", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(*[arg] if arg else [])
  for key in (a[len("--config."):].split("=")[0] for a in argv if a.startswith("--config.")):
    node, parts = config, key.split(".")
    for i, part in enumerate(parts):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        names = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
        hint = [".".join([*parts[:i], m]) for m in difflib.get_close_matches(part, names, 1)]
        return (f"the config has no key {key!r}{f' (did you mean {hint[0]!r}?)' if hint else ''}"
                "; its keys are in configs/default.py (a typo in --config.KEY=VALUE?).")
      node = node[part]
  return None


def parse_flags(argv):
  """absl's flag parsing, where a config file that is not there, or a --config.KEY that the
  config does not have, is one line too."""
  try:
    parsed = app.parse_flags_with_usage(argv)
  except AttributeError:  # ml_collections: a --config.KEY that the config lacks
    if message := unknown_key(argv):
      raise SystemExit(f"error: {message}") from None
    raise
  path = config_flags.get_config_filename(flags.FLAGS["config"]).split(":")[0]
  if not os.path.isfile(path):
    configs = sorted(glob.glob(os.path.join(os.path.dirname(path) or ".", "*.py")))
    raise SystemExit(f"error: --config={path!r} is not a file; use one of "
                     f"{', '.join(configs) or 'configs/default.py'}.")
  return parsed
