"""Every test runs on the CPU backend with 8 virtual devices, on any host: JAX_PLATFORMS=cpu
and the device count are set here, before JAX is imported, and inherited by subprocesses.
tests/test_accelerator.py runs on the host's real accelerator instead, in subprocesses given
the environment as it was before (`ACCELERATOR_ENV`)."""

import os

ACCELERATOR_ENV = dict(os.environ)
os.environ["JAX_PLATFORMS"] = "cpu"
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
