"""What a run reports, in one place (`Report`): its metrics to the writers (writers.py), the log's
progress lines and bar, the loop's clock (`Clock`), a profile (`Profiler`), what the run is about
to do (`log_run`; the state: `Report`) and each log interval's rates (`Report.train`)."""

import contextlib
import os
import platform
import shlex
import sys
import time
from typing import NamedTuple

import flax
import jax
from absl import logging
from flax import nnx

from .. import errors
from ..parallel import sharding
from . import flops, steps, writers


class Report:
  """The run's reporting: `writer` (TensorBoard, W&B; process 0's), `clock`, `progress` (the
  log's lines and bar), `profiler`. Made once the state is restored or built, it logs what the
  run will do (`log_run`), and the model and its state.

  Args:
    run_plan: the run's plan.
    workdir: where the writers write, and the profile.
    data: the run's data (`input_pipeline.Data`: its info, steps and memory).
    first_step: the step the run starts from (0: a new run).
    graphdef: the state's graph.
    state: the state.
  """

  def __init__(self, run_plan, workdir: str, data, first_step: int, graphdef, state):
    config, info, num_train_steps = run_plan.config, data.info, data.num_train_steps
    log_run(config, info, run_plan.recipe, data.memory, num_train_steps, workdir)
    # Compiled now, as one program: op by op, it would compile at the first log, inside the
    # first timed interval (a GPU: ~1 s of a ResNet-50 run's second interval).
    self.schedule = jax.jit(run_plan.recipe.schedule(config, num_train_steps))
    self.schedule(0)
    self.speed = flops.Speed(graphdef, state, info.image_shape, run_plan)
    logging.info("%d steps of %d examples, %d per call; %.3g FLOPs a step, peak %s",
                 num_train_steps, config.run.global_batch_size, config.run.steps_per_dispatch,
                 self.speed.flops_per_step,
                 f"{self.speed.peak:.3g} FLOP/s" if self.speed.peak else "unknown")
    model = nnx.merge(graphdef, state)[0]
    logging.info("%s: %s parameters; model and optimizer state: %.3g MB a device (%s; a whole "
                 "copy: %.3g MB)", type(model).__name__,
                 f"{sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))):,}",
                 sharding.bytes_per_device(state) / 1e6, config.parallelism,
                 sum(x.nbytes for x in jax.tree.leaves(state)) / 1e6)
    if warning := steps.mask_warning(model):
      logging.warning("%s", warning)
    is_main = jax.process_index() == 0
    self.writer = writers.create_writer(workdir, write=is_main, config=config,
                                        new_run=first_step == 0)
    self.clock = Clock()
    self.progress = Progress(num_train_steps, self.writer, self.clock, show=is_main,
                             metrics=tuple(run_plan.recipe.METRICS))
    self.profiler = Profiler(config, workdir)
    self.workdir, self.is_main = workdir, is_main
    self.class_names = info.class_names or [str(i) for i in range(info.num_classes)]

  def train(self, step: int, since: int, summary: dict[str, float]) -> None:
    """Writes and logs the metrics of training steps, with the rates of the lap that ends now
    (from the step's FLOPs) and the learning rate of the last update.

    Args:
      step: the interval's last step.
      since: its first.
      summary: its metrics (`dispatch.summarize`'s).
    """
    lap, summary = self.clock.lap(step, since), dict(summary)
    if lap.steps:  # no rate for an interval that holds only the compiling call
      summary["examples_per_sec"] = summary["examples"] * lap.steps / (step - since + 1) / (
          lap.seconds)
      summary.update(self.speed.report(lap.steps / lap.seconds))
      summary["input_wait_fraction"] = lap.waited / lap.seconds
    summary["learning_rate"] = float(self.schedule(step - 1))  # of update n = step - 1
    self.writer.write_scalars(step, {f"train_{name}": v for name, v in summary.items()})
    self.progress.report(step, since, summary, lap)

  def eval(self, step: int, metrics: dict[str, float], confusion=None) -> None:
    """Writes and logs an evaluation's metrics; the final one's confusion too (its counts)."""
    self.writer.write_scalars(step, {f"eval_{name}": v for name, v in metrics.items()})
    if confusion is not None:
      writers.write_confusion(self.writer, step, confusion.counts, self.class_names)
    self.progress.report_eval(step, metrics)

  def end(self, last_step: int | None = None, batch_size: int = 0) -> None:
    """Closes the writers; with the `last_step` of a finished run, first writes the whole loop's
    rates (`Clock.whole_loop`), and after, logs the commands to run next on its workdir."""
    if last_step is not None and (loop := self.clock.whole_loop(last_step, batch_size)):
      self.writer.write_scalars(last_step, loop)
    self.writer.close()
    if last_step is not None and self.is_main:
      w, python = shlex.quote(self.workdir), shlex.quote(errors.shown(sys.executable))
      board = os.path.join(os.path.dirname(sys.executable), "tensorboard")  # (the venv's)
      board = shlex.quote(errors.shown(board)) if os.path.exists(board) else "tensorboard"
      logging.info("Next: evaluate the run, classify images, export the model, see the curves:"
                   "\n  %s evaluate.py --workdir=%s\n  %s predict.py --workdir=%s IMAGE_OR_FOLDER"
                   " ...\n  %s export.py --workdir=%s --out=model.npz\n  %s --logdir=%s",
                   python, w, python, w, python, w, board, w)


class Lap(NamedTuple):
  """A log interval of the training loop, on its clock."""

  steps: int  # its steps that ran on the clock (the compiling first call runs before it)
  seconds: float  # its time, less evaluation and saving
  waited: float  # of which, waiting for the input


class Clock:
  """The training loop's time, in one place. It runs from the return of the first dispatch
  (compiled by then); a lap is a log interval, less what ran `paused` (evaluation, saving);
  `waiting` counts the time spent waiting for the input."""

  def __init__(self):
    self.created = self.lap_start = self.first_time = self.call_start = time.perf_counter()
    self.started, self.first_step, self.waited = False, 0, 0.0

  def start(self, step: int) -> float:
    """Starts the clock after `step`; returns the seconds of the call that ended there."""
    now = time.perf_counter()
    self.started, self.first_step, self.first_time, self.cpu = True, step, now, time.thread_time()
    self.lap_start, self.waited = now, 0.0
    return now - self.call_start

  @contextlib.contextmanager
  def waiting(self):
    start = time.perf_counter()
    yield
    self.call_start = time.perf_counter()
    self.waited += self.call_start - start

  @contextlib.contextmanager
  def paused(self):
    start = time.perf_counter()
    yield
    self.lap_start += time.perf_counter() - start

  def lap(self, step: int, since: int) -> Lap:
    """The lap of steps `since`..`step`; the next starts now."""
    now = time.perf_counter()
    lap = Lap(step - max(since - 1, self.first_step), now - self.lap_start, self.waited)
    self.lap_start, self.waited = now, 0.0
    return lap

  def eta(self, step: int, num_steps: int) -> str:
    rate = (step - self.first_step) / max(time.perf_counter() - self.first_time, 1e-9)
    seconds = (num_steps - step) / rate if rate else 0
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}" if rate else "?"

  def whole_loop(self, last_step: int, batch_size: int) -> dict[str, float]:
    """Training throughput of the whole loop (input pipeline, logging, evaluation, checkpoints),
    and the main thread's CPU time per step (the host work that a step must hide); {} when the
    clock never ran a step."""
    num_steps = last_step - self.first_step if self.started else 0
    if not num_steps:
      return {}
    return {"loop_examples_per_sec": num_steps * batch_size / (
                time.perf_counter() - self.first_time),
            "loop_host_us_per_step": 1e6 * (time.thread_time() - self.cpu) / num_steps}


def draw_bar(done: int, total: int, text: str = "", width: int = 30):
  """`[=====     ] done/total text` on stderr (a terminal), `width` wide, over the one before."""
  full = width * done // max(total, 1)
  sys.stderr.write(f"\r[{'=' * full}{' ' * (width - full)}] {done}/{total} {text}\033[K")
  sys.stderr.flush()


class Progress:
  """One log line per log interval and, on a terminal, a progress bar between them (redrawn at
  most 4 times a second). The writers get `steps_per_sec` (of each lap) and `uptime`.

  Args:
    num_steps: the run's steps.
    writer: the run's writers.
    clock: the loop's clock.
    show: whether the bar is drawn (process 0's, on a terminal).
    metrics: the recipe's metrics, each logged (after the step, loss and accuracy).
  """

  def __init__(self, num_steps: int, writer: writers.Writers, clock: Clock, show: bool = True,
               metrics: tuple[str, ...] = ("loss", "accuracy")):
    self.num_steps, self.writer, self.clock = num_steps, writer, clock
    self.others = [name for name in metrics if name not in ("loss", "accuracy")]  # the recipe's
    self.bar, self.drawn = show and sys.stderr.isatty(), 0.0

  def update(self, step: int):
    """After every call: one clock read, unless the bar is due."""
    if self.bar and (now := time.perf_counter()) - self.drawn > 0.25:
      self.drawn = now
      draw_bar(step, self.num_steps, f"ETA {self.clock.eta(step, self.num_steps)}")

  def log(self, message: str, *args, level: int = logging.INFO):
    """A log line (absl's `message % args`, at `level`), printed above the bar."""
    self.close()
    logging.log(level, message, *args)

  def close(self):
    """Clears the bar (it is drawn again at the next update)."""
    if self.bar:
      sys.stderr.write("\r\033[K")
      sys.stderr.flush()

  def report(self, step: int, since: int, summary: dict[str, float], lap: Lap):
    """The log line of the training steps `since`..`step`, and a warning for skipped steps.

    Args:
      step: the interval's last step.
      since: its first.
      summary: its metrics and rates (`Report.train`'s).
      lap: its time on the clock.
    """
    self.writer.write_scalars(step, {"steps_per_sec": lap.steps / max(lap.seconds, 1e-9),
                                     "uptime": time.perf_counter() - self.clock.created})
    rate = summary.get("examples_per_sec")  # none for the compiling call alone
    wait = summary.get("input_wait_fraction")
    other = summary["loss"] != summary.get("cross_entropy", summary["loss"])  # (smoothed, say)
    self.log("step %d/%d  loss %.4f%s  accuracy %.4f%s  %s examples/s  input wait %s  ETA %s",
             step, self.num_steps, summary["loss"],
             f" (cross-entropy {summary['cross_entropy']:.4f})" if other
             else "", summary["accuracy"], self.more(summary),
             "?" if rate is None else f"{rate:.0f}",
             "?" if wait is None else f"{100 * wait:.0f}%", self.clock.eta(step, self.num_steps))
    if summary["nonfinite_steps"]:
      self.log("Skipped %d of steps %d-%d: non-finite loss or gradient.",
               int(summary["nonfinite_steps"]), since, step, level=logging.WARNING)

  def report_eval(self, step: int, metrics: dict[str, float]):
    self.log("eval at step %d: loss %.4f  accuracy %.4f%s  (%d examples)", step, metrics["loss"],
             metrics["accuracy"], self.more(metrics), metrics["examples"])

  def more(self, summary: dict[str, float]) -> str:
    return "".join(f"  {name} {summary[name]:.4f}" for name in self.others)


class Profiler:
  """A jax.profiler trace of steps [first, first + num) (whole dispatches) into the workdir, on
  process 0, each dispatch annotated with its last step."""

  def __init__(self, config, workdir: str):
    self.first = config.profile_first_step if jax.process_index() == 0 else 0
    self.last, self.workdir, self.on = self.first + config.profile_num_steps - 1, workdir, False

  def before(self, step: int, done: int):  # the dispatch runs steps step + 1 .. done
    if self.first and not self.on and step < self.first <= done:
      jax.profiler.start_trace(self.workdir)
      self.on = True

  def annotate(self, done: int):
    return jax.profiler.StepTraceAnnotation("train", step_num=done) if self.on else (
        contextlib.nullcontext())

  def after(self, step: int, running):
    if self.on and step >= self.last:
      jax.block_until_ready(running)
      jax.profiler.stop_trace()
      self.on, self.first = False, 0


def log_run(config, info, recipe, memory, num_train_steps: int, workdir: str) -> None:
  """Logs what a run will do: the software, devices, workdir, data, input, batch and schedule.

  Args:
    config: the run's config.
    info: the data's DatasetInfo.
    recipe: the run's recipe module.
    memory: `input_pipeline.host_memory`'s.
    num_train_steps: the run's steps.
    workdir: the run's workdir.
  """
  devices = jax.device_count()
  logging.info("jax %s, flax %s, Python %s; %d %s device%s%s", jax.__version__, flax.__version__,
               platform.python_version(), devices, jax.default_backend(), "s" * (devices > 1),
               f" in {jax.process_count()} processes" if jax.process_count() > 1 else "")
  logging.info("checkpoints and TensorBoard files in %s; compilation cache %s", workdir,
               jax.config.jax_compilation_cache_dir or "off")
  names = ", ".join(info.class_names)
  names = names if len(names) <= 60 else names[:60].rsplit(", ", 1)[0] + ", ..."
  logging.info("%s: %d train and %d eval images of %s, %d classes%s", config.dataset,
               info.num_examples["train"], info.num_examples["eval"],
               "x".join(map(str, info.image_shape)), info.num_classes, names and f" ({names})")
  logging.info("input: %d worker%s a process (and as many for evaluation%s), ~%.3g GiB of host "
               "memory in its buffers", memory.workers, "s" * (memory.workers != 1), config.get(
                   "randaugment") and f"; training's RandAugment {config.randaugment}",
               memory.bytes / 2**30)
  logging.info("global batch %d%s; peak learning rate %.4g%s, %d warmup steps, %s decay",
               config.run.global_batch_size, f" ({config.run.per_device_batch_size} x {devices} "
               "devices)" if config.per_device_batch_size else "",
               recipe.peak_learning_rate(config),
               "" if config.lr_scaling == "none" else f" ({config.lr_scaling} scaling of "
               f"{config.learning_rate:g} at batch {config.base_batch_size})",
               recipe.warmup_steps(config, num_train_steps), config.schedule)
