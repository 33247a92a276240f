"""Fine-tuning pretrained weights on your photos (a few hundred a class), as timm's `train.py
--pretrained` would: model.py's ResNet-50 from timm's or torchvision's ImageNet weights (or vit.py's
ViT-B/16: configs/finetune.py:vit), a new head for your classes, the input normalised as the
weights were trained (their config.json, else ImageNet's mean and std: logged).

  .venv/bin/python write_arrayrecord.py --out_dir=data/photos --image_folder=photos \
      --image_size=224,224
  .venv/bin/python train.py --config=configs/finetune.py --config.data_dir=data/photos \
      --config.init_from=hf-hub:timm/resnet50.a1_in1k --workdir=runs/photos

config.init_from: a .safetensors or .pth file in timm's or torchvision's names, or hf-hub:ORG/NAME
(training/pretrained.py). The recipe: AdamW at a low peak (3e-4) after a short warmup (1 epoch),
a cosine decay over 20 epochs, the new head at 10x the rate (`head_lr_multiplier`), a weight decay
of 0.05 on the kernels, label smoothing 0.1, the gradient's norm clipped at 1, milder crops than
training from scratch (25-100% of the area) and flips. ViTs add BEiT's layer-wise decay
(`layer_decay` 0.65: block i of 12 at 0.65^(12 - i) of the rate). A frozen backbone (the head alone
trained, a linear probe): --config.freeze_backbone=True; BatchNorm kept on the weights' statistics
(small batches): --config.freeze_batch_norm=True.
"""

from configs import default


def get_config(model: str = "resnet50"):
  """The recipe for model.py's `resnet50` (the default) or vit.py's ViT-B/16 (`vit`)."""
  config = default.get_config()
  config.dataset = "arrayrecord"
  config.augment_max_shift = 0
  config.augment_flip = True
  config.augment_crop = True
  config.augment_crop_scale = (0.25, 1.0)
  if model == "vit":
    config.model.update(module="vit", name="vit_b", patch=16, scan=False)
    config.layer_decay = 0.65
  else:
    config.model.update(name="resnet50")
  config.optimizer = "adamw"
  config.learning_rate = 3e-4
  config.head_lr_multiplier = 10.0
  config.weight_decay = 0.05
  config.warmup_epochs = 1.0
  config.schedule = "cosine"
  config.label_smoothing = 0.1
  config.grad_clip_norm = 1.0
  config.batch_size = 32
  config.num_epochs = 20
  config.log_every_steps = 10
  config.eval_every_steps = 40
  config.checkpoint_every_steps = 40
  return config
