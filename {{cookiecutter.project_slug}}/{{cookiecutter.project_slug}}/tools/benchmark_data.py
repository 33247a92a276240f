"""The input side of benchmark.py: how fast the host feeds the devices. The Grain iterator alone
on synthetic images as the loop reads it (placed on the devices); the same over JPEG files kept
encoded and decoded by Grain's worker processes; 224x224x3 arrays read by worker processes and
placed on the devices, for the main process's CPU-seconds per GB delivered (how many images one
core of it can feed); and, for `benchmark.py --data_dir`, the training batches of your own data
as train.py reads and places them (the config's decoding, crops and workers), in images per
second and per CPU-second of this process and its workers, beside a plain PIL loop (open,
decode, resize) over the same images: how many cores one accelerator needs.
"""

import functools
import glob
import io
import json
import os
import resource
import tempfile
import threading
import time

import jax
import numpy as np
from flax import serialization
from PIL import Image

import write_arrayrecord

from .. import plan, rules
from ..data import arrayrecord, batches, image_files, input_pipeline, sources
from ..parallel import sharding

PIPELINE = dict(image_shape=(64, 64, 3), batch_size=1024)
DECODING = dict(image_shape=(64, 64, 3), batch_size=256, num_images=2048)
WORKERS = dict(image_shape=(224, 224, 3), batch_size=256, steps_per_dispatch=4, num_images=512)


def measure_pipeline(config, is_tiny: bool, seconds: float = 3.0) -> dict:
  """Images/s of the Grain iterator alone over synthetic images, resized to PIPELINE, placing
  each element on the devices (spmd).

  Args:
    config: the run's config (its workers).
    is_tiny: --tiny's smaller sizes.
    seconds: the time measured.
  """
  config = config.copy_and_resolve_references()
  config.dataset = "synthetic"
  config.synthetic.image_shape = PIPELINE["image_shape"]
  config.batch_size = PIPELINE["batch_size"]
  config.synthetic.num_train = 8 * config.batch_size
  config.num_epochs = 1000  # never runs out
  splits, _ = sources.get_datasets(config)
  put = functools.partial(sharding.global_batch, mesh=sharding.make_mesh())
  iterator = input_pipeline.as_iterator(
      batches.train_batches(splits["train"], plan.resolved(config)), config, put=put)
  jax.block_until_ready(next(iterator))  # threads started, first element read
  start, images = time.perf_counter(), 0
  while time.perf_counter() - start < (0.3 if is_tiny else seconds):
    element = next(iterator)
    images += element["mask"].size
  jax.block_until_ready(element)
  return dict(images_per_sec=images / (time.perf_counter() - start),
              steps_per_dispatch=config.steps_per_dispatch, **PIPELINE)


def write_jpeg_folder(folder: str, num_images: int, size: int, num_classes: int = 4):
  """Writes smooth random RGB JPEGs (a photo's usual content), one subfolder per class.

  Args:
    folder: where.
    num_images: how many.
    size: their side.
    num_classes: the subfolders.
  """
  rng = np.random.default_rng(0)
  for i in range(num_images):
    os.makedirs(directory := os.path.join(folder, f"class{i % num_classes}"), exist_ok=True)
    coarse = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    coarse.resize((size, size), Image.Resampling.BICUBIC).save(f"{directory}/{i:05d}.jpg")


def measure_decoding(config, is_tiny: bool, seconds: float = 3.0) -> dict:
  """Images/s of the Grain iterator over JPEG files kept encoded (`write_arrayrecord.py
  --keep_encoded`), decoded by the worker processes.

  Args:
    config: the run's config (its workers).
    is_tiny: --tiny's smaller sizes.
    seconds: the time measured.
  """
  config = config.copy_and_resolve_references()
  config.dataset, config.batch_size = "arrayrecord", DECODING["batch_size"]
  config.num_epochs = 1000  # never runs out
  num_images = DECODING["num_images"] // (8 if is_tiny else 1)
  with tempfile.TemporaryDirectory() as root:
    write_jpeg_folder(f"{root}/jpeg", num_images, DECODING["image_shape"][0])
    write_arrayrecord.write_image_folder(f"{root}/data", f"{root}/jpeg", keep_encoded=True)
    config.data_dir = f"{root}/data"
    splits, _ = sources.get_datasets(config)
    iterator = input_pipeline.as_iterator(
        batches.train_batches(splits["train"], plan.resolved(config)), config)
    next(iterator)  # workers started, first element read
    start, images = time.perf_counter(), 0
    while time.perf_counter() - start < (0.3 if is_tiny else seconds):
      images += next(iterator)["mask"].size
    images_per_sec = images / (time.perf_counter() - start)
    iterator.close()
  return dict(DECODING, images_per_sec=images_per_sec, num_images=num_images,
              workers=batches.default_workers(config))


class PeakMemory(threading.Thread):
  """The highest resident memory of the process tree (`process_tree`: the input's workers
  are processes of their own) while it runs, sampled every `interval` seconds; `cpu`: the CPU
  time it has taken itself (reading /proc), left out of the input's figures."""

  def __init__(self, interval: float = 0.2):
    super().__init__(daemon=True)
    self.interval, self.peak, self.stopped, self.cpu = interval, 0, threading.Event(), 0.0

  def run(self):
    page = os.sysconf("SC_PAGE_SIZE")
    while not self.stopped.wait(self.interval):
      self.peak = max(self.peak, page * sum(int(f[21]) for f in process_tree().values()))
      self.cpu = time.thread_time()

  def stop(self) -> int:
    self.stopped.set()
    self.join()
    return self.peak


def placer(config):
  """What train.py does with an element's shares: place them on the devices."""
  if config.parallelism == "pmap":
    from ..parallel import pmap

    return pmap.pmap_batch
  return functools.partial(sharding.global_batch, mesh=sharding.make_mesh(config))


class Staged:
  """`put`, each share first copied (np.copyto) into one of a few buffers kept for its shape, while
  `on`: the copy a GPU's runtime makes of pageable host memory into pinned staging memory before
  its transfer, made here in the main process (the CPU backend takes an aligned array in place,
  so without this the main process's cost per GB is the CPU's, not a GPU host's)."""

  def __init__(self, put, depth: int = 8):
    self.put, self.depth, self.on, self.buffers = put, depth, False, {}
    # Sent so far (`batches.sent`: packed crops, the bytes they fill, rounded), the bytes the
    # crops themselves hold, and the batch rows they held.
    self.bytes = self.crop_bytes = self.slots = 0

  def __call__(self, shares, *args, **kwargs):
    """`put(shares, *args, **kwargs)`, the bytes counted and, while `on`, copied first."""
    shares = [shares] if isinstance(shares, dict) else shares
    self.crop_bytes += sum(int(share["filled"].sum()) for share in shares if "filled" in share)
    shares = batches.sent(shares)
    self.bytes += sum(x.nbytes for x in jax.tree.leaves(shares) if isinstance(x, np.ndarray))
    self.slots += sum(share["mask"].size for share in shares)
    if self.on:
      shares = [{key: self.copy(value, share.get("packed") if key == "image" else None)
                 for key, value in share.items()} for share in shares]
    return self.put(shares, *args, **kwargs)

  def copy(self, x, room: int | None = None):
    if not isinstance(x, np.ndarray) or not x.ndim:
      return x
    # As many as may be in flight (a batch's shares, prefetched), made and touched once (a
    # runtime's staging buffers are allocated once and reused); packed crops' of their room
    # (`room`: their lengths vary).
    if (key := (x.shape[:-1], x.dtype.str)) not in self.buffers:
      self.buffers[key] = [np.full((*x.shape[:-1], room or x.shape[-1]), 0, x.dtype)
                           for _ in range(self.depth)]
    ring = self.buffers[key]
    ring.append(ring.pop(0))
    staged = ring[-1].reshape(-1)[:x.size].reshape(x.shape)  # (x's strides: taken in place)
    np.copyto(staged, x)
    return staged


def deliver(iterator, elements: int, sampler: PeakMemory | None = None,
            put: "Staged | None" = None) -> dict:
  """`elements` elements from `iterator` (placed on the devices, each waited for), after a first
  one: the images and bytes delivered (those `put` sent, where given: packed crops, the bytes
  they fill; else the placed arrays'), the wall time, and the CPU time of the main process (its
  threads: receiving, placing) and of its process tree (its workers too), `sampler`'s own and
  the CPU devices' (`devices_cpu_seconds`) left out. A count, not a window of time: a large
  batch's figures hold as a small one's.

  Args:
    iterator: the input's iterator, placing each element.
    elements: how many are measured, after a first one.
    sampler: samples the process tree's memory; None: not sampled.
    put: the placing function, whose sent bytes are counted; None: the placed arrays' bytes.
  """
  jax.block_until_ready(next(iterator))  # workers started, first element read
  start, main, tree = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF), cpu_seconds()
  sampled = sampler.cpu if sampler else 0.0
  on_devices = devices_cpu_seconds()
  images = slots = nbytes = 0
  for _ in range(elements):
    element = jax.block_until_ready(next(iterator))
    mask = np.asarray(element["mask"])  # (a transfer of a few bytes)
    images, slots = images + int(mask.sum()), slots + mask.size
    nbytes += sum(x.nbytes for x in element.values())
  crops = {}
  if put is not None:  # (a row's bytes as `put` has sent them so far: placed ahead, they vary)
    nbytes = slots * put.bytes / put.slots
    if put.crop_bytes:
      crops["crop_bytes_per_image"] = put.crop_bytes / put.slots
  wall, ended = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
  sampled = (sampler.cpu if sampler else 0.0) - sampled
  on_devices = devices_cpu_seconds() - on_devices  # (a GPU's work: left out of both)
  main_cpu = ended.ru_utime + ended.ru_stime - main.ru_utime - main.ru_stime - sampled - on_devices
  return dict(images=images, gb=nbytes / 1e9, seconds=wall, main_cpu_seconds=main_cpu,
              tree_cpu_seconds=cpu_seconds() - tree - sampled - on_devices,
              devices_cpu_seconds=on_devices, bytes_per_image=nbytes / slots, **crops)


def main_process_cost(delivered: dict) -> dict:
  """The main process's CPU-seconds per GB delivered, and the images/s one core of it feeds at
  this image size (its ceiling)."""
  per_gb = delivered["main_cpu_seconds"] / delivered["gb"]
  return dict(main_cpu_seconds_per_gb=per_gb,
              main_cpu_ms_per_image=per_gb * delivered["bytes_per_image"] / 1e6,
              main_process_ceiling_images_per_second=1e9 / (per_gb * delivered["bytes_per_image"]))


def measure_workers(config, is_tiny: bool, elements: int = 6) -> dict:
  """WORKERS' uint8 arrays in ArrayRecord files, read by `config`'s worker processes (at least
  one) as training reads them and placed on the devices (spmd): images/s, and the main
  process's cost per GB delivered (`main_process_cost`), over elements of k = 4 batches; the
  same with the shares pickled (where there is no /dev/shm; before shared memory, the only way).

  Args:
    config: the run's config (its workers).
    is_tiny: --tiny's smaller sizes.
    elements: how many are measured.
  """
  config = config.copy_and_resolve_references()
  config.dataset, config.num_epochs, config.parallelism = "arrayrecord", 10**6, "spmd"
  config.batch_size = WORKERS["batch_size"]
  config.steps_per_dispatch = WORKERS["steps_per_dispatch"]
  config.num_workers = batches.default_workers(config) or 1
  num_images = WORKERS["num_images"] // (4 if is_tiny else 1)
  rng = np.random.default_rng(0)
  result = dict(WORKERS, num_images=num_images, workers=config.num_workers)
  with tempfile.TemporaryDirectory() as root:
    write_arrayrecord.write_dataset(root, {split: (
        rng.integers(0, 256, (n, *WORKERS["image_shape"]), dtype=np.uint8),
        rng.integers(0, 10, n)) for split, n in (("train", num_images), ("eval", 8))})
    config.data_dir = root
    splits, _ = sources.get_datasets(config)
    for name, shared_memory in (("", True), ("pickled_", False)):
      iterator = input_pipeline.as_iterator(
          batches.train_batches(splits["train"], plan.resolved(config)), config,
          put=placer(config), shared_memory=shared_memory)
      delivered = deliver(iterator, 1 if is_tiny else elements)
      iterator.close()
      result[f"{name}images_per_sec"] = delivered["images"] / delivered["seconds"]
      result.update({name + key: value for key, value in main_process_cost(delivered).items()})
  return result


def process_tree() -> dict[int, list[str]]:
  """This process and its live children (its Grain workers): /proc/PID/stat's fields from the
  third (state) on, by PID (Linux)."""
  tree = {}
  for stat in glob.glob("/proc/[0-9]*/stat"):
    try:
      with open(stat) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # ended meanwhile
      continue
    pid = int(stat.split("/")[2])
    if pid == os.getpid() or int(fields[1]) == os.getpid():
      tree[pid] = fields
  return tree


PADDING = [0.0]  # thread CPU-seconds that sharding.padded took here (`timed_padding`)


def timed_padding() -> None:
  """Has `sharding.padded` count its thread CPU-seconds in PADDING: the CPU devices run that small
  program inline, on the placing thread (a GPU's own work on a GPU host)."""
  if getattr(sharding.padded, "timed", False):
    return
  original = sharding.padded

  def timed(*args, **kwargs):
    start = time.thread_time()
    out = jax.block_until_ready(original(*args, **kwargs))
    PADDING[0] += time.thread_time() - start
    return out

  timed.timed, sharding.padded = True, timed


def devices_cpu_seconds() -> float:
  """CPU time of the CPU devices' own work (a GPU's on a GPU host): this process's XLA:CPU
  threads (`tf_XLA...`), from /proc (Linux; elsewhere 0), and the padding of packed crops that
  they run on the placing thread (`timed_padding`)."""
  total = PADDING[0] * os.sysconf("SC_CLK_TCK")
  for task in glob.glob(f"/proc/{os.getpid()}/task/*"):
    try:
      with open(f"{task}/comm") as f:
        if not f.read().startswith("tf_XLA"):
          continue
      with open(f"{task}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
      total += int(fields[11]) + int(fields[12])
    except OSError:  # (ended meanwhile)
      continue
  return total / os.sysconf("SC_CLK_TCK")


def cpu_seconds() -> float:
  """CPU time of this process and of its children, live (from /proc, Linux) or ended."""
  ended = resource.getrusage(resource.RUSAGE_CHILDREN)
  live = sum(int(fields[11]) + int(fields[12]) for fields in process_tree().values())
  return ended.ru_utime + ended.ru_stime + live / os.sysconf("SC_CLK_TCK")


def pil_loop(encoded, image_shape, seconds: float) -> float:
  """Images per CPU-second of PIL opening, decoding and resizing images in turn.

  Args:
    encoded: () -> the images' bytes.
    image_shape: the resize's [H, W, C].
    seconds: the CPU time measured.
  """
  height, width, channels = image_shape
  done, start = 0, time.process_time()
  while time.process_time() - start < seconds:
    with Image.open(io.BytesIO(encoded(done))) as image:
      np.asarray(image.convert("L" if channels == 1 else "RGB").resize(
          (width, height), Image.Resampling.BILINEAR))
    done += 1
  return done / (time.process_time() - start)


def measure_input(config, splits, info, num_batches: int, rate: float) -> dict:
  """`measure_data`'s figures of one way of reading the data, and half as many batches again
  with the staging copy.

  Args:
    config: the run's config (the way it reads the data).
    splits: the data's splits.
    info: its DatasetInfo.
    num_batches: the batches measured (in elements of k).
    rate: the images/s whose cores are counted.
  """
  memory = PeakMemory()
  memory.start()
  timed_padding()
  put = Staged(placer(config))
  iterator = input_pipeline.as_iterator(batches.train_batches(splits["train"], config),
                                        config, put=put)
  elements = -(-num_batches // config.run.steps_per_dispatch)
  delivered = deliver(iterator, elements, memory, put)
  put.on = True  # the same again, with a GPU's staging copy: the main process's cost alone
  deliver(iterator, 2, put=put)  # (its buffers made first: a runtime's are, before a run)
  staged = {f"{key}_with_staging_copy": value for key, value in main_process_cost(
      deliver(iterator, max(elements // 2, 1), put=put)).items()}
  peak = memory.stop()
  iterator.close()
  images, wall, cpu = delivered["images"], delivered["seconds"], delivered["tree_cpu_seconds"]
  return dict(batches=elements * config.run.steps_per_dispatch, images=images, seconds=wall,
              images_per_second=images / wall,
              images_per_cpu_second=images / cpu,
              **({"images_per_worker_cpu_second": images / (
                  cpu - delivered["main_cpu_seconds"])} if config.num_workers else {}),
              bytes_per_image=delivered["bytes_per_image"],
              **{key: delivered[key] for key in ("crop_bytes_per_image",) if key in delivered},
              **main_process_cost(delivered), **staged,
              target_images_per_second=rate, cores_per_accelerator=rate * cpu / images,
              peak_memory_mib=peak / 2**20,
              # (its buffers alone: each process's own, Python, JAX, Grain, is not in it)
              expected_buffer_memory_mib=input_pipeline.host_memory(
                  config, info, iterators=1).bytes / 2**20)


def measure_data(config, num_batches: int, rate: float, image_folder: str | None = None) -> dict:
  """`num_batches` training batches of `config.data_dir`, placed on the devices: images per
  second and per CPU-second (this process and its Grain workers), the main process's cost per
  GB (`main_process_cost`), the cores that feed `rate` images/s, the peak resident memory of
  the process tree (and `input_pipeline.host_memory`'s expectation of the buffers), the PIL loop
  over the photos. Photos whose crops the devices resize: the same again with the host
  resizing them (`host_resize_...`), in this run.

  Args:
    config: the run's config (`data_dir`).
    num_batches: the training batches measured.
    rate: the images/s whose cores are counted.
    image_folder: the photos' files, for the PIL loop; None: the stored images, when encoded.
  """
  config = plan.resolved(config)
  config.num_epochs = 10**6  # never runs out
  splits, info = sources.get_datasets(config)
  result = dict(data_dir=config.data_dir, dataset=config.dataset,
                image_shape=list(info.image_shape), crops_on_host=info.crops_on_host,
                canvas=info.canvas and list(info.canvas),
                decoder="simplejpeg" if image_files.simplejpeg else "PIL",
                workers=batches.default_workers(config),
                **measure_input(config, splits, info, num_batches, rate))
  if info.canvas:  # today's other path, in the same run
    config.resize_on_device = False
    splits, info = sources.get_datasets(config)
    result.update({f"host_resize_{key}": value for key, value in measure_input(
        config, splits, info, num_batches, rate).items()})
    result["over_host_resize"] = (result["images_per_cpu_second"]
                                  / result["host_resize_images_per_cpu_second"])
  source, encoded = splits["train"], None
  if image_folder:
    paths = image_files.images_under(image_folder)
    encoded = lambda i: open(paths[i % len(paths)], "rb").read()  # noqa: E731, SIM115
  elif isinstance(source, arrayrecord.RecordSource) and isinstance(
      serialization.msgpack_restore(source.records[0])["image"], bytes):
    encoded = lambda i: serialization.msgpack_restore(  # noqa: E731
        source.records[i % len(source)])["image"]
  if encoded is not None:
    result["pil_loop_of"] = image_folder or "the stored images"
    result["pil_loop_images_per_cpu_second"] = pil_loop(encoded, info.image_shape,
                                                        10.0)
    result["pipeline_over_pil_loop"] = (result["images_per_cpu_second"]
                                        / result["pil_loop_images_per_cpu_second"])
  return result


def main(config, data_dir: str, num_batches: int, rate: float, image_folder: str | None,
         out: str):
  """`benchmark.py --data_dir`: `measure_data`, printed and written as JSON.

  Args:
    config: the run's config.
    data_dir: the data, read as `config.dataset` reads it ('arrayrecord' for the digits' and
      synthetic configs).
    num_batches: the training batches measured.
    rate: the images/s whose cores are counted.
    image_folder: as `measure_data`'s.
    out: the JSON file.
  """
  config.data_dir = data_dir
  if sources.SOURCES[config.dataset].in_memory:
    config.dataset = "arrayrecord"
  try:
    rules.validate_config(config)
  except rules.ConfigError as e:
    raise SystemExit(f"error: {e}") from None
  result = measure_data(config, num_batches, rate, image_folder)
  print("\n".join(f"{key}: {value:,.4g}" if isinstance(value, float) else f"{key}: {value}"
                  for key, value in result.items()))
  with open(out, "w") as f:
    json.dump(result, f, indent=2)
  return result
