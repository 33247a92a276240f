"""Compile-only devices of a TPU or GPU topology that is not here, for aot.py.

JAX compiles for a TPU without one (`jax.experimental.topologies`, with libtpu: the `tpu` extra)
and for NVIDIA GPUs without one (the `cuda12` extra), given the GPU's figures as a
`GpuTargetConfig` text proto: `GPU_TARGETS` holds them for the GPUs in `chips.CHIPS`.
"""

import importlib.util
import re

from .chips import chip

# GPU figures for XLA's GPU compiler (its GpuTargetConfig; as in openxla/xla's
# xla/backends/gpu/target_config/specs): (device kind, compute capability, SMs, FP32 units per
# SM, clock GHz, L2 bytes, shared memory per SM, opt-in shared memory per block).
GPU_TARGETS = {
    "h100": ("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 1.98, 50 * 2**20, 233472, 232448),
    "h200": ("NVIDIA H200 141GB HBM3e", (9, 0), 132, 128, 1.98, 50 * 2**20, 233472, 232448),
    "b200": ("NVIDIA B200", (10, 0), 148, 128, 1.965, 132644864, 233472, 232448),
    "a100": ("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 1.41, 40 * 2**20, 167936, 166912),
}
TPU_NAMES = ("v4", "v5e", "v5p", "v6e")


def gpu_target_config(name: str) -> str:
  """The `GpuTargetConfig` text proto of GPU `name` (a key of GPU_TARGETS)."""
  kind, (major, minor), sms, fpus, ghz, l2, shared_sm, shared_optin = GPU_TARGETS[name]
  figures = dict(
      threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=49152,
      shared_memory_per_core=shared_sm, threads_per_core_limit=2048, core_count=sms,
      fpus_per_core=fpus, block_dim_limit_x=2**31 - 1, block_dim_limit_y=65535,
      block_dim_limit_z=65535, memory_bandwidth=int(chip(kind).memory_bandwidth),
      l2_cache_size=l2, clock_rate_ghz=ghz, device_memory_size=chip(kind).memory_bytes,
      shared_memory_per_block_optin=shared_optin, registers_per_core_limit=65536,
      registers_per_block_limit=65536)
  info = " ".join(f"{key}: {value}" for key, value in figures.items())
  capability = f"cuda_compute_capability < major: {major} minor: {minor} >"
  return (f"gpu_device_info < {info} {capability} > platform_name: 'CUDA' "
          f"dnn_version_info < major: 9 minor: 10 > device_description_str: '{kind}'")


KNOWN = (f"TPU: {', '.join(f'{n}:AxB[xC]' for n in TPU_NAMES)} (e.g. v5e:2x4, v4:2x2x2); "
         f"GPU: {', '.join(f'{n}:N' for n in GPU_TARGETS)} or NAME:HOSTSxN (e.g. h100:8, h100:2x8)")


class TopologyError(ValueError):
  """A topology name that cannot be compiled for; the message lists the known ones."""


def compile_only_devices(topology: str, num_slices: int = 1) -> list:
  """The devices of `topology` ('v5e:2x4', 'h100:8', 'h100:2x8', ...), compile-only: nothing runs
  on them, but `jax.jit(...).lower(...).compile()` compiles for them. `num_slices`: TPU slices
  joined by the data-center network (multi-slice)."""
  from jax.experimental import topologies

  name, _, shape = topology.lower().partition(":")
  if name in GPU_TARGETS and re.fullmatch(r"(\d+x)?\d+", shape) and num_slices == 1:
    hosts, _, per_host = shape.rpartition("x")
    try:
      return topologies.get_topology_desc(
          name, "cuda", target_config=gpu_target_config(name),
          topology=f"1x{hosts or 1}x{per_host}").devices
    except Exception as e:  # noqa: BLE001  (the plugin's errors have no common type)
      raise TopologyError(f"--topology={topology!r}: JAX cannot compile for NVIDIA GPUs here "
                          f"({type(e).__name__}: {str(e)[:200]}); install the GPU compiler: "
                          "pip install -e \".[cuda12]\"") from None
  if name in TPU_NAMES and re.fullmatch(r"\d+x\d+(x\d+)?", shape):
    try:
      # (v4 and v5p: one device per chip, both cores, as on their VMs: "megacore")
      return topologies.get_topology_desc(
          topology_name=topology, platform="tpu", num_slices=num_slices,
          chip_config_name="megacore" if name in ("v4", "v5p") else "default").devices
    except Exception as e:  # noqa: BLE001
      missing = importlib.util.find_spec("libtpu") is None
      raise TopologyError(
          f"--topology={topology!r}: " + ("JAX cannot compile for TPUs here; install the TPU "
                                          "compiler: pip install -e \".[tpu]\"" if missing else
                                          f"{str(e)[:200]}; known: {KNOWN}")) from None
  if name in GPU_TARGETS and num_slices != 1:
    raise TopologyError(f"--num_slices={num_slices} is for TPUs; for GPUs on several hosts give "
                        f"--topology={name}:HOSTSxN.")
  raise TopologyError(f"--topology={topology!r} is unknown; known: {KNOWN}.")

