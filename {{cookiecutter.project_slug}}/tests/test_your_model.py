"""Your model: model.py as it is now, through the whole project. The other tests build the tests'
own models (conftest.owned), so they pass whatever model.py holds; these take model.py's
`create_model` on the configs as they are (configs/tiny.py: the digits) and check that it
builds, takes the same steps on every path, stops and resumes bit for bit, and that predict,
evaluate and export work on its workdir. Run them alone after editing model.py:

  python -m pytest tests/test_your_model.py
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image
from test_multiprocess import assert_same_run
from test_multiprocess import train as train_processes
from test_parallel import as_numpy, batches, run
from test_preemption import final_state

import evaluate
import export
import predict
import train
from configs import tiny

from {{cookiecutter.project_slug}} import plan
from {{cookiecutter.project_slug}}.data import sources
from {{cookiecutter.project_slug}}.training import damaged, optim, runs, steps, trained

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config_as_shipped():
  """configs/tiny.py on model.py (not the tests' own models), every checkpoint kept."""
  config = tiny.get_config()
  config.max_checkpoints_to_keep = 10
  config.steps_per_dispatch = plan.steps_per_dispatch(config)
  assert config.model.module == "model"
  return config


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """One uninterrupted spmd run of `config_as_shipped` (23 steps, checkpoints at 10, 20, 23):
  its workdir and final eval metrics."""
  workdir = tmp_path_factory.mktemp("your_model") / "straight"
  return workdir, train.train_and_evaluate(config_as_shipped(), str(workdir))


def test_your_model_maps_images_to_logits():
  """The check that train.py makes before compiling anything (`optim.check_model`: abstract),
  then the model run in train mode and in eval mode (as the steps set them): finite logits."""
  config = plan.resolved(config_as_shipped())
  splits, info = sources.get_datasets(config)
  run_plan = plan.make_plan(config)
  optim.check_model(run_plan, info)
  model = optim.create_model(run_plan, info.image_shape, info.num_classes, nnx.Rngs(0))
  images = jnp.asarray(splits["eval"].images[:5], jnp.float32) / 255
  for set_mode in (model.train, model.eval):
    set_mode()
    logits = steps.forward(model, {"image": images, "mask": jnp.ones(5, bool)}, None)
    assert logits.shape == (5, info.num_classes) and bool(jnp.all(jnp.isfinite(logits)))
  assert steps.mask_warning(model) is None, steps.mask_warning(model)


# The paths are compared with plain SGD at the config's learning rate: its update is the gradient,
# so what is compared is what the model computes (gradients, batch statistics, random draws).
# Adam-like optimizers divide each entry by its size, which turns the rounding noise of a
# gradient that is zero in exact arithmetic (a bias before a normalisation) into full steps; the
# optimizers' own code is the same on every path (tests/test_parallel.py runs the recipe's).
# Differences are measured against the update: 1e-4 of a leaf's own change, or of its share of
# the whole state's change (float32 rounding, reduced in another order: ~1e-6 of it).
RTOL = 1e-4


def comparable(config):
  """`config` on plain SGD at a constant rate: where paths differ only by the order of their sums,
  its steps differ by as little. An adaptive optimizer (Adam: each step about the rate, whatever
  the gradient's size) turns rounding into steps the size of any other on a parameter whose true
  gradient is 0: a bias under BatchNorm, attention's key bias. Those move evaluation, through
  BatchNorm's running averages, by more than any tolerance."""
  config.update(COMPARABLE)
  return config


COMPARABLE = dict(optimizer="sgd", momentum=0.0, weight_decay=0.0, grad_clip_norm=0.0,
                  ema_decay=0.0, warmup_steps=0, warmup_epochs=0.0, schedule="constant")


def differences(got, want, start) -> list[str]:
  """Each leaf of `got` that differs from `want` beyond its bound, said with the bound; integer
  leaves (counts, RNG keys) must be equal. Names as the checkpoint's: 0/ the model's leaves."""
  leaves = lambda tree: {damaged.leaf_name(p).removesuffix("/value"): as_numpy(x)  # noqa: E731
                         for p, x in jax.tree_util.tree_leaves_with_path(tree)}
  got, want, start = leaves(got), leaves(want), leaves(start)
  floats = [n for n, x in want.items() if np.issubdtype(x.dtype, np.floating)]
  change = {n: float(np.linalg.norm((want[n] - start[n]).astype(np.float64))) for n in floats}
  total, size = np.sqrt(sum(c * c for c in change.values())), sum(want[n].size for n in floats)
  wrong = []
  for name, x in got.items():
    if name not in change:
      if not np.array_equal(x, want[name]):
        wrong.append(f"{name} differs (integers: {np.sum(x != want[name])} entries)")
      continue
    scale = max(change[name], total * np.sqrt(want[name].size / size))
    diff = float(np.linalg.norm((x - want[name]).astype(np.float64)))
    if not diff <= RTOL * scale:
      wrong.append(f"{name} differs by {diff:.3g} (norm), bound {RTOL * scale:.3g} = {RTOL:g} x "
                   f"{scale:.3g} (its update's norm, or its share of the state's)")
  return wrong


def with_randomness_off(graphdef, state):
  """The same state, its modules' `deterministic` on (what model.eval() sets: nnx.Dropout's,
  nnx.MultiHeadAttention's, and any random layer's of yours that honours it), in training too:
  the model's class given a `train()` that sets it back on after Flax's (the step calls
  model.train()); BatchNorm still on batch statistics."""
  objects = nnx.merge(graphdef, state)
  model_class = type(objects[0])

  def train(self, **attributes):
    model_class.train(self, **attributes)
    self.set_attributes(deterministic=True, raise_if_not_found=False)

  objects[0].__class__ = type(model_class.__name__, (model_class,), {"train": train})
  objects[0].set_attributes(deterministic=True, raise_if_not_found=False)
  return nnx.split(objects)


def draws_randomness(graphdef, state, images) -> bool:
  """Whether the model (in the mode of `graphdef`) gives other outputs with other RNG keys."""
  def forward(rekey: bool):
    model = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))[0]
    if rekey:
      keys = nnx.state(model, nnx.RngKey)
      fold_in = jax.vmap(lambda key: jax.random.fold_in(key, 1))  # (stacked layers: a key each)
      nnx.update(model, jax.tree.map(lambda k: fold_in(k.reshape(-1)).reshape(k.shape), keys))
    return np.asarray(steps.forward(model, {"image": images, "mask": jnp.ones(len(images), bool)},
                                    None))

  return not np.array_equal(forward(False), forward(True))


def takes_the_same_steps_on_every_path(batch_norm_devices: int, paths=("spmd", "fsdp", "pmap"),
                                       **keys):
  """Three SGD steps (a padded batch among them) from the same state: each path gives one
  device's state (its batch split into 8 groups for BatchNorm's statistics with
  `batch_norm_devices`=1) and metrics. Random layers draw by row of the global batch on spmd and
  fsdp, as on one device; pmap draws each device's own, so pmap is compared with them off."""
  config = comparable(config_as_shipped())
  config.fsdp_min_size = 0  # split every leaf that divides over 8
  config.batch_norm_devices = batch_norm_devices
  config.update(keys)
  splits, info = sources.get_datasets(config)
  assert info.image_shape == (8, 8, 1)  # (test_parallel.batches: digits-shaped)
  config = plan.resolved(config)
  run_plan = plan.make_plan(config)
  graphdef, state = nnx.split(optim.build_state(run_plan, info.image_shape, info.num_classes, 3))
  images = jnp.asarray(splits["eval"].images[:16], jnp.float32) / 255
  quiet = with_randomness_off(graphdef, state)
  assert not draws_randomness(*quiet, images), (
      "your model draws random numbers with `deterministic=True` (what model.eval() sets): "
      "evaluation would be random too; give each random layer a `deterministic` attribute and "
      "draw nothing when it is True, as nnx.Dropout does")
  data = batches([64, 20, 64])
  copy = lambda state: jax.tree.map(jnp.copy, state)  # (the steps donate it)  # noqa: E731
  reference, wrong = {}, {}
  for parallelism in paths:
    graph, start = quiet if parallelism == "pmap" else (graphdef, state)
    if graph not in reference:
      reference[graph] = run(config, "single", data, graph, copy(start))
    single, single_metrics = reference[graph]
    got, metrics = run(config, parallelism, data, graph, copy(start))
    leaves = differences(got, single, start)
    if (metrics["examples"] != 148 or metrics["accuracy"] != single_metrics["accuracy"]
        or metrics["loss"] != pytest.approx(single_metrics["loss"], rel=1e-5)):
      leaves.insert(0, f"loss {metrics['loss']:.7g}, accuracy {metrics['accuracy']:.7g} of "
                    f"{metrics['examples']} examples; one device: {single_metrics['loss']:.7g}, "
                    f"{single_metrics['accuracy']:.7g} of 148")
    if leaves:
      wrong[parallelism] = (leaves, len(jax.tree.leaves(single)))
  if wrong:
    pytest.fail(path_report(wrong, paths), pytrace=False)


# What makes a path take another step than one device, said once under the summary.
LIKELY_CAUSES = (
    "Likely causes: a statistic over the batch a device sees (a layer of yours that reduces "
    "over the batch: under pmap it sees a device's; nnx.BatchNorm is given the devices' axis), "
    "code that reads x.shape[0] (a device's batch under pmap, the global one elsewhere), random "
    "keys drawn from the data, or a random layer that ignores `deterministic`.")


def path_report(wrong: dict, paths, shown: int = 5) -> str:
  """What a failing path comparison prints: a summary line (each failing path, in how many of
  its leaves; the paths that agree), the likely causes in one sentence, then per path its
  metrics' line when they differ and at most `shown` leaves."""
  summary = "; ".join(
      f"{path} differs from one device in "
      + ", ".join(filter(None, [
          "its metrics" if lines[0].startswith("loss ") else "",
          f"{sum(not x.startswith('loss ') for x in lines)} of {total} leaves"]))
      for path, (lines, total) in wrong.items())
  agree = [path for path in paths if path not in wrong]
  if agree:
    summary += f"; {' and '.join(agree)} agree{'s' if len(agree) == 1 else ''}"
  details = []
  for path, (lines, _) in wrong.items():
    metrics_line = [x for x in lines[:1] if x.startswith("loss ")]
    leaves = lines[len(metrics_line):]
    details += [f"{path}: {line}" for line in metrics_line + leaves[:shown]]
    if len(leaves) > shown:
      details.append(f"{path}: ... and {len(leaves) - shown} more leaves")
  return "\n".join([summary, LIKELY_CAUSES, *details])


def test_your_model_takes_the_same_steps_on_every_path():
  """With the global batch's BatchNorm statistics (configs/default.py's)."""
  takes_the_same_steps_on_every_path(batch_norm_devices=0)


def test_your_model_takes_the_same_steps_with_each_devices_own_statistics():
  """config.batch_norm_devices=1 (configs/imagenet.py's): each device's BatchNorm statistics,
  spmd alone (test_parallel holds fsdp and pmap on the tests' own BatchNorm model)."""
  takes_the_same_steps_on_every_path(batch_norm_devices=1, paths=("spmd",))


@pytest.mark.slow  # (the paths' steps compiled again)
def test_your_model_takes_the_same_steps_with_mixup_and_cutmix():
  """configs/vit.py's mixup and CutMix (recipe.mix: each example with its neighbour), label
  smoothing: every path (pmap too: neighbours lie on one device) takes one device's steps."""
  takes_the_same_steps_on_every_path(batch_norm_devices=0, mixup_alpha=0.8, cutmix_alpha=1.0,
                                     label_smoothing=0.1)


def test_your_model_resumes_bit_for_bit(straight, tmp_path, caplog):
  """Stopped after its step-10 checkpoint and started again in the same workdir: the same final
  metrics and the same bits (parameters, optimizer, batch statistics, RNG keys and counts). Its
  copy of model.py edited since (a comment: the same leaves): said, and the copy renewed."""
  workdir, expected = straight
  shutil.copytree(workdir / "checkpoints" / "10", tmp_path / "checkpoints" / "10")
  for name in (runs.CONFIG_FILE, runs.DATA_FILE):
    shutil.copy(workdir / name, tmp_path / name)
  source = (workdir / runs.MODEL_FILE).read_text()
  assert source == open(os.path.join(PROJECT, "model.py")).read()
  (tmp_path / runs.MODEL_FILE).write_text(source + "# an edit since\n")
  assert train.train_and_evaluate(config_as_shipped(), str(tmp_path)) == expected
  assert "model.py has changed since this run last started" in caplog.text
  assert (tmp_path / runs.MODEL_FILE).read_text() == source
  step, state = final_state(tmp_path)
  wanted_step, wanted = final_state(workdir)
  assert step == wanted_step and state.keys() == wanted.keys()
  for name, value in wanted.items():
    np.testing.assert_array_equal(state[name], value, err_msg=name)


def test_predict_evaluate_and_export_work_on_your_model(straight, tmp_path):
  workdir, expected = straight
  run = trained.Restored(str(workdir))
  source = sources.get_datasets(run.config)[0]["eval"]
  result = evaluate.evaluate(run, source)
  assert result["examples"] == 360 and result["accuracy"] == expected["accuracy"]
  assert result["loss"] == pytest.approx(expected["loss"], rel=1e-5)
  images = source.images[:7]
  wanted = steps.probabilities(run.graphdef, run.state, images)
  paths = [str(tmp_path / f"{i}.png") for i in range(len(images))]
  for path, image in zip(paths, images, strict=True):
    Image.fromarray(image[..., 0]).save(path)
  predicted = np.stack([p for _, p in predict.predict(run, paths)])
  if not np.allclose(predicted, wanted, atol=1e-6, rtol=0):
    pytest.fail(
        f"predict.py's probabilities of {len(images)} images (in a batch padded to "
        f"{run.config.run.global_batch_size}) differ from those of the same images alone in "
        f"their batch in {np.sum(~np.isclose(predicted, wanted, atol=1e-6, rtol=0))} of "
        f"{predicted.size} entries (by up to {np.abs(predicted - wanted).max():.3g}): the model's "
        "output for an image depends on the rest of its batch (its padding included); in eval "
        "mode (model.eval()) take no statistic over the batch (BatchNorm: its running "
        "averages).", pytrace=False)
  export.write(run, str(tmp_path / "model.npz"))
  artifact = np.load(tmp_path / "model.npz")
  exported = jax.export.deserialize(bytearray(artifact["program"]))
  arrays = [artifact[f"array_{i}"].view(aval.dtype)
            for i, aval in enumerate(exported.in_avals[:-1])]
  np.testing.assert_allclose(exported.call(arrays, images), wanted, atol=1e-6)


@pytest.mark.slow
def test_your_model_trains_alike_on_one_process_and_two(tmp_path):
  """train.py on model.py and recipe.py (configs/tiny.py, `comparable`), its random layers
  drawing: 2 processes of 4 devices over loopback (launch.py) train as 1 process of 8, the same
  losses, accuracies and example counts at every step (each process reads the rows its devices
  hold, so every example meets the same random draws). On Adam, the evaluation of the template's
  user model (its tests/user_models/vit.py) parted by 7.5e-4 in loss at step 10 (its biases
  under BatchNorm 0.04 apart) while its training losses agreed within 7e-7; on SGD, within 5e-7
  in both."""
  sgd = [f"--config.{key}={value}" for key, value in COMPARABLE.items()]
  single = train_processes(tmp_path / "one", 1, *sgd, own=False)
  multi = train_processes(tmp_path / "two", 2, *sgd, own=False)
  assert_same_run(multi, single)
  assert set(single["eval_examples"].values()) == {360}


@pytest.mark.slow
def test_your_model_stops_on_ctrl_c_and_resumes_with_the_same_command(tmp_path):
  """`python train.py` (configs/tiny.py, 20 epochs: 450 steps) given SIGINT after its first
  checkpoint: it saves and exits 130; the same command again ends as the run never stopped."""
  command = [sys.executable, "train.py", "--config=configs/tiny.py", "--config.num_epochs=20"]
  final_eval = lambda log: re.findall(r"Final eval: .*", log)[-1]  # noqa: E731
  straight = subprocess.run([*command, f"--workdir={tmp_path / 'straight'}"], cwd=PROJECT,
                            capture_output=True, text=True, timeout=600)
  assert straight.returncode == 0, straight.stderr[-3000:]
  workdir = tmp_path / "run"
  process = subprocess.Popen([*command, f"--workdir={workdir}"], cwd=PROJECT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 300
    while not (workdir / "checkpoints" / "10").is_dir():
      assert process.poll() is None and time.monotonic() < deadline, "no checkpoint"
      time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=300)
  finally:
    process.kill()
  assert process.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
  assert re.search(r"Stopped by SIGINT after step \d+ of 450; saved checkpoint", stderr), stderr
  again = subprocess.run([*command, f"--workdir={workdir}"], cwd=PROJECT, capture_output=True,
                         text=True, timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "Resumed from the checkpoint of step" in again.stderr
  assert final_eval(again.stderr) == final_eval(straight.stderr)
