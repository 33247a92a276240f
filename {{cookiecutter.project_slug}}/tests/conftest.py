"""Runs every test on 8 virtual CPU devices (unless XLA_FLAGS already asks for a count)."""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import pytest  # noqa: E402
from absl import flags  # noqa: E402

flags.FLAGS.mark_as_parsed()  # absl flags are parsed by app.run in train.py, not under pytest


@pytest.fixture
def tiny_config():
  from configs import tiny

  return tiny.get_config()
