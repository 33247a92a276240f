"""ViT-B/16 on ImageNet at 224 (vit.py): DeiT's recipe (Touvron et al. 2021), as big_vision and
timm train it from scratch: AdamW (b1 0.9, b2 0.999) at 5e-4 x batch / 512, a weight decay of 0.05
on the kernels alone (not biases, norms, the class token or the position embeddings), 5 warmup
epochs then a cosine decay over 300 epochs, label smoothing 0.1, the gradient's norm clipped at 1
(big_vision's), random resized crops of 8-100% and flips. Global batch 4096; bfloat16 compute,
float32 parameters. Not here: DeiT's RandAugment, random erasing, stochastic depth and
mixup/cutmix (write them in recipe.py's `augment` and `loss`): without them expect less than
DeiT-B's 81.8% top-1 (this recipe has not been run to the end here).

  python train.py --config=configs/vit.py --config.data_dir=data/imagenet --workdir=runs/vit
  python aot.py --config=configs/vit.py --config.dataset=synthetic --topology=h100:8  # will it fit

Large models, one line each: --config.parallelism=fsdp (the parameters and AdamW's moments split
over the devices); --config.remat=block (or a jax.checkpoint_policies name); --config.mu_dtype=
bfloat16 (AdamW's first moment in half the bytes); --config.model.scan=True (the blocks under
nnx.scan: one compiled, less memory, more copies; unrolled here: BENCHMARKS.md). ViT-S/16 and
Ti/16: --config.model.name=vit_s or vit_ti.
"""

import ml_collections

from configs import imagenet


def get_config():
  config = imagenet.get_config()  # ImageNet's data, crops and intervals
  config.model = ml_collections.ConfigDict(dict(
      module="vit", name="vit_b", patch=16, depth=0, dropout=0.0, scan=False, dtype="bfloat16",
      param_dtype="float32"))
  config.batch_norm_devices = 0  # (no BatchNorm)
  # Fits h100:8 (34.6 GiB a GPU); v5e chips (16 GiB): --config.remat=block --config.model.scan=True
  # (9.79 GiB; BENCHMARKS.md)
  config.remat = "dots_with_no_batch_dims_saveable"
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
  return config
