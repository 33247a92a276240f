"""Smoke test of benchmark.py: a real --tiny run measures every model and path (no timings)."""

import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
import sys

import pytest

import benchmark

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def assert_positive_finite(numbers: dict, keys: tuple[str, ...], where: str):
  for key in keys:
    assert math.isfinite(numbers[key]) and numbers[key] > 0, (where, key, numbers[key])


@pytest.mark.slow
def test_tiny_benchmark_measures_every_model_and_path(tmp_path):
  out, markdown = tmp_path / "bench.json", tmp_path / "tables.md"
  dates = {f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d}"}  # the run's: it may cross midnight
  done = subprocess.run([sys.executable, "benchmark.py", "--tiny", f"--out={out}",
                         f"--markdown={markdown}"], cwd=PROJECT, capture_output=True, text=True,
                        timeout=400)
  dates.add(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d}")
  assert done.returncode == 0, done.stderr[-3000:]

  results = json.loads(out.read_text())
  assert results["device_count"] == benchmark.NUM_DEVICES
  assert set(results["models"]) == set(benchmark.MODELS)
  for name, model in results["models"].items():
    assert set(model["paths"]) == set(benchmark.PATHS), name
    for path, numbers in model["paths"].items():
      assert_positive_finite(numbers, ("compile_s", "first_step_s", "step_ms", "examples_per_sec",
                                       "peak_host_mb", "state_mb_per_device",
                                       "step_peak_mb_per_device"), f"{name}:{path}")
      # The step holds the state (donated: updated in place), the batch and its temporaries.
      assert numbers["step_peak_mb_per_device"] > numbers["state_mb_per_device"], (name, path)
    assert_positive_finite(model, ("pmap_over_spmd_step_time", "ema_over_spmd_step_time"), name)
    # The moving average: one more copy of the parameters (and BatchNorm's statistics).
    assert model["ema_state_mb_per_device"] > model["paths"]["spmd"]["state_mb_per_device"]
  ours = results["config_parallelism"]  # configs/default.py's
  other = ({"spmd", "pmap"} - {ours}).pop()
  assert set(results["loop"]) == {"digits:spmd", "digits:pmap", f"large:{ours}", "resnet:spmd"}
  resnet = results["loop"]["resnet:spmd"]  # --tiny on the CPU: the ResNet-18, 32x32, 2 a device
  assert (resnet["image_shape"], resnet["batch_size"]) == ([32, 32, 3], 2 * benchmark.NUM_DEVICES)
  assert resnet["mfu"] is None  # the CPU's peak is unknown
  for key, loop in results["loop"].items():
    assert_positive_finite(loop, ("loop_examples_per_sec", "step_examples_per_sec", "efficiency",
                                  "host_us_per_step"), f"loop:{key}")
    # --tiny runs one (bare step, loop) pair per path: the efficiency is that pair's ratio.
    assert loop["efficiencies"] == [loop["efficiency"]]
    assert loop["efficiency"] == pytest.approx(
        loop["loop_examples_per_sec"] / loop["step_examples_per_sec"], rel=1e-9)
  assert results["loop"][f"digits:{ours}"]["steps_per_dispatch"] == 5  # --tiny: 5, else 10
  assert_positive_finite(results["pipeline"], ("images_per_sec",), "pipeline")
  run = results["default_run"]  # --tiny: configs/tiny.py, k = 1 on the CPU
  assert_positive_finite(run, ("wall_s", "startup_s", "first_train_call_s", "first_eval_call_s",
                               "accuracy"), "default_run")
  assert run["steps_per_dispatch"] == 1 and run["startup_s"] < run["wall_s"]
  assert_positive_finite(results["decoding"], ("images_per_sec", "workers"), "decoding")
  workers = results["workers"]
  assert_positive_finite(workers, ("images_per_sec", "workers", "main_cpu_seconds_per_gb",
                                   "main_process_ceiling_images_per_second",
                                   "pickled_images_per_sec", "pickled_main_cpu_seconds_per_gb",
                                   "pickled_main_process_ceiling_images_per_second"), "workers")
  assert workers["main_process_ceiling_images_per_second"] == pytest.approx(
      1e9 / workers["main_cpu_seconds_per_gb"] / (224 * 224 * 3 + 9), rel=1e-6)
  assert re.search(r"^ResNet \(32x32x3, batch 16, float32, 8 x cpu\): \d+ images/s a device in "
                   r"the loop, MFU unknown \(no peak for this chip\); loop/bare step \d+\.\d\d",
                   done.stdout, re.MULTILINE), done.stdout
  if results["dispatch"]:  # ({} for a model.py without the ResNet-18)
    assert_positive_finite(results["dispatch"], ("state_ms", "flat_ms", "state_ema_ms",
                                                 "flat_ema_ms", "arrays", "arrays_ema"), "dispatch")
    assert results["dispatch"]["arrays_ema"] > results["dispatch"]["arrays"]
    assert re.search(r"^dispatch host cost, resnet18 state \(\d+ arrays\): \d+\.\d\d ms a call "
                     r"as an nnx.State, \d+\.\d\d ms as the loop's flat list; with the moving "
                     r"average \(\d+ arrays\)", done.stdout, re.MULTILINE), done.stdout

  for line in (r"loop efficiency: \d+\.\d\d", r"loop efficiency \(large\): \d+\.\d\d",
               rf"loop efficiency \({other}\): \d+\.\d\d", r"pmap/spmd step time: \d+\.\d\d",
               r"moving average: spmd step time x\d+\.\d\d, state \d+\.\d+ MB/device against",
               r"input pipeline \(64x64x3, batch 1024\): \d+ images/s",
               r"image decoding \(JPEG 64x64, \d+ workers\): \d+ images/s",
               r"input with workers \(224x224x3 uint8, batch 256, k=4, \d+ worker processes, "
               r"placed on the devices\): \d+ images/s; the main process \d+\.\d{3} CPU-s per GB "
               r"delivered: one core feeds [\d,]+ images/s \(pickled, without /dev/shm: \d+ "
               r"images/s, \d+\.\d{3} CPU-s per GB, [\d,]+ images/s\)",
               r"default run \(configs/tiny.py, k=1, no compilation cache\): \d+\.\d s as a whole "
               r"process"):
    assert re.search(f"^{line}", done.stdout, re.MULTILINE), (line, done.stdout)

  # The Markdown file: the JSON's figures as its tables show them, under the machine and date.
  text = markdown.read_text()
  rows = [line.strip("| ").split(" | ") for line in text.splitlines() if line.startswith("| ")]
  header = dict(row for row in rows if len(row) == 2)
  assert header["date (UTC)"] in dates and header["command"] == "`python benchmark.py`"
  assert header["JAX backend"] == (f"{results['backend']}: {benchmark.NUM_DEVICES} devices "
                                   f"({results['device_kind']})")
  assert header["versions"] == (
      f"Python {platform.python_version()}, jax {results['jax']}, flax {results['flax']}, "
      f"grain {importlib.metadata.version('grain')}")
  assert header["machine"].endswith(f", {os.cpu_count()} cores")
  assert header["--tiny"].startswith("yes")
  for name, model in results["models"].items():
    for path, r in model["paths"].items():
      assert [name, "x".join(map(str, model["image_shape"])), str(model["batch_size"]), path,
              f"{r['compile_s']:.2f}", f"{r['first_step_s']:.2f}", f"{r['step_ms']:.2f}",
              f"{r['examples_per_sec']:.0f}", f"{r['peak_host_mb']:.0f}",
              f"{r['state_mb_per_device']:.3f}", f"{r['step_peak_mb_per_device']:.3f}"] in rows
  for key, loop in results["loop"].items():
    row = next(row for row in rows if row[0] == key)
    assert row[6:8] == [f"{loop['loop_examples_per_sec']:.0f}",
                        f"{loop['step_examples_per_sec']:.0f}"], row
    assert row[-1] == f"{loop['efficiency']:.2f}", row
  pipeline, large = results["pipeline"], results["models"]["large"]
  for line in (f"- loop efficiency: {results['loop'][f'digits:{ours}']['efficiency']:.2f}",
               f"- pmap/spmd step time: {large['pmap_over_spmd_step_time']:.2f} (large)",
               f"- input pipeline (64x64x3, batch 1024): {pipeline['images_per_sec']:.0f} images/s",
               f"- default run (configs/tiny.py, k=1, no compilation cache): {run['wall_s']:.1f} s "
               f"as a whole process, {run['startup_s']:.1f} s to its first step"):
    assert line in text, (line, text)


@pytest.mark.slow
def test_the_input_pipeline_alone_on_your_own_data(tmp_path):
  """benchmark.py --data_dir: photos stored whole, read with the ImageNet recipe's crops by one
  Grain worker process, their crops resized on the devices and, in the same run, on the host,
  beside a plain PIL loop over the files they were written from; a data directory that is not
  there is one line."""
  sys.path.insert(0, os.path.join(PROJECT, "tests"))
  from test_image_folder import write_wide_photos

  from configs import imagenet

  from {{cookiecutter.project_slug}}.data import sources

  write_wide_photos(tmp_path / "photos", per_class=8)
  done = subprocess.run([sys.executable, "write_arrayrecord.py", f"--out_dir={tmp_path / 'data'}",
                         f"--image_folder={tmp_path / 'photos'}", "--image_size=64",
                         "--resize_shorter=73"], cwd=PROJECT, capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  out = tmp_path / "data.json"
  command = [sys.executable, "benchmark.py", f"--data_dir={tmp_path / 'data'}", "--batches=3",
             f"--pil_image_folder={tmp_path / 'photos'}", "--config=configs/imagenet.py",
             "--config.batch_size=8", "--config.num_workers=1", "--images_per_second=1000",
             f"--out={out}", f"--markdown={tmp_path / 'BENCHMARKS.md'}"]
  done = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(out.read_text())
  assert result["workers"] == 1 and result["crops_on_host"] and result["image_shape"] == [64, 64, 3]
  assert_positive_finite(result, ("images_per_second", "images_per_cpu_second",
                                  "pil_loop_images_per_cpu_second", "pipeline_over_pil_loop",
                                  "peak_memory_mib", "expected_buffer_memory_mib",
                                  "main_cpu_seconds_per_gb",
                                  "main_process_ceiling_images_per_second",
                                  "images_per_worker_cpu_second",
                                  "main_cpu_seconds_per_gb_with_staging_copy",
                                  "host_resize_images_per_cpu_second", "over_host_resize"), "data")
  canvas = sources.canvas(imagenet.get_config(), 73, (64, 64, 3))
  assert result["canvas"] == list(canvas) and result["over_host_resize"] == pytest.approx(
      result["images_per_cpu_second"] / result["host_resize_images_per_cpu_second"], rel=1e-9)
  # Each crop sent as its own pixels (`batches.pack`): about what it holds, not the largest's room
  # (a crop holds 0.08-1 of the photo's 73 x 97 pixels, with the few its resize reads around it).
  assert 9 + 6 * 4 + 4 < result["bytes_per_image"] < 0.75 * math.prod(canvas) * 3
  assert result["host_resize_bytes_per_image"] == 64 * 64 * 3 + 9
  assert result["decoder"] == "simplejpeg"
  assert result["images_per_worker_cpu_second"] > result["images_per_cpu_second"]
  section = (tmp_path / "BENCHMARKS.md").read_text()  # (a section of its own, kept: --resnet's)
  assert section.startswith("# Benchmarks") and "## Photos stored whole: the input alone" in section
  for row in (f"| images per CPU-second (workers and main process) | "
              f"{result['images_per_cpu_second']:,.0f} | "
              f"{result['host_resize_images_per_cpu_second']:,.0f} |",
              f"| main process, CPU-s per GB: with a GPU's staging copy | "
              f"{result['main_cpu_seconds_per_gb_with_staging_copy']:.3f} | "
              f"{result['host_resize_main_cpu_seconds_per_gb_with_staging_copy']:.3f} |",
              f"| cores a device at 1,000 images/s | {result['cores_per_accelerator']:.1f} | "
              f"{result['host_resize_cores_per_accelerator']:.1f} |"):
    assert row in section, section
  assert result["main_process_ceiling_images_per_second"] == pytest.approx(
      1e9 / result["main_cpu_seconds_per_gb"] / result["bytes_per_image"], rel=1e-6)
  assert result["cores_per_accelerator"] == pytest.approx(
      1000 / result["images_per_cpu_second"], rel=1e-9)
  assert result["batches"] == 3 and result["images"] == 3 * 8  # (a count: the 8 of every batch)
  assert f"images_per_cpu_second: {result['images_per_cpu_second']:,.4g}" in done.stdout

  command[2] = f"--data_dir={tmp_path / 'nowhere'}"
  done = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, timeout=300)
  assert done.returncode == 1
  assert done.stderr.strip().splitlines()[-1] == (
      f"error: config.data_dir={str(tmp_path / 'nowhere')!r} does not exist; give the directory "
      "that write_arrayrecord.py wrote.")


def test_the_resnet_comparison_is_a_section_of_its_own_that_the_whole_benchmark_keeps(tmp_path):
  """`--resnet`'s figures (here made up, in the shape benchmark_torch.py and the loop give them)
  as a section: images/s a GPU, MFU from the project's FLOPs, each over torch.compile's; written
  into BENCHMARKS.md beside the whole benchmark's tables, replaced by the next --resnet, kept
  when the whole benchmark rewrites the file."""
  from {{cookiecutter.project_slug}}.tools import benchmark_report

  loop = dict(device_count=2, loop_examples_per_sec=11000.0, step_examples_per_sec=12000.0,
              mfu=0.22, efficiencies=[0.91, 0.92, 0.93], steps_per_dispatch=10)
  torch = dict(device="NVIDIA H100 80GB HBM3", batch_size=256, torch="2.11", timm="1.0",
               modes=dict(eager=dict(images_per_sec=4000.0), compile=dict(images_per_sec=5000.0)))
  section = benchmark_report.resnet_section(dict(loop=loop, torch=torch, jax="0.11", repeats=3))
  rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in section.splitlines()
          if line.startswith("| ") and "---" not in line}
  assert rows["this project: the whole loop (train.py)"] == ["5,500", "0.220", "1.10 |"]
  assert rows["this project: its bare train step"] == ["6,000", "0.240", "1.20 |"]
  assert rows["timm under torch.compile"] == ["5,000", "0.200", "1.00 |"]
  assert rows["timm, eager"] == ["4,000", "0.160", "0.80 |"]
  assert "0.91 0.92 0.93" in section and "GPU figures: 2 x NVIDIA H100" in section

  path = str(tmp_path / "BENCHMARKS.md")
  benchmark.write_markdown(path, "# Benchmarks\n\n## Train step\n\nold\n")
  benchmark.write_markdown(path, section=section)
  assert open(path).read() == "# Benchmarks\n\n## Train step\n\nold\n\n" + section
  benchmark.write_markdown(path, "# Benchmarks\n\n## Train step\n\nnew\n")  # the whole one
  assert open(path).read() == "# Benchmarks\n\n## Train step\n\nnew\n\n" + section
  again = section.replace("5,500", "5,600")
  benchmark.write_markdown(path, section=again)
  assert open(path).read() == "# Benchmarks\n\n## Train step\n\nnew\n\n" + again


@pytest.mark.slow  # (a process)
def test_kernels_are_a_gpu_streams_kernels_a_step_summed_by_kind(tmp_path):
  """`--kernels`' reading of a profile (here a made one, as jax.profiler writes a GPU's: a plane
  a device, a line a stream): two steps of a convolution, a reduction, a selection and a memset;
  the host's events and the GPU's other lines are not kernels. On the CPU, --kernels says in
  one line that it needs a GPU, before compiling anything."""
  import jax

  from {{cookiecutter.project_slug}}.tools import benchmark_kernels

  names = ["sm90_xmma_fprop_implicit_gemm_bf16", "input_convert_reduce_fusion_3",
           "loop_select_fusion_27", "memset32"]
  step_ps = [3_000_000_000, 1_000_000_000, 2_000_000, 1_000_000]  # 3 ms, 1 ms, 2 us, 1 us
  events, offset = [], 0
  for _ in range(2):
    for i, duration in enumerate(step_ps):
      events.append(" ".join(["events { metadata_id:", str(i + 1), "offset_ps:", str(offset),
                              "duration_ps:", str(duration), "}"]))
      offset += duration + 500_000_000  # 0.5 ms idle after each
  metadata = " ".join(" ".join(["event_metadata { key:", str(i + 1), "value { id:", str(i + 1),
                                "name:", json.dumps(name), "} }"]) for i, name in enumerate(names))
  gpu = " ".join(['planes { id: 1 name: "/device:GPU:0"',
                  'lines { id: 1 name: "Stream #14(Compute)" timestamp_ns: 1000', *events, "}",
                  'lines { id: 2 name: "XLA Ops" timestamp_ns: 1000', events[0], "}", metadata,
                  "}"])
  host = " ".join(['planes { id: 2 name: "/host:CPU" lines { id: 1 name: "python" timestamp_ns: 0',
                   events[0], "}", metadata, "}"])
  result = benchmark_kernels.kernels(jax.profiler.ProfileData.from_text_proto(gpu + host), 2)
  assert result["kernels"] == 4 and result["small_kernels"] == 2
  assert result["kernel_ms"] == pytest.approx(4.003) and result["small_ms"] == pytest.approx(0.003)
  assert result["span_ms"] == pytest.approx((2 * 4.003 + 7 * 0.5) / 2)  # last idle not spanned
  assert result["kinds"] == {
      "convolutions and matrix products": dict(ms=pytest.approx(3.0), kernels=1.0),
      "reductions": dict(ms=pytest.approx(1.0), kernels=1.0),
      "selections": dict(ms=pytest.approx(0.002), kernels=1.0),
      "memset and memcpy": dict(ms=pytest.approx(0.001), kernels=1.0)}
  assert [k["name"] for k in result["longest"]] == names
  report = benchmark_kernels.report(result)
  assert "| convolutions and matrix products | 3.00 | 1 | 75% |" in report, report
  assert "4 kernels, 2 of them under 5 us" in report, report
  with pytest.raises(ValueError, match="no GPU kernels"):
    benchmark_kernels.kernels(jax.profiler.ProfileData.from_text_proto(host), 2)

  done = subprocess.run([sys.executable, "benchmark.py", "--kernels",
                         f"--out={tmp_path / 'k.json'}"], cwd=PROJECT, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode != 0 and not (tmp_path / "k.json").exists()
  assert done.stderr.strip().splitlines()[-1] == (
      "error: --kernels profiles a GPU's kernels; JAX's backend here is cpu.")


@pytest.mark.slow  # (a process; a TPU compile)
def test_randaugment_is_measured_on_the_host_and_for_the_devices(tmp_path):
  """`--randaugment`: DeiT's RandAugment an image at 224 on the host (PIL) and the resize it
  needs, in JAX under jit here, and, where the TPU compiler is installed (the dev extra's
  `tpu`), a v5e chip's bound of it against configs/vit.py's step: numbers, and the line."""
  out = tmp_path / "randaugment.json"
  done = subprocess.run([sys.executable, "benchmark.py", "--randaugment", "--tiny",
                         f"--out={out}"], cwd=PROJECT, capture_output=True, text=True,
                        timeout=400)
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(out.read_text())
  assert_positive_finite(result, ("host_ms", "host_resize_ms", "device_ms"), "randaugment")
  assert "RandAugment (DeiT's) at 224x224, an image: on the host (PIL, one core)" in done.stdout
  if "tpu_error" not in result:
    assert_positive_finite(result, ("tpu_ms", "tpu_gb", "tpu_flops"), "randaugment on a TPU")
    assert "on a TPU v5e chip, at best" in done.stdout
