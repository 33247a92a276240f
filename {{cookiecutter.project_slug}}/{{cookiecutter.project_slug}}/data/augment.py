"""Augmentations that the recipe (recipe.py) calls on the devices, each drawn from one example's
key (training/steps.py makes it from the example's place in the data stream alone), and the
resize of photos' crops that the host cut (`unpacked`, `resize_crops`: dispatch.on_resized)."""

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
