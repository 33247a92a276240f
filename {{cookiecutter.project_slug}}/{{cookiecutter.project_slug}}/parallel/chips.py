"""What each accelerator can do: peak FLOP/s (for MFU), memory and its bandwidth."""

from typing import NamedTuple


class Chip(NamedTuple):
  peak_flops: float  # dense bfloat16 FLOP/s of one device
  memory_bandwidth: float  # bytes/s of its memory (HBM)
  memory_bytes: int  # its memory


GiB = 2**30
# By a part of the device's `device_kind` (first match wins). Vendors' published figures.
CHIPS = {
    "H100 PCIe": Chip(756e12, 2.0e12, 80 * 10**9),
    "H100": Chip(989e12, 3.35e12, 84942979072),
    "H200": Chip(989e12, 4.8e12, 151397597184),
    "B200": Chip(2250e12, 7.67e12, 191514411008),
    "A100": Chip(312e12, 2.039e12, 85100068864),
    "L40S": Chip(362e12, 0.864e12, 48 * GiB),
    "L4": Chip(121e12, 0.3e12, 24 * GiB),
    "TPU v4": Chip(275e12, 1.2e12, 32 * GiB),
    "TPU v5 lite": Chip(197e12, 0.819e12, 16 * GiB),
    "TPU v5p": Chip(459e12, 2.765e12, 95 * GiB),
    "TPU v5": Chip(459e12, 2.765e12, 95 * GiB),
    "TPU v6 lite": Chip(918e12, 1.64e12, 32 * GiB),
    "TPU7x": Chip(2307e12, 7.37e12, 192 * GiB),
}


def chip(device_kind: str) -> Chip | None:
  return next((c for name, c in CHIPS.items() if name in device_kind), None)


def peak_flops(device_kind: str) -> float:
  """Peak dense bfloat16 FLOP/s of one device of this kind, or 0 when unknown."""
  found = chip(device_kind)
  return found.peak_flops if found else 0.0
