"""The launch files in clusters/, as users copy them: each parsed, its layout given to the
decision of distributed.py, and (slow) the SLURM script and the GPU JobSet run as 2 processes on
127.0.0.1 that join through JAX's own detection and train as 1 process does."""

import os
import shlex
import signal
import subprocess
import sys
import time

import portpicker
import pytest
import yaml
from conftest import OWN
from test_distributed import plain_machine, task  # noqa: F401  (a fixture)
from test_multiprocess import assert_same_run, four_devices, stop_all, train
from test_train import read_scalars

from {{cookiecutter.project_slug}}.parallel import distributed

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTERS = os.path.join(PROJECT, "clusters")
RUN = ("--config=configs/tiny.py", *OWN, "--config.num_epochs=6")


def sbatch_options() -> dict[str, str]:
  """The script's #SBATCH options, as sbatch reads them."""
  with open(f"{CLUSTERS}/slurm.sbatch") as f:
    lines = [line.split(None, 1)[1].strip() for line in f if line.startswith("#SBATCH ")]
  return dict(line.lstrip("-").split("=", 1) if "=" in line else (line.lstrip("-"), "")
              for line in lines)


def jobset(name: str) -> tuple[dict, dict]:
  """A JobSet file's document and its one container."""
  with open(f"{CLUSTERS}/{name}") as f:
    document = yaml.safe_load(f)
  job = document["spec"]["replicatedJobs"][0]["template"]["spec"]
  return document, job["template"]["spec"]["containers"][0]


def test_the_scripts_parse():
  for script in ("slurm.sbatch", "tpu-vm-pod.sh"):
    done = subprocess.run(["bash", "-n", f"{CLUSTERS}/{script}"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_sbatch_layout_is_one_the_decision_serves(plain_machine):  # noqa: F811
  """A task a GPU, bound to it: task 5 of a node sees its one GPU and drives it; the signal comes
  in time to save; the job requeues itself; the input gets cores of its own."""
  options = sbatch_options()
  assert options["gpus-per-task"] == "1" and "requeue" in options
  env = task(5, f"{options['ntasks-per-node']}(x{options['nodes']})", "5",
             SLURM_GPUS_PER_TASK=options["gpus-per-task"])
  assert distributed.cluster(env) == {"local_device_ids": [0]}
  assert options["signal"].startswith("TERM@") and int(options["signal"].split("@")[1]) >= 120
  assert int(options["cpus-per-task"]) >= 2


def assert_memory_backed_shm(pods, container):
  """/dev/shm a memory-backed volume (a pod's own is 64 MB: the input's workers need more)."""
  shm = next(m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
  volumes = {v["name"]: v for v in pods["template"]["spec"]["volumes"]}
  assert volumes[shm]["emptyDir"]["medium"] == "Memory"


def test_the_gpu_jobset_names_its_coordinator_and_its_processes():
  document, container = jobset("gke-gpu-jobset.yaml")
  job = document["spec"]["replicatedJobs"][0]
  pods = job["template"]["spec"]
  assert pods["parallelism"] == pods["completions"] and pods["completionMode"] == "Indexed"
  args = container["args"]
  assert f"--num_processes={pods['parallelism']}" in args
  assert_memory_backed_shm(pods, container)
  assert "--process_id=$(JOB_COMPLETION_INDEX)" in args
  address = {e["name"]: e["value"] for e in container["env"]}["JAX_COORDINATOR_ADDRESS"]
  name = document["metadata"]["name"]
  assert address.split(":")[0] == f"{name}-{job['name']}-0-0.{name}"  # pod 0, JobSet's DNS
  assert any(a.startswith("--workdir=gs://") for a in args)  # every pod reaches it


def test_the_tpu_jobset_fills_its_slice():
  document, container = jobset("gke-tpu-jobset.yaml")
  pods = document["spec"]["replicatedJobs"][0]["template"]["spec"]
  selector = pods["template"]["spec"]["nodeSelector"]
  rows, columns = map(int, selector["cloud.google.com/gke-tpu-topology"].split("x"))
  chips = int(container["resources"]["limits"]["google.com/tpu"])
  assert pods["parallelism"] * chips == rows * columns
  assert not any(a.startswith("--coordinator_address") for a in container["args"])
  assert_memory_backed_shm(pods, container)


GCLOUD = r"""#!/bin/bash
# gcloud, standing in: records its arguments; `compute tpus tpu-vm scp ... SOURCES NAME:DIR` copies
# the sources into $HOST_DIR/DIR, as onto a host.
printf "%s\n" "$*" >> "$GCLOUD_LOG"
if [[ $4 == scp ]]; then
  target=${!#}; target=${target#*:}; mkdir -p "$HOST_DIR/$target"
  for source in "${@:5:$(($# - 5))}"; do
    [[ $source == --* ]] || cp -r "$source" "$HOST_DIR/$target/"
  done
fi
"""


@pytest.mark.slow  # (processes)
def test_the_tpu_pod_script_runs_train_py_on_every_host_with_the_arguments(tmp_path):
  """gcloud (a stand-in that records its arguments and copies what scp is given into a folder,
  as onto a host): the project copied to every worker, all that train.py needs (there, `import
  train` works), then one command on all of them that installs it and runs train.py with the
  arguments, quoted."""
  (tmp_path / "gcloud").write_text(GCLOUD)
  (tmp_path / "gcloud").chmod(0o755)
  log = tmp_path / "gcloud.log"
  done = subprocess.run(
      ["bash", f"{CLUSTERS}/tpu-vm-pod.sh", "pod", "us-west4-a", "--workdir=gs://b/run x",
       "--config=configs/imagenet.py"], capture_output=True, text=True, timeout=30,
      env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "GCLOUD_LOG": str(log),
           "HOST_DIR": str(tmp_path / "host")})
  assert done.returncode == 0, done.stderr
  copy, ssh = log.read_text().splitlines()
  code = ("import train, model, {{cookiecutter.project_slug}} as package; "
          "print(package.__file__)")
  imported = subprocess.run(  # from the copy (an editable install would find the original)
      [sys.executable, "-c", code],
      cwd=tmp_path / "host" / "nnx-dp", capture_output=True, text=True, timeout=120,
      env={**os.environ, "PYTHONPATH": ""})
  assert imported.returncode == 0, imported.stderr[-3000:]
  assert imported.stdout.strip().startswith(str(tmp_path / "host" / "nnx-dp")), imported.stdout
  assert copy.startswith("compute tpus tpu-vm scp --zone=us-west4-a --worker=all --recurse")
  assert {"train.py", "model.py", "clusters"} <= set(copy.split()) and copy.endswith("pod:nnx-dp")
  assert (tmp_path / "host" / "nnx-dp" / "clusters" / "watched.py").is_file()
  assert ssh.startswith("compute tpus tpu-vm ssh pod --zone=us-west4-a --worker=all --command=")
  command = ssh.split("--command=", 1)[1]
  assert shlex.split(command.split("&&")[-1]) == [
      ".venv/bin/python", "clusters/watched.py", "train.py", "--workdir=gs://b/run x",
      "--config=configs/imagenet.py"]
  usage = subprocess.run(["bash", f"{CLUSTERS}/tpu-vm-pod.sh", "pod"], capture_output=True,
                         text=True, timeout=30)
  assert usage.returncode == 2 and usage.stderr.startswith("usage: ")


def test_the_sbatch_script_gives_each_job_its_workdir_and_says_when_requeue_is_refused(tmp_path):
  """Without WORKDIR, a job writes runs/<job name>-<job id> (two experiments never share one);
  stopped by --signal (143) on a cluster that refuses `scontrol requeue`, it says so and how to
  resume."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "srun").write_text('#!/bin/bash\necho "$*" > "$SRUN_LOG"\nexit 143\n')
  (bin_dir / "scontrol").write_text("#!/bin/bash\necho 'Requeue not allowed' >&2\nexit 1\n")
  for tool in ("srun", "scontrol"):
    (bin_dir / tool).chmod(0o755)
  env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77",
         "SLURM_JOB_NAME": "nnx-dp", "SLURM_SUBMIT_DIR": str(tmp_path),
         "SRUN_LOG": str(tmp_path / "srun.log")}
  env.pop("WORKDIR", None)
  done = subprocess.run(["bash", f"{CLUSTERS}/slurm.sbatch", "--config=configs/imagenet.py"],
                        env=env, capture_output=True, text=True, timeout=30)
  assert done.returncode == 143
  assert f"--workdir={tmp_path}/runs/nnx-dp-77 --config=configs/imagenet.py" in (
      tmp_path / "srun.log").read_text()
  assert done.stderr.strip().splitlines()[-1] == (
      f"slurm.sbatch: the run saved a checkpoint in {tmp_path}/runs/nnx-dp-77, but this cluster "
      "refused to requeue job 77 (scontrol requeue failed; some clusters allow it to admins "
      f"only): resume it with WORKDIR={tmp_path}/runs/nnx-dp-77 sbatch clusters/slurm.sbatch "
      "--config=configs/imagenet.py")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
  return train(tmp_path_factory.mktemp("one"), 1, *RUN[2:])


FAKE_SRUN = r"""#!/bin/bash
# srun, standing in: the command (srun's options dropped) as 2 tasks of one node on 127.0.0.1,
# each given the variables that srun sets; their PIDs written to $TASK_PIDS; the worst status.
while [[ $1 == --* ]]; do shift; done
pids=()
for i in 0 1; do
  SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NTASKS=2 SLURM_NODEID=0 SLURM_STEP_NUM_NODES=1 \
    SLURM_STEP_NODELIST=127.0.0.1 SLURM_STEP_TASKS_PER_NODE=2 "$@" &
  pids+=($!)
done
echo "${pids[@]}" > "$TASK_PIDS"
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


@pytest.mark.slow
def test_the_sbatch_script_trains_as_one_process_and_requeues_when_signalled(
    tmp_path, one_process):
  """The script as sbatch runs it (srun and scontrol stand-ins): SIGTERM to its tasks after step
  10 (what --signal sends) saves, exits 143 and requeues the job; the job's next start resumes
  from the checkpoint and ends as 1 process does (but the loss logged first after the stop: the
  steps since the stop alone)."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "srun").write_text(FAKE_SRUN)
  (bin_dir / "scontrol").write_text('#!/bin/bash\necho "$*" >> "$SCONTROL_LOG"\n')
  for tool in ("srun", "scontrol"):
    (bin_dir / tool).chmod(0o755)
  port = portpicker.pick_unused_port()
  env = four_devices(
      PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_JOB_NAME="nnx-dp",
      SLURM_SUBMIT_DIR=PROJECT, SLURM_CPUS_PER_TASK="1", PYTHON=sys.executable,
      WORKDIR=str(tmp_path / "run"), TASK_PIDS=str(tmp_path / "pids"),
      SCONTROL_LOG=str(tmp_path / "scontrol.log"), JAX_COORDINATOR_PORT=str(port),
      JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}")  # (the coordinator on loopback only)
  command = ["bash", f"{CLUSTERS}/slurm.sbatch", *RUN, "--heartbeat_timeout_seconds=10"]
  job = subprocess.Popen(command, cwd="/", env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 300
    while not (tmp_path / "run" / "checkpoints" / "10").is_dir():
      assert time.monotonic() < deadline and job.poll() is None
      time.sleep(0.1)
    for pid in (tmp_path / "pids").read_text().split():
      os.kill(int(pid), signal.SIGTERM)
    stderr = job.communicate(timeout=120)[1]
  finally:
    stop_all([job])
  assert job.returncode == 143, stderr[-3000:]
  assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
  again = subprocess.run(command, cwd="/", env=env, capture_output=True, text=True, timeout=400)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "Resumed from the checkpoint of step" in again.stderr
  assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"  # done: not requeued
  stopped = int(stderr.split("after step ")[1].split()[0])
  resumed = read_scalars(str(tmp_path / "run"))
  first_log = -(-(stopped + 1) // 5) * 5  # its loss: the steps after the stop only
  for step, loss in one_process["train_loss"].items():
    if step != first_log:
      assert resumed["train_loss"][step] == pytest.approx(loss, abs=1e-5), step
  assert max(resumed["eval_accuracy"]) == max(one_process["eval_accuracy"])  # (a stop on an
  for step, accuracy in resumed["eval_accuracy"].items():  # eval step leaves that evaluation)
    assert accuracy == pytest.approx(one_process["eval_accuracy"][step], abs=1e-6), step
    assert resumed["eval_loss"][step] == pytest.approx(one_process["eval_loss"][step], abs=1e-5)
    assert resumed["eval_examples"][step] == one_process["eval_examples"][step] == 360


@pytest.mark.slow
def test_the_gpu_jobset_environment_trains_as_one_process(tmp_path, one_process):
  """Each pod's command and environment from the JobSet (its index for JOB_COMPLETION_INDEX, the
  coordinator's name replaced by 127.0.0.1, the run's config and workdir by the test's): 2
  processes (each train.py under clusters/watched.py) that JAX joins from
  JAX_COORDINATOR_ADDRESS, training as 1 process does."""
  _, container = jobset("gke-gpu-jobset.yaml")
  port = portpicker.pick_unused_port()
  env = {e["name"]: e["value"] for e in container["env"]}
  env["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{port}"
  args = [a for a in container["args"] if not a.startswith(("--config=", "--workdir="))]
  processes = [subprocess.Popen(
      [sys.executable, *container["command"][1:], *RUN, f"--workdir={tmp_path}",
       *[a.replace("$(JOB_COMPLETION_INDEX)", str(i)) for a in args]],
      cwd=PROJECT, env=four_devices(**env, JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}"),
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]
  try:
    stderrs = [p.communicate(timeout=400)[1] for p in processes]
  finally:
    stop_all(processes)
  assert [p.returncode for p in processes] == [0, 0], stderrs[0][-3000:]
  assert "Process 1 of 2 drives" in stderrs[1]
  assert_same_run(read_scalars(str(tmp_path)), one_process)
