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
from test_parallel import assert_trees_close, batches, run
from test_preemption import final_state

import evaluate
import export
import predict
import train
from configs import tiny

from {{cookiecutter.project_slug}}.data import input_pipeline
from {{cookiecutter.project_slug}}.training import optim, runs, steps, trained

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config_as_shipped():
  """configs/tiny.py on model.py (not the tests' own models), every checkpoint kept."""
  config = tiny.get_config()
  config.max_checkpoints_to_keep = 10
  config.steps_per_dispatch = steps.steps_per_dispatch(config)
  assert config.model.module == "model"
  return config


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """One uninterrupted spmd run of `config_as_shipped` (23 steps, checkpoints at 10, 20, 23):
  its workdir and final eval metrics."""
  workdir = tmp_path_factory.mktemp("your_model") / "straight"
  return workdir, train.train_and_evaluate(config_as_shipped(), str(workdir))


def test_your_model_maps_images_to_logits():
  config = config_as_shipped()
  sources, info = input_pipeline.get_datasets(config)
  model = optim.create_model(config, info.image_shape, info.num_classes, nnx.Rngs(0))
  images = jnp.asarray(sources["eval"].images[:5], jnp.float32) / 255
  logits = steps.call_model(model, images, jnp.ones(5, bool))
  assert logits.shape == (5, info.num_classes) and bool(jnp.all(jnp.isfinite(logits)))
  assert steps.mask_warning(model) is None, steps.mask_warning(model)


def without_dropout(graphdef, state):
  """The same model with its Dropout layers' rates at 0 (the steps' train mode would turn
  `deterministic` back off): pmap draws each device's own dropout, another mask than one
  device's, so pmap is compared with the others without it."""
  model = nnx.merge(graphdef, state)
  for _, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Dropout):
      node.rate = 0.0
  return nnx.split(model)


def takes_the_same_steps_on_every_path(batch_norm_devices: int, paths=("spmd", "fsdp"),
                                       without_dropout_paths=("spmd", "pmap", "fsdp")):
  """Three steps (a padded batch among them) from the same state: one device (its batch split
  into 8 groups for BatchNorm's statistics with `batch_norm_devices`=1) and `paths` give the
  same state and metrics, dropout included; `without_dropout_paths` too, with Dropout off."""
  config = config_as_shipped()
  config.fsdp_min_size = 0  # split every leaf that divides over 8
  config.batch_norm_devices = batch_norm_devices
  _, info = input_pipeline.get_datasets(config)
  assert info.image_shape == (8, 8, 1)  # (test_parallel.batches: digits-shaped)
  graphdef, state = nnx.split(optim.build_state(config, info.image_shape, info.num_classes, 3))
  data = batches([64, 20, 64])
  copy = lambda state: jax.tree.map(jnp.copy, state)  # (the steps donate it)  # noqa: E731
  for graph, start, chosen in ((graphdef, state, paths),
                               (*without_dropout(graphdef, state), without_dropout_paths)):
    if not chosen:
      continue
    single, single_metrics = run(config, "single", data, graph, copy(start))
    for parallelism in chosen:
      got, metrics = run(config, parallelism, data, graph, copy(start))
      assert_trees_close(got, single, atol=1e-5)
      assert metrics["examples"] == 148 and metrics["accuracy"] == single_metrics["accuracy"]
      assert metrics["loss"] == pytest.approx(single_metrics["loss"], rel=1e-5), parallelism


def test_your_model_takes_the_same_steps_on_every_path():
  """With the global batch's BatchNorm statistics (configs/default.py's)."""
  takes_the_same_steps_on_every_path(batch_norm_devices=0)


def test_your_model_takes_the_same_steps_with_each_devices_own_statistics():
  """config.batch_norm_devices=1 (configs/imagenet.py's): each device's BatchNorm statistics,
  spmd alone (test_parallel holds fsdp and pmap on the tests' own BatchNorm model)."""
  takes_the_same_steps_on_every_path(batch_norm_devices=1, paths=("spmd",),
                                     without_dropout_paths=())


def test_your_model_resumes_bit_for_bit(straight, tmp_path):
  """Stopped after its step-10 checkpoint and started again in the same workdir: the same final
  metrics and the same bits (parameters, optimizer, batch statistics, RNG keys and counts)."""
  workdir, expected = straight
  shutil.copytree(workdir / "checkpoints" / "10", tmp_path / "checkpoints" / "10")
  for name in (runs.CONFIG_FILE, runs.DATA_FILE):
    shutil.copy(workdir / name, tmp_path / name)
  assert train.train_and_evaluate(config_as_shipped(), str(tmp_path)) == expected
  step, state = final_state(tmp_path)
  wanted_step, wanted = final_state(workdir)
  assert step == wanted_step and state.keys() == wanted.keys()
  for name, value in wanted.items():
    np.testing.assert_array_equal(state[name], value, err_msg=name)


def test_predict_evaluate_and_export_work_on_your_model(straight, tmp_path):
  workdir, expected = straight
  run = trained.Restored(str(workdir))
  source = input_pipeline.get_datasets(run.config)[0]["eval"]
  result = evaluate.evaluate(run, source)
  assert result["examples"] == 360 and result["accuracy"] == expected["accuracy"]
  assert result["loss"] == pytest.approx(expected["loss"], rel=1e-5)
  images = source.images[:7]
  wanted = steps.probabilities(run.graphdef, run.state, images)
  paths = [str(tmp_path / f"{i}.png") for i in range(len(images))]
  for path, image in zip(paths, images, strict=True):
    Image.fromarray(image[..., 0]).save(path)
  predicted = [p for _, p in predict.predict(run, paths)]
  np.testing.assert_allclose(np.stack(predicted), wanted, atol=1e-6)
  export.write(run, str(tmp_path / "model.npz"))
  artifact = np.load(tmp_path / "model.npz")
  exported = jax.export.deserialize(bytearray(artifact["program"]))
  arrays = [artifact[f"array_{i}"].view(aval.dtype)
            for i, aval in enumerate(exported.in_avals[:-1])]
  np.testing.assert_allclose(exported.call(arrays, images), wanted, atol=1e-6)


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
