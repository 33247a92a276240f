"""Runs one process of a job (train.py, evaluate.py, ...) under a cluster's launcher, watched:
its standard error and signals passed on, and the job's loss of a process said in one line
instead of the survivor's stack dumps (nnx_data_parallel/parallel/watch.py). The files of
clusters/ call it; it ends with its process, which ends with it.

  srun ... .venv/bin/python clusters/watched.py train.py --config=... --workdir=...
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's
from {{cookiecutter.project_slug}}.parallel import watch  # noqa: E402  (installed or not)

if __name__ == "__main__":
  if len(sys.argv) < 2:
    sys.exit("usage: python clusters/watched.py SCRIPT.py [its flags]")
  sys.exit(watch.watched([sys.executable, *sys.argv[1:]]))
