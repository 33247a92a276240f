"""On-device augmentation: stored pixels to the model's float input, with random resized crops,
flips and shifts, each keyed by the example's place in the data stream alone, so that any
batching, number of devices or processes, and any resume give every example the same one."""

import math

import jax
import jax.numpy as jnp

# Folded into the seed's key before the stream positions: the augmentation keys are then none of
# the keys that `nnx.Rngs(seed)` hands out (fold_in(key(seed), n), n = 0, 1, ...).
AUGMENT_STREAM = 0x61756720  # b"aug "


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


def to_float(images_BHWC) -> jax.Array:
  """Stored pixels -> the model's float32 input: integers divided by 255, floats as they are."""
  images = images_BHWC.astype(jnp.float32)
  return images / 255.0 if jnp.issubdtype(images_BHWC.dtype, jnp.integer) else images


def example_keys(seed: int, positions_B) -> jax.Array:
  """One random key an example, from `seed` and its place in the data stream alone."""
  key = jax.random.fold_in(jax.random.key(seed), AUGMENT_STREAM)
  return jax.vmap(lambda position: jax.random.fold_in(key, position))(positions_B)


def transform(images_BHWC, keys_B, crop: tuple | None = None, flip: bool = False,
              max_shift: int = 0) -> jax.Array:
  """With `crop` ((scale range, aspect range), see `random_resized_crop`) a random resized crop,
  with `flip` a horizontal flip of half the images, with `max_shift` a shift by up to that many
  pixels each way (zero fill), in that order; each drawn from the example's key (`keys_B`)."""
  if crop:
    images_BHWC = jax.vmap(lambda key, image: random_resized_crop(
        jax.random.fold_in(key, 1), image, *crop))(keys_B, images_BHWC)
  if flip:
    flips_B = jax.vmap(lambda key: jax.random.bernoulli(jax.random.fold_in(key, 2)))(keys_B)
    images_BHWC = jnp.where(flips_B[:, None, None, None], images_BHWC[:, :, ::-1], images_BHWC)
  if not max_shift:
    return images_BHWC
  _, height, width, channels = images_BHWC.shape
  shifts_B2 = jax.vmap(lambda key: jax.random.randint(key, (2,), 0, 2 * max_shift + 1))(keys_B)
  padded = jnp.pad(images_BHWC, ((0, 0), (max_shift,) * 2, (max_shift,) * 2, (0, 0)))
  return jax.vmap(lambda image, shift: jax.lax.dynamic_slice(
      image, (shift[0], shift[1], 0), (height, width, channels)))(padded, shifts_B2)

