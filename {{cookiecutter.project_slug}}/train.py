"""Data-parallel training and evaluation: the loop and its set-up (the steps are in steps.py).

  python train.py --config=configs/default.py --workdir=/tmp/run [--config.batch_size=256 ...]

The logic is in `train_and_evaluate(config, workdir)`; the absl entry point is at the bottom.
"""

import sys

if __name__ == "__main__" and sys.stderr.isatty():  # at once: the imports below take seconds
  print("train.py: starting (importing JAX, Flax, Orbax, Grain)", file=sys.stderr, flush=True)

import contextlib
from typing import NamedTuple

import jax
import ml_collections
from absl import flags, logging
from ml_collections import config_flags

from {{cookiecutter.project_slug}} import process
from {{cookiecutter.project_slug}}.data import input_pipeline
from {{cookiecutter.project_slug}}.parallel import sharding
from {{cookiecutter.project_slug}}.training import (
  dispatch,
  optim,
  report,
  runs,
  stopping,
)


class Run(NamedTuple):
  """A run, set up (`set_up`): what the loop reads."""

  plan: runs.Plan  # the run's config (`runs.prepare`), its model's and recipe's modules
  workdir: str
  data: input_pipeline.Input  # the splits, described; training's length; the iterators, started
  first_step: int  # the checkpoint's (0: a new run)
  state: object  # the first step's, placed for `compiled` (`put_state`): a pytree of arrays
  compiled: dispatch.Steps
  checkpoints: runs.Checkpoints  # (`runs.start_or_resume`'s): the loop's one contact with Orbax
  report: report.Report  # the writers, the log, the clock, the profile
  eval_compile_s: float


def set_up(config: ml_collections.ConfigDict, workdir: str) -> Run:
  """Everything before the first step: the run's config (`runs.prepare`) and plan, the data read
  and described, the model and optimizer built (or restored from the workdir's latest checkpoint,
  or `config.init_from`'s) and placed, the steps compiled, the writers opened, the input started;
  what the run is, logged."""
  run_plan, workdir = runs.prepare(config, workdir)  # the modules it names, made once
  config = run_plan.config
  # The devices' layout; the data (this process's rows of each batch), read and described.
  mesh = sharding.make_mesh(config)
  stopping.phase("reading the data")  # (each phase bounded by the watchdog: stopping.Watchdog)
  logging.info("reading the data: config.dataset=%r", config.dataset)  # (each phase: a line)
  data = input_pipeline.Input(config, sharding.process_rows(mesh, config.run.global_batch_size))
  info, num_train_steps = data.info, data.num_train_steps
  run_plan = runs.with_class_weights(run_plan, info)  # (balanced: the data's class counts)
  config = run_plan.config
  logging.info("checking model.py on the data's images %s", list(info.image_shape))
  optim.check_model(run_plan, info)  # model.py on this data, abstractly: before any compile
  # The state: built, or restored (the workdir's latest checkpoint), and the steps that take it.
  stopping.phase("building the model and optimizer state, or restoring it")
  logging.info("building the model and optimizer state, or restoring it from %s", workdir)
  graphdef, abstract, init = optim.initial_state(run_plan, info, mesh, num_train_steps)
  saved, first_step, state = runs.start_or_resume(workdir, config, info, abstract, init)
  # What the run reports (process 0 writes): what it will do, its metrics, progress, a profile.
  reporting = report.Report(run_plan, workdir, data, first_step, graphdef, state)
  # The steps, compiled at their first call; the state placed for them.
  compiled = dispatch.make(graphdef, run_plan, mesh, info=info)
  state = compiled.put_state(state)
  if config.print_shardings:
    logging.info("%s", sharding.describe_run(compiled.get_state(state),
                                             compiled.put_batch(data.eval_batches[0])))
  # The input: its workers start here; the eval step compiled on its first and last batches.
  data.start(first_step, compiled.put_batch)
  stopping.phase("compiling the evaluation step (or loading it from the compilation cache)")
  logging.info("compiling the steps (or loading them from the compilation cache)")
  return Run(run_plan, workdir, data, first_step, state, compiled, saved, reporting,
             dispatch.compile_eval(compiled, state, data.eval_batches, run_plan.metrics.eval))


def train_loop(run: Run, received: list):
  """The steps from the run's first to its last, logging, evaluating and saving on the way;
  returns the last step, its state, the last evaluation's metrics (None if stopped before one)
  and what stopped the run early (`stopping.stop_now`: a signal in `received`), or None."""
  config, compiled, saved, reporting = run.plan.config, run.compiled, run.checkpoints, run.report
  clock, progress, profiler = reporting.clock, reporting.progress, reporting.profiler
  k, num_train_steps, state = config.run.steps_per_dispatch, run.data.num_train_steps, run.state
  # `running` merges the metrics of the training steps from `since` on, on the devices. Each
  # dispatch runs the steps of one element: up to the next multiple of k (or the end).
  running, since = compiled.empty(run.plan.metrics.train), run.first_step + 1
  step, eval_metrics, stopped_by, every = run.first_step, None, None, dispatch.sync_every(config)
  best = stopping.Best(config, saved)  # (kept with its metrics: Orbax's BestN; early stopping)
  if ended := best.stops(step):  # (a resumed run that stopped early: ends again)
    progress.log("%s", ended)
  # The evaluations' metrics; the last one's also the confusion matrix, written as an image
  # (with early stopping each one's counts it: any may be the last).
  final = run.plan.metrics.confusion(run.data.info.num_classes)

  def evaluate(last: bool):  # (the state and step as they are now)
    stopping.phase(f"the evaluation at step {step}", "evaluation")
    return jax.device_get(dispatch.evaluate(compiled, state, run.data.eval, len(
        run.data.eval_batches), config, final if last else run.plan.metrics.eval))

  def save(metrics=None):  # (in the background: it writes while the evaluation runs)
    stopping.phase(f"saving checkpoint {step}", "save")
    saved.save(step, compiled.get_state(state), metrics)

  while step < num_train_steps and not ended:
    done = min((step // k + 1) * k, num_train_steps)  # `done` counts finished updates
    profiler.before(step, done)
    steps = f"step {done}" if done == step + 1 else f"steps {step + 1}-{done}"
    stopping.phase(f"the call of {steps}", "call")  # (its input and results too)
    with clock.waiting():  # for the input: an input-bound loop shows here
      batches = next(run.data.train)
    if not clock.started:  # (a call returns once compiled and dispatched)
      stopping.phase("compiling the training step (or loading it from the compilation cache)")
    with profiler.annotate(done):
      state, running = compiled.train(state, running, batches)
    if not clock.started:  # (its collectives wait for the other processes' compiles: their bound)
      stopping.phase(f"the first call ({steps}), the other processes' compiles included")
    if every and done // every > step // every:
      jax.block_until_ready(running)
    step = done
    profiler.after(step, running)
    progress.update(step)
    if not clock.started:  # the loop's clock starts once the first dispatch is compiled
      jax.block_until_ready(running)
      progress.log("first calls (compiling, or loading from the cache): train %.2f s, eval "
                   "%.2f s", clock.start(step), run.eval_compile_s)
    is_last = step == num_train_steps
    stopped_by = stopping.stop_now(received, can_agree=step % config.log_every_steps == 0)
    log_now = step % config.log_every_steps == 0 or is_last
    if log_now or step % config.checkpoint_every_steps == 0 or stopped_by:
      saved.check()  # an asynchronous save that failed since: stop here
      fetched = jax.device_get(running)  # one transfer, for the check and the summary
      stopping.check_finite(fetched.nonfinite_steps, since, config, saved)
      if log_now:
        reporting.train(step, since, dispatch.summarize(fetched))
        running, since = compiled.empty(run.plan.metrics.train), step + 1
    # On a stop signal: save, and leave the evaluation (the grace period is for saving).
    evaluate_now = (step % config.eval_every_steps == 0 or is_last) and not stopped_by
    save_now = step % config.checkpoint_every_steps == 0 or is_last or stopped_by
    if evaluate_now or save_now:
      jax.block_until_ready(state)  # the steps queued so far are training time
      with clock.paused():  # left out of the training rates
        if save_now and not config.best_metric:
          save()
        if evaluate_now:
          evaluated = evaluate(is_last or bool(config.get("early_stopping_evals")))
          eval_metrics = dispatch.summarize(evaluated)
          improved, ended = best.improves(step, eval_metrics), best.stops(step)
          reporting.eval(step, eval_metrics, getattr(evaluated, "confusion", None) if (
              is_last or ended) else None)
        if config.best_metric and (save_now or evaluate_now and (improved or ended)):
          save(eval_metrics if evaluate_now and improved else None)  # (a new best's metrics:
          # BestN keeps the one with the best value, so an equal one later never displaces it)
      if ended:
        progress.log("%s", ended)
    if stopped_by:
      break
  if eval_metrics is None and not stopped_by:  # nothing left to train: the restored state's
    eval_metrics = dispatch.summarize(evaluate(False))
  return step, state, eval_metrics, stopped_by


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float] | None:
  """Trains, resuming from the latest checkpoint in `workdir`; returns the final eval metrics.
  Raises `stopping.Stopped` when SIGTERM/SIGINT (or a preemption notice) stopped it, after saving
  a checkpoint."""
  run = set_up(config, workdir)
  config, workdir, num_train_steps = run.plan.config, run.workdir, run.data.num_train_steps
  # Closed at the end, however it ends: the workers stopped, the progress bar cleared; the last
  # asynchronous save waited for; the workdir let go (its claim, `runs.Claim`).
  with contextlib.closing(run.checkpoints.claim):
    with (stopping.stop_signals() as received, contextlib.closing(run.data),
          contextlib.closing(run.report.progress)):
      step, state, eval_metrics, stopped_by = train_loop(run, received)
    stopping.phase("the last save", "save")
    run.checkpoints.close()
    stopping.phase(None)
  if stopped_by:
    run.report.end()
    logging.warning("%s", stopping.Stopped(stopped_by, step, num_train_steps, workdir))
    raise stopping.Stopped(stopped_by, step, num_train_steps, workdir)  # (no local: no cycle)
  logging.info("Final eval: accuracy %.4f, loss %.4f, on %d examples", eval_metrics["accuracy"],
               eval_metrics["loss"], eval_metrics["examples"])
  run.report.end(step, config.run.global_batch_size)  # (then the commands for next)
  return eval_metrics


_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.", lock_config=True)
flags.mark_flag_as_required("config")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints and metrics go.", required=True)


def main(argv):
  del argv
  # From here on every wait is bounded and a signal is honoured in every phase (its thread:
  # "watchdog"), each ending the run in one line.
  with stopping.Watchdog(_CONFIG.value):
    stopping.phase("joining the job, where this is one process of several")
    process.start(_CONFIG.value)  # the log, the compilation cache; several processes: joined
    with process.exits():  # an error: one line
      train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  process.run(main)
