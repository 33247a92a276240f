"""RandAugment (Cubuk et al., 2019) as timm's `rand-...` strings define it (`config.randaugment`;
DeiT's: 'rand-m9-mstd0.5-inc1'), on the host: the training split's images, uint8 at the model's
size, each by PIL's operations as timm's, in the loader's workers (batches.LoadUnit.augment).

Each image draws its own from the run's seed and its place in the stream alone (as the crops,
`image_files.Crops`), so a resume, any number of processes, workers or devices, and every
parallelism draw the same. Loaded only when `config.randaugment` is set."""

import dataclasses
import re

import numpy as np
from PIL import Image, ImageEnhance, ImageOps

from ..errors import ConfigError

# timm's _RAND_TRANSFORMS; `inc1` (_RAND_INCREASING_TRANSFORMS) makes Posterize, Solarize and
# the four enhancements stronger as the magnitude grows.
OPS = ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "SolarizeAdd",
       "Color", "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateXRel",
       "TranslateYRel")
STRING = r"rand(-(m|mstd|mmax|p)\d+(\.\d*)?|-(n|inc)\d+)*"  # timm's keys (`t`, weighted: not)
IMAGENET_MEAN = (0.485, 0.456, 0.406)  # the fill of what the geometric ops uncover, as timm's


@dataclasses.dataclass(frozen=True)
class RandAugment:
  """`num_layers` operations an image, each drawn uniformly from OPS (with replacement) and applied
  with probability `prob`, at a magnitude ~ N(`magnitude`, `magnitude_std`) clipped to [0,
  `magnitude_max`] (of 10: timm's scale), its sign (the rotation's, a shear's...) drawn 50/50."""

  magnitude: float = 10
  num_layers: int = 2
  prob: float = 0.5
  magnitude_std: float = 0.0  # > 100: uniform in [0, magnitude]
  magnitude_max: float = 10
  increasing: bool = False
  fill: tuple[int, ...] = (124, 116, 104)
  seed: int = 0

  @classmethod
  def of(cls, config) -> "RandAugment":
    """`config.randaugment` parsed (timm's keys: m, n, mstd, mmax, inc, p), the fill the colour of
    the input's mean (`config.run.input_mean`, else ImageNet's), the run's seed."""
    if not re.fullmatch(STRING, config.randaugment):
      raise ConfigError(f"config.randaugment={config.randaugment!r} is not one of timm's "
                        "RandAugment strings; use e.g. 'rand-m9-mstd0.5-inc1' (DeiT's: m "
                        "magnitude of 10, n layers, mstd its noise, mmax, inc, p), or ''.")
    keys = {"m": "magnitude", "n": "num_layers", "mstd": "magnitude_std", "mmax": "magnitude_max",
            "inc": "increasing", "p": "prob"}
    kinds = {"num_layers": int, "increasing": lambda v: bool(int(float(v)))}
    given = {keys[key]: kinds.get(keys[key], float)(value) for key, value in
             (re.fullmatch(r"([a-z]+)(.*)", part).groups()
              for part in config.randaugment.split("-")[1:])}
    mean = tuple(config.run.get("input_mean", ())) or IMAGENET_MEAN
    return cls(**given, fill=tuple(min(255, round(255 * m)) for m in mean), seed=config.seed)

  def draws(self, position: int) -> list[tuple[str, float]]:
    """The operations that example `position` gets, with their signed magnitudes (of 10)."""
    rng = np.random.default_rng([self.seed, position, 7])  # (the crop's: [seed, position])
    ops = rng.integers(len(OPS), size=self.num_layers)
    applied, noise, negate = (rng.random(self.num_layers) for _ in range(3))
    magnitude = np.full(self.num_layers, float(self.magnitude))
    if self.magnitude_std > 100:
      magnitude = noise * self.magnitude
    elif self.magnitude_std > 0:
      magnitude = rng.normal(self.magnitude, self.magnitude_std, self.num_layers)
    magnitude = np.clip(magnitude, 0, self.magnitude_max)
    return [(OPS[op], m * (-1 if neg > 0.5 else 1)) for op, m, a, neg in zip(
        ops, magnitude, applied, negate, strict=True) if a < self.prob]

  def __call__(self, images_NHWC: np.ndarray, positions_N: np.ndarray) -> np.ndarray:
    """The images (uint8), each with its draws (`draws`), as a new array."""
    out_NHWC = images_NHWC.copy()
    for image_HWC, position in zip(out_NHWC, positions_N, strict=True):
      gray = image_HWC.shape[-1] == 1
      image = Image.fromarray(image_HWC[..., 0] if gray else image_HWC)
      for name, signed in self.draws(int(position)):
        image = apply(image, name, signed, self.increasing,
                      round(np.mean(self.fill)) if gray else self.fill[:3])
      image_HWC[:] = np.asarray(image).reshape(image_HWC.shape)
    return out_NHWC


def apply(image, name: str, signed: float, increasing: bool, fill):
  """One of OPS at a signed magnitude (of 10), as timm's AugmentOp applies it: rotations up to
  30 degrees, shears up to 0.3, translations up to 45% of the side (bicubic, DeiT's; what they
  uncover `fill`), enhancements of factor 0.1-1.9 (`increasing`: 1 +- 0.9), Posterize to 4-0
  bits, Solarize above 256-0 (`increasing`; else the reverse), SolarizeAdd of up to 110."""
  level, m = signed / 10, abs(signed) / 10
  warp = dict(resample=Image.Resampling.BICUBIC, fillcolor=fill)
  affine = {"ShearX": (1, level * 0.3, 0, 0, 1, 0), "ShearY": (1, 0, 0, level * 0.3, 1, 0),
            "TranslateXRel": (1, 0, level * 0.45 * image.size[0], 0, 1, 0),
            "TranslateYRel": (1, 0, 0, 0, 1, level * 0.45 * image.size[1])}
  if name in affine:
    return image.transform(image.size, Image.Transform.AFFINE, affine[name], **warp)
  if name == "Rotate":
    return image.rotate(level * 30, **warp)
  if name in ("AutoContrast", "Equalize", "Invert"):
    return {"AutoContrast": ImageOps.autocontrast, "Equalize": ImageOps.equalize,
            "Invert": ImageOps.invert}[name](image)
  if name == "Posterize":  # (ImageOps.posterize's table; Pillow 13's refuses 0 bits: black)
    bits = 4 - int(m * 4) if increasing else int(m * 4)
    return image.point([i & (0xFF << (8 - bits)) & 0xFF for i in range(256)] * len(
        image.getbands()))
  if name == "Solarize":
    threshold = int(m * 256)
    return ImageOps.solarize(image, 256 - threshold if increasing else threshold)
  if name == "SolarizeAdd":
    add = int(m * 110)
    lut = [min(255, i + add) if i < 128 else i for i in range(256)]
    return image.point(lut * len(image.getbands()))
  factor = max(0.1, 1 + level * 0.9) if increasing else m * 1.8 + 0.1
  return getattr(ImageEnhance, name)(image).enhance(factor)
