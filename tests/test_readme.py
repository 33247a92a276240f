"""The READMEs' commands, run as written: the template README's in a copy of this repository,
then the baked README's from the baked folder, where the first command leaves the reader.

A ```bash block runs verbatim, in a fresh shell (no virtual environment active, no XLA_FLAGS),
unless the line above it says `<!-- not run by the README test: REASON -->` (printed). A
```python block under `<!-- model.py ... -->` replaces the baked `model.py` and trains.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

TEMPLATE = Path(__file__).resolve().parents[1]
SLUG = "nnx_data_parallel"
BLOCK = re.compile(r"(?:<!-- (?P<note>[^>]*) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)```", re.DOTALL)
SKIP = "not run by the README test: "
NOT_COPIED = shutil.ignore_patterns(".git", ".venv*", "build", "__pycache__", ".pytest_cache",
                                    ".ruff_cache", "workdir*")


def blocks(readme: Path) -> list[tuple[str, str, str]]:
  """Every fenced block of `readme`: (language, code, the HTML comment right above it)."""
  return [(m["lang"], m["code"], m["note"] or "")
          for m in BLOCK.finditer(readme.read_text(encoding="utf-8"))]


def fresh_shell_env() -> dict[str, str]:
  """The environment of a new terminal: this test's own interpreter settings left out."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "VIRTUAL_ENV", "PYTHONPATH")}
  env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                if not (Path(p).parent / "pyvenv.cfg").exists())
  return env


def run_block(code: str, cwd: Path, timeout: int) -> str:
  proc = subprocess.run(["bash", "-e", "-c", code], cwd=cwd, env=fresh_shell_env(), check=False,
                        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
  output = proc.stdout + proc.stderr
  assert proc.returncode == 0, f"{code}\nexit {proc.returncode}:\n{output[-5000:]}"
  assert "Traceback" not in output, f"{code}\n{output[-5000:]}"
  return output


def training_log(output: str) -> list[str]:
  """The lines of a training run's output, from its first log line on (pip's are left out)."""
  lines = output.splitlines()
  first = next(i for i, line in enumerate(lines) if re.search(r"\] jax \S+, flax ", line))
  return lines[first:]


def final_accuracy(output: str) -> float:
  return float(re.findall(r"Final eval: accuracy ([\d.]+)", output)[-1])


def write_photos(folder: Path):
  """The reader's own folder of JPEG files, one subfolder per class, of several sizes as photos
  come: the digits, 0..255, at 8x8, 12x12 and 16x16 (which the README's command fits to 8x8)."""
  from PIL import Image
  from sklearn.datasets import load_digits

  images, labels = load_digits(return_X_y=True)
  for i, (image, label) in enumerate(zip(images, labels, strict=True)):
    (folder / str(label)).mkdir(parents=True, exist_ok=True)
    pixels = Image.fromarray(np.round(image.reshape(8, 8) * 255 / 16).astype(np.uint8))
    side = (8, 12, 16)[i % 3]
    pixels.resize((side, side), Image.Resampling.BICUBIC).save(
        folder / str(label) / f"{i:04d}.jpg", quality=95)


def write_mine_npz(path: Path):
  """The reader's own arrays, as the baked README describes them: the digits, uint8 0..255."""
  from sklearn.datasets import load_digits

  images, labels = load_digits(return_X_y=True)
  images = np.round(images.reshape(-1, 8, 8, 1) * 255 / 16).astype(np.uint8)
  np.savez(path, train_images=images[:1400], train_labels=labels[:1400],
           eval_images=images[1400:], eval_labels=labels[1400:])


@pytest.mark.readme
def test_readme_commands_run_as_written(tmp_path):
  clone = tmp_path / "nnx-dp"
  shutil.copytree(TEMPLATE, clone, ignore=NOT_COPIED)

  template_blocks = blocks(clone / "README.md")
  assert [lang for lang, _, _ in template_blocks] == ["bash", "bash", "bash"]
  (_, bake, _), (_, _, note), (_, _, cruft_note) = template_blocks
  assert "-m pytest" in template_blocks[1][1] and not note  # run by CI as this suite itself
  assert "tests/test_cruft.py" in cruft_note  # `cruft create gh:...`: its steps, on a clone
  output = run_block(bake, clone, timeout=1500)
  log = training_log(output)
  # The paths (the project's, the compilation cache's) are the user's, of any length.
  paths = (str(clone), os.path.expanduser("~/.cache/jax_compilation_cache"))
  noisy = [line for line in log if "WARNING" in line
           or len(line.replace(paths[0], "DIR").replace(paths[1], "DIR")) > 160]
  assert not noisy, "\n".join(noisy)
  assert final_accuracy(output) >= 0.98, log[-3:]
  print(f"template README: trained to {final_accuracy(output)}; its log: {len(log)} lines")

  project = clone / "build" / SLUG
  # Run again, the command leaves the bake (an edited model.py) as it is, saying why in a line.
  edited = (project / "model.py").read_text() + "# mine\n"
  (project / "model.py").write_text(edited)
  again = subprocess.run(["bash", "-e", "-c", bake], check=False, cwd=clone,
                         env=fresh_shell_env(), stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, timeout=300)
  assert again.returncode != 0 and (project / "model.py").read_text() == edited
  assert again.stdout.strip().splitlines()[-1] == (  # (cookiecutter prints it on stdout)
      f'Error: "build/{SLUG}" directory already exists'), again.stdout[-2000:]
  write_mine_npz(project / "mine.npz")
  write_photos(project / "photos")
  ran, skipped, models = 0, [], []
  for lang, code, note in blocks(project / "README.md"):
    if note.startswith(SKIP):
      skipped.append(note.removeprefix(SKIP))
    elif lang == "bash":
      output = run_block(code, project, timeout=900)
      if "train.py" in code or "launch.py" in code:
        assert final_accuracy(output) >= 0.9, output[-2000:]
      ran += 1
    elif note.startswith("model.py"):
      models.append(code)
  print(f"baked README: ran {ran} bash blocks; not run: {skipped}")
  # Not run: the test command itself, and ImageNet (the cluster launch files: test_clusters.py).
  assert skipped == ["it is the suite that holds that test",
                     "it needs ImageNet (ILSVRC 2012, 150 GB)",
                     "it downloads ResNet-50's weights; tests/test_pretrained.py runs it on "
                     "random ones"]
  assert ran >= 3 and len(models) == 1
  # aot.py's compilers went into a venv of their own: training's stays quiet on the CPU.
  compilers = run_block(".venv/bin/python -c \"import importlib.util as u; print([m for m in "
                        "('libtpu', 'jax_cuda12_plugin') if u.find_spec(m)])\"", project, 60)
  assert compilers.strip() == "[]", compilers

  for parallelism in ("spmd", "pmap"):  # the README's own model.py, on both paths
    (project / "model.py").write_text(models[0], encoding="utf-8")
    output = run_block(
        "XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python train.py "
        f"--config=configs/tiny.py --workdir=workdir_readme_model_{parallelism} "
        f"--config.parallelism={parallelism} --config.num_epochs=3", project, timeout=600)
    assert "non-finite" not in output and final_accuracy(output) >= 0.8, output[-2000:]
    assert not [line for line in output.splitlines() if "WARNING" in line or "E0000" in line]
    print(f"README model.py, {parallelism}: accuracy {final_accuracy(output)}")
