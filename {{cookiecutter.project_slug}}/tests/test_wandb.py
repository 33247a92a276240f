"""Weights & Biases beside TensorBoard (wandb_writer.WandbWriter), in W&B's offline mode: nothing
leaves the machine; what a run logged is read back from W&B's own files."""

import glob
import json
import os
import struct
import subprocess
import sys

import pytest
from conftest import PROJECT, owned

import train
from configs import tiny

from {{cookiecutter.project_slug}} import host_rules, rules

BLOCK, HEADER = 32768, 7  # W&B's .wandb log: LevelDB's record format after a 7-byte file header


def wandb_records(path: str) -> list:
  """The `Record`s of a .wandb file: chunks (crc, length, type: 1 whole, 2 first, 3 middle, 4
  last) laid in 32 KiB blocks, a block's tail shorter than a chunk header left as padding."""
  from wandb.proto import wandb_internal_pb2  # (here: the fast tier does not load W&B)

  with open(path, "rb") as f:
    data = f.read()
  records, pending, pos = [], b"", HEADER
  while pos + HEADER <= len(data):
    if BLOCK - pos % BLOCK < HEADER:
      pos += BLOCK - pos % BLOCK
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
    pending += data[pos + HEADER:pos + HEADER + length]
    pos += HEADER + length
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      records.append(record)
      pending = b""
  return records


def logged(run_dir: str) -> tuple[dict[int, dict], dict]:
  """What an offline W&B run directory holds: the values logged at each step, and the config."""
  (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
  history, config = {}, {}
  for record in wandb_records(path):
    if record.HasField("history"):
      items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
               for item in record.history.item}
      history.setdefault(items.pop("_step"), {}).update(items)
    for item in (record.run.config.update if record.HasField("run") else
                 record.config.update if record.HasField("config") else ()):
      config[item.key] = json.loads(item.value_json)
  return history, config


@pytest.fixture
def offline(monkeypatch, tmp_path):
  """W&B offline, its caches and settings in `tmp_path`, WANDB_DIR unset (files: the workdir)."""
  monkeypatch.delenv("WANDB_DIR", raising=False)
  monkeypatch.setenv("WANDB_MODE", "offline")
  for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
    monkeypatch.setenv(name, str(tmp_path / name.lower()))


@pytest.mark.slow  # (an optional extra; the fast tier keeps within 120 s on 2 cores)
def test_a_run_and_its_resume_log_to_one_wandb_run(offline, tmp_path):
  """The scalars that TensorBoard gets, at the same steps, and the config; the resumed run under
  the same W&B id (offline, W&B writes a directory for each process: they merge at sync)."""
  config = owned(tiny.get_config())
  config.wandb_project, config.num_epochs = "nnx-dp-test", 1
  workdir = tmp_path / "run"
  first = train.train_and_evaluate(config, str(workdir))
  run_id = (workdir / "wandb_run_id").read_text()
  (run_dir,) = glob.glob(str(workdir / "wandb" / f"offline-run-*-{run_id}"))
  history, logged_config = logged(run_dir)
  last = max(history)
  assert history[last]["eval_accuracy"] == pytest.approx(first["accuracy"], abs=1e-6)
  assert logged_config["learning_rate"] == config.learning_rate
  assert logged_config["wandb_project"] == "nnx-dp-test"
  assert "train_loss" in history[config.log_every_steps]
  assert (workdir / "checkpoints" / str(last)).is_dir()  # W&B's steps are the run's

  config.num_epochs, config.resume_may_change = 2, "num_epochs"  # trained on
  second = train.train_and_evaluate(config, str(workdir))
  assert (workdir / "wandb_run_id").read_text() == run_id
  run_dirs = sorted(glob.glob(str(workdir / "wandb" / f"offline-run-*-{run_id}")))
  assert len(run_dirs) == 2 and run_dir in run_dirs
  resumed, _ = logged(next(d for d in run_dirs if d != run_dir))
  assert min(resumed) > last
  assert resumed[max(resumed)]["eval_accuracy"] == pytest.approx(second["accuracy"], abs=1e-6)


def test_wandb_project_without_wandb_installed_is_one_line(monkeypatch):
  installed = host_rules._installed
  monkeypatch.setattr(host_rules, "_installed",
                      lambda module: module != "wandb" and installed(module))
  config = owned(tiny.get_config())
  config.wandb_project = "mine"
  with pytest.raises(rules.ConfigError) as e:
    rules.validate_config(config)
  assert str(e.value) == ("config.wandb_project='mine' needs the `wandb` package: pip install -e "
                          "'.[wandb]'.")


@pytest.mark.slow
def test_a_run_without_wandb_project_never_imports_wandb(tmp_path):
  code = ("import sys; from absl import flags; flags.FLAGS.mark_as_parsed(); import train; "
          "from configs import tiny; from conftest import owned; "
          "c = owned(tiny.get_config()); c.num_epochs = 1; "
          f"train.train_and_evaluate(c, {str(tmp_path / 'run')!r}); "
          "print(sorted(m for m in sys.modules if m.split('.')[0] == 'wandb'))")
  done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.strip().splitlines()[-1] == "[]"
