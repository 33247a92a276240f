"""ViT-B/16 on ImageNet at 224 (vit.py): DeiT's recipe (Touvron et al. 2021), as big_vision and
timm train it from scratch: AdamW (b1 0.9, b2 0.999) at 5e-4 x batch / 512, a weight decay of 0.05
on the kernels alone (not biases, norms, the class token or the position embeddings), 5 warmup
epochs then a cosine decay over 300 epochs, label smoothing 0.1, the gradient's norm clipped at 1
(big_vision's), random resized crops of 8-100% and flips, RandAugment 'rand-m9-mstd0.5-inc1'
(on the host's workers: data/randaugment.py), mixup (0.8) and CutMix (1.0), one of them on
every image (recipe.mix). Global batch 4096; bfloat16 compute, float32 parameters. Not here:
DeiT's random erasing and stochastic depth (write them in recipe.py's `augment` and vit.py):
without them expect less than DeiT-B's 81.8% top-1 (this recipe has not been run to the end
here).

  python train.py --config=configs/vit.py --config.data_dir=data/imagenet --workdir=runs/vit
  python aot.py --config=configs/vit.py --config.dataset=synthetic --topology=h100:8  # will it fit

At a small scale, in minutes on 8 CPU devices (ViT-Ti/4 on the digits, from scratch, as below
but at a batch of 128 and 2e-3, 3 warmup epochs of 30, without RandAugment, mixup and CutMix,
which need longer schedules):

  python train.py --config=configs/vit.py:small --workdir=runs/vit

Large models, one line each: --config.parallelism=fsdp (the parameters and AdamW's moments split
over the devices); --config.remat=block (or a jax.checkpoint_policies name); --config.mu_dtype=
bfloat16 (AdamW's first moment in half the bytes); --config.model.scan=True (the blocks under
nnx.scan: one compiled, less memory, more copies; unrolled here: BENCHMARKS.md). ViT-S/16 and
Ti/16: --config.model.name=vit_s or vit_ti.
"""

import ml_collections

from configs import default, imagenet


def get_config(scale: str = "imagenet"):
  """ViT-B/16 on ImageNet; `small`: ViT-Ti/4 on configs/default.py's data (the digits)."""
  if scale not in ("imagenet", "small"):
    raise ValueError(f"configs/vit.py:{scale}: use configs/vit.py (ImageNet) or :small")
  small = scale == "small"
  config = default.get_config() if small else imagenet.get_config()  # data, crops, intervals
  config.model = ml_collections.ConfigDict(dict(
      module="vit", name="vit_ti" if small else "vit_b", patch=4 if small else 16, depth=0,
      dropout=0.0, scan=False, dtype="float32" if small else "bfloat16", param_dtype="float32"))
  config.batch_norm_devices = 0  # (no BatchNorm)
  # Fits h100:8 (34.6 GiB a GPU); v5e chips (16 GiB): --config.remat=block --config.model.scan=True
  # (9.79 GiB; BENCHMARKS.md)
  config.remat = "none" if small else "dots_with_no_batch_dims_saveable"
  config.optimizer = "adamw"
  config.momentum = 0.9
  config.nesterov = False
  config.learning_rate = 5e-4
  config.lr_scaling = "linear"
  config.base_batch_size = 512
  config.weight_decay = 0.05  # (decoupled: on the kernels alone)
  config.warmup_epochs = 5.0
  config.schedule = "cosine"
  config.label_smoothing = 0.1
  config.grad_clip_norm = 1.0
  config.batch_size = 4096
  config.num_epochs = 300
  config.mixup_alpha, config.cutmix_alpha = 0.8, 1.0  # (mix_prob 1, mix_switch_prob 0.5)
  config.randaugment = "rand-m9-mstd0.5-inc1"  # (on the host's workers)
  if small:
    config.learning_rate, config.base_batch_size, config.warmup_epochs = 2e-3, 128, 3.0
    config.batch_size, config.num_epochs = 128, 30
    config.mixup_alpha = config.cutmix_alpha = 0.0
    config.randaugment = ""
  return config
