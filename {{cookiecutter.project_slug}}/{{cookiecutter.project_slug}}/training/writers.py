"""Where a run's metrics go: TensorBoard event files (tensorboardX: CLU's writers import
TensorFlow) and W&B beside them (wandb_writer.py). Each writer has the methods of CLU's
`MetricWriter` that the scripts call. (The log's lines, the clock and the profile: report.py.)"""

import concurrent.futures

import numpy as np

from ..plan import flatten


class TensorBoardWriter:
  """TensorBoard event files in `logdir` (tensorboardX)."""

  def __init__(self, logdir: str):
    import tensorboardX

    self._writer = tensorboardX.SummaryWriter(logdir=logdir)

  def write_scalars(self, step: int, scalars: dict):
    for key, value in scalars.items():
      self._writer.add_scalar(key, float(value), global_step=step)

  def write_images(self, step: int, images: dict):
    for key, value in images.items():
      self._writer.add_images(key, value, global_step=step, dataformats="NHWC")

  def write_hparams(self, hparams: dict):
    import tensorboardX.summary

    # Into this writer's own file (add_hparams would open a second one).
    plain = {k: v if isinstance(v, (int, float, str, bool)) else str(v)
             for k, v in hparams.items()}
    for summary in tensorboardX.summary.hparams(plain, {}):
      self._writer.file_writer.add_summary(summary)

  def flush(self):
    self._writer.flush()

  def close(self):
    self._writer.close()


class Writers:
  """Several writers behind one, written by one background thread (calls keep their order; the
  loop never waits for a file or the network). A writer's error is raised at the next call."""

  def __init__(self, writers: list):
    self.writers, self.pending = writers, []
    self.thread = concurrent.futures.ThreadPoolExecutor(1, "writers") if writers else None

  def _each(self, method: str, *args):
    for future in [f for f in self.pending if f.done()]:
      self.pending.remove(future)
      future.result()
    self.pending += [self.thread.submit(getattr(w, method), *args) for w in self.writers]

  def write_scalars(self, step: int, scalars: dict):
    self._each("write_scalars", step, dict(scalars))

  def write_images(self, step: int, images: dict):
    self._each("write_images", step, images)

  def write_hparams(self, hparams: dict):
    self._each("write_hparams", hparams)

  def flush(self):
    self._each("flush")
    for future in self.pending:
      future.result()
    self.pending = []

  def close(self):
    if self.thread:
      self.flush()
      self._each("close")
      self.thread.shutdown()
      self.writers, self.thread = [], None
      for future in self.pending:
        future.result()


def create_writer(workdir: str, write: bool = True, config=None, new_run: bool = False) -> Writers:
  """The run's writers: TensorBoard event files and, when `config.wandb_project` names one, a W&B
  run (`WandbWriter`).

  Args:
    workdir: where the event files go.
    write: False: none (processes other than 0; the log gets `Progress`'s lines).
    config: the run's config.
    new_run: whether the config is written as the run's hyperparameters (TensorBoard's HPARAMS).
  """
  if not write:
    return Writers([])
  chosen = [TensorBoardWriter(workdir)]
  flat = None
  if config is not None:
    flat = flatten(config.to_dict())  # the config as dotted keys
    if config.get("wandb_project"):
      from .wandb_writer import WandbWriter  # (a run without W&B never imports it)

      chosen.append(WandbWriter(workdir, config.wandb_project, flat))
  writers = Writers(chosen)
  if new_run and flat is not None:
    writers.write_hparams(flat)
  return writers


def write_confusion(writer, step: int, counts, names, prefix: str = "eval") -> np.ndarray:
  """Writes a confusion matrix `[true class, predicted class]` of counts as an image
  (`{prefix}_confusion_matrix`; `confusion_matrix` for the run's own eval split) and each class's
  accuracy as a scalar (`{prefix}_accuracy/NAME`, of the classes with examples); returns those
  accuracies (NaN: a class without examples)."""
  counts = np.asarray(counts)
  with np.errstate(invalid="ignore"):
    per_class = np.diag(counts) / counts.sum(axis=1)
  writer.write_scalars(step, {f"{prefix}_accuracy/{name}": accuracy for name, accuracy in
                              zip(names, per_class, strict=True) if not np.isnan(accuracy)})
  share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)  # a row a true class, white
  cell = max(4, 256 // len(counts))  # where all its examples went; cells of 4 pixels at least
  pixels = np.kron(np.round(255 * share), np.ones((cell, cell))).astype(np.uint8)
  image = np.repeat(pixels[None, :, :, None], 3, axis=-1)
  writer.write_images(step, {"confusion_matrix" if prefix == "eval" else
                             f"{prefix}_confusion_matrix": image})
  return per_class
