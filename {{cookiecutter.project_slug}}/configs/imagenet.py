"""ResNet-50 on ImageNet: Goyal et al. 2017 ("Accurate, Large Minibatch SGD"), with a cosine
decay, Nesterov's momentum and label smoothing (Flax's examples/imagenet, timm's baselines).

  python write_arrayrecord.py --image_folder=imagenet --out_dir=data/imagenet \
      --resize_shorter=256 --image_size=224  # imagenet/{train,val}/CLASS/*.JPEG
  python train.py --config=configs/imagenet.py --config.data_dir=data/imagenet \
      --workdir=runs/resnet50

Or a copy of it on the Hugging Face Hub or on disk: --config.dataset=huggingface
--config.huggingface.name=ILSVRC/imagenet-1k (or --config.data_dir=a save_to_disk folder), or
TFDS's: --config.dataset=tfds --config.tfds_name=imagenet2012 --config.data_dir=DIR.
--config.dataset=synthetic gives random pixels of ImageNet's shapes: aot.py and benchmark.py
need nothing else (python aot.py --config=configs/imagenet.py --config.dataset=synthetic
--topology=v5e:2x4). The global batch is 1024 (128 a device on 8); the peak learning rate
0.1 x batch / 256 follows it.
"""

from configs import default


def get_config():
  config = default.get_config()
  config.dataset = "arrayrecord"
  config.data_dir = ""  # (where write_arrayrecord.py wrote it)
  config.synthetic.update(image_shape=(224, 224, 3), num_classes=1000, num_train=10240,
                          num_eval=1024)
  config.image_size = (224, 224, 3)  # huggingface: decoded to this
  config.augment_max_shift = 0
  config.augment_flip = True
  config.augment_crop = True  # of 8-100% of the area, aspect 3/4-4/3 (the defaults)
  config.eval_crop_ratio = 0.875  # 224 of 256 (photos stored whole: --resize_shorter)

  config.model.update(name="resnet50", dtype="bfloat16", param_dtype="float32")
  config.optimizer = "sgd"
  config.momentum = 0.9
  config.nesterov = True
  config.learning_rate = 0.1
  config.lr_scaling = "linear"
  config.base_batch_size = 256
  config.warmup_epochs = 5.0
  config.schedule = "cosine"
  config.weight_decay = 1e-4  # L2, on the weights only: not BatchNorm's nor the biases
  config.label_smoothing = 0.1
  config.batch_size = 1024
  # Each device's own statistics (128 examples on 8): Goyal et al.'s per-worker BatchNorm, and
  # no all-reduce on the critical path of each BatchNorm layer (README: ResNet-50 and ViT-B/16
  # on ImageNet).
  config.batch_norm_devices = 1
  config.num_epochs = 90

  config.log_every_steps = 100
  config.eval_every_steps = 2500
  config.checkpoint_every_steps = 2500
  return config
