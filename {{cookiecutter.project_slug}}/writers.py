"""CLU metric writers (TensorBoard, with or without TensorFlow; Weights & Biases beside it) and
the progress a person reads.

CLU 0.0.12 imports TensorFlow when `clu.metric_writers` (and so `clu.periodic_actions`) is
imported, only to define its TensorBoard `SummaryWriter`. When TensorFlow is not installed, this
module gives CLU a `SummaryWriter` backed by tensorboardX, which writes the same standard event
files, before CLU is imported. With TensorFlow installed, CLU's own writer is used unchanged.
Import this module before anything that imports `clu.metric_writers`.
"""

import importlib.util
import os
import sys
import time
import types

from absl import logging


def _tensorboardx_summary_writer(interface):
  import tensorboardX
  import tensorboardX.summary

  class SummaryWriter(interface.MetricWriter):
    """CLU's MetricWriter interface, written as TensorBoard event files by tensorboardX."""

    def __init__(self, logdir: str):
      self._writer = tensorboardX.SummaryWriter(logdir=logdir)

    def write_scalars(self, step, scalars):
      for key, value in scalars.items():
        self._writer.add_scalar(key, float(value), global_step=step)

    def write_images(self, step, images):
      for key, value in images.items():
        self._writer.add_images(key, value, global_step=step, dataformats="NHWC")

    def write_texts(self, step, texts):
      for key, value in texts.items():
        self._writer.add_text(key, value, global_step=step)

    def write_histograms(self, step, arrays, num_buckets=None):
      for key, value in arrays.items():
        self._writer.add_histogram(key, value, global_step=step)

    def write_hparams(self, hparams):
      # Into this writer's own file (add_hparams would open a second one).
      plain = {k: v if isinstance(v, (int, float, str, bool)) else str(v)
               for k, v in hparams.items()}
      for summary in tensorboardX.summary.hparams(plain, {}):
        self._writer.file_writer.add_summary(summary)

    def write_videos(self, step, videos):
      del step, videos  # not supported by this writer; CLU's logging writer ignores them too

    def write_audios(self, step, audios, *, sample_rate):
      for key, value in audios.items():
        self._writer.add_audio(key, value, global_step=step, sample_rate=sample_rate)

    def write_summaries(self, step, values, metadata=None):
      del step, values, metadata  # raw TF summaries need TensorFlow

    def flush(self):
      self._writer.flush()

    def close(self):
      self._writer.close()

  return SummaryWriter


def _install():
  name = "clu.metric_writers.summary_writer"
  if importlib.util.find_spec("tensorflow") is not None or name in sys.modules:
    return
  shim = types.ModuleType(name)

  def __getattr__(attr):  # called while clu.metric_writers imports, after its interface module
    if attr != "SummaryWriter":
      raise AttributeError(attr)
    shim.SummaryWriter = _tensorboardx_summary_writer(sys.modules["clu.metric_writers.interface"])
    return shim.SummaryWriter

  shim.__getattr__ = __getattr__
  sys.modules[name] = shim


_install()

from clu import metric_writers  # noqa: E402  (after the shim, on purpose)


class WandbWriter(metric_writers.MetricWriter):
  """Scalars and hyperparameters to a Weights & Biases run (the `wandb` extra), one W&B run per
  workdir: its id is kept in `workdir/wandb_run_id`, so a resumed run logs to the same one. W&B
  reads its own variables (WANDB_MODE=offline, WANDB_ENTITY, ...); its files go into the
  workdir unless WANDB_DIR names a place. Images, texts and histograms stay TensorBoard's."""

  def __init__(self, workdir: str, project: str, config: dict):
    import wandb  # only here: a run without `config.wandb_project` never imports it
    from etils import epath

    id_file = epath.Path(workdir) / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.exists() else None
    local = "://" not in workdir and "WANDB_DIR" not in os.environ
    self._run = wandb.init(project=project, id=run_id, resume="allow",
                           name=os.path.basename(os.path.normpath(workdir)), config=config,
                           dir=workdir if local else None)
    if run_id is None:
      id_file.write_text(self._run.id)

  def write_scalars(self, step, scalars):
    self._run.log({key: float(value) for key, value in scalars.items()}, step=step)

  def write_hparams(self, hparams):
    self._run.config.update(hparams, allow_val_change=True)

  def write_summaries(self, step, values, metadata=None):
    del step, values, metadata

  def write_images(self, step, images):
    del step, images

  def write_videos(self, step, videos):
    del step, videos

  def write_audios(self, step, audios, *, sample_rate):
    del step, audios, sample_rate

  def write_texts(self, step, texts):
    del step, texts

  def write_histograms(self, step, arrays, num_buckets=None):
    del step, arrays, num_buckets

  def flush(self):
    pass

  def close(self):
    self._run.finish()


def create_writer(workdir: str, write: bool = True, config=None) -> metric_writers.MetricWriter:
  """TensorBoard event files in `workdir` and, when `config.wandb_project` names one, a W&B run
  (`WandbWriter`), written by a background thread; nothing when `write` is False (processes
  other than 0). The log gets `Progress`'s lines instead."""
  if not write:
    return metric_writers.MultiWriter([])
  chosen = [metric_writers.SummaryWriter(workdir)]
  if config is not None and config.get("wandb_project"):
    from plan import flatten  # the config as TensorBoard's hparams get it

    chosen.append(WandbWriter(workdir, config.wandb_project, flatten(config.to_dict())))
  return metric_writers.AsyncMultiWriter(chosen)


def _minutes(seconds: float) -> str:
  return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def draw_bar(done: int, total: int, text: str = "", width: int = 30):
  """`[=====     ] done/total text` on stderr (a terminal), over the one drawn before."""
  full = width * done // max(total, 1)
  sys.stderr.write(f"\r[{'=' * full}{' ' * (width - full)}] {done}/{total} {text}\033[K")
  sys.stderr.flush()


class Progress:
  """One log line per log interval (step, loss, accuracy, examples/s, ETA) and, when stderr is a
  terminal, a progress bar between them, redrawn at most 4 times a second. TensorBoard gets
  `steps_per_sec` and `uptime`."""

  def __init__(self, num_steps: int, writer: metric_writers.MetricWriter, show: bool = True):
    self.num_steps, self.writer = num_steps, writer
    self.bar = show and sys.stderr.isatty()
    self.t0, self.drawn = time.perf_counter(), 0.0
    self.start(0)

  def start(self, step: int):
    """Starts the clock that the ETA and steps/s read (after the first call has compiled)."""
    self.first_step = self.last_step = step
    self.first_time = self.last_time = time.perf_counter()

  def pause(self, seconds: float):
    """Leaves `seconds` (an evaluation, a checkpoint) out of the next `steps_per_sec`."""
    self.last_time += seconds

  def eta(self, step: int, now: float) -> str:
    rate = (step - self.first_step) / max(now - self.first_time, 1e-9)
    return _minutes((self.num_steps - step) / rate) if rate else "?"

  def update(self, step: int):
    """After every call: one clock read, unless the bar is due."""
    if self.bar and (now := time.perf_counter()) - self.drawn > 0.25:
      self.drawn = now
      draw_bar(step, self.num_steps, f"ETA {self.eta(step, now)}")

  def log(self, message: str, *args, level: int = logging.INFO):
    """A log line, printed above the bar."""
    self.close()
    logging.log(level, message, *args)

  def close(self):
    """Clears the bar (it is drawn again at the next update)."""
    if self.bar:
      sys.stderr.write("\r\033[K")
      sys.stderr.flush()

  def report(self, step: int, summary: dict[str, float]):
    now = time.perf_counter()
    self.writer.write_scalars(step, {
        "steps_per_sec": (step - self.last_step) / max(now - self.last_time, 1e-9),
        "uptime": now - self.t0})
    self.last_step, self.last_time = step, now
    rate = summary.get("examples_per_sec")  # none for the compiling call alone
    wait = summary.get("input_wait_fraction")
    smoothed = summary["loss"] != summary.get("cross_entropy", summary["loss"])
    self.log("step %d/%d  loss %.4f%s  accuracy %.4f  %s examples/s  input wait %s  ETA %s",
             step, self.num_steps, summary["loss"],
             f" (smoothed labels; cross-entropy {summary['cross_entropy']:.4f})" if smoothed
             else "", summary["accuracy"], "?" if rate is None else f"{rate:.0f}",
             "?" if wait is None else f"{100 * wait:.0f}%", self.eta(step, now))


__all__ = ["metric_writers", "create_writer", "draw_bar", "Progress", "WandbWriter"]
