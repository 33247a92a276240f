"""Pretrained weights (training/pretrained.py): timm's and torchvision's ResNets and timm's ViTs,
put into model.py's and vit.py's models through `config.init_from`, give PyTorch's logits. The
comparisons build PyTorch's models with random weights (nothing downloads) and need the `torch`
extra: skipped, with the reason, without it. The rest needs no PyTorch."""

import importlib
import os

import numpy as np
import pytest
from conftest import SHIPPED_MODEL
from flax import nnx
from safetensors.numpy import save_file

from {{cookiecutter.project_slug}}.errors import ConfigError
from {{cookiecutter.project_slug}}.training import finetune, pretrained


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


def test_hf_hub_weights_are_read_from_a_prepared_cache_offline(tmp_path, monkeypatch):
  """hf-hub:ORG/NAME reads Hugging Face's cache (here one the test writes, offline: nothing
  downloads), as huggingface_hub lays it out."""
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_HOME", str(tmp_path))
  import huggingface_hub.constants

  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
  repo = tmp_path / "hub" / "models--someone--resnet18"
  snapshot = repo / "snapshots" / ("0" * 40)
  snapshot.mkdir(parents=True)
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text("0" * 40)
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
  assert "Final eval" in out.stderr
