"""Template updates with cruft (README: Updating a baked project): a project baked by
`cruft create` from a git clone of this template takes a later commit of the clone with
`cruft update`; where the user edited the same lines, git's conflict markers show both."""

import os
import subprocess
import sys
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[1]
GIT_ENV = os.environ | {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
                        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
TEMPLATE_LINE = "# A line of a later template commit."
USER_LINE = "# The user's own line, in the same place."


def run(cwd, *args) -> subprocess.CompletedProcess:
  return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, env=GIT_ENV,
                        timeout=120)


def commit(cwd, message: str) -> None:
  for args in (["git", "add", "-A"], ["git", "commit", "-q", "-m", message]):
    done = run(cwd, *args)
    assert done.returncode == 0, done.stderr


def add_line(path: Path, line: str, after: int) -> None:
  lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
  path.write_text("".join(lines[:after] + [line + "\n"] + lines[after:]), encoding="utf-8")


def test_cruft_update_brings_a_later_template_commit_into_a_baked_project(tmp_path):
  clone = tmp_path / "template"
  done = run(tmp_path, "git", "clone", "-q", str(TEMPLATE), str(clone))
  assert done.returncode == 0, done.stderr
  cruft = [sys.executable, "-m", "cruft"]
  done = run(tmp_path, *cruft, "create", "--no-input", "--output-dir", "out", str(clone))
  assert done.returncode == 0, done.stderr
  project = tmp_path / "out" / "nnx_data_parallel"
  assert (project / ".cruft.json").is_file() and (project / "train.py").is_file()
  assert run(project, "git", "init", "-q").returncode == 0
  commit(project, "baked")

  baked = clone / "{{cookiecutter.project_slug}}"
  add_line(baked / "model.py", TEMPLATE_LINE, after=1)
  machinery = Path("{{cookiecutter.project_slug}}", "training", "writers.py")  # any module of it
  add_line(baked / machinery, TEMPLATE_LINE, after=1)
  commit(clone, "a later template commit")
  assert run(project, *cruft, "check").returncode == 1  # out of date
  add_line(project / "model.py", USER_LINE, after=1)
  commit(project, "the user's own model")

  done = run(project, *cruft, "update", "-y")
  assert done.returncode == 0, done.stdout + done.stderr
  writers = project / "nnx_data_parallel" / "training" / "writers.py"
  assert writers.read_text(encoding="utf-8").splitlines()[1] == TEMPLATE_LINE
  model = (project / "model.py").read_text(encoding="utf-8").splitlines()
  assert model[1:6] == ["<<<<<<< ours", USER_LINE, "=======", TEMPLATE_LINE, ">>>>>>> theirs"]
  assert run(project, "git", "status", "--short", "model.py").stdout.startswith("UU")
  assert run(project, *cruft, "check").returncode == 0  # up to date: the conflict is the user's


def test_cruft_update_moves_a_project_baked_before_the_package(tmp_path):
  """README: The move to one package. A project baked from the last commit with the machinery at
  its top level, with the user's own edits in it, takes the move with `cruft update` to the
  move's commit, then to the newest: the modules land in the package with the user's lines, and
  train.py imports."""
  moved = run(TEMPLATE, "git", "log", "-1", "--format=%H", "--diff-filter=D", "--",
              "{{cookiecutter.project_slug}}/steps.py").stdout.strip()
  assert moved, "the template's history holds no commit that moved steps.py (a shallow clone?)"
  clone = tmp_path / "template"
  done = run(tmp_path, "git", "clone", "-q", str(TEMPLATE), str(clone))
  assert done.returncode == 0, done.stderr
  cruft = [sys.executable, "-m", "cruft"]
  done = run(tmp_path, *cruft, "create", "--no-input", "--checkout", f"{moved}^",
             "--output-dir", "out", str(clone))
  assert done.returncode == 0, done.stderr
  project = tmp_path / "out" / "nnx_data_parallel"
  assert (project / "steps.py").is_file()
  assert run(project, "git", "init", "-q").returncode == 0
  commit(project, "baked")
  # (in metrics.py's docstring, which the template has left as it was since: a user's line beside
  # lines the template changed is a conflict, as in any merge; steps.py's first line has changed)
  add_line(project / "metrics.py", USER_LINE, after=1)
  commit(project, "the user's own line")

  # As the README says: first to the move itself, where each module is still close to its old
  # self (git applies a rename only above 50% alike), then to the newest commit.
  done = run(project, *cruft, "update", "-y", "--checkout", moved)
  assert done.returncode == 0, done.stdout + done.stderr
  commit(project, "the move to one package")
  done = run(project, *cruft, "update", "-y")
  assert done.returncode == 0, done.stdout + done.stderr
  assert not (project / "steps.py").exists() and not (project / "parallel.py").exists()
  metrics = project / "nnx_data_parallel" / "training" / "metrics.py"
  assert metrics.read_text(encoding="utf-8").splitlines()[1] == USER_LINE
  assert (project / "nnx_data_parallel" / "parallel" / "sharding.py").is_file()
  done = run(project, sys.executable, "-c", "import train")
  assert done.returncode == 0, done.stderr[-3000:]
  assert run(project, *cruft, "check").returncode == 0
