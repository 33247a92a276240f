"""Augmentations that the recipe (recipe.py) calls on the devices, each drawn from one example's
key (training/steps.py makes it from the example's place in the data stream alone)."""

import math

import jax
import jax.numpy as jnp


def random_resized_crop(key, image_HWC, scale, ratio) -> jax.Array:
  """A crop of a random fraction of the area in `scale` and aspect (width / height) in `ratio`
  (log-uniform), resized back to the image's size (bilinear): the first of 10 draws that fits
  in the image, or the whole image. The crop need not fall on whole pixels."""
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
