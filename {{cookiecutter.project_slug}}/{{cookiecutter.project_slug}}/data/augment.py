"""Augmentations that the recipe (recipe.py) calls on the devices, each drawn from one example's
key (training/steps.py makes it from the example's place in the data stream alone); mixup and
CutMix of pairs of real examples (`neighbours`, `mixup_cutmix`); and the resize of photos' crops
that the host cut (`unpacked`, `resize_crops`: dispatch.on_resized)."""

import math

import jax
import jax.numpy as jnp


def random_resized_crop(key, image_HWC, scale, ratio) -> jax.Array:
  """A random crop resized back to the image's size (bilinear): the first of 10 draws that fits
  in the image, or the whole image. The crop need not fall on whole pixels.

  Args:
    key: the draw's random key.
    image_HWC: a float image.
    scale: (low, high), the crop's fraction of the area.
    ratio: (low, high), its aspect (width / height), drawn log-uniform.
  """
  height, width, _ = image_HWC.shape
  area_key, ratio_key, place_key = jax.random.split(key, 3)
  area = height * width * jax.random.uniform(area_key, (10,), minval=scale[0], maxval=scale[1])
  aspect = jnp.exp(jax.random.uniform(ratio_key, (10,), minval=math.log(ratio[0]),
                                      maxval=math.log(ratio[1])))
  crop_h, crop_w = jnp.sqrt(area / aspect), jnp.sqrt(area * aspect)
  fits = (crop_h <= height) & (crop_w <= width)
  first = jnp.argmax(fits)
  size_2 = jnp.where(fits.any(), jnp.stack([crop_h[first], crop_w[first]]),
                     jnp.array([height, width], jnp.float32))
  corner_2 = jax.random.uniform(place_key, (2,)) * (jnp.array([height, width]) - size_2)
  # (jax.image.resize takes static sizes only; this is the resampling that it runs.)
  zoom_2 = jnp.array([height, width]) / size_2
  return jax.image.scale_and_translate(image_HWC, image_HWC.shape, (0, 1), zoom_2,
                                       -corner_2 * zoom_2, method="linear")


def neighbours(x_B) -> jax.Array:
  """`x_B` with rows 2i and 2i + 1 swapped (an odd count's last row kept): each example's partner
  for mixing. A device holds whole pairs of the rows (an even share of the batch, on every
  path), so pairing moves nothing between devices."""
  even = len(x_B) - len(x_B) % 2
  swapped = x_B[:even].reshape(even // 2, 2, *x_B.shape[1:])[:, ::-1].reshape(x_B[:even].shape)
  return jnp.concatenate([swapped, x_B[even:]])


def beta(key, alpha: float, tries: int = 16) -> jax.Array:
  """A draw of Beta(alpha, alpha) (1 where alpha is 0): X / (X + Y) of two Gamma(alpha) draws,
  each by Marsaglia and Tsang's method (alpha < 1: Gamma(alpha + 1) U^(1 / alpha)) with `tries`
  proposals at once, the first accepted kept (each is, with probability over 0.95: all 16 fail
  once in 1e20 draws). No loop: under SPMD, jax.random.beta's loop (until every example's draw
  is accepted) waits on the whole batch at each turn (aot.py: 8 all-reduces more a step)."""
  if alpha <= 0:
    return jnp.float32(1.0)
  a = alpha + 1 if alpha < 1 else alpha
  d = a - 1 / 3
  normal_key, uniform_key, boost_key = jax.random.split(key, 3)
  x_2T = jax.random.normal(normal_key, (2, tries))
  v_2T = (1 + x_2T / math.sqrt(9 * d)) ** 3
  accepted_2T = (v_2T > 0) & (jnp.log(jax.random.uniform(uniform_key, (2, tries))) < (
      x_2T**2 / 2 + d - d * v_2T + d * jnp.log(jnp.maximum(v_2T, 1e-30))))
  v_2 = jnp.take_along_axis(v_2T, jnp.argmax(accepted_2T, axis=1)[:, None], 1)[:, 0]
  log_gamma_2 = jnp.log(d * v_2)  # (in logs: tiny draws of a small alpha do not underflow)
  if alpha < 1:
    log_gamma_2 += jnp.log(jax.random.uniform(boost_key, (2,), minval=1e-30)) / alpha
  return jax.nn.sigmoid(log_gamma_2[0] - log_gamma_2[1])


def mixup_cutmix(key, image_HWC, other_HWC, mixup_alpha, cutmix_alpha, switch_prob, prob,
                 paired=True):
  """One image mixed with another (timm's Mixup, drawn per image): with probability `prob`,
  CutMix where `switch_prob` draws it (always where mixup is off): a box of the other image
  pasted in, its sides sqrt(1 - lam) of the image's, lam ~ Beta(cutmix_alpha, cutmix_alpha), its
  centre uniform, clipped at the edges; else mixup: lam x + (1 - lam) other, lam ~
  Beta(mixup_alpha, mixup_alpha). Unmixed where not `paired` (padding: one select, one buffer).

  Returns:
    The image, and its weight on its own label: lam (CutMix's: 1 - the box's share of the area,
    as cut), 1 where it is not mixed.
  """
  height, width, _ = image_HWC.shape
  apply_key, switch_key, mixup_key, cutmix_key, box_key = jax.random.split(key, 5)
  lam_mixup, lam_cutmix = beta(mixup_key, mixup_alpha), beta(cutmix_key, cutmix_alpha)
  cut_h = jnp.floor(height * jnp.sqrt(1 - lam_cutmix)).astype(jnp.int32)
  cut_w = jnp.floor(width * jnp.sqrt(1 - lam_cutmix)).astype(jnp.int32)
  centre_y, centre_x = jax.random.randint(box_key, (2,), 0, jnp.array([height, width]))
  top, bottom = (jnp.clip(centre_y + d, 0, height) for d in (-(cut_h // 2), cut_h // 2))
  left, right = (jnp.clip(centre_x + d, 0, width) for d in (-(cut_w // 2), cut_w // 2))
  rows_H1, cols_1W = jnp.arange(height)[:, None], jnp.arange(width)[None, :]
  box_HW = (rows_H1 >= top) & (rows_H1 < bottom) & (cols_1W >= left) & (cols_1W < right)
  cut = cutmix_alpha > 0 and (mixup_alpha <= 0 or jax.random.bernoulli(switch_key, switch_prob))
  apply = jax.random.bernoulli(apply_key, prob) & paired
  mixed_HWC = jnp.where(cut, jnp.where(box_HW[..., None], other_HWC, image_HWC),
                        lam_mixup * image_HWC + (1 - lam_mixup) * other_HWC)
  lam = jnp.where(cut, 1 - (bottom - top) * (right - left) / (height * width), lam_mixup)
  return jnp.where(apply, mixed_HWC, image_HWC), jnp.where(apply, lam, 1.0)


def unpacked(packed_GN, offset_B, boxes_B6, canvas_HWC) -> jax.Array:
  """Crops sent end to end, each in a canvas (uint8, zeros around it) for `resize_crops`: a
  gather from each row.

  Args:
    packed_GN: `batches.pack`'s bytes: the B crops of G devices, B // G a row.
    offset_B: where each crop, row-major [h, w, C], starts in its row.
    boxes_B6: each crop's box; its h and w in `[:, 4:]`.
    canvas_HWC: the canvas's shape.
  """
  height, width, channels = canvas_HWC
  h_H11, w_1W1, c_C = (jnp.arange(height)[:, None, None], jnp.arange(width)[None, :, None],
                       jnp.arange(channels))

  def unpack(row_N, offset, box_6):
    filled_h, filled_w = box_6[4].astype(jnp.int32), box_6[5].astype(jnp.int32)
    inside_HW1 = (h_H11 < filled_h) & (w_1W1 < filled_w)
    index_HWC = jnp.where(inside_HW1, offset + (h_H11 * filled_w + w_1W1) * channels + c_C, 0)
    return jnp.where(inside_HW1, row_N[index_HWC], 0).astype(jnp.uint8)

  groups = packed_GN.shape[0]
  per_row = jax.vmap(jax.vmap(unpack, (None, 0, 0)))
  crops_GBHWC = per_row(packed_GN, offset_B.reshape(groups, -1),
                        boxes_B6.reshape(groups, -1, 6))
  return crops_GBHWC.reshape(-1, *canvas_HWC)


def resize_crops(crops_BHWC, boxes_B6, out_hw) -> jax.Array:
  """Photos' crops cut on the host, each resized on the device as PIL's bilinear resize of its
  box would be (a triangle filter, widened by the zoom where it shrinks, over the crop's own
  pixels alone): a matrix product each way.

  Args:
    crops_BHWC: the crops in their canvases (`unpacked`), float32.
    boxes_B6: each crop's box (top, left, bottom, right, in its canvas's pixels) and the height
      and width its pixels fill (the rest is padding; a padding example's zeros give zeros).
    out_hw: the resized (height, width).
  Returns:
    The resized crops, float32 [B, *out_hw, C], of the crops' scale.
  """
  _, height, width, _ = crops_BHWC.shape

  def weights(start, end, filled, size, out):  # [out, size]: output pixel <- canvas pixel
    zoom = (end - start) / out
    reach = jnp.maximum(zoom, 1.0)
    centre_O = start + (jnp.arange(out) + 0.5) * zoom
    weight_OS = jnp.maximum(1 - jnp.abs(jnp.arange(size) + 0.5 - centre_O[:, None]) / reach, 0)
    weight_OS = jnp.where(jnp.arange(size) < filled, weight_OS, 0.0)
    return weight_OS / jnp.maximum(weight_OS.sum(1, keepdims=True), 1e-30)

  def resize(crop_HWC, box_6):
    top, left, bottom, right, filled_h, filled_w = box_6
    rows_OH = weights(top, bottom, filled_h, height, out_hw[0])
    columns_PW = weights(left, right, filled_w, width, out_hw[1])
    return jnp.einsum("oh,hwc,pw->opc", rows_OH, crop_HWC, columns_PW)

  return jax.vmap(resize)(crops_BHWC, boxes_B6.astype(jnp.float32))
