"""After training: predict.py, evaluate.py, export.py and config.init_from, on real checkpoints.

One small run serves most tests: the digits 0-3 as PNG files in class folders, converted by
write_arrayrecord.py and fine-tuned from the 10-class straight spmd run (`folder_run`).
"""

import functools
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys

import conftest
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import made_once, two_epochs
from PIL import Image
from tensorboard.backend.event_processing import event_accumulator

import evaluate
import export
import predict
import train
import write_arrayrecord
from configs import default

from {{cookiecutter.project_slug}} import plan, rules
from {{cookiecutter.project_slug}}.data import image_files, sources
from {{cookiecutter.project_slug}}.parallel import sharding
from {{cookiecutter.project_slug}}.training import finetune, optim, runs, steps, trained

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLASSES = ("zero", "one", "two", "three")  # the digits 0-3; labels follow the sorted names


@pytest.fixture(scope="session")
def folder_run(straight_runs, shared_tmp):
  """The digits 0-3 as root/pngs/{train,val}/NAME/*.png, written as ArrayRecord and fine-tuned
  for 6 epochs from the straight spmd run: (root, workdir, final eval metrics, log lines).
  Made once for all workers (conftest.made_once)."""
  root, (metrics, lines) = made_once(shared_tmp, "folder_run", functools.partial(
      fine_tune_on_a_folder, str(straight_runs["spmd"][0])))
  return root, str(root / "workdir"), metrics, lines


def fine_tune_on_a_folder(source, root):
  splits, _ = sources.get_datasets(default.get_config())
  for split, folder in (("train", "train"), ("eval", "val")):
    for i, (image, label) in enumerate(zip(splits[split].images, splits[split].labels,
                                           strict=True)):
      if label < len(CLASSES):
        os.makedirs(directory := root / "pngs" / folder / CLASSES[label], exist_ok=True)
        Image.fromarray(image[..., 0]).save(directory / f"{i:04d}.png")
  write_arrayrecord.write_image_folder(str(root / "data"), str(root / "pngs"))
  config = two_epochs("spmd")
  # (no flips: a mirrored digit is no digit; with them, 5 seeds ended at 0.78-0.92 accuracy)
  config.num_epochs, config.augment_flip = 6, False
  config.dataset, config.data_dir, config.num_workers = "arrayrecord", str(root / "data"), 0
  config.init_from = source
  lines = []
  handler = logging.Handler()
  handler.emit = lambda record: lines.append(record.getMessage())
  logger, level = logging.getLogger("absl"), logging.getLogger("absl").level
  logger.addHandler(handler)
  logger.setLevel(logging.INFO)
  try:
    metrics = train.train_and_evaluate(config, str(root / "workdir"))
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)
  return metrics, lines


def test_fine_tuning_copies_the_convolutions_and_starts_a_new_classifier(folder_run,
                                                                         straight_runs, tmp_path):
  root, workdir, metrics, lines = folder_run
  source = str(straight_runs["spmd"][0])
  assert [line for line in lines if "afresh" in line] == [
      f"Fine-tuning from step 45 of {source} (its moving average); initialised afresh (another "
      "shape): dense/bias "
      "(10,) -> (4,), dense/kernel (64, 10) -> (64, 4)"]
  assert metrics["examples"] == 144 and metrics["accuracy"] > 0.9, metrics  # chance: 0.25

  config, info = trained.read_description(workdir)  # the state it started from, built again
  mesh = sharding.make_mesh(config)
  _, abstract, init = optim.initial_state(plan.make_plan(plan.resolved(config)), info, mesh, 10)
  start = jax.device_get(finetune.init_from(source, abstract, init)())
  fresh = jax.device_get(init())
  with ocp.CheckpointManager(os.path.join(source, "checkpoints")) as checkpoints:
    saved = checkpoints.restore(45, args=ocp.args.Composite(
        state=ocp.args.StandardRestore()))["state"]
  for i in range(2):
    for name in ("kernel", "bias"):
      np.testing.assert_array_equal(start[0]["convs"][i][name][...],
                                    saved["2"]["convs"][str(i)][name]["value"])
  for name in ("kernel", "bias"):
    np.testing.assert_array_equal(start[0]["dense"][name][...], fresh[0]["dense"][name][...])
  assert int(start[1]["step"][...]) == 0  # a fresh optimizer
  assert len(start) == 3  # two_epochs keeps a moving average (ema_decay): it starts as the model
  for x, y in zip(jax.tree.leaves(start[2]), jax.tree.leaves(start[0]), strict=True):
    np.testing.assert_array_equal(x, y)
  # Under fsdp each leaf is read into its shards: an eighth of the kernel on each device.
  sharded = config.copy_and_resolve_references()
  sharded.parallelism, sharded.fsdp_min_size = "fsdp", 0
  sharded = plan.resolved(sharded)
  mesh = sharding.make_mesh(sharded)
  _, abstract, init = optim.initial_state(plan.make_plan(sharded), info, mesh, 10)
  kernel = finetune.init_from(source, abstract, init)()[0]["convs"][1]["kernel"][...]
  wanted = jax.tree.leaves(abstract[0]["convs"][1]["kernel"])[0].sharding
  assert kernel.sharding.is_equivalent_to(wanted, kernel.ndim)
  assert sharding.bytes_per_device(kernel) == kernel.nbytes // 8
  np.testing.assert_array_equal(kernel, saved["2"]["convs"]["1"]["kernel"]["value"])

  config.init_from = source  # resuming its own checkpoints: nothing left to train
  shutil.copytree(workdir, tmp_path / "workdir")  # (other tests read the run while this one runs)
  assert train.train_and_evaluate(config, str(tmp_path / "workdir")) == metrics


def test_another_model_is_not_fine_tuned_and_the_workdir_is_kept(straight_runs, tiny_config,
                                                                  tmp_path):
  tiny_config.model.features = (8, 16, 32)  # an extra convolution
  tiny_config.init_from = str(straight_runs["spmd"][0])
  with pytest.raises(rules.ConfigError) as error:
    train.train_and_evaluate(tiny_config, str(tmp_path / "workdir"))
  assert str(error.value) == (
      f"config.init_from={tiny_config.init_from!r}: convs/2/bias is in this model but not in "
      "the checkpoint (a missing or extra layer); only the shapes of leaves may differ.")
  assert not (tmp_path / "workdir").exists()


def test_predictions_agree_with_evaluation_and_are_named_by_the_folders(folder_run):
  root, workdir, metrics, _ = folder_run
  run = trained.Restored(workdir)
  assert run.info.class_names == tuple(sorted(CLASSES))
  paths = image_files.find_images([str(root / "pngs" / "val")])
  (root / "broken.png").write_bytes(b"not an image")
  predicted = dict(predict.predict(run, [*paths, str(root / "broken.png")], batch_size=24))
  assert predicted.pop(str(root / "broken.png")).startswith("UnidentifiedImageError")
  assert len(predicted) == metrics["examples"] == 144  # 6 batches of 24, every file once
  labels = {path: run.info.class_names.index(os.path.basename(os.path.dirname(path)))
            for path in paths}
  correct = sum(int(np.argmax(p)) == labels[path] for path, p in predicted.items())
  assert correct == round(metrics["accuracy"] * 144)
  loss = np.mean([-np.log(p[labels[path]]) for path, p in predicted.items()])
  assert loss == pytest.approx(metrics["loss"], rel=1e-5)

  for source in (sources.get_datasets(run.config)[0]["eval"],
                 evaluate.image_folder_source(str(root / "pngs" / "val"), run)):
    result = evaluate.evaluate(run, source)
    assert result["examples"] == 144 and result["accuracy"] == metrics["accuracy"]
    assert result["loss"] == pytest.approx(metrics["loss"], rel=1e-6)
    counts = result["confusion"]
    assert counts.sum() == 144 and np.trace(counts) == correct
    np.testing.assert_allclose(result["per_class_accuracy"], np.diag(counts) / counts.sum(1))


@pytest.mark.parametrize("parallelism", [  # (slow: the other paths' full trainings)
    "spmd", *[pytest.param(name, marks=pytest.mark.slow) for name in ("pmap", "fsdp")]])
def test_every_path_evaluates_its_checkpoint_as_training_did(straight_runs, parallelism):
  """The model alone is restored (its moving average: the recipe keeps one), placed as the run
  placed it: fsdp's split over the devices, the others whole on each."""
  workdir, metrics = straight_runs[parallelism]
  run = trained.Restored(str(workdir))
  assert run.step == 45 and run.info.class_names == tuple(str(i) for i in range(10))
  assert set(run.state.keys()) == {"convs", "dense"}  # a model's, not (model, optimizer, ...)
  assert {x.dtype for x in jax.tree.leaves(run.state)} == {np.dtype(np.float32)}
  held = sharding.bytes_per_device(run.state)
  assert held < run.bytes / 2 if parallelism == "fsdp" else held == run.bytes
  result = evaluate.evaluate(run, sources.get_datasets(run.config)[0]["eval"])
  assert result["examples"] == 360 and result["accuracy"] == metrics["accuracy"]
  assert result["loss"] == pytest.approx(metrics["loss"], rel=1e-6)


@pytest.mark.parametrize("parallelism", ["spmd", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_a_model_larger_than_the_devices_is_refused_saying_what_it_needs(straight_runs,
                                                                         parallelism, monkeypatch):
  """Devices that hold less than the model as the run placed it (whole, or an eighth by fsdp):
  one line, before anything is read. (The CPU reports no memory: here it says 256 bytes.)"""
  workdir = straight_runs[parallelism][0]
  state = trained.Restored(str(workdir)).state
  whole, need = sum(x.nbytes for x in jax.tree.leaves(state)), sharding.bytes_per_device(state)
  assert need == whole if parallelism == "spmd" else need < whole / 4
  monkeypatch.setattr(trained, "device_memory_bytes", lambda device: 256)
  with pytest.raises(rules.ConfigError) as e:
    trained.Restored(str(workdir))
  fix = (f"devices of {need / 2**30:.3g} GiB or more." if parallelism == "spmd" else
         f"{-(-need * 8 // 256)} or more of them.")
  assert str(e.value) == (
      f"the model of {str(workdir)!r} needs {need / 2**30:.3g} GiB a device ({parallelism} over "
      f"8 devices); these hold {256 / 2**30:.3g} GiB: use {fix}")


def test_a_workdir_without_a_checkpoint_or_that_step_is_one_line(folder_run, tmp_path):
  _, workdir, _, _ = folder_run
  with pytest.raises(rules.ConfigError, match=r"holds no config.json: give the --workdir of a "):
    trained.Restored(str(tmp_path))
  for name in (runs.CONFIG_FILE, runs.DATA_FILE):
    shutil.copy(os.path.join(workdir, name), tmp_path)
  with pytest.raises(rules.ConfigError, match="holds no checkpoint yet; train first"):
    trained.Restored(str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == sorted([runs.CONFIG_FILE, runs.DATA_FILE])
  with pytest.raises(rules.ConfigError, match=r"^--step=7: workdir .* holds the checkpoints of "
                                             r"steps 10, 20, 30, 40, 50, 54\.$"):
    trained.Restored(workdir, step=7)


def test_a_checkpoint_deleted_as_it_is_read_is_not_damage(folder_run, tmp_path, monkeypatch):
  """export.py (evaluate.py, predict.py) on a run still training: its retention deletes the
  checkpoint being read as it saves a newer one. The newest is listed again and read (not "no
  checkpoint can be restored"); the one asked for by --step, gone, is one line."""
  _, workdir, _, _ = folder_run
  shutil.copytree(workdir, tmp_path / "run", ignore=shutil.ignore_patterns("events.*"))
  saved, read = tmp_path / "run" / "checkpoints", trained.restore_model

  def retention(checkpoints, step, abstract, where):  # the training saves 64, deletes step
    if step != 64:
      shutil.copytree(saved / str(step), saved / "64", dirs_exist_ok=True)
      shutil.rmtree(saved / str(step))
    return read(checkpoints, step, abstract, where)
  monkeypatch.setattr(trained, "restore_model", retention)
  assert trained.Restored(str(tmp_path / "run")).step == 64 and not (saved / "54").exists()
  with pytest.raises(rules.ConfigError, match=r"^checkpoint 50 in '.*' was deleted as it was "
                     r"read \(the run there keeps its newest checkpoints, "
                     r"config.max_checkpoints_to_keep\); the checkpoints now: 10, 20, 30, 40, "
                     r"64\.$"):
    trained.Restored(str(tmp_path / "run"), step=50)


# Runs with nothing but jax and numpy: flax cannot be imported, and the project is not on the
# path (python -I: no PYTHONPATH, no current directory).
LOAD_EXPORTED = """
import sys

class NoFlax:
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] == "flax":
      raise ImportError("flax is not here")

sys.meta_path.insert(0, NoFlax())
import jax
import numpy as np

artifact = np.load("model.npz")
exported = jax.export.deserialize(bytearray(artifact["program"]))
arrays = [artifact[f"array_{i}"].view(aval.dtype) for i, aval in enumerate(exported.in_avals[:-1])]
images = np.load("images.npy")
probs = [exported.call(arrays, images[:1]), exported.call(arrays, images)]
np.save("probs.npy", np.concatenate(probs))
assert not [m for m in sys.modules if m.split(".")[0] in ("flax", "runs", "model", "steps")]
"""


def exported(folder_run, where, num_images: int) -> np.ndarray:
  """The folder run's model exported to `where`/model.npz, beside `num_images` of its images
  (images.npy) as predict.py reads them; returns predict.py's probabilities for them."""
  root, workdir, _, _ = folder_run
  run = trained.Restored(workdir)
  paths = image_files.find_images([str(root / "pngs" / "val")])[:num_images]
  export.write(run, str(where / "model.npz"))
  np.save(where / "images.npy", np.stack([image_files.read_image(p, (8, 8, 1)) for p in paths]))
  return np.stack([p for _, p in predict.predict(run, paths)])


def load_exported(python, where) -> np.ndarray:
  """LOAD_EXPORTED run by `python` in isolated mode (no PYTHONPATH, no project) in `where`."""
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  done = subprocess.run([python, "-I", "-c", LOAD_EXPORTED], cwd=where, env=env,
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-3000:]
  return np.load(where / "probs.npy")


@pytest.mark.slow  # (a process; fast: test_your_model.py exports and reads back)
def test_the_exported_model_runs_without_flax_or_the_project(folder_run, tmp_path):
  wanted = exported(folder_run, tmp_path, 13)
  probs = load_exported(sys.executable, tmp_path)
  assert probs.shape == (14, 4) and probs.dtype == np.float32
  np.testing.assert_allclose(probs[0], wanted[0], atol=1e-5)  # a batch of 1
  np.testing.assert_allclose(probs[1:], wanted, atol=1e-5)  # a batch of 13


# What the README says the exported model needs, and nothing else (flatbuffers: jax.export's
# deserialisation imports it; jax does not require it).
EXPORT_NEEDS = ("jax", "numpy", "flatbuffers")


@pytest.mark.slow
def test_the_exported_model_loads_in_a_fresh_venv_of_what_the_readme_names(folder_run, tmp_path):
  """A new virtual environment holding only `EXPORT_NEEDS` (the versions here) loads the export
  and gives the restored model's probabilities."""
  import importlib.metadata

  wanted = exported(folder_run, tmp_path, 5)
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
  pins = [f"{name}=={importlib.metadata.version(name)}" for name in EXPORT_NEEDS]
  done = subprocess.run([venv / "bin" / "pip", "install", "-q", *pins], capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  np.testing.assert_allclose(load_exported(venv / "bin" / "python", tmp_path)[1:], wanted,
                             atol=1e-5)


@pytest.mark.slow  # (fsdp's full training)
def test_an_fsdp_runs_export_holds_its_whole_arrays_and_answers_as_it_does(straight_runs,
                                                                          tmp_path):
  """The arrays split over the devices are written whole, one entry each, beside a program that
  takes them: read back from the file, it gives the restored model's probabilities."""
  run = trained.Restored(str(straight_runs["fsdp"][0]))
  assert any(len(x.sharding.device_set) > 1 and not x.sharding.is_fully_replicated
             for x in jax.tree.leaves(run.state))  # some arrays are split
  export.write(run, str(tmp_path / "model.npz"))
  artifact = np.load(tmp_path / "model.npz")
  exported = jax.export.deserialize(bytearray(artifact["program"]))
  whole = [np.asarray(x) for x in jax.tree.leaves(run.state)]
  assert sorted(artifact.files) == sorted(["program", *(f"array_{i}" for i in range(len(whole)))])
  arrays = [artifact[f"array_{i}"].view(aval.dtype)
            for i, aval in enumerate(exported.in_avals[:-1])]
  for read, wanted in zip(arrays, whole, strict=True):
    np.testing.assert_array_equal(read, wanted)
  images = (np.arange(5 * 8 * 8) % 17 * 15).astype(np.uint8).reshape(5, 8, 8, 1)
  np.testing.assert_allclose(exported.call(arrays, images),
                             steps.probabilities(run.graphdef, run.state, images), atol=1e-6)


def script(*args) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, *args], cwd=PROJECT, capture_output=True, text=True,
                        timeout=300)


@pytest.mark.slow
def test_the_commands(folder_run, tmp_path):
  """predict.py, evaluate.py and export.py as a user runs them; their errors, one line each."""
  root, workdir, metrics, _ = folder_run
  photo = tmp_path / "photo.png"  # a colour photo of another size: its fit said once
  Image.fromarray(np.full((24, 16, 3), 200, np.uint8)).save(photo)
  done = script("predict.py", f"--workdir={workdir}", "--json", "--top_k=2",
                str(root / "pngs" / "val"), str(photo), str(photo))
  assert done.returncode == 0, done.stderr
  lines = [json.loads(line) for line in done.stdout.splitlines()]
  assert len(lines) == 146 and all(len(line["top_k"]) == 2 for line in lines)
  assert sum(line["class"] == os.path.basename(os.path.dirname(line["path"]))
             for line in lines[:144]) == round(metrics["accuracy"] * 144)
  assert [line for line in done.stderr.splitlines() if line.startswith("predict.py:")] == [
      f"predict.py: {photo} is 24x16x3, the model's images 8x8x1: each image of another size is "
      "scaled to cover it and centre-cropped, its colours made gray, as the run's data was"]
  assert done.stderr.strip().splitlines()[-1] == (
      "classified 146 images with the checkpoint of step 54; skipped 0 unreadable files")

  done = script("evaluate.py", f"--workdir={workdir}")
  assert done.returncode == 0, done.stderr
  assert done.stdout.startswith(f"step 54: loss {metrics['loss']:.4f}  accuracy "
                                f"{metrics['accuracy']:.4f}  (144 examples)")
  events = [os.path.join(workdir, "evaluate", name)
            for name in os.listdir(os.path.join(workdir, "evaluate"))]
  reader = event_accumulator.EventAccumulator(events[0])
  reader.Reload()
  assert reader.Tags()["images"] == ["confusion_matrix"]
  assert "eval_accuracy/zero" in reader.Tags()["scalars"]

  # Other images: their own tags beside the run's, not on its evaluation curve.
  done = script("evaluate.py", f"--workdir={workdir}", f"--image_folder={root / 'pngs' / 'val'}")
  assert done.returncode == 0, done.stderr
  tags = {}
  for name in os.listdir(os.path.join(workdir, "evaluate")):
    reader = event_accumulator.EventAccumulator(os.path.join(workdir, "evaluate", name))
    reader.Reload()
    tags[name] = reader.Tags()
  assert len(tags) == 2
  assert any("eval_loss" in t["scalars"] and not any("image_folder" in s for s in t["scalars"])
             for t in tags.values())
  assert any({"image_folder_val_loss", "image_folder_val_accuracy/zero"} <= set(t["scalars"])
             and "eval_loss" not in t["scalars"]
             and t["images"] == ["image_folder_val_confusion_matrix"] for t in tags.values())

  done = script("export.py", f"--workdir={workdir}", f"--out={tmp_path / 'model.npz'}")
  assert done.returncode == 0, done.stderr
  assert json.loads((tmp_path / "model.json").read_text())["class_names"] == sorted(CLASSES)

  for args in (["predict.py", f"--workdir={tmp_path}", str(root / "pngs")],
               ["evaluate.py", f"--workdir={tmp_path}"],
               ["export.py", f"--workdir={tmp_path}", f"--out={tmp_path / 'x.npz'}"]):
    done = script(*args)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        f"error: workdir {str(tmp_path)!r} holds no config.json: give the --workdir of a training "
        "run (train.py writes it at start)."], done.stderr
  # A path that is not there (the README's `photos/3`, before there are photos), an --out in a
  # folder that is not there: one line each, before the checkpoint is read.
  done = script("predict.py", f"--workdir={workdir}", str(tmp_path / "photos" / "3"))
  assert done.returncode == 1 and done.stderr.strip().splitlines() == [
      f"error: {str(tmp_path / 'photos' / '3')!r} does not exist; give image files or folders of "
      "them."], done.stderr
  out = tmp_path / "missing" / "model.npz"
  done = script("export.py", f"--workdir={workdir}", f"--out={out}")
  assert done.returncode == 1 and done.stderr.strip().splitlines() == [
      f"error: --out={str(out)!r}: the folder {str(out.parent)!r} does not exist; make it, or "
      "give a path in a folder that does."], done.stderr


@pytest.mark.slow
def test_a_run_on_float_pixels_is_used_as_it_was_trained(tmp_path):
  """Pixels stored as floats (standardised here: -0.75 to 1.75, which no division by 255 gives)
  reach the model as stored, in training and so in evaluate.py, predict.py (.npy arrays: image
  files are refused in one line) and the exported artifact (float input); data.json and
  model.json say so, and the three agree."""
  splits, _ = sources.get_datasets(default.get_config())
  standardise = lambda x: ((x / np.float32(255) - 0.3) / 0.4).astype(np.float32)  # noqa: E731
  write_arrayrecord.write_dataset(str(tmp_path / "data"), {
      split: (standardise(splits[split].images), splits[split].labels)
      for split in ("train", "eval")})
  config = two_epochs("spmd")
  config.dataset, config.data_dir, config.num_workers = "arrayrecord", str(tmp_path / "data"), 0
  workdir = tmp_path / "workdir"
  metrics = train.train_and_evaluate(config, str(workdir))
  data = json.loads((workdir / "data.json").read_text())
  assert (data["pixel_dtype"], data["model_input"]) == ("float32", "pixels as stored")

  run = trained.Restored(str(workdir))
  evaluated = evaluate.evaluate(run, sources.get_datasets(run.config)[0]["eval"])
  assert evaluated["examples"] == 360 and evaluated["accuracy"] == metrics["accuracy"] > 0.5
  images = standardise(splits["eval"].images)
  exported = export.export(run)
  probs = np.asarray(exported.call([np.asarray(x) for x in jax.tree.leaves(run.state)], images))
  assert (probs.argmax(-1) == splits["eval"].labels).sum() == round(360 * metrics["accuracy"])
  for i in range(12):
    np.save(tmp_path / f"{i:02d}.npy", images[i])
  paths = image_files.find_images([str(tmp_path)])
  predicted = np.stack([p for _, p in predict.predict(run, paths)])
  np.testing.assert_allclose(predicted, probs[:12], atol=1e-6)

  Image.fromarray(splits["eval"].images[0, ..., 0]).save(tmp_path / "digit.png")
  done = script("predict.py", f"--workdir={workdir}", str(tmp_path))
  assert done.returncode == 1 and done.stderr.strip().splitlines() == [
      f"error: the run was trained on float32 pixels as stored (its data.json), which image "
      f"files such as {str(tmp_path / 'digit.png')!r} do not give: pass .npy arrays [8, 8, 1] "
      "of float32 instead."], done.stderr
  done = script("export.py", f"--workdir={workdir}", f"--out={tmp_path / 'model.npz'}")
  assert done.returncode == 0, done.stderr
  assert json.loads((tmp_path / "model.json").read_text())["pixel_dtype"] == "float32"


def test_the_confusion_matrix_keeps_class_names_apart_and_other_data_has_its_own_tags():
  text = evaluate.confusion_text(["china", "flower"], np.array([[3, 1], [0, 4]]))
  header, china, flower = text.splitlines()[1:]
  assert header.split() == ["china", "flower"]
  assert china.split() == ["china", "3", "1"] and flower.split() == ["flower", "0", "4"]
  assert evaluate.tag_prefix(None, None) == "eval"
  assert evaluate.tag_prefix("/photos/test set/", None) == "image_folder_test_set"
  assert evaluate.tag_prefix(None, "data/other") == "data_dir_other"


CHANGED_MODEL = '''
from flax import nnx


class MLP(nnx.Module):
  def __init__(self, image_shape, num_classes, *, rngs):
    self.dense = nnx.Linear(image_shape[0] * image_shape[1] * image_shape[2], num_classes,
                            rngs=rngs)

  def __call__(self, images_BHWC):
    return self.dense(images_BHWC.reshape(images_BHWC.shape[0], -1))


def create_model(config, image_shape, num_classes, rngs):
  return MLP(image_shape, num_classes, rngs=rngs)
'''


def test_a_run_whose_model_py_changed_is_built_with_its_copy_only_when_asked(straight_runs,
                                                                             tmp_path):
  """The workdir keeps the model's source as trained. Once the module it names differs (here
  written anew in the project, an MLP in place of the CNN), evaluation, predict and export build
  today's, which does not fit the checkpoint: one line naming the leaf and --use_runs_model;
  with it (`runs_model`), the run's own model from the copy, said. A config.json naming a module
  that is not the project's own is refused before anything is imported."""
  original, metrics = straight_runs["spmd"]
  assert (original / runs.MODEL_FILE).read_text() == (
      pathlib.Path(conftest.TESTS) / f"{conftest.SHIPPED_MODEL}.py").read_text()
  workdir = tmp_path / "run"
  shutil.copytree(original, workdir)
  name = f"changed_model_{os.getpid()}"  # a module of the project (its tests/), for this test
  changed = pathlib.Path(conftest.TESTS) / f"{name}.py"
  config = json.loads((workdir / runs.CONFIG_FILE).read_text())
  config["model"]["module"] = name  # the module the run names, rewritten since
  (workdir / runs.CONFIG_FILE).write_text(json.dumps(config))
  changed.write_text(CHANGED_MODEL)
  try:
    assert "as the run trained it" in trained.Restored(str(original)).summary
    with pytest.raises(rules.ConfigError) as refused:
      trained.Restored(str(workdir))
    assert str(refused.value).startswith(
        f"workdir {str(workdir)!r} holds a checkpoint (step 45) of a different model: "
        "0/convs/0/bias/value is (8,) there and absent in this config and model"), refused.value
    assert str(refused.value).endswith(
        f"; {name}.py differs from the run's copy, {workdir / runs.MODEL_FILE}: --use_runs_model "
        "builds the model with it (that executes the file's code: a workdir you trust)."), (
        refused.value)
    run = trained.Restored(str(workdir), runs_model=True)
    assert run.summary.endswith(f"model: the run's own, {workdir / runs.MODEL_FILE} "
                                f"(--use_runs_model; {name}.py has changed since)"), run.summary
    result = evaluate.evaluate(run, sources.get_datasets(run.config)[0]["eval"])
    assert result["examples"] == 360 and result["accuracy"] == metrics["accuracy"]
  finally:
    changed.unlink()
  for key, module in (("model.module", "json"), ("recipe", "antigravity")):
    config = json.loads((original / runs.CONFIG_FILE).read_text())
    if key == "recipe":
      config["recipe"] = module
    else:
      config["model"]["module"] = module
    (workdir / runs.CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(rules.ConfigError, match=rf"names config.{key}='{module}', which is not a "
                       "module of this project"):
      trained.Restored(str(workdir))
  assert "antigravity" not in sys.modules  # (importing it opens a web browser)


@pytest.mark.slow
def test_train_replace_model_py_then_evaluate_predict_and_export_the_old_run(tmp_path):
  """As a user does it, in a copy of the project: train on model.py's CNN, replace model.py by an
  MLP, then the commands on the old workdir, by default, refuse in one line naming the leaf
  that differs and --use_runs_model; with it, they work, each saying that it used the run's own
  copy."""
  project = tmp_path / "project"
  shutil.copytree(PROJECT, project, ignore=shutil.ignore_patterns(
      ".*", "__pycache__", "runs", "*.egg-info"))
  workdir = tmp_path / "run"
  command = lambda *args: subprocess.run(  # noqa: E731
      [sys.executable, *args], cwd=project, capture_output=True, text=True, timeout=300)
  done = command("train.py", "--config=configs/tiny.py", f"--workdir={workdir}")
  assert done.returncode == 0, done.stderr[-3000:]
  (project / "model.py").write_text(CHANGED_MODEL)
  image = tmp_path / "digit.png"
  Image.fromarray(sources.get_datasets(default.get_config())[0]["eval"].images[0, ..., 0]
                  ).save(image)
  said = f"model: the run's own, {workdir / runs.MODEL_FILE} (--use_runs_model; model.py has"
  for args in (["evaluate.py"], ["predict.py", str(image)],
               ["export.py", f"--out={tmp_path / 'model.npz'}"]):
    done = command(*args, f"--workdir={workdir}")
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and last.startswith(
        f"error: workdir {str(workdir)!r} holds a checkpoint (step 23) of a different model: "
        "0/convs/0/bias/value is (8,) there and absent"), done.stderr[-3000:]
    assert "--use_runs_model builds the model with it" in last, last
    done = command(*args, f"--workdir={workdir}", "--use_runs_model")
    assert done.returncode == 0 and said in done.stderr, done.stderr[-3000:]


# Appended to a workdir's copy of model.py: what would run if a tool executed it.
PAYLOAD = """
import pathlib as _pathlib
_pathlib.Path(__file__).with_name("payload_ran").write_text("yes")
"""


@pytest.mark.slow
def test_a_workdirs_model_py_runs_only_with_use_runs_model(straight_runs, tmp_path):
  """A workdir's model.py with a payload appended (the same model, and code of someone else's):
  evaluate.py, predict.py and export.py with their default flags build today's model and never
  run it, saying in one line that the copy differs; --use_runs_model runs it (as its help says)."""
  workdir = tmp_path / "run"
  shutil.copytree(straight_runs["spmd"][0], workdir)
  copy = workdir / runs.MODEL_FILE
  copy.write_text(copy.read_text() + PAYLOAD)
  image = tmp_path / "digit.png"
  Image.fromarray(sources.get_datasets(default.get_config())[0]["eval"].images[0, ..., 0]
                  ).save(image)
  command = lambda *args: subprocess.run(  # noqa: E731
      [sys.executable, *args, f"--workdir={workdir}"], cwd=PROJECT, capture_output=True,
      text=True, timeout=300)
  for args in (["evaluate.py"], ["predict.py", str(image)],
               ["export.py", f"--out={tmp_path / 'model.npz'}"]):
    done = command(*args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"which differs from the run's copy {copy} (not run: --use_runs_model" in done.stderr
    assert not (workdir / "payload_ran").exists(), args
  done = command("evaluate.py", "--use_runs_model")
  assert done.returncode == 0 and (workdir / "payload_ran").exists(), done.stderr[-3000:]
