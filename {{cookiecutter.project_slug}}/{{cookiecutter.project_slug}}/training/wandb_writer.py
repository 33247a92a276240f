"""Weights & Biases beside TensorBoard (`config.wandb_project`, the `wandb` extra)."""

import os

import wandb
from etils import epath


class WandbWriter:
  """Scalars and hyperparameters to a Weights & Biases run (the `wandb` extra), one W&B run per
  workdir: its id is kept in `workdir/wandb_run_id`, so a resumed run logs to the same one. W&B
  reads its own variables (WANDB_MODE=offline, WANDB_ENTITY, ...); its files go into the
  workdir unless WANDB_DIR names a place. Images stay TensorBoard's.

  Args:
    workdir: the run's workdir.
    project: the W&B project.
    config: the run's config, as its hyperparameters.
  """

  def __init__(self, workdir: str, project: str, config: dict):
    id_file = epath.Path(workdir) / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.exists() else None
    local = "://" not in workdir and "WANDB_DIR" not in os.environ
    self._run = wandb.init(project=project, id=run_id, resume="allow",
                           name=os.path.basename(os.path.normpath(workdir)), config=config,
                           dir=workdir if local else None)
    if run_id is None:
      id_file.write_text(self._run.id)

  def write_scalars(self, step: int, scalars: dict):
    self._run.log({key: float(value) for key, value in scalars.items()}, step=step)

  def write_images(self, step: int, images: dict):
    del step, images

  def write_hparams(self, hparams: dict):
    self._run.config.update(hparams, allow_val_change=True)

  def flush(self):
    pass

  def close(self):
    self._run.finish()
