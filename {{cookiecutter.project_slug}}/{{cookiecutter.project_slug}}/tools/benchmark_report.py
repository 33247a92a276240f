"""The results of benchmark.py as tables: printed as text (`report`) and written as Markdown
(`markdown`, BENCHMARKS.md) headed by what a reader needs to weigh them: the machine (CPU model
and cores, JAX backend and devices), the Python, jax, flax and grain versions, the date, whether
it was a --tiny smoke run, and the command that regenerates them. It measures nothing.
"""

import datetime
import importlib.metadata
import os
import platform
import re


def shape(dims) -> str:
  return "x".join(map(str, dims))


def tables(results: dict) -> dict[str, tuple[list[str], list[list[str]]]]:
  """The train step's table (a row per model and path) and the loop's: headers and cells."""
  step = (["model", "shape", "batch", "path", "compile s", "first step s", "step ms",
           "examples/s", "peak host MB", "state MB/device", "step peak MB/device"], [])
  for name, model in results["models"].items():
    for path, r in model["paths"].items():
      step[1].append([name, shape(model["image_shape"]), str(model["batch_size"]), path,
                      f"{r['compile_s']:.2f}", f"{r['first_step_s']:.2f}", f"{r['step_ms']:.2f}",
                      f"{r['examples_per_sec']:.0f}", f"{r['peak_host_mb']:.0f}",
                      f"{r['state_mb_per_device']:.3f}", f"{r['step_peak_mb_per_device']:.3f}"])
  loop = (["loop", "shape", "batch", "model", "dtype", "k", "loop examples/s",
           "bare step examples/s", "host us/step", "paired ratios", "efficiency"], [])
  for key, r in results["loop"].items():
    loop[1].append([key, shape(r["image_shape"]), str(r["batch_size"]), r["model"],
                    r["dtype"], str(r["steps_per_dispatch"]), f"{r['loop_examples_per_sec']:.0f}",
                    f"{r['step_examples_per_sec']:.0f}", f"{r['host_us_per_step']:.0f}",
                    " ".join(f"{e:.2f}" for e in r["efficiencies"]), f"{r['efficiency']:.2f}"])
  return {"Train step": step, "Training loop": loop}


def notes(results: dict) -> list[str]:
  """The figures that are no table: ratios, the input pipeline, the default run."""
  lines = []
  for name, model in results["models"].items():
    lines.append(f"pmap/spmd step time: {model['pmap_over_spmd_step_time']:.2f} ({name})")
    lines.append(f"moving average: spmd step time x{model['ema_over_spmd_step_time']:.2f}, state "
                 f"{model['ema_state_mb_per_device']:.3f} MB/device against "
                 f"{model['paths']['spmd']['state_mb_per_device']:.3f} ({name})")
  pipeline, decoding, run = results["pipeline"], results["decoding"], results["default_run"]
  lines.append(f"input pipeline ({shape(pipeline['image_shape'])}, batch "
               f"{pipeline['batch_size']}): {pipeline['images_per_sec']:.0f} images/s")
  lines.append(f"image decoding (JPEG {shape(decoding['image_shape'][:2])}, "
               f"{decoding['workers']} workers): {decoding['images_per_sec']:.0f} images/s")
  if workers := results.get("workers"):
    lines.append(f"input with workers ({shape(workers['image_shape'])} uint8, batch "
                 f"{workers['batch_size']}, k={workers['steps_per_dispatch']}, "
                 f"{workers['workers']} worker processes, placed on the devices): "
                 f"{workers['images_per_sec']:.0f} images/s; the main process "
                 f"{workers['main_cpu_seconds_per_gb']:.3f} CPU-s per GB delivered: one core "
                 f"feeds {workers['main_process_ceiling_images_per_second']:,.0f} images/s "
                 f"(pickled, without /dev/shm: {workers['pickled_images_per_sec']:.0f} images/s, "
                 f"{workers['pickled_main_cpu_seconds_per_gb']:.3f} CPU-s per GB, "
                 f"{workers['pickled_main_process_ceiling_images_per_second']:,.0f} images/s)")
  if dispatch := results.get("dispatch"):
    lines.append(f"dispatch host cost, {dispatch['model']} state ({dispatch['arrays']} arrays): "
                 f"{dispatch['state_ms']:.2f} ms a call as an nnx.State, {dispatch['flat_ms']:.2f} "
                 f"ms as the loop's flat list; with the moving average ({dispatch['arrays_ema']} "
                 f"arrays): {dispatch['state_ema_ms']:.2f} ms, {dispatch['flat_ema_ms']:.2f} ms")
  lines.append(f"default run ({run['config']}, k={run['steps_per_dispatch']}, no compilation "
               f"cache): {run['wall_s']:.1f} s as a whole process, {run['startup_s']:.1f} s to "
               f"its first step (first calls: train {run['first_train_call_s']:.2f} s, eval "
               f"{run['first_eval_call_s']:.2f} s); accuracy {run['accuracy']:.4f}")
  if resnet := results["loop"].get("resnet:spmd"):
    mfu = f"MFU {resnet['mfu']:.3f}" if resnet["mfu"] else "MFU unknown (no peak for this chip)"
    lines.append(f"ResNet ({shape(resnet['image_shape'])}, batch {resnet['batch_size']}, "
                 f"{resnet['dtype']}, {resnet['device_count']} x {resnet['device_kind']}): "
                 f"{resnet['loop_examples_per_sec'] / resnet['device_count']:.0f} images/s a "
                 f"device in the loop, {mfu}; loop/bare step {resnet['efficiency']:.2f}")
  for key, loop in results["loop"].items():
    model, path = key.split(":")
    label = "" if model == "digits" else f" ({model})"
    label = label if path == results["config_parallelism"] else f" ({path})"
    lines.append(f"loop efficiency{label}: {loop['efficiency']:.2f}")
  return lines


def numeric(rows: list[list[str]]) -> list[bool]:
  """Which columns hold numbers (aligned right)."""
  return [bool(re.fullmatch(r"[\d. ]+", cell)) for cell in rows[0]]


def report(results: dict) -> str:
  """The tables as text, for the terminal."""
  lines = [f"jax {results['jax']}, flax {results['flax']}, {results['device_count']} "
           f"{results['backend']} devices ({results['device_kind']})" +
           (" (tiny)" if results["tiny"] else "")]
  for header, rows in tables(results).values():
    widths = [max(map(len, column)) for column in zip(header, *rows, strict=True)]
    lines += ["  ".join(cell.rjust(width) if right else cell.ljust(width) for cell, width, right
                        in zip(row, widths, numeric(rows), strict=True))
              for row in (header, *rows)]
  return "\n".join(lines + notes(results))


def machine() -> str:
  """The CPU's model and its cores."""
  try:
    with open("/proc/cpuinfo") as f:
      cpu = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.MULTILINE)[1]
  except (OSError, TypeError):  # not Linux
    cpu = platform.processor() or platform.machine()
  return f"{cpu}, {os.cpu_count()} cores"


def markdown_header() -> str:
  return ("# Benchmarks\n\nFigures for one machine, written by `benchmark.py`; what each measures "
          "and how: its docstring. Regenerate them with `python benchmark.py`.\n")


def markdown(results: dict) -> str:
  """The tables as Markdown, headed by the machine, the versions and the date."""
  tiny = results["tiny"]
  versions = ", ".join([f"Python {platform.python_version()}", f"jax {results['jax']}",
                        f"flax {results['flax']}", f"grain {importlib.metadata.version('grain')}"])
  lines = [markdown_header(),
           "| | |", "| --- | --- |", f"| machine | {machine()} |",
           f"| JAX backend | {results['backend']}: {results['device_count']} devices "
           f"({results['device_kind']}) |", f"| versions | {versions} |",
           f"| date (UTC) | {datetime.datetime.now(datetime.UTC):%Y-%m-%d} |",
           f"| --tiny | {'yes: a smoke run, its timings mean nothing' if tiny else 'no'} |",
           "| command | `python benchmark.py` |"]
  for title, (header, rows) in tables(results).items():
    lines += ["", f"## {title}", "", "| " + " | ".join(header) + " |",
              "|" + "".join(" ---: |" if right else " --- |" for right in numeric(rows)),
              *("| " + " | ".join(row) + " |" for row in rows)]
  return "\n".join(lines + ["", "## Ratios, input, default run", ""] +
                   [f"- {line}" for line in notes(results)]) + "\n"


RESNET_TITLE = "## ResNet-50 against PyTorch"


def resnet_section(c: dict) -> str:
  """`benchmark.py --resnet`'s figures as a Markdown section: images/s a GPU, MFU (the model's
  FLOPs, the same for both: ResNet-50 v1.5) and each over torch.compile's."""
  loop, torch = c["loop"], c["torch"]
  devices, modes = loop["device_count"], torch["modes"]
  compiled = modes["compile"]["images_per_sec"]
  mfu_per_image = loop["mfu"] / (loop["loop_examples_per_sec"] / devices) if loop["mfu"] else 0
  rows = [("this project: the whole loop (train.py)", loop["loop_examples_per_sec"] / devices),
          ("this project: its bare train step", loop["step_examples_per_sec"] / devices),
          ("timm under torch.compile", compiled), ("timm, eager", modes["eager"]["images_per_sec"])]
  date = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d}"
  pairs = " ".join(f"{e:.2f}" for e in loop["efficiencies"])
  lines = [RESNET_TITLE, "",
           f"GPU figures: {devices} x {torch['device']}, {date}, `python benchmark.py --resnet`. "
           f"ResNet-50 v1.5 training at batch {torch['batch_size']} a GPU, 224 x 224, bfloat16. "
           f"The project (jax {c['jax']}): configs/imagenet.py on synthetic images, k = "
           f"{loop['steps_per_dispatch']}, its whole loop (input, metrics, evaluation, "
           f"checkpoints) and its bare step, medians of {c['repeats']} pairs (loop/bare: {pairs})."
           f" timm {torch['timm']} under PyTorch {torch['torch']} (benchmark_torch.py): "
           "channels_last, bfloat16 autocast, SGD with Nesterov's momentum, one batch already on "
           "the GPU; the median of its timed windows.", "",
           "| | images/s | MFU | over torch.compile |", "| --- | ---: | ---: | ---: |"]
  lines += [f"| {name} | {rate:,.0f} | "
            f"{f'{mfu_per_image * rate:.3f}' if mfu_per_image else '?'} | {rate / compiled:.2f} |"
            for name, rate in rows]
  return "\n".join(lines) + "\n"


PHOTOS_TITLE = "## Photos stored whole: the input alone"
FORMS_TITLE = "## The train step's forms"  # (dispatch.STEP_FORMS: written by hand, from aot.py)
KNOWN_TITLE = "## Known problems"  # (written by hand: the stack's bugs that the project avoids)
OWN_SECTIONS = (RESNET_TITLE, PHOTOS_TITLE, FORMS_TITLE, KNOWN_TITLE)  # (written by their own
# commands, or by hand: kept by the others)


def photos_section(r: dict) -> str:
  """`benchmark.py --data_dir`'s figures as a Markdown section."""
  date = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d}"
  shape = "x".join(map(str, r["image_shape"]))
  both = "host_resize_images_per_second" in r  # (photos resized on the devices, and on the host)

  def row(name: str, key: str, form: str) -> str:
    values = [r[key], *([r[f"host_resize_{key}"]] if both else [])]
    return f"| {name} | " + " | ".join(format(value, form) for value in values) + " |"

  rows = [row("images/s", "images_per_second", ",.0f"),
          row("images per CPU-second (workers and main process)", "images_per_cpu_second", ",.0f"),
          *([row("images per worker CPU-second", "images_per_worker_cpu_second", ",.0f")]
            if "images_per_worker_cpu_second" in r else []),
          row("bytes an image sent to the devices", "bytes_per_image", ",.0f"),
          *([f"| bytes an image's crop holds (sent end to end, in lengths of a 256th) | "
             f"{r['crop_bytes_per_image']:,.0f} |" + (" |" if both else "")]
            if "crop_bytes_per_image" in r else []),
          row("main process, CPU-s per GB: the CPU backend (takes arrays in place)",
              "main_cpu_seconds_per_gb", ".3f"),
          row("main process, CPU-s per GB: with a GPU's staging copy",
              "main_cpu_seconds_per_gb_with_staging_copy", ".3f"),
          row("main process, CPU-ms an image: with a GPU's staging copy",
              "main_cpu_ms_per_image_with_staging_copy", ".3f"),
          row(f"cores a device at {r['target_images_per_second']:,.0f} images/s",
              "cores_per_accelerator", ".1f"),
          row("peak memory of the process tree, MiB", "peak_memory_mib", ",.0f"),
          *([f"| a plain PIL loop (open, decode, resize), images per CPU-second | "
             f"{r['pil_loop_images_per_cpu_second']:,.0f} |" + (" |" if both else "")]
            if "pil_loop_images_per_cpu_second" in r else [])]
  header = (["| | crops resized on the devices | resized on the host |", "| --- | ---: | ---: |"]
            if both else ["| | |", "| --- | ---: |"])
  canvas = (", each crop sent as its own pixels, end to end (the largest "
            f"{'x'.join(map(str, r['canvas']))})") if both else ""
  lines = [PHOTOS_TITLE, "",
           f"`python benchmark.py --data_dir=DIR` ({machine()}, {date}): the training batches of "
           f"DIR ({r['dataset']}, {shape}, crops on the host: {r['crops_on_host']}{canvas}), "
           f"decoded by {r['decoder']} in {r['workers']} worker process(es) and placed on the "
           f"devices, without a step: {r['batches']} batches of {r['images'] // r['batches']} "
           f"({r['seconds']:.0f} s)" + (" each way, in one run" if both else "")
           + ". Cores a device: at the rate given (`--images_per_second`), if a GPU host's cores "
           "were this machine's (a guess).", "",
           *header, *rows]
  return "\n".join(lines) + "\n"


def section(text: str, title: str = RESNET_TITLE) -> str | None:
  """The `title` section of a Markdown text (up to the next heading of its level), or None."""
  start = text.find(title)
  if start < 0:
    return None
  end = text.find("\n## ", start + 1)
  return text[start:] if end < 0 else text[start:end + 1]


def with_section(text: str, new: str) -> str:
  """`text` with the section that `new` heads (its first line) replaced by `new`, or `new`
  appended."""
  old = section(text, new.split("\n", 1)[0])
  if old is None:
    return text.rstrip("\n") + "\n\n" + new
  return text.replace(old, new.rstrip("\n") + "\n" + ("\n" if not text.endswith(old) else ""))
