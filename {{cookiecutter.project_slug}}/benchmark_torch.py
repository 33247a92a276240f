"""The PyTorch reference for benchmark.py's ResNet row: timm's ResNet-50 trained on one GPU in
eager PyTorch and under torch.compile, as configs/imagenet.py trains the project's (SGD with
Nesterov's momentum 0.9, weight decay 1e-4, label smoothing 0.1), channels_last, bfloat16
autocast, on a fixed random batch already on the GPU (no input pipeline: the project's figure
includes its loop's; this one does not). Not a dependency of the project: it needs torch and
timm, which the project never imports.

  python benchmark_torch.py [--batch_size=256] [--steps=100] [--modes=eager,compile] [--out=F]

Prints one JSON line: each mode's images/s (the median of `--windows` timed windows of
`--steps` steps, each window waited for), its compile/warm-up seconds, and the versions.
`python benchmark.py --resnet` runs it beside the project's loop and writes the comparison.
"""

import argparse
import json
import statistics
import time

import timm
import torch


def train_step(model, optimizer, loss_fn):
  """A training step in bfloat16 autocast: (images, labels) -> the loss.

  Args:
    model: the model (eager or compiled).
    optimizer: its optimizer.
    loss_fn: (logits, labels) -> the loss.
  """

  def step(images, labels):
    with torch.autocast("cuda", dtype=torch.bfloat16):
      loss = loss_fn(model(images), labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss
  return step


def measure(mode: str, batch_size: int, steps: int, windows: int, warmup: int) -> dict:
  """timm's ResNet-50's training images/s on one GPU (channels last, bfloat16 autocast).

  Args:
    mode: "eager", or "compile" (torch.compile).
    batch_size: a step's images.
    steps: the steps of a timed window.
    windows: the windows timed.
    warmup: the steps before them (compiling, settling the allocator).
  Returns:
    The windows' median images/s, each window's, the warmup's seconds and the peak memory.
  """
  torch.manual_seed(0)
  model = timm.create_model("resnet50", num_classes=1000).cuda().to(
      memory_format=torch.channels_last)
  model.train()
  optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                              weight_decay=1e-4)
  loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
  forward = torch.compile(model) if mode == "compile" else model
  step = train_step(forward, optimizer, loss_fn)
  images = torch.randn(batch_size, 3, 224, 224, device="cuda").to(
      memory_format=torch.channels_last)
  labels = torch.randint(0, 1000, (batch_size,), device="cuda")
  start = time.perf_counter()
  for _ in range(warmup):  # compiles (torch.compile) and settles the allocator
    step(images, labels)
  torch.cuda.synchronize()
  warmup_s = time.perf_counter() - start
  rates = []
  for _ in range(windows):
    start = time.perf_counter()
    for _ in range(steps):
      loss = step(images, labels)
    loss.item()  # waits for the window's last step
    rates.append(steps * batch_size / (time.perf_counter() - start))
  return dict(images_per_sec=statistics.median(rates), window_rates=rates, warmup_s=warmup_s,
              peak_memory_gb=torch.cuda.max_memory_allocated() / 2**30)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batch_size", type=int, default=256)
  parser.add_argument("--steps", type=int, default=50, help="steps a timed window")
  parser.add_argument("--windows", type=int, default=5)
  parser.add_argument("--warmup", type=int, default=15)
  parser.add_argument("--modes", default="eager,compile")
  parser.add_argument("--out", default="")
  args = parser.parse_args()
  if not torch.cuda.is_available():
    raise SystemExit("benchmark_torch.py times a GPU: torch.cuda.is_available() is False here.")
  torch.backends.cudnn.benchmark = True
  result = dict(batch_size=args.batch_size, device=torch.cuda.get_device_name(),
                torch=torch.__version__, timm=timm.__version__, modes={})
  for mode in args.modes.split(","):
    result["modes"][mode] = measure(mode, args.batch_size, args.steps, args.windows, args.warmup)
    torch.cuda.reset_peak_memory_stats()
  print(json.dumps(result))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
