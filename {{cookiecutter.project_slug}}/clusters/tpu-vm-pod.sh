#!/bin/bash
# train.py on a Cloud TPU VM pod slice: the project copied to every host, installed there, and
# the same command run on all of them at once (JAX finds the other hosts by itself).
#   bash clusters/tpu-vm-pod.sh TPU_NAME ZONE --config=configs/imagenet.py \
#       --workdir=gs://BUCKET/runs/nnx-dp
# The arguments after TPU_NAME and ZONE go to train.py; --workdir must be one that every host
# reaches (gs://). Run it again after a preemption: it resumes from the workdir's checkpoint.
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: bash clusters/tpu-vm-pod.sh TPU_NAME ZONE --workdir=gs://BUCKET/RUN [train.py flags]" >&2
  exit 2
fi
name=$1 zone=$2
shift 2
cd "$(dirname "$0")/.."
# What train.py needs: the entry points, model.py, the configs and the package (not .venv, data
# or workdirs). Add what else your model.py imports.
gcloud compute tpus tpu-vm scp --zone="$zone" --worker=all --recurse \
  pyproject.toml README.md LICENSE *.py configs clusters {{cookiecutter.project_slug}} "$name":nnx-dp
gcloud compute tpus tpu-vm ssh "$name" --zone="$zone" --worker=all --command="cd nnx-dp && \
python3 -m venv .venv && .venv/bin/pip install -q -e '.[tpu,gcs]' && \
.venv/bin/python clusters/watched.py train.py $(printf '%q ' "$@")"
