"""Pretrained weights (`config.init_from` naming a file or `hf-hub:ORG/NAME`): a PyTorch state dict
in timm's or torchvision's names, put into model.py's ResNet-18/50 or vit.py's ViT (any size and
patch; its blocks stacked, scanned or not), exactly: their logits are PyTorch's
(tests/test_pretrained.py). Loaded only when such weights are asked for (runs.start_or_resume).

  --config.init_from=resnet50.safetensors          # timm's or torchvision's names
  --config.init_from=resnet50.pth                  # torch.load (weights only): needs PyTorch
  --config.init_from=hf-hub:timm/resnet50.a1_in1k  # downloaded once into Hugging Face's cache

Names are mapped and shapes checked (a mismatch: one line naming the first key and both shapes);
convolution kernels go from PyTorch's [out, in, h, w] to [h, w, in, out], linear ones are
transposed, timm's fused qkv is split into the attention's query, key and value; BatchNorm's
running statistics come too. A head of another class count starts afresh, said; so does
anything the file does not hold; the keys that are not used are named. A ViT's position
embeddings are resized (bicubic, as timm does) to another image size, and RGB kernels summed
for gray images (as timm's in_chans=1), each said. The input is normalised as the weights were
trained (`input_statistics`: timm's config.json beside the file or in the Hub's repo, else
ImageNet's mean and std), in training, evaluation, predict.py and export.py alike.
"""

import functools
import json
import os
import re

import numpy as np
from absl import logging

from .. import process
from ..errors import ConfigError

HUB = "hf-hub:"
FILES = (".safetensors", ".pth", ".pt", ".bin")
IGNORED = re.compile(r"(^|\.)num_batches_tracked$")  # BatchNorm's counter: nothing to map
# What torchvision's and most of timm's ImageNet weights were trained on: their default.
IMAGENET = dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), input_size=(3, 224, 224))


def is_weights(source: str) -> bool:
  """Whether `config.init_from` names pretrained weights (else: a run's workdir)."""
  return source.startswith(HUB) or source.endswith(FILES)


def read(source: str) -> dict[str, np.ndarray]:
  """A state dict (name -> array) from a .safetensors file (no PyTorch needed), a PyTorch file
  (.pth, .pt, .bin: torch.load, weights only) or `hf-hub:ORG/NAME` (its model.safetensors, else
  pytorch_model.bin, through Hugging Face's cache: offline once cached)."""
  if source.startswith(HUB):
    source = hub_file(source[len(HUB):])
  if not os.path.isfile(source):
    raise ConfigError(f"config.init_from={source!r}: no such file; give a .safetensors or .pth "
                      "file, a run's workdir, or hf-hub:ORG/NAME.")
  if source.endswith(".safetensors"):
    from safetensors.numpy import load_file

    return load_file(source)
  try:
    import torch
  except ImportError:
    raise ConfigError(f"config.init_from={source!r}: reading a PyTorch file needs PyTorch "
                      "(pip install torch), or convert it to .safetensors.") from None
  state = torch.load(source, map_location="cpu", weights_only=True)
  state = state.get("state_dict", state.get("model", state))  # (a training checkpoint's)
  return {name: value.float().numpy() if value.is_floating_point() else value.numpy()
          for name, value in state.items() if hasattr(value, "numpy")}


def hub_file(repo: str, names=("model.safetensors", "pytorch_model.bin")) -> str:
  """The local path of `repo`'s weights (the first of `names` it has) on the Hugging Face Hub,
  downloaded into its cache once (HF_HOME; offline: HF_HUB_OFFLINE=1, the cache alone)."""
  import huggingface_hub

  missing = None
  for name in names:
    cached = huggingface_hub.try_to_load_from_cache(repo, name)
    if isinstance(cached, str):
      return cached
    try:
      return huggingface_hub.hf_hub_download(repo, name)
    except Exception as e:  # noqa: BLE001 (the next name; the first failure is said)
      missing = missing or e
  raise ConfigError(f"config.init_from={HUB}{repo}: neither {' nor '.join(names)} could be had "
                    f"({type(missing).__name__}: "
                    f"{str(missing).splitlines()[0] if str(missing) else ''}); check the name, "
                    "the network, or HF_HOME's cache.")


@functools.cache
def weights_config(source: str) -> tuple[dict, str]:
  """What the weights were trained on (mean, std, input_size [C, H, W]): timm's
  `pretrained_cfg` in the config.json beside the file or in its Hub repo, else `IMAGENET`; and
  where that came from."""
  try:
    path = (hub_file(source[len(HUB):], ("config.json",)) if source.startswith(HUB) else
            os.path.join(os.path.dirname(os.path.abspath(source)), "config.json"))
    with open(path) as f:
      given = json.load(f)
    given = given.get("pretrained_cfg", given)
    if "mean" in given and "std" in given:
      return {**IMAGENET, **given}, path
  except (ConfigError, OSError, ValueError, AttributeError):
    pass
  return IMAGENET, "ImageNet's, the default: no config.json with them beside the weights"


def input_statistics(source: str) -> dict:
  """The mean and std (by channel, of pixels in [0, 1]) that the weights' input was normalised
  with (`weights_config`): `config.run`'s input_mean and input_std."""
  given, _ = weights_config(source)
  return dict(input_mean=tuple(map(float, given["mean"])),
              input_std=tuple(map(float, given["std"])))


def hwio(w):
  return np.transpose(w, (2, 3, 1, 0))  # PyTorch's [out, in, h, w] -> [h, w, in, out]


def resnet_names(ours: dict, theirs: dict) -> dict[str, tuple[str, object]]:
  """model.py's ResNet leaves (by name: 'blocks/3/convs/1/kernel') -> (their key, how a value
  becomes ours), for timm's and torchvision's names (the same for ResNets)."""
  norm = {"scale": "weight", "bias": "bias", "mean": "running_mean", "var": "running_var"}
  blocks = sorted({(int(s), int(i)) for s, i in re.findall(r"^layer(\d+)\.(\d+)\.", "\n".join(
      theirs), re.MULTILINE)})
  names = {"stem/kernel": ("conv1.weight", hwio), "head/kernel": ("fc.weight", np.transpose),
           "head/bias": ("fc.bias", None)}
  for name in ours:
    parts = name.split("/")
    if parts[0] == "stem_norm":
      names[name] = (f"bn1.{norm[parts[1]]}", None)
    elif parts[0] == "blocks" and int(parts[1]) < len(blocks):
      stage, i = blocks[int(parts[1])]
      where, rest = f"layer{stage}.{i}", parts[2:]
      if rest[0] == "convs":
        names[name] = (f"{where}.conv{int(rest[1]) + 1}.weight", hwio)
      elif rest[0] == "norms":
        names[name] = (f"{where}.bn{int(rest[1]) + 1}.{norm[rest[2]]}", None)
      elif rest[0] == "project":
        names[name] = (f"{where}.downsample.0.weight", hwio)
      elif rest[0] == "project_norm":
        names[name] = (f"{where}.downsample.1.{norm[rest[1]]}", None)
  return names


def vit_names(ours: dict, theirs: dict) -> dict[str, tuple[str | list[str], object]]:
  """vit.py's ViT leaves -> (timm's key, or the depth's keys to stack, and how a value becomes
  ours)."""
  depth = len({m for m in re.findall(r"^blocks\.(\d+)\.", "\n".join(theirs), re.MULTILINE)})
  _, width, heads, _ = ours.get("blocks/attention/query/kernel", (0, 1, 1, 1))  # [depth, D, N, H]

  def qkv(part: int, bias: bool):
    def take(w):  # timm's fused [3 x width, width] (rows: q, k, v; each heads x head width)
      w = w[part * width:(part + 1) * width]
      return w.reshape(heads, -1) if bias else w.T.reshape(width, heads, -1)
    return take

  names = {"embed/kernel": ("patch_embed.proj.weight", hwio),
           "embed/bias": ("patch_embed.proj.bias", None), "cls_embedding": ("cls_token", None),
           "position_embedding": ("pos_embed", None), "norm/scale": ("norm.weight", None),
           "norm/bias": ("norm.bias", None), "head/kernel": ("head.weight", np.transpose),
           "head/bias": ("head.bias", None)}
  per_block = {
      "attention_norm/scale": ("norm1.weight", None), "attention_norm/bias": ("norm1.bias", None),
      "mlp_norm/scale": ("norm2.weight", None), "mlp_norm/bias": ("norm2.bias", None),
      "mlp_in/kernel": ("mlp.fc1.weight", np.transpose), "mlp_in/bias": ("mlp.fc1.bias", None),
      "mlp_out/kernel": ("mlp.fc2.weight", np.transpose), "mlp_out/bias": ("mlp.fc2.bias", None),
      "attention/out/kernel": ("attn.proj.weight", lambda w: w.T.reshape(heads, -1, w.shape[0])),
      "attention/out/bias": ("attn.proj.bias", None)}
  for part, name in enumerate(("query", "key", "value")):
    per_block[f"attention/{name}/kernel"] = ("attn.qkv.weight", qkv(part, bias=False))
    per_block[f"attention/{name}/bias"] = ("attn.qkv.bias", qkv(part, bias=True))
  for name, (key, how) in per_block.items():
    names[f"blocks/{name}"] = ([f"blocks.{i}.{key}" for i in range(depth)], how)
  return names


def convert(theirs: dict[str, np.ndarray], ours: dict[str, tuple], source: str):
  """Their state dict as our model's leaves.

  Args:
    theirs: the state dict (timm's or torchvision's names).
    ours: our model's leaves' shapes, by name ('stem/kernel', 'blocks/attention/query/kernel').
    source: `config.init_from` (for the messages).
  Returns:
    Our leaves' values by name, and the names of those left as they are (another shape: the
    head; or nothing in the file for them).
  """
  names = (vit_names if "embed/kernel" in ours else resnet_names)(ours, theirs)
  values, fresh, used = {}, [], set()
  for name, shape in ours.items():
    key, how = names.get(name, (None, None))
    keys = key if isinstance(key, list) else [key]
    if key is None or not keys or any(k not in theirs for k in keys):
      fresh.append(name)
      continue
    value = np.stack([(how or np.asarray)(theirs[k]) for k in keys]) if isinstance(key, list) \
        else (how or np.asarray)(theirs[key])
    used.update(keys)
    if name == "position_embedding" and value.shape != shape:
      value = resized_position_embedding(value, shape)
      logging.info("config.init_from=%s: position embeddings resized (bicubic, as timm does), "
                   "%s -> %s: the images' size differs from the weights'", source,
                   theirs[key].shape, shape)
    if name in ("stem/kernel", "embed/kernel") and value.shape[2] == 3 and shape[2] == 1:
      value = value.sum(axis=2, keepdims=True)  # RGB weights for gray images: as timm adapts
      logging.info("config.init_from=%s: the first convolution's RGB kernels summed over the "
                   "colours, for images of one channel (as timm's in_chans=1)", source)
    if value.shape != tuple(shape):
      if name.startswith("head/"):  # another class count: a new head
        fresh.append(name)
        continue
      raise ConfigError(f"config.init_from={source}: {keys[0]} has shape "
                        f"{list(theirs[keys[0]].shape)}, which does not fit this model's {name} "
                        f"{list(shape)}: weights of another architecture or size "
                        "(config.model.name, model.patch).")
    values[name] = value
  if not values:
    raise ConfigError(f"config.init_from={source}: none of its {len(theirs)} keys fits this "
                      f"model (first: {next(iter(theirs), None)!r}); the weights of model.py's "
                      "ResNets or vit.py's ViTs, in timm's or torchvision's names, fit.")
  unused = sorted(k for k in theirs if k not in used and not IGNORED.search(k))
  if unused and process.is_first():
    logging.warning("config.init_from=%s: %d keys not used: %s", source, len(unused),
                    ", ".join(unused))
  return values, fresh


def resized_position_embedding(value: np.ndarray, shape: tuple) -> np.ndarray:
  """[1, 1 + h * w, D] position embeddings (a class token's first) resized to `shape`'s grid."""
  import jax

  _, tokens, width = shape
  side, new = int(round((value.shape[1] - 1) ** 0.5)), int(round((tokens - 1) ** 0.5))
  grid = value[:, 1:].reshape(1, side, side, width)
  grid = np.asarray(jax.image.resize(grid, (1, new, new, width), "bicubic"))
  return np.concatenate([value[:, :1], grid.reshape(1, new * new, width)], axis=1)


def init_from(source: str, abstract, init, run=None, image_shape=()):
  """Fine-tuning from pretrained weights: a function like `init` whose model (and moving
  average) starts as the weights; the optimizer is fresh. Everything is read and checked first.

  Args:
    source: `config.init_from`: a file, or hf-hub:ORG/NAME.
    abstract: the state's abstract value.
    init: builds the state.
    run: `config.run` (the input's statistics, said); None: not said.
    image_shape: the images' [H, W, C]: a size other than the weights' is said.
  """
  import jax
  import jax.numpy as jnp

  from .checkpoints import shapes
  from .damaged import leaf_name

  ours = {name[2:].removesuffix("/value"): shape for name, shape in shapes(abstract).items()
          if name.startswith("0/") and "rngs/" not in name}  # the model's, its RNG streams aside
  theirs = read(source)
  values, fresh = convert(theirs, ours, source)
  heads = [n for n in fresh if n.startswith("head/")]
  logging.info("Fine-tuning from %s: %d of this model's leaves from its %d keys%s%s", source,
               len(values), len(theirs), "; the head started afresh (another class count: "
               f"{list(ours['head/kernel'])})" if heads else "",
               "; also afresh: " + ", ".join(n for n in fresh if n not in heads)
               if len(fresh) > len(heads) else "")
  given, where = weights_config(source)
  if run is not None:
    mine = (tuple(run.input_mean), tuple(run.input_std)) == (
        tuple(given["mean"]), tuple(given["std"]))
    logging.info("Fine-tuning from %s: the input normalised by mean %s, std %s (%s)", source,
                 tuple(run.input_mean), tuple(run.input_std),
                 where if mine else "config.input_mean and input_std, not the weights'")
  size = tuple(given["input_size"])[1:]
  if image_shape and tuple(image_shape[:2]) != size and process.is_first():
    logging.warning("config.init_from=%s: the weights were trained on images of %dx%d, these are "
                    "%dx%d: they may do worse; write the photos at %d (write_arrayrecord.py "
                    "--image_size=%d,%d) or set config.image_size", source, *size,
                    *image_shape[:2], size[0], *size)

  def build():
    def take(path, x):
      name = leaf_name(path)
      if name[:2] in ("0/", "2/") and (mine := name[2:].removesuffix("/value")) in values:
        return jnp.array(values[mine], x.dtype)  # (the model and its average: a buffer each)
      return x
    return jax.tree_util.tree_map_with_path(take, init())

  return build
