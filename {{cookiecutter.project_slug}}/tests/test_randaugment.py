"""RandAugment (data/randaugment.py, `config.randaugment`): timm's operations on the host's
workers, each image's draws from the run's seed and its stream position alone: the same batches
with or without workers, on any process's rows and from a resumed position; a resumed run ends
bit for bit as the run never stopped."""

import shutil
import types

import numpy as np
import pytest
from conftest import owned
from PIL import Image
from test_preemption import final_state

import train
from configs import tiny

from {{cookiecutter.project_slug}} import plan, rules
from {{cookiecutter.project_slug}}.data import batches, randaugment, sources
from {{cookiecutter.project_slug}}.errors import ConfigError

DEIT = "rand-m9-mstd0.5-inc1"


def photo(shape=(224, 224, 3), seed=0) -> np.ndarray:
  """A photo-like image: smooth gradients and noise, every operation changes it."""
  y, x = np.mgrid[:shape[0], :shape[1]]
  base = np.stack([x * 255 / shape[1], y * 255 / shape[0], (x + y) * 127 / sum(shape[:2])], -1)
  noise = np.random.default_rng(seed).normal(0, 20, shape)
  return np.clip(base[..., :shape[2]] + noise, 0, 255).astype(np.uint8)


@pytest.mark.slow  # (timm imports PyTorch: seconds)
@pytest.mark.parametrize("increasing", [False, True], ids=["rand", "inc1"])
def test_each_operation_is_timms(increasing, monkeypatch):
  """Every operation at signed magnitudes from -10 to 10 gives timm's AugmentOp's pixels, bit for
  bit (PIL both; DeiT's bicubic and fill). timm's Posterize at 0 bits (magnitude 0; `inc1`'s
  10) raises on Pillow 13 ('bits must be between or equal to 1 and 8'): black here, as Pillow
  before 13 made it."""
  auto_augment = pytest.importorskip("timm.data.auto_augment")  # (the torch extra: CI's first)
  fill = (124, 116, 104)
  hparams = dict(img_mean=fill, interpolation=Image.Resampling.BICUBIC)
  image, changed = photo(), set()
  strengthened = ("Posterize", "Solarize", "Color", "Contrast", "Brightness", "Sharpness")
  for name in randaugment.OPS:
    timm_name = name + "Increasing" if increasing and name in strengthened else name
    for signed in (-10.0, -6.3, 0.0, 2.0, 9.0, 10.0):
      negate = 0.9 if signed < 0 else 0.1  # (timm's sign: random.random() > 0.5 negates)
      monkeypatch.setattr(auto_augment, "random", types.SimpleNamespace(random=lambda n=negate: n))
      ours = np.asarray(randaugment.apply(Image.fromarray(image), name, signed, increasing, fill))
      op = auto_augment.AugmentOp(timm_name, prob=1.0, magnitude=abs(signed), hparams=hparams)
      try:
        theirs = np.asarray(op(Image.fromarray(image)))
      except ValueError as e:  # Pillow 13's posterize of 0 bits
        assert name == "Posterize" and "bits" in str(e), e
        assert not ours.any(), (name, signed)
        continue
      np.testing.assert_array_equal(ours, theirs, err_msg=f"{name} at {signed}")
      changed.add(name) if not np.array_equal(ours, image) else None
  assert changed == set(randaugment.OPS)  # (each at some magnitude: the test sees it act)


def test_the_string_is_timms_and_the_draws_its_distribution():
  """'rand-m9-mstd0.5-inc1' parsed as timm parses it; 30,000 images' draws: 2 operations each,
  uniform over the 15, applied half the time, magnitudes N(9, 0.5) clipped to [0, 10], signs
  50/50; the same position draws the same, another seed not."""
  config = owned(tiny.get_config())
  config.randaugment = DEIT
  augment = randaugment.RandAugment.of(plan.resolved(config))
  assert (augment.magnitude, augment.num_layers, augment.magnitude_std, augment.increasing,
          augment.prob, augment.magnitude_max) == (9, 2, 0.5, True, 0.5, 10)
  draws = [augment.draws(position) for position in range(30000)]
  ops = [name for image in draws for name, _ in image]
  assert len(ops) / (2 * 30000) == pytest.approx(0.5, abs=0.01)
  shares = np.array([ops.count(name) for name in randaugment.OPS]) / len(ops)
  assert np.all(np.abs(shares * 15 - 1) < 0.06), shares
  magnitudes = np.array([signed for image in draws for _, signed in image])
  assert np.abs(magnitudes).max() == 10 and np.abs(magnitudes).mean() == pytest.approx(9, abs=0.05)
  assert (magnitudes < 0).mean() == pytest.approx(0.5, abs=0.01)
  assert augment.draws(123) == draws[123]
  other = randaugment.RandAugment(**{**augment.__dict__, "seed": 1})
  assert sum(other.draws(p) != draws[p] for p in range(100)) > 90
  config.randaugment = "rand-m9-mstd101"  # (timm: over 100, uniform in [0, m])
  uniform = randaugment.RandAugment.of(plan.resolved(config))
  spread = np.array([abs(s) for p in range(3000) for _, s in uniform.draws(p)])
  assert spread.max() < 9 and spread.mean() == pytest.approx(4.5, abs=0.2)


@pytest.mark.parametrize("given, problem", [
    ("rand-m9-q3", "'rand-m9-q3' is not one of timm's RandAugment strings"),
    ("m9-mstd0.5", "'m9-mstd0.5' is not one of timm's RandAugment strings"),
    ("rand-m9-tweights", "'rand-m9-tweights' is not one of timm's RandAugment strings"),
    ("rand-n2.5", "'rand-n2.5' is not one of timm's RandAugment strings")])
def test_a_string_not_timms_is_one_line_before_anything_runs(given, problem):
  config = owned(tiny.get_config())
  config.randaugment = given
  with pytest.raises(ConfigError) as raised:
    rules.validate_config(config)
  assert problem in str(raised.value) and "'rand-m9-mstd0.5-inc1'" in str(raised.value)
  assert "\n" not in str(raised.value)


def test_float_pixels_are_refused_in_one_line_before_anything_compiles(tmp_path, monkeypatch):
  """Pixels stored as float32 (write_arrayrecord.py's arrays): PIL's operations take 8-bit
  images, so train.py says so in one line, with the fix, and saves nothing."""
  from test_train import PROJECT, run_in_process

  import write_arrayrecord

  splits, _ = sources.get_datasets(owned(tiny.get_config()))
  write_arrayrecord.write_dataset(str(tmp_path / "data"), {
      split: (splits[split].images[:64].astype(np.float32) / 255, splits[split].labels[:64])
      for split in ("train", "eval")})
  monkeypatch.chdir(PROJECT)
  error = run_in_process("--config=configs/tiny.py", "--config.dataset=arrayrecord",
                         f"--config.data_dir={tmp_path / 'data'}", f"--config.randaugment={DEIT}",
                         f"--workdir={tmp_path / 'run'}")
  assert error == (f"error: config.randaugment='{DEIT}' works on 8-bit images; these are "
                   "float32: store them as uint8, or use --config.randaugment='' (and your own "
                   "augmentation in recipe.augment)."), error
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_batches_are_the_same_on_any_rows_and_resumed():
  """The digits with DeiT's RandAugment: each training image augmented (not the padding, not
  evaluation's), the same elements read again from a resumed step and as two processes' rows
  of each global batch (through worker processes: the slow test below)."""
  config = owned(tiny.get_config())
  config.update(randaugment=DEIT, num_epochs=1)
  assert batches.default_workers(config) >= 1  # (held in memory, augmented: workers)
  resolved = plan.resolved(config)
  splits, _ = sources.get_datasets(config)
  config.randaugment = ""
  plain = batches.train_batches(splits["train"], plan.resolved(config))
  augmented = batches.train_batches(splits["train"], resolved)
  elements = [augmented[i] for i in range(len(augmented))]
  images, before = (np.concatenate([e["image"].reshape(-1, 8, 8, 1) for e in stream])
                    for stream in (elements, plain))
  mask = np.concatenate([e["mask"].reshape(-1) for e in elements])
  changed_share = (images != before).any(axis=(1, 2, 3))[mask].mean()
  assert 0.5 < changed_share < 0.9, changed_share  # (0.75 draw one op at least; some do nothing)
  assert not elements[-1]["image"][~elements[-1]["mask"]].any()  # padding: zeros
  again = batches.train_batches(splits["train"], resolved, first_step=10)  # (of 23)
  halves = [batches.train_batches(splits["train"], resolved, rows=tuple(range(h, 64, 2)))
            for h in (0, 1)]
  for i, element in enumerate(elements):
    if i >= 10:
      np.testing.assert_array_equal(again[i - 10]["image"], element["image"])
    for h, half in enumerate(halves):
      np.testing.assert_array_equal(half[i]["image"], element["image"][:, h::2])
  evaluation = batches.eval_batches(splits["eval"], resolved)[0]
  np.testing.assert_array_equal(
      evaluation["image"], batches.eval_batches(splits["eval"], plan.resolved(
          owned(tiny.get_config())))[0]["image"])


@pytest.mark.slow  # (two trainings, with a worker process each)
def test_a_run_with_randaugment_resumes_bit_for_bit(tiny_config, tmp_path):
  """The tiny config with DeiT's RandAugment (a worker process augments), resumed from its
  step-10 checkpoint: the run that never stopped, bit for bit; so is the run augmented in this
  process (no workers); not the run without it (the augmentation is trained on)."""
  tiny_config.randaugment = DEIT
  assert batches.default_workers(tiny_config) >= 1
  straight = train.train_and_evaluate(tiny_config, str(tmp_path / "straight"))
  shutil.copytree(tmp_path / "straight" / "checkpoints" / "10",
                  tmp_path / "resumed" / "checkpoints" / "10")
  assert train.train_and_evaluate(tiny_config, str(tmp_path / "resumed")) == straight
  tiny_config.num_workers = 0
  assert train.train_and_evaluate(tiny_config, str(tmp_path / "here")) == straight
  for run in ("resumed", "here"):
    _, state = final_state(tmp_path / run)
    for name, value in final_state(tmp_path / "straight")[1].items():
      np.testing.assert_array_equal(state[name], value, err_msg=f"{run}: {name}")
  tiny_config.randaugment, tiny_config.num_workers = "", -1
  assert train.train_and_evaluate(tiny_config, str(tmp_path / "plain")) != straight


def test_photos_at_224_are_resized_by_the_host_and_augmented(tmp_path):
  """Photos stored whole (write_arrayrecord.py --resize_shorter=256 --image_size=224), the
  default resize_on_device=True: with RandAugment the host resizes the crops (no boxes sent) and
  augments them at 224 x 224, the same again."""
  from test_image_folder import convert

  for label in ("a", "b"):
    (tmp_path / "photos" / label).mkdir(parents=True)
    for i in range(4):
      Image.fromarray(photo((300, 400, 3), seed=i)).save(tmp_path / "photos" / label / f"{i}.jpg")
  done = convert(f"--out_dir={tmp_path / 'data'}", f"--image_folder={tmp_path / 'photos'}",
                 "--image_size=224", "--resize_shorter=256", "--eval_fraction=0.25")
  assert done.returncode == 0, done.stderr
  config = owned(tiny.get_config())
  config.update(dataset="arrayrecord", data_dir=str(tmp_path / "data"), augment_crop=True,
                augment_max_shift=0, batch_size=8, num_epochs=3, randaugment=DEIT)
  assert config.resize_on_device
  splits, info = sources.get_datasets(config)
  assert info.crops_on_host and info.canvas is None
  elements = batches.train_batches(splits["train"], plan.resolved(config))
  assert "box" not in elements[0] and elements[0]["image"].shape[-3:] == (224, 224, 3)
  augment = randaugment.RandAugment.of(plan.resolved(config))
  config.update(randaugment="", resize_on_device=False)  # (the crops as the host resizes them)
  plain = batches.train_batches(sources.get_datasets(config)[0]["train"], plan.resolved(config))
  drawn = []  # (each real example: whether it drew an operation, whether its pixels changed)
  for element, before in zip(elements, plain, strict=True):
    flat = {key: element[key].reshape(-1, *element[key].shape[2:]) for key in element}
    for i in np.flatnonzero(flat["mask"]):
      drawn.append((bool(augment.draws(int(flat["position"][i]))),
                    (flat["image"][i] != before["image"].reshape(-1, 224, 224, 3)[i]).any()))
  assert len(drawn) == 18 and all(drew for drew, changed in drawn if changed)
  assert sum(changed for _, changed in drawn) >= 0.5 * sum(drew for drew, _ in drawn) > 0
  config.update(randaugment=DEIT, resize_on_device=True)
  again = batches.train_batches(sources.get_datasets(config)[0]["train"], plan.resolved(config))
  np.testing.assert_array_equal(again[0]["image"], elements[0]["image"])
