"""Pretrained weights (training/pretrained.py): timm's and torchvision's ResNets and timm's ViTs,
put into model.py's and vit.py's models through `config.init_from`, give PyTorch's logits. The
comparisons build PyTorch's models with random weights (nothing downloads) and need the `torch`
extra: skipped, with the reason, without it. The rest needs no PyTorch."""

import functools
import importlib
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import SHIPPED_MODEL
from flax import nnx
from safetensors.numpy import save_file

from {{cookiecutter.project_slug}} import plan
from {{cookiecutter.project_slug}}.errors import ConfigError
from {{cookiecutter.project_slug}}.training import finetune, optim, pretrained, steps


@pytest.fixture
def torch():
  """PyTorch (with timm and torchvision: the torch extra), or the test skipped, saying so."""
  for name in ("torch", "timm", "torchvision"):
    pytest.importorskip(name, reason="the torch extra: pip install -e '.[torch]'")
  import torch

  return torch


def ours(module: str, name: str, image_size: int = 224, num_classes: int = 1000, **model):
  """model.py's (the tests' own copy, whatever model.py holds: conftest.SHIPPED_MODEL) or vit.py's
  `name` in float32, as `create_model` builds it for a run."""
  module = SHIPPED_MODEL if module == "model" else module
  config = importlib.import_module("configs.default").get_config()
  config.model.update(name=name, module=module, dtype="float32", param_dtype="float32", **model)
  if module == "vit":
    config.model.update(patch=16, depth=0, dropout=0.0, scan=model.get("scan", False))
  return importlib.import_module(module).create_model(
      config, (image_size, image_size, 3), num_classes, nnx.Rngs(0))


def loaded(model, source: str):
  """`model` with the weights of `source` put in through `config.init_from`'s own path."""
  state = nnx.state(model)
  build = finetune.init_from(source, (state,), lambda: (state,))
  nnx.update(model, build()[0])
  return model


def randomized(torch, torch_model):
  """PyTorch's model in eval mode, its BatchNorms' statistics and scales random too (their
  defaults, 0 and 1, would hide a statistic taken for another)."""
  generator = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for module in torch_model.modules():
      if isinstance(module, torch.nn.BatchNorm2d):
        for tensor, low, high in ((module.weight, 0.5, 1.5), (module.bias, -0.1, 0.1),
                                  (module.running_mean, -0.1, 0.1),
                                  (module.running_var, 0.5, 1.5)):
          tensor.copy_(torch.rand(tensor.shape, generator=generator) * (high - low) + low)
  return torch_model.eval()


def assert_same_logits(torch, model, torch_model, image_size: int = 224):
  images = np.random.default_rng(0).normal(size=(8, 3, image_size, image_size)).astype(np.float32)
  with torch.no_grad():
    want = torch_model(torch.from_numpy(images)).numpy()
  model.eval()
  got = np.asarray(model(images.transpose(0, 2, 3, 1)))
  error = np.abs(got - want).max() / np.abs(want).max()
  print(f"largest difference over the largest logit: {error:.2e}")
  assert error < 1e-4, error


def save(torch, state_dict, path) -> str:
  if str(path).endswith(".safetensors"):
    save_file({k: v.numpy() for k, v in state_dict.items()}, str(path))
  else:
    torch.save(state_dict, str(path))
  return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("maker, file", [
    ("timm", "resnet50.safetensors"), ("timm", "resnet50.pth"),
    ("torchvision", "resnet50.safetensors")])
def test_a_resnet50_of_timm_or_torchvision_gives_their_logits(torch, tmp_path, maker, file):
  import timm
  import torchvision

  torch_model = randomized(torch, timm.create_model("resnet50") if maker == "timm"
                           else torchvision.models.resnet50())
  path = save(torch, torch_model.state_dict(), tmp_path / file)
  assert_same_logits(torch, loaded(ours("model", "resnet50"), path), torch_model)


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_timm_vit_b16_gives_its_logits_unrolled_or_scanned(torch, tmp_path, scan):
  import timm

  torch_model = timm.create_model("vit_base_patch16_224").eval()
  path = save(torch, torch_model.state_dict(), tmp_path / "vit.safetensors")
  assert_same_logits(torch, loaded(ours("vit", "vit_b", scan=scan), path), torch_model)


@pytest.mark.slow
def test_another_class_count_and_image_size_a_new_head_and_resized_position_embeddings(
    torch, tmp_path, caplog):
  """timm's ViT-Ti/16 at 224 into a 10-class ViT-Ti/16 at 112: every leaf but the head comes
  from the file, the head starts afresh, the position embeddings are resized; each is said."""
  import timm

  torch_model = timm.create_model("vit_tiny_patch16_224").eval()
  path = save(torch, torch_model.state_dict(), tmp_path / "vit.safetensors")
  model = ours("vit", "vit_ti", image_size=112, num_classes=10)
  head = np.asarray(model.head.kernel[...])
  with caplog.at_level("INFO"):
    loaded(model, path)
  np.testing.assert_array_equal(np.asarray(model.head.kernel[...]), head)  # afresh: as built
  np.testing.assert_array_equal(np.asarray(model.embed.bias[...]),
                                torch_model.patch_embed.proj.bias.detach().numpy())
  assert model.position_embedding[...].shape == (1, 50, 192)
  said = caplog.text
  assert "the head started afresh (another class count: [192, 10])" in said
  assert "position embeddings resized" in said and "(1, 197, 192) -> (1, 50, 192)" in said


def test_a_file_of_another_architecture_is_refused_in_one_line_naming_the_key(tmp_path):
  """ResNet-18's weights with one convolution of another shape: one line naming the first key
  that does not fit, both shapes, and what to check."""
  model = ours("model", "resnet18", width=8)  # (narrow: built in a moment)
  theirs = {"conv1.weight": np.zeros((8, 3, 5, 5), np.float32)}
  path = str(tmp_path / "other.safetensors")
  save_file(theirs, path)
  with pytest.raises(ConfigError, match=r"conv1\.weight has shape \[8, 3, 5, 5\], which does "
                     r"not fit this model's stem/kernel \[7, 7, 3, 8\]"):
    loaded(model, path)
  save_file({"encoder.weight": np.zeros(3, np.float32)}, path)
  with pytest.raises(ConfigError, match="none of its 1 keys fits this model"):
    loaded(model, path)


def test_a_missing_file_is_said_in_one_line(tmp_path):
  with pytest.raises(ConfigError, match="no such file"):
    pretrained.read(str(tmp_path / "missing.safetensors"))


def offline_hub(tmp_path, monkeypatch, repo: str):
  """Hugging Face's cache in `tmp_path` (offline: nothing downloads), holding `repo` ("ORG/NAME")
  as huggingface_hub lays it out; returns its snapshot's folder, for the files."""
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_HOME", str(tmp_path))
  import huggingface_hub.constants

  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
  folder = tmp_path / "hub" / f"models--{repo.replace('/', '--')}"
  snapshot = folder / "snapshots" / ("0" * 40)
  snapshot.mkdir(parents=True)
  (folder / "refs").mkdir()
  (folder / "refs" / "main").write_text("0" * 40)
  return snapshot


def test_hf_hub_weights_are_read_from_a_prepared_cache_offline(tmp_path, monkeypatch):
  """hf-hub:ORG/NAME reads Hugging Face's cache (here one the test writes, offline: nothing
  downloads), as huggingface_hub lays it out."""
  snapshot = offline_hub(tmp_path, monkeypatch, "someone/resnet18")
  weights = {"conv1.weight": np.ones((64, 3, 7, 7), np.float32)}
  save_file(weights, str(snapshot / "model.safetensors"))
  read = pretrained.read("hf-hub:someone/resnet18")
  np.testing.assert_array_equal(read["conv1.weight"], weights["conv1.weight"])
  with pytest.raises(ConfigError, match="hf-hub:someone/absent: neither model.safetensors"):
    pretrained.read("hf-hub:someone/absent")
  assert os.environ["HF_HUB_OFFLINE"] == "1"


@pytest.mark.slow
def test_train_py_starts_from_torchvision_weights_and_says_so(torch, tmp_path):
  """train.py with `--config.init_from=FILE.safetensors` (torchvision's ResNet-18, random
  weights) on the digits: the run starts from them (every leaf but the head: 100 of the file's
  122 keys, its 20 BatchNorm counters aside), the RGB kernels of its first convolution summed for
  the gray digits, its 1000-class head replaced by a 10-class one; it trains an epoch and ends
  0, its log saying each."""
  import subprocess
  import sys

  import torchvision

  path = save(torch, randomized(torch, torchvision.models.resnet18()).state_dict(),
              tmp_path / "resnet18.safetensors")
  out = subprocess.run(
      [sys.executable, "train.py", "--config=configs/tiny.py", "--config.model.name=resnet18",
       f"--config.model.module={SHIPPED_MODEL}",
       "--config.model.width=64", f"--config.init_from={path}", f"--workdir={tmp_path / 'run'}"],
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), capture_output=True,
      text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"Fine-tuning from {path}: 100 of this model's leaves from its 122 keys; the head " \
         "started afresh (another class count: [512, 10])" in out.stderr, out.stderr[-3000:]
  assert "RGB kernels summed over the colours, for images of one channel" in out.stderr
  assert ("the input normalised by mean (0.485, 0.456, 0.406), std (0.229, 0.224, 0.225) "
          "(ImageNet's, the default: no config.json with them beside the weights)") in out.stderr
  assert "the weights were trained on images of 224x224, these are 8x8" in out.stderr
  assert "Final eval" in out.stderr


def timm_config(directory, mean, std, size=224) -> None:
  """A config.json as timm's `save_for_hf` writes it beside model.safetensors (its keys that
  matter here; the slow test below has timm write one)."""
  given = dict(input_size=[3, size, size], crop_pct=0.95, mean=mean, std=std)
  (directory / "config.json").write_text(json.dumps(dict(architecture="resnet50",
                                                         pretrained_cfg=given)))


def test_the_inputs_statistics_are_the_weights_own_else_imagenets(tmp_path, monkeypatch):
  """config.init_from's mean and std: its config.json's (beside the file, or in its Hub repo,
  read offline from a prepared cache), else ImageNet's, said; config.input_mean wins; a resumed
  run keeps its own, whatever init_from says now."""
  weights = tmp_path / "weights"
  weights.mkdir()
  save_file({"conv1.weight": np.zeros((1,), np.float32)}, str(weights / "model.safetensors"))
  imagenet = dict(input_mean=(0.485, 0.456, 0.406), input_std=(0.229, 0.224, 0.225))
  assert pretrained.input_statistics(str(weights / "model.safetensors")) == imagenet
  assert "ImageNet's, the default" in pretrained.weights_config(
      str(weights / "model.safetensors"))[1]
  timm_config(weights, [0.5, 0.5, 0.5], [0.25, 0.5, 1.0])
  source = str(weights / "model.safetensors")
  pretrained.weights_config.cache_clear()
  assert pretrained.input_statistics(source) == dict(input_mean=(0.5, 0.5, 0.5),
                                                     input_std=(0.25, 0.5, 1.0))
  config = importlib.import_module("configs.tiny").get_config()
  config.init_from = source
  assert plan.resolved(config).run.input_std == (0.25, 0.5, 1.0)
  config.input_mean, config.input_std = (0.1,), (0.2,)
  assert (plan.resolved(config).run.input_mean, plan.resolved(config).run.input_std) == (
      (0.1,), (0.2,))
  config.input_mean, config.input_std, config.init_from = (), (), ""
  assert plan.resolved(config).run.input_mean == ()  # no weights: as the pixels are
  saved = json.loads(plan.resolved(config).to_json())
  saved["run"].update(input_mean=[0.5] * 3, input_std=[0.25] * 3)
  assert plan.resolved(config, resuming=(saved, "w")).run.input_std == (0.25,) * 3
  # hf-hub:ORG/NAME: the repo's config.json, from the cache, offline.
  timm_config(offline_hub(tmp_path, monkeypatch, "someone/vit"), [0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
  assert pretrained.input_statistics("hf-hub:someone/vit")["input_std"] == (0.5, 0.5, 0.5)


def test_the_input_is_normalised_alike_in_training_evaluation_predict_and_export(tiny_config):
  """steps.forward (training's and evaluation's) and steps.probabilities (predict.py's and
  export.py's) give the model (pixels / 255 - mean) / std, by channel (gray images: the
  colours' mean); () leaves the pixels as they are."""

  seen = []

  class Probe(nnx.Module):
    def __call__(self, images):
      seen.append(images)
      return images.reshape(len(images), -1)[:, :3]

  images = np.random.default_rng(0).integers(0, 256, (2, 4, 4, 3)).astype(np.uint8)
  config = plan.resolved(tiny_config)
  config.run.update(input_mean=(0.5, 0.25, 0.0), input_std=(0.5, 0.25, 2.0))
  steps.forward(Probe(), {"image": images, "mask": np.ones(2, bool)}, config)
  graphdef, state = nnx.split(Probe())
  steps.probabilities(graphdef, state, images, config=config)
  pixels = images.astype(np.float32) / np.float32(255)  # (float32, as the step computes)
  want = (pixels - np.float32([0.5, 0.25, 0.0])) / np.float32([0.5, 0.25, 2.0])
  for got in seen:
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7)
  steps.forward(Probe(), {"image": images[..., :1], "mask": np.ones(2, bool)}, config)
  np.testing.assert_allclose(np.asarray(seen[-1]), (pixels[..., :1] - 0.25) / (2.75 / 3),
                             rtol=1e-6, atol=1e-7)
  config.run.update(input_mean=(), input_std=())
  steps.forward(Probe(), {"image": images, "mask": np.ones(2, bool)}, config)
  np.testing.assert_array_equal(np.asarray(seen[-1]), pixels)


def test_layer_decay_the_heads_rate_and_a_frozen_backbone_scale_each_update(tiny_config):
  """recipe.optimizer with sgd (no momentum): each update is -rate x factor x gradient, the factor
  BEiT's d^(L - i) for block i of L (stacked on their first axis, as vit.py's, or numbered),
  d^(L + 1) for the embeddings, head_lr_multiplier for the head, 1 for the last norm; a frozen
  backbone moves the head alone."""
  import recipe

  config = importlib.import_module("configs.default").get_config()
  config.update(optimizer="sgd", momentum=0.0, learning_rate=0.5, schedule="constant",
                head_lr_multiplier=10.0, layer_decay=0.5)
  config = plan_resolved(config)
  one = functools.partial(np.ones, dtype=np.float32)
  stacked = dict(embed=dict(kernel=one((2, 2))), blocks=dict(mlp=dict(kernel=one((3, 2)))),
                 norm=dict(scale=one(2)), head=dict(kernel=one((2, 2))))
  numbered = dict(stem=dict(kernel=one(2)), head=dict(bias=one(2)),
                  blocks={i: dict(kernel=one(2)) for i in range(3)})
  for params, want in (
      (stacked, {"embed": 0.5 ** 4, "blocks": np.array([[0.125], [0.25], [0.5]]), "norm": 1.0,
                 "head": 10.0}),
      (numbered, {"stem": 0.5 ** 4, "blocks": {0: 0.125, 1: 0.25, 2: 0.5}, "head": 10.0})):
    optimizer = recipe.optimizer(config, 10)
    updates, _ = optimizer.update(params, optimizer.init(params), params)
    expected = jax.tree.map(lambda p, f: -0.5 * f * p, params, broadcast(want, params))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6),
                 updates, expected)
  frozen = plan_resolved(config, freeze_backbone=True, layer_decay=0.0)
  optimizer = recipe.optimizer(frozen, 10)
  updates, _ = optimizer.update(stacked, optimizer.init(stacked), stacked)
  assert all(not np.asarray(u).any() for name, tree in updates.items() if name != "head"
             for u in jax.tree.leaves(tree))
  np.testing.assert_allclose(np.asarray(updates["head"]["kernel"]), -5.0 * np.ones((2, 2)))
  # A model of yours without a `head` or `blocks`: refused in one line as its state is built.
  mine = dict(encoder=dict(kernel=one(2)), classifier=dict(kernel=one(2)))
  with pytest.raises(ConfigError, match="an attribute named `head`, which this model has none"):
    recipe.optimizer(frozen, 10).init(mine)
  with pytest.raises(ConfigError, match="config.layer_decay=0.5 decays the rates of the blocks"):
    recipe.optimizer(plan_resolved(config, head_lr_multiplier=1.0), 10).init(mine)


def plan_resolved(config, **changes):

  config = config.copy_and_resolve_references()
  config.update(changes)
  return plan.resolved(config)


def broadcast(factors, params):
  """A factor per subtree of `params` made one per leaf."""
  if isinstance(params, dict):
    return {k: broadcast(factors[k] if isinstance(factors, dict) else factors, v)
            for k, v in params.items()}
  return factors


@pytest.mark.slow
def test_every_path_fine_tunes_alike_from_the_same_weights(torch, tmp_path, tiny_config):
  """configs/finetune.py's knobs (the head at 10x, BEiT's layer decay, the input normalised by
  the weights' statistics) on a ViT-Ti from timm's weights (2 blocks of 4x4 patches, random, made
  here): one device, spmd, pmap and fsdp start from the same weights and end three steps (one of
  them padded) at the same state (test_vit.py's `assert_leaves_near`; SGD with momentum: Adam
  would blow the rounding of gradients that are zero in exact arithmetic, attention's key bias,
  up to whole steps, as test_vit.py says)."""
  import timm
  from test_parallel import batches, run
  from test_vit import assert_leaves_near


  torch_model = timm.create_model("vit_tiny_patch16_224", patch_size=4, img_size=8, in_chans=1,
                                  depth=2, num_classes=10)
  path = save(torch, torch_model.state_dict(), tmp_path / "vit.safetensors")
  tiny_config.model.update(module="vit", name="vit_ti", patch=4, depth=2, scan=False)
  tiny_config.update(init_from=path, optimizer="sgd", learning_rate=0.05, weight_decay=1e-4,
                     head_lr_multiplier=10.0, layer_decay=0.65, grad_clip_norm=1.0,
                     fsdp_min_size=0)
  config = plan.resolved(tiny_config)
  assert config.run.input_mean == (0.485, 0.456, 0.406)  # (no config.json: ImageNet's)
  run_plan = plan.make_plan(ml_collections.FrozenConfigDict(config))
  graphdef, state = nnx.split(optim.build_state(run_plan, (8, 8, 1), 10, 3))
  state = finetune.init_from(path, state, lambda: state)()
  np.testing.assert_array_equal(np.asarray(state[0]["embed"]["bias"][...]),
                                torch_model.patch_embed.proj.bias.detach().numpy())
  data = batches([64, 20, 64])
  copy = lambda: jax.tree.map(jnp.copy, state)  # (the steps donate it)  # noqa: E731
  single, _ = run(config, "single", data, graphdef, copy())
  for parallelism in ("spmd", "pmap", "fsdp"):
    trained, metrics = run(config, parallelism, data, graphdef, copy())
    assert metrics["examples"] == 148
    assert_leaves_near(trained, single)
  moved = np.abs(np.asarray(single[0]["head"]["kernel"][...]) - np.asarray(
      state[0]["head"]["kernel"][...])).max()
  assert moved > 0


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["spmd", "pmap"])
def test_frozen_batch_norm_trains_on_its_running_statistics_and_keeps_them(tiny_config,
                                                                           parallelism):
  """config.freeze_batch_norm: BatchNorm normalises by its running statistics in training too,
  and leaves them as they were; the parameters train, alike on one device and on 8 (SGD: Adam
  blows up the rounding of a gradient entry that is zero in exact arithmetic, test_vit.py)."""
  import test_parallel as paths

  tiny_config.freeze_batch_norm = True
  graphdef, state = paths.batchnorm_state(paths.SGD, model_class=paths.StockBatchNormCNN)
  data = paths.batches([64, 20])
  single, _ = paths.run(tiny_config, "single", data, graphdef, jax.tree.map(jnp.copy, state))
  trained, _ = paths.run(tiny_config, parallelism, data, graphdef, jax.tree.map(jnp.copy, state))
  paths.assert_trees_close(trained, single, atol=1e-6)
  for name in ("mean", "var"):
    np.testing.assert_array_equal(np.asarray(trained[0]["norm"][name][...]),
                                  np.asarray(state[0]["norm"][name][...]))
  assert not np.array_equal(np.asarray(trained[0]["dense"]["kernel"][...]),
                            np.asarray(state[0]["dense"]["kernel"][...]))


@pytest.mark.slow
def test_the_readmes_fine_tuning_command_trains_evaluates_and_predicts(torch, tmp_path):
  """The README's "your photos from ImageNet's ResNet-50", its two lines as written but for the
  paths, the weights and 1 epoch: timm's ResNet-50 (random weights) saved by timm's own
  `save_for_hf` (model.safetensors and its config.json), a folder of 3 classes of 8 photos;
  train.py starts from the weights, its log naming them, the head replaced and the input's mean
  and std (from the config.json); evaluate.py and predict.py then read the run."""
  import shlex
  import subprocess
  import sys

  import timm
  from PIL import Image
  from timm.models import save_for_hf

  project = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  readme = open(os.path.join(project, "README.md"), encoding="utf-8").read()
  lines = [line for line in readme.splitlines() if "photos224" in line]
  assert len(lines) == 2 and "configs/finetune.py" in lines[1], lines
  weights = tmp_path / "resnet50"
  save_for_hf(randomized(torch, timm.create_model("resnet50")), str(weights),
              safe_serialization=True)
  rng = np.random.default_rng(0)
  for name, colour in (("cat", 0), ("dog", 1), ("fox", 2)):
    (tmp_path / "photos" / name).mkdir(parents=True)
    for i in range(8):
      pixels = rng.integers(0, 96, (80, 72, 3), dtype=np.uint8)
      pixels[..., colour] += 150
      Image.fromarray(pixels).save(tmp_path / "photos" / name / f"{i}.jpg")
  source, workdir = str(weights / "model.safetensors"), str(tmp_path / "run")
  mine = {"hf-hub:timm/resnet50.a1_in1k": source, "data/photos224": str(tmp_path / "data"),
          "=photos": f"={tmp_path / 'photos'}", "workdir_pretrained": workdir}

  def python(*args):
    out = subprocess.run([sys.executable, *args], cwd=project, capture_output=True, text=True,
                         timeout=900, env=dict(os.environ, XLA_FLAGS=(
                             "--xla_force_host_platform_device_count=8")))
    assert out.returncode == 0, out.stderr[-3000:]
    return out

  def as_written(line):
    for written, here in mine.items():
      line = line.replace(written, here)
    return shlex.split(line.split(".venv/bin/python ", 1)[1])

  python(*as_written(lines[0]))
  trained = python(*as_written(lines[1]), "--config.num_epochs=1",
                   f"--config.model.module={SHIPPED_MODEL}").stderr
  assert f"Fine-tuning from {source}: " in trained, trained[-3000:]
  assert "the head started afresh (another class count: [2048, 3])" in trained
  assert (f"the input normalised by mean (0.485, 0.456, 0.406), std (0.229, 0.224, 0.225) "
          f"({weights / 'config.json'})") in trained
  assert "Final eval" in trained and "the weights were trained on images of" not in trained
  evaluated = python("evaluate.py", f"--workdir={workdir}")
  assert "accuracy" in evaluated.stdout
  predicted = python("predict.py", f"--workdir={workdir}", str(tmp_path / "photos" / "fox"))
  assert predicted.stdout.count(".jpg") == 8, predicted.stdout
