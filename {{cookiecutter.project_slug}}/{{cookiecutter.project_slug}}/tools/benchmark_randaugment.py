"""benchmark.py --randaugment: what RandAugment (DeiT's 'rand-m9-mstd0.5-inc1') costs an image
at 224 x 224 on the host's workers (data/randaugment.py, PIL, one core; and the host's resize of
the crop that it needs, which `resize_on_device` would have left to the devices) against the
devices: the same 15 operations in JAX (`on_device`, below: not the product's, its measure),
under jit here, and compiled for a TPU v5e whose cost analysis bounds its time a chip."""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ..data import randaugment
from ..data.image_files import resized
from ..parallel import chips, topologies

DEIT = randaugment.RandAugment(magnitude=9, magnitude_std=0.5, increasing=True)


def on_device(key, image_HWC, fill=(124.0, 116.0, 104.0)):
  """DeiT's RandAugment of one float image (0-255) in JAX: 2 layers (`layer`)."""
  for layer_key in jax.random.split(key, 2):
    image_HWC = layer(layer_key, image_HWC, fill)
  return image_HWC


def layer(key, image_HWC, fill):
  """One of the 15 operations, with probability 0.5: each computed and one selected (what vmap
  makes of a switch), the geometric ones one bilinear warp."""
  height, width, _ = image_HWC.shape
  gray = lambda x: (x @ jnp.array([0.299, 0.587, 0.114]))[..., None]  # noqa: E731
  op_key, apply_key, m_key, sign_key = jax.random.split(key, 4)
  op = jax.random.randint(op_key, (), 0, 15)
  m = jnp.clip(9 + 0.5 * jax.random.normal(m_key), 0, 10) / 10
  level = jnp.where(jax.random.bernoulli(sign_key), -m, m)
  angle, shear, shift = jnp.deg2rad(level * 30), level * 0.3, level * 0.45
  matrices = jnp.stack([  # output (x, y, 1) -> input (x, y)
      jnp.eye(3)[:2],
      jnp.array([[jnp.cos(angle), jnp.sin(angle), 0], [-jnp.sin(angle), jnp.cos(angle), 0]]),
      jnp.array([[1, shear, 0], [0, 1, 0]]), jnp.array([[1, 0, 0], [shear, 1, 0]]),
      jnp.array([[1, 0, shift * width], [0, 1, 0]]),
      jnp.array([[1, 0, 0], [0, 1, shift * height]])])
  geometric = jnp.array([0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2, 3, 4, 5])[op]
  y, x = jnp.mgrid[:height, :width].astype(jnp.float32)
  source = jnp.einsum("ij,jhw->ihw", matrices[geometric], jnp.stack([x, y, jnp.ones_like(x)]))
  sample = jax.scipy.ndimage.map_coordinates  # (order 1: bilinear; outside: the fill)
  inside = ((source[0] >= 0) & (source[0] <= width - 1) & (source[1] >= 0)
            & (source[1] <= height - 1))[..., None]
  warp = jnp.where(inside, jnp.stack([sample(image_HWC[..., c], source[::-1], order=1)
                                      for c in range(3)], -1), jnp.array(fill))
  low, high = image_HWC.min((0, 1)), image_HWC.max((0, 1))
  counts_C256 = jax.vmap(lambda c: jnp.zeros(256).at[c.astype(jnp.int32).ravel()].add(1))(
      jnp.moveaxis(image_HWC, -1, 0))
  lut_C256 = jnp.clip(jnp.cumsum(counts_C256, 1) / counts_C256.sum(1, keepdims=True) * 255, 0,
                      255)
  equalized = jnp.stack([lut_C256[c][image_HWC[..., c].astype(jnp.int32)] for c in range(3)], -1)
  bits = 4 - jnp.floor(m * 4)
  smooth = jnp.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]]) / 13  # (PIL's SMOOTH)
  blurred = jnp.stack([jax.scipy.signal.convolve2d(image_HWC[..., c], smooth, mode="same")
                       for c in range(3)], -1)
  factor = jnp.maximum(0.1, 1 + level * 0.9)
  blend = lambda other: jnp.clip(other + factor * (image_HWC - other), 0, 255)  # noqa: E731
  results = jnp.stack([
      (image_HWC - low) * 255 / jnp.maximum(high - low, 1), equalized, 255 - image_HWC, warp,
      jnp.floor(image_HWC / 2 ** (8 - bits)) * 2 ** (8 - bits),
      jnp.where(image_HWC >= 256 - jnp.floor(m * 256), 255 - image_HWC, image_HWC),
      jnp.where(image_HWC < 128, jnp.minimum(image_HWC + jnp.floor(m * 110), 255), image_HWC),
      blend(gray(image_HWC)), blend(gray(image_HWC).mean()), blend(jnp.zeros_like(image_HWC)),
      blend(blurred), warp, warp, warp, warp])
  return jnp.where(jax.random.bernoulli(apply_key), results[op], image_HWC)


def median_seconds(fn, repeats: int = 5) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def measure(images: int = 64) -> dict:
  """Milliseconds an image: the host's RandAugment and resize (one core), the JAX version under
  jit on this backend (all its cores), and a TPU v5e chip's bound of it (its compiler's bytes
  and FLOPs over the chip's bandwidth and peak) for a device's share of configs/vit.py's batch
  (512), beside that step's own bound an image (aot.py's: 335 ms a step of 512 a chip)."""
  rng = np.random.default_rng(0)
  photos = rng.integers(0, 256, (images, 224, 224, 3), np.uint8)
  photos = (photos // 2 + np.linspace(0, 127, 224, dtype=np.uint8)[None, :, None, None])
  positions = np.arange(images)
  host_s = median_seconds(lambda: DEIT(photos, positions)) / images
  crop = rng.integers(0, 256, (256, 341, 3), np.uint8)  # (a 256-shorter photo's crop)
  resize_s = median_seconds(lambda: [resized(crop, (10, 5, 300, 250), (224, 224, 3))
                                     for _ in range(images)]) / images
  batch = jax.jit(jax.vmap(on_device))
  keys, floats = jax.random.split(jax.random.key(0), images), jnp.asarray(photos, jnp.float32)
  jax.block_until_ready(batch(keys, floats))
  device_s = median_seconds(lambda: jax.block_until_ready(batch(keys, floats))) / images
  figures = dict(host_ms=host_s * 1e3, host_resize_ms=resize_s * 1e3,
                 device_ms=device_s * 1e3, device=jax.devices()[0].device_kind)
  try:
    tpu = topologies.compile_only_devices("v5e:1x1")[0]
  except Exception as e:  # (no TPU compiler: pip install -e '.[tpu]')
    return figures | dict(tpu_error=str(e).splitlines()[0])
  sharding = jax.sharding.NamedSharding(jax.sharding.Mesh([tpu], ("x",)),
                                       jax.sharding.PartitionSpec())
  share = (jax.ShapeDtypeStruct((512,), keys.dtype, sharding=sharding),  # (a chip's 512)
           jax.ShapeDtypeStruct((512, 224, 224, 3), jnp.float32, sharding=sharding))
  cost = jax.jit(jax.vmap(on_device)).lower(*share).compile().cost_analysis() or {}
  chip = chips.chip(tpu.device_kind)
  bound = max(cost.get("flops", 0) / chip.peak_flops,
              cost.get("bytes accessed", 0) / chip.memory_bandwidth)
  return figures | dict(tpu_ms=bound / 512 * 1e3, tpu_step_ms=0.335 / 512 * 1e3,
                        tpu_gb=cost.get("bytes accessed", 0) / 512 / 1e9,
                        tpu_flops=cost.get("flops", 0) / 512)


def describe(r: dict) -> str:
  lines = [f"RandAugment (DeiT's) at 224x224, an image: on the host (PIL, one core) "
           f"{r['host_ms']:.2f} ms, and its resize of the crop {r['host_resize_ms']:.2f} ms; "
           f"in JAX on {r['device']} (all cores) {r['device_ms']:.2f} ms"]
  if "tpu_ms" in r:
    share = 100 * r["tpu_ms"] / r["tpu_step_ms"]
    lines.append(f"on a TPU v5e chip, at best {r['tpu_ms']:.3f} ms ({r['tpu_gb'] * 1e3:.1f} MB, "
                 f"{r['tpu_flops'] / 1e6:.0f} MFLOP an image), {share:.0f}% of configs/vit.py's "
                 f"step a chip ({r['tpu_step_ms']:.3f} ms an image)")
  return "; ".join(lines) + (f" (TPU: {r['tpu_error']})" if "tpu_error" in r else "")


if __name__ == "__main__":
  print(describe(measure()))
