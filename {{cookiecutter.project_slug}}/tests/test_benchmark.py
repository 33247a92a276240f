"""Smoke test of benchmark.py: a real --tiny run measures every model and path (no timings)."""

import json
import math
import os
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
  out = tmp_path / "bench.json"
  done = subprocess.run([sys.executable, "benchmark.py", "--tiny", f"--out={out}"], cwd=PROJECT,
                        capture_output=True, text=True, timeout=400)
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
  assert set(results["loop"]) == {"digits:spmd", "digits:pmap", f"large:{ours}"}
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

  for line in (r"loop efficiency: \d+\.\d\d", r"loop efficiency \(large\): \d+\.\d\d",
               rf"loop efficiency \({other}\): \d+\.\d\d", r"pmap/spmd step time: \d+\.\d\d",
               r"moving average: spmd step time x\d+\.\d\d, state \d+\.\d+ MB/device against",
               r"input pipeline \(64x64x3, batch 1024\): \d+ images/s",
               r"image decoding \(JPEG 64x64, \d+ workers\): \d+ images/s",
               r"default run \(configs/tiny.py, k=1, no compilation cache\): \d+\.\d s as a whole "
               r"process"):
    assert re.search(f"^{line}", done.stdout, re.MULTILINE), (line, done.stdout)
