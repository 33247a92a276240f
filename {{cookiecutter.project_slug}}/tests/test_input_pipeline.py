import collections

import ml_collections
import numpy as np
import pytest

import input_pipeline
from write_arrayrecord import write_dataset


def numbered(n: int) -> input_pipeline.ArraySource:
  """n examples whose label is their index, so we can tell exactly which ones a batch holds."""
  images = np.arange(1, n + 1, dtype=np.float32).reshape(n, 1, 1, 1)
  return input_pipeline.ArraySource(images, np.arange(n, dtype=np.int32))


def eval_batches(source, batch_size, **process):
  config = ml_collections.ConfigDict(dict(batch_size=batch_size))
  return input_pipeline.eval_batches(source, config, **process)


def real_labels(batch) -> list[int]:
  return batch["label"][batch["mask"]].tolist()


@pytest.mark.parametrize("n, batch_size", [(77, 16), (64, 16), (5, 8)])
def test_every_example_once_padding_masked(n, batch_size):
  batches = list(eval_batches(numbered(n), batch_size))
  assert len(batches) == -(-n // batch_size)
  assert all(b["image"].shape == (batch_size, 1, 1, 1) for b in batches)
  assert [label for b in batches for label in real_labels(b)] == list(range(n))
  last = batches[-1]
  assert last["mask"].sum() == n - (len(batches) - 1) * batch_size
  assert not last["label"][~last["mask"]].any()  # padding is zeros
  assert not last["image"][~last["mask"]].any()


@pytest.mark.parametrize("n, batch_size, processes", [(1001, 64, 2), (77, 16, 4), (9, 4, 2)])
def test_processes_split_each_global_batch(n, batch_size, processes):
  single = list(eval_batches(numbered(n), batch_size))
  per_process = [list(eval_batches(numbered(n), batch_size, process_index=p,
                                   process_count=processes)) for p in range(processes)]
  assert {len(batches) for batches in per_process} == {len(single)}  # same step count everywhere
  for step, batch in enumerate(single):
    parts = [batches[step] for batches in per_process]
    assert all(part["label"].shape == (batch_size // processes,) for part in parts)
    assert sorted(sum((real_labels(part) for part in parts), [])) == real_labels(batch)


def test_train_stream_is_a_fresh_seeded_permutation_each_epoch(tiny_config):
  tiny_config.num_epochs, tiny_config.augment_max_shift, tiny_config.batch_size = 3, 0, 16
  n = 50
  epochs = [real_labels(b) for b in input_pipeline.train_batches(numbered(n), tiny_config)]
  labels = sum(epochs, [])
  assert len(labels) == 3 * n
  per_epoch = [labels[i * n:(i + 1) * n] for i in range(3)]
  assert all(sorted(epoch) == list(range(n)) for epoch in per_epoch)
  assert per_epoch[0] != per_epoch[1] != per_epoch[2]
  again = sum((real_labels(b) for b in input_pipeline.train_batches(numbered(n), tiny_config)), [])
  assert again == labels
  tiny_config.seed += 1
  other = sum((real_labels(b) for b in input_pipeline.train_batches(numbered(n), tiny_config)), [])
  assert other != labels


def test_iterator_resumes_at_a_batch(tiny_config):
  batches = eval_batches(numbered(100), 16)
  all_batches = list(input_pipeline.as_iterator(batches, tiny_config))
  resumed = list(input_pipeline.as_iterator(batches, tiny_config, start=4))
  assert len(resumed) == len(all_batches) - 4
  for a, b in zip(all_batches[4:], resumed, strict=True):
    np.testing.assert_array_equal(a["label"], b["label"])


def test_random_shift_moves_pixels_by_key():
  images = np.zeros((300, 8, 8, 1), np.float32)
  images[:, 4, 4] = 1.0
  keys = np.arange(300)
  shifted = input_pipeline.random_shift(images, 1, keys)
  assert shifted.shape == images.shape and (shifted.sum(axis=(1, 2, 3)) == 1.0).all()
  positions = collections.Counter(tuple(np.argwhere(image[..., 0])[0]) for image in shifted)
  assert set(positions) == {(4 + dy, 4 + dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)}
  assert min(positions.values()) > 300 / 9 / 2  # roughly uniform
  again = input_pipeline.random_shift(images[::-1], 1, keys[::-1])[::-1]
  np.testing.assert_array_equal(again, shifted)  # a function of the key, not of the batch


def test_training_batches_do_not_depend_on_the_process_count(tiny_config):
  """Shuffle and augmentation are functions of the stream position: 2 processes together
  produce exactly the global batches of 1 process."""
  tiny_config.batch_size = 64
  source = input_pipeline.ArraySource(
      np.random.default_rng(0).random((100, 8, 8, 1), dtype=np.float32), np.arange(100))
  single = list(input_pipeline.train_batches(source, tiny_config))
  parts = [list(input_pipeline.train_batches(source, tiny_config, process_index=p,
                                             process_count=2)) for p in range(2)]
  for step, batch in enumerate(single):
    for key in batch:
      joined = np.stack([parts[0][step][key], parts[1][step][key]], axis=1)  # interleave
      np.testing.assert_array_equal(joined.reshape(batch[key].shape), batch[key])


def test_digits_split(tiny_config):
  splits, info = input_pipeline.get_datasets(tiny_config)
  assert info.image_shape == (8, 8, 1) and info.num_classes == 10
  assert info.num_examples == {"train": 1437, "eval": 360}
  example = splits["eval"].take(np.array([0]))
  assert example["image"].dtype == np.float32 and 0 <= example["image"].min() <= 1


def test_arrayrecord_round_trip(tmp_path, tiny_config):
  """Shards written by write_arrayrecord.py are read back, example by example, by the pipeline."""
  rng = np.random.default_rng(0)
  arrays = {split: (rng.integers(0, 256, (n, 6, 5, 3), dtype=np.uint8),
                    rng.integers(0, 4, n).astype(np.int32)) for split, n in
            (("train", 53), ("eval", 11))}
  write_dataset(str(tmp_path), arrays, num_shards=3)
  assert len(input_pipeline.arrayrecord_paths(str(tmp_path), "train")) == 3
  tiny_config.dataset, tiny_config.data_dir = "arrayrecord", str(tmp_path)
  splits, info = input_pipeline.get_datasets(tiny_config)
  assert info.image_shape == (6, 5, 3)
  assert info.num_classes == int(max(y.max() for _, y in arrays.values())) + 1
  assert info.num_examples == {"train": 53, "eval": 11}
  for split, (images, labels) in arrays.items():
    read = splits[split].take(np.arange(len(labels)))
    np.testing.assert_array_equal(read["image"], images)
    np.testing.assert_array_equal(read["label"], labels)
  batch = next(iter(input_pipeline.eval_batches(splits["eval"], tiny_config)))
  np.testing.assert_allclose(batch["image"][:11], arrays["eval"][0] / 255.0, rtol=1e-6)
