"""A run's config (`prepare`) and its workdir: config.json (the run's config), data.json (the data's
description), a copy of its model.py, its checkpoints (checkpoints.py: `Checkpoints`). A run
started again in its workdir resumes it, and keeps its config but for what plan.FREE_ON_RESUME
names. (Reading a trained run back: trained.py.)"""

import contextlib
import json
import sys

import jax
import ml_collections
from absl import logging
from etils import epath

from .. import plan, rules
from ..data import sources
from ..plan import CONFIG_FILE, Plan
from .checkpoints import Checkpoints, absolute, checkpoint_manager

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


def start_or_resume(workdir: str, config, info: sources.DatasetInfo, abstract, init
                    ) -> tuple[Checkpoints, int, object]:
  """The run's checkpoints (`checkpoints.Checkpoints`), the step it starts from and its state:
  the workdir's latest checkpoint's, else `init`'s (fine-tuned from `config.init_from`'s run:
  finetune.py, read first, so that a mismatch stops the run before its workdir is touched).
  Writes the workdir's description (`write_description`)."""
  if config.init_from:
    from .finetune import init_from

    init = init_from(config.init_from, abstract, init)
  saved = Checkpoints(workdir, config)
  first_step, state = saved.restore_or_init(abstract, init)
  write_description(workdir, config, info)
  return saved, first_step, state


def write_description(workdir: str, config, info: sources.DatasetInfo) -> None:
  """config.json, data.json and a copy of the model's source, `MODEL_FILE` (process 0): what
  `trained.Restored` needs besides a checkpoint, whatever model.py comes to hold."""
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
