"""Smoke test of benchmark.py: a real --tiny run, every model and path measured (no timings checked)."""

import json
import math
import os
import re
import subprocess
import sys

import benchmark

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_benchmark_measures_every_model_and_path(tmp_path):
  out = tmp_path / "bench.json"
  done = subprocess.run([sys.executable, "benchmark.py", "--tiny", f"--out={out}"], cwd=PROJECT,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]

  results = json.loads(out.read_text())
  assert set(results["models"]) == set(benchmark.MODELS)
  for name, model in results["models"].items():
    assert set(model["paths"]) == set(benchmark.PATHS), name
    for path, numbers in model["paths"].items():
      for key in ("compile_s", "step_ms", "examples_per_sec", "peak_host_mb"):
        assert math.isfinite(numbers[key]) and numbers[key] > 0, (name, path, key, numbers[key])
    assert math.isfinite(model["pmap_over_spmd_step_time"]) and model["pmap_over_spmd_step_time"] > 0
  assert set(results["loop"]) == set(benchmark.LOOP_PATHS)
  for path, loop in results["loop"].items():
    for key in ("loop_examples_per_sec", "step_examples_per_sec", "efficiency"):
      assert math.isfinite(loop[key]) and loop[key] > 0, (path, key, loop[key])
  assert results["device_count"] == benchmark.NUM_DEVICES

  assert re.search(r"^loop efficiency: \d\.\d\d$", done.stdout, re.MULTILINE), done.stdout
  assert re.search(r"^pmap/spmd step time: \d+\.\d\d", done.stdout, re.MULTILINE), done.stdout
