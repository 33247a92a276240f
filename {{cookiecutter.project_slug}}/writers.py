"""CLU metric writers, with or without TensorFlow.

CLU 0.0.12 imports TensorFlow when `clu.metric_writers` (and so `clu.periodic_actions`) is
imported, only to define its TensorBoard `SummaryWriter`. When TensorFlow is not installed, this
module gives CLU a `SummaryWriter` backed by tensorboardX, which writes the same standard event
files, before CLU is imported. With TensorFlow installed, CLU's own writer is used unchanged.
Import this module before anything that imports `clu.metric_writers`.
"""

import importlib.util
import sys
import types


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

from clu import metric_writers, periodic_actions  # noqa: E402  (after the shim, on purpose)

__all__ = ["metric_writers", "periodic_actions"]
