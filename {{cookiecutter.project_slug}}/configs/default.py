"""Default hyperparameters: the CNN on the UCI digits, data-parallel over every device."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # Data: 'digits' (ships with scikit-learn), 'arrayrecord' (files in data_dir, written by
  # write_arrayrecord.py), 'huggingface' (huggingface.py: a save_to_disk or Parquet folder in
  # data_dir, or a Hub name), 'tfds' (tfds_data.py: a TFDS data dir in data_dir) or
  # 'synthetic' (random images, for benchmarks).
  config.dataset = "digits"
  config.data_dir = ""
  # huggingface: columns and the eval split found from the data unless named here.
  config.huggingface = ml_collections.ConfigDict(
      dict(name="", image_column="", label_column="", eval_split=""))
  config.tfds_name = ""  # tfds (tfds_data.py): the dataset's name, e.g. 'imagenet2012'
  config.image_size = ()  # huggingface, tfds: (height, width, channels); (): the first image's
  config.eval_fraction = 0.2  # digits: the held-out split
  config.synthetic = ml_collections.ConfigDict(
      dict(image_shape=(32, 32, 3), num_classes=10, num_train=8192, num_eval=1024))
  config.augment_max_shift = 1  # random shifts of up to this many pixels; 0 turns them off
  # Photo augmentation (README: Scaling to more devices), off for the digits; evaluation never
  # augments. A random horizontal flip, and a random crop of a fraction of the image's area in
  # `augment_crop_scale` and of aspect (width / height) in `augment_crop_ratio`, resized back.
  config.augment_flip = False
  config.augment_crop = False
  config.augment_crop_scale = (0.08, 1.0)  # Inception's (and timm's) defaults
  config.augment_crop_ratio = (3 / 4, 4 / 3)
  # Mixup and CutMix (recipe.mix: timm's, pairs of real examples; DeiT's: 0.8, 1.0, 1.0, 0.5):
  # mixup's and CutMix's Beta(alpha, alpha) (0: off), the chance an image is mixed, and that it
  # is CutMix's where both are on.
  config.mixup_alpha = 0.0
  config.cutmix_alpha = 0.0
  config.mix_prob = 1.0
  config.mix_switch_prob = 0.5
  # RandAugment on the host's workers (data/randaugment.py: PIL's operations, as timm's), as a
  # timm string: '' (off) or e.g. 'rand-m9-mstd0.5-inc1' (DeiT's: 2 operations of magnitude 9
  # of 10, its noise 0.5, the increasing ones). With it the host resizes photos' crops.
  config.randaugment = ""
  # Photos stored whole (write_arrayrecord.py --resize_shorter) are cropped on the host, as
  # they are decoded: training's crop (above; without augment_crop, evaluation's) from the whole
  # photo; evaluation scales them to cover the image size / this, keeps the centre (256 -> 224).
  config.eval_crop_ratio = 0.875
  # The host cuts each crop out and the devices resize it, in the step (as PIL's bilinear resize
  # would, within one level of 255); False: the host resizes too, sending fewer bytes.
  config.resize_on_device = True
  # Grain worker processes: -1 chooses from the host's cores (none for data held in memory,
  # whose batches are one NumPy gather); 0 reads in the main process.
  config.num_workers = -1
  config.read_threads = 2  # Grain threads per process (or per worker)
  config.prefetch_batches = 2  # units (a device's share of k batches) a worker reads ahead
  config.prefetch_to_device = 2  # elements placed on the devices ahead of the step; 0: none

  # Model and optimisation. module: the module whose create_model builds the model (model.py:
  # yours; its create_model reads the keys below, and any you add).
  # name: model.py's 'cnn' (of one convolution per entry of `features`), 'resnet18' or
  # 'resnet50' (of `width` channels in its first stage). dtype: the computation's; param_dtype:
  # the parameters' (bfloat16 compute with float32 parameters: mixed precision). dropout: the
  # cnn's Dropout rate before its classifier (0: none). module='vit' (vit.py, configs/vit.py):
  # name 'vit_ti', 'vit_s' or 'vit_b', of `patch` x `patch` patches, `depth` blocks (0: the
  # name's), run under nnx.scan (`scan`) or unrolled, `dropout` after its blocks' layers.
  config.model = ml_collections.ConfigDict(
      dict(module="model", name="cnn", features=(32, 64), width=64, dtype="float32",
           param_dtype="float32", dropout=0.0, patch=16, depth=0, scan=True))
  # Activations recomputed in the backward pass, for models too large for the memory (vit.py's
  # blocks; a model of yours: nnx.remat, as vit.py uses it): 'none', 'block' (each block keeps
  # its input alone) or a jax.checkpoint_policies name, e.g. 'dots_with_no_batch_dims_saveable'.
  config.remat = "none"
  # The recipe (recipe.py: the loss, augmentation, metrics, optimizer and schedule): its module.
  # The keys below are its options; a key you add is read there as config.KEY.
  config.recipe = "recipe"
  config.optimizer = "adam"  # 'adam', 'adamw' or 'sgd' (recipe.optimizer)
  config.learning_rate = 3e-3  # peak at `base_batch_size` (scaled by `lr_scaling`)
  # The global batch over the base one scales the peak: 'none', 'linear' (Goyal et al. 2017,
  # "Accurate, Large Minibatch SGD") or 'sqrt'.
  config.lr_scaling = "none"
  config.base_batch_size = 128  # the global batch at which `learning_rate` is the peak
  config.warmup_steps = 0  # linear rise from 0 to the peak over this many steps
  config.warmup_epochs = 0.0  # or over this many epochs' steps (when warmup_steps is 0)
  config.schedule = "cosine"  # after the warmup, to the end: 'cosine' or 'linear' to 0, 'constant'
  config.momentum = 0.9  # sgd's momentum (0: none); adam's and adamw's b1
  config.nesterov = False  # Nesterov's momentum (sgd); NAdam (adam, adamw)
  # The optimizer's first moment (adam's and adamw's mu, sgd's momentum): '' in the parameters'
  # dtype; 'bfloat16' halves it (the second moment stays float32: recipe.optimizer).
  config.mu_dtype = ""
  # On the weights (the arrays named `kernel`) only. adamw: decoupled, lr x this x w taken
  # off w each step (optax multiplies it by the learning rate; 0.05-0.1 is usual); adam, sgd:
  # L2, this x w added to the gradient (PyTorch's weight_decay).
  config.weight_decay = 0.0
  config.grad_clip_norm = 0.0  # clip the gradient's global norm to this; 0: no clipping
  # Each class's weight in the training loss, a weighted mean over the real examples: '' (none),
  # 'balanced' (N / (K x its examples), of the training split's class counts) or one a class,
  # comma-separated ('1,1,4': the third class's losses count 4 times).
  config.class_weights = ""
  config.label_smoothing = 0.0  # the targets: 1 - this on the label, this / classes on all
  # Fine-tuning (configs/finetune.py; recipe.learning_rate_factors): the head's learning rate
  # times this; every other parameter frozen (the head alone trained); BEiT's layer-wise decay d
  # of ViTs' rates (block i of L: d^(L - i); 0: none); BatchNorm kept on its running statistics.
  config.head_lr_multiplier = 1.0
  config.freeze_backbone = False
  config.layer_decay = 0.0
  config.freeze_batch_norm = False
  config.ema_decay = 0.0  # evaluate an exponential moving average of the parameters; 0: off
  # The average's decay at update n: min(ema_decay, (1 + n) / (10 + n)), so that a short run's
  # average is not its initialisation; False: ema_decay from the start. Kept in float32.
  config.ema_warmup = True
  config.batch_size = 128  # global: over all devices and processes, per optimizer step
  config.per_device_batch_size = 0  # > 0: the global batch is this x the devices (not batch_size)
  config.grad_accum_steps = 1  # split each batch into this many sequential micro-batches
  # BatchNorm's batch statistics in training (layers.BatchNorm): those of the real examples of
  # each group of this many devices (1: a device's own share, as PyTorch without SyncBatchNorm;
  # 0: the global batch, whatever the devices). README: ResNet-50 and ViT-B/16 on ImageNet.
  config.batch_norm_devices = 0
  # Optimizer steps per compiled call (lax.scan over as many stacked batches): the host's
  # per-call work is paid once per k steps. The log, eval and checkpoint intervals must be
  # multiples of it. 0: chosen per backend, 10 on a GPU or TPU (or the largest number below 10
  # that divides those intervals), 1 on the CPU (README: Speed).
  config.steps_per_dispatch = 0
  config.num_epochs = 50
  config.seed = 0
  # Fine-tuning: the model's parameters and batch statistics from the latest checkpoint of this
  # other run's workdir (leaves of another shape, and the optimizer, start afresh); or from
  # pretrained weights in timm's or torchvision's names (model.py's ResNets, vit.py's ViTs): a
  # .safetensors or .pth file, or hf-hub:ORG/NAME (training/pretrained.py); '': none.
  config.init_from = ""
  # The input normalised, (pixels in [0, 1] - mean) / std by channel, in training, evaluation,
  # predict.py and export.py: () takes pretrained weights' (config.init_from: their config.json,
  # else ImageNet's), else none.
  config.input_mean = ()
  config.input_std = ()

  # Parallelism: 'spmd' (jax.jit over a device mesh), 'pmap' (the legacy jax.pmap) or 'fsdp'
  # (spmd with the model and optimizer state split over the devices: for models larger than
  # one device's memory).
  config.parallelism = "{{ cookiecutter.parallelism }}"
  config.fsdp_devices = 0  # fsdp: split the state over groups of this many devices; 0: all
  # fsdp: leaves with fewer elements stay replicated (biases, scales, counters): gathering them
  # would cost more time than the memory it saves. 16384 float32 elements: 64 KiB.
  config.fsdp_min_size = 16384
  config.print_shardings = False  # log where the state and the first batch live, at start-up
  # XLA compiler options for the jit-compiled steps (spmd, fsdp), as 'name=value,...', e.g.
  # 'xla_gpu_enable_latency_hiding_scheduler=false' (README: Will it fit?); '': none.
  config.xla_options = ""

  # JAX's persistent compilation cache (train.py): a program compiled once is loaded by later
  # runs, a resumed one too, instead of compiled again; '' turns it off (as does JAX itself by
  # default). Programs that compiled faster than `compilation_cache_min_seconds` are not kept.
  # The cache is trusted code: never a directory that others can write.
  config.compilation_cache_dir = "~/.cache/jax_compilation_cache"
  config.compilation_cache_min_seconds = 0.5
  # The watchdog (training/stopping.py): no wait lasts forever. Set-up, compiles and the first
  # call (which waits for every process's compile) may take `watchdog_compile_s`; a later call, an
  # evaluation or a save `watchdog_factor` times the slowest of its kind so far, at least
  # `watchdog_floor_s`. Past its bound the run ends in one
  # line, exit 75, which clusters/slurm.sbatch requeues; the same command resumes. 0: no bound.
  config.watchdog_compile_s = 1800
  config.watchdog_floor_s = 300
  config.watchdog_factor = 20.0

  # Performance reports. MFU needs the peak FLOP/s of one device: looked up from the device
  # kind (bf16, dense) when 0.
  config.peak_flops_per_device = 0.0
  config.profile_first_step = 0  # > 0: write a jax.profiler trace into the workdir from here
  config.profile_num_steps = 5
  # Weights & Biases beside TensorBoard (the wandb extra): the project's name; '' turns it off.
  # WANDB_MODE, WANDB_DIR (default: the workdir), WANDB_ENTITY, ... are W&B's own.
  config.wandb_project = ""

  # Intervals, in steps. Training also logs, evaluates and checkpoints at its last step.
  config.log_every_steps = 50
  config.eval_every_steps = 200
  config.checkpoint_every_steps = 200
  config.max_checkpoints_to_keep = 3
  # Also keep every checkpoint of a step that is a multiple of this (a multiple of
  # checkpoint_every_steps), however many newer ones follow; 0: none. A resume keeps the run's.
  config.keep_checkpoint_every_steps = 0
  # The best checkpoint by an evaluation metric ('eval_accuracy', `best_mode` 'max'; 'eval_loss'
  # and 'min'), saved at each evaluation that improves it and kept beside the newest ('': none);
  # evaluate.py, predict.py and export.py take it with --step=best. early_stopping_evals: the run
  # ends after this many evaluations without improving it (0: never), said in a line.
  config.best_metric = ""
  config.best_mode = "max"
  config.early_stopping_evals = 0
  config.skip_nonfinite_steps = False  # True: skip a step whose loss is not finite; False: stop
  # A resumed run keeps its own config (the workdir's config.json) but for how it runs (plan.py's
  # FREE_ON_RESUME); the keys named here (comma-separated, e.g. 'learning_rate,num_epochs') may
  # change too, each change logged.
  config.resume_may_change = ""
  # On the CPU backend, wait for a result this often: XLA:CPU collectives abort when hundreds
  # of steps are queued. Other backends never wait inside the loop.
  config.cpu_sync_every_steps = 8
  return config
