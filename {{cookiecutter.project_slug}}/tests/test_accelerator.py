"""On the host's real accelerator (GPU or TPU), when it has one: a few epochs of the tiny config
on both paths, pmap = spmd, resume, and a non-zero MFU. (What the TPU's and the GPU's compilers
can tell without one, test_aot.py asks them here.) Every other test runs on the CPU (see
conftest.py); these run in subprocesses given the environment as it was before pytest pinned
the CPU, and are skipped, with the reason, on a host without an accelerator.

  python -m pytest -m accelerator -rs
"""

import json
import os
import subprocess
import sys

import pytest
from conftest import ACCELERATOR_ENV

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.accelerator, pytest.mark.slow]  # (processes, full trainings)

PROBE = "import jax; print(jax.default_backend(), jax.devices()[0].device_kind, sep='|')"

# Trains the tiny config for 2 epochs on each path, then resumes the spmd run from its step-20
# checkpoint; prints the final eval metrics and the logged MFU of each run as JSON.
DRIVER = """
import json, os, shutil, sys, tempfile
from absl import flags
flags.FLAGS.mark_as_parsed()
import train
from configs import tiny
from conftest import owned
from test_train import read_scalars

def config(parallelism):
  c = owned(tiny.get_config())
  c.parallelism, c.num_epochs, c.max_checkpoints_to_keep = parallelism, 2, 10
  return c

root, out = tempfile.mkdtemp(), {}
for parallelism in ("spmd", "pmap"):
  workdir = os.path.join(root, parallelism)
  out[parallelism] = train.train_and_evaluate(config(parallelism), workdir)
  out[parallelism + "_mfu"] = list(read_scalars(workdir).get("train_mfu", {}).values())
resumed = os.path.join(root, "resumed")
shutil.copytree(os.path.join(root, "spmd", "checkpoints", "20"),
                os.path.join(resumed, "checkpoints", "20"))
out["resumed"] = train.train_and_evaluate(config("spmd"), resumed)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def accelerator() -> dict:
  env = dict(ACCELERATOR_ENV)  # as before conftest.py pinned the CPU
  probe = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=300)
  assert probe.returncode == 0, probe.stderr[-3000:]
  backend, kind = probe.stdout.strip().splitlines()[-1].split("|")
  if backend == "cpu":
    pytest.skip("no accelerator: JAX's default backend on this host is the CPU")
  return dict(env=env, backend=backend, kind=kind)


def test_train_pmap_equals_spmd_resume_and_mfu_on_the_accelerator(accelerator):
  from {{cookiecutter.project_slug}}.parallel import chips

  path = [os.path.join(PROJECT, "tests"), accelerator["env"].get("PYTHONPATH")]  # (the host's)
  env = accelerator["env"] | {"PYTHONPATH": os.pathsep.join(filter(None, path))}
  done = subprocess.run([sys.executable, "-c", DRIVER], cwd=PROJECT, capture_output=True,
                        text=True, timeout=1200, env=env)
  assert done.returncode == 0, done.stderr[-4000:]
  out = json.loads(done.stdout.splitlines()[-1])
  spmd, pmap, resumed = out["spmd"], out["pmap"], out["resumed"]
  for result in (spmd, pmap, resumed):
    assert result["examples"] == 360 and result["accuracy"] > 0.5, result
  # Accelerators reduce in other orders (and may pick non-deterministic kernels): close, not equal.
  assert pmap["loss"] == pytest.approx(spmd["loss"], rel=1e-3, abs=1e-4)
  assert abs(pmap["accuracy"] - spmd["accuracy"]) <= 2 / 360
  assert resumed["loss"] == pytest.approx(spmd["loss"], rel=1e-3, abs=1e-4)
  assert abs(resumed["accuracy"] - spmd["accuracy"]) <= 2 / 360
  if chips.peak_flops(accelerator["kind"]):
    assert out["spmd_mfu"] and all(mfu > 0 for mfu in out["spmd_mfu"] + out["pmap_mfu"])
  else:
    print(f"no peak FLOP/s known for {accelerator['kind']!r}: MFU not logged")
