"""Which processes join a job, and which GPUs each drives: decided from the variables that the
launchers set (SLURM's, Open MPI's, Kubernetes', Cloud TPU's), never from JAX's private modules."""

import glob
import io
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from {{cookiecutter.project_slug}}.parallel import distributed, watch

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER_VARIABLES = ("SLURM_", "OMPI_", "TPU_", "MEGASCALE_", "KUBERNETES_", "JAX_COORDINATOR",
                     "CUDA_VISIBLE_DEVICES", "PMI_", "MPI_LOCAL", "RANK", "WORLD_SIZE",
                     "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "JOB_COMPLETION_INDEX", "PMIX_")


@pytest.fixture
def plain_machine(monkeypatch):
  """No cluster's environment variables, and any connection attempt fails the test."""
  for name in list(os.environ):
    if name.startswith(CLUSTER_VARIABLES):
      monkeypatch.delenv(name)

  def no_network(*args, **kwargs):
    raise AssertionError(f"a connection was attempted: {args}")

  monkeypatch.setattr(socket.socket, "connect", no_network)
  monkeypatch.setattr(socket, "create_connection", no_network)
  monkeypatch.setattr(socket, "getaddrinfo", no_network)


def task(local: int, tasks_per_node: str, gpus: str | None, **more) -> dict[str, str]:
  """One srun task's variables: task `local` of its node (node 0), `tasks_per_node` as SLURM
  writes it ('8(x2)'), CUDA_VISIBLE_DEVICES `gpus` (None: unset)."""
  counts = [int(p.split("(x")[0]) * int(p.split("(x")[1].rstrip(")") if "(x" in p else 1)
            for p in tasks_per_node.split(",")]
  env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_NODEID": "0",
         "SLURM_NTASKS": str(sum(counts)), "SLURM_PROCID": str(local),
         "SLURM_LOCALID": str(local), "SLURM_STEP_TASKS_PER_NODE": tasks_per_node, **more}
  if gpus is not None:
    env["CUDA_VISIBLE_DEVICES"] = gpus
  return env


ALL_EIGHT = "0,1,2,3,4,5,6,7"


@pytest.mark.parametrize("env, drives", [
    # a task a GPU, each seeing the node's 8 (--ntasks-per-node=8 --gres=gpu:8): JAX's own layout
    (task(3, "8(x2)", ALL_EIGHT), [3]),
    # a task a GPU bound to it (--gpus-per-task=1): it sees one, ordinal 0, whatever its number
    (task(3, "8(x2)", "3", SLURM_GPUS_PER_TASK="1"), [0]),
    (task(3, "8(x2)", "0", SLURM_GPUS_PER_TASK="1"), [0]),  # (cgroups renumber it 0)
    (task(5, "8(x2)", "5"), [0]),  # --gpu-bind=single:1 without --gpus-per-task
    # --gpus-per-task=2: the two it sees are its own
    (task(1, "4(x2)", "2,3", SLURM_GPUS_PER_TASK="2"), [0, 1]),
    # a task a node driving all its GPUs (--ntasks-per-node=1 --gpus-per-node=8)
    (task(0, "1(x2)", ALL_EIGHT), list(range(8))),
    # a partial node: GPUs 2 and 3, two tasks seeing both; one task driving both
    (task(1, "2(x2)", "2,3"), [1]),
    (task(0, "1(x2)", "2,3"), [0, 1]),
    # two tasks sharing a node's 8: 4 each
    (task(1, "2(x2)", ALL_EIGHT), [4, 5, 6, 7]),
])
def test_each_slurm_layout_drives_its_own_gpus(plain_machine, env, drives):
  assert distributed.cluster(env) == {"local_device_ids": drives}


def test_the_tasks_of_this_node_are_read_from_slurms_list():
  """'4(x2),3' is 4, 4 and 3 tasks on nodes 0, 1 and 2; without it, SLURM_NTASKS_PER_NODE."""
  env = {"SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_NTASKS": "11"}
  assert [distributed.tasks_on_this_node({**env, "SLURM_NODEID": str(n)})
          for n in range(3)] == [4, 4, 3]
  assert distributed.tasks_on_this_node({"SLURM_NTASKS_PER_NODE": "8", "SLURM_NTASKS": "16"}) == 8
  node_two = task(0, "2,3", "0,1,2", SLURM_NODEID="1")  # a node of 3 tasks and 3 GPUs
  assert distributed.cluster(node_two) == {"local_device_ids": [0]}


def test_a_layout_that_cannot_be_served_is_refused_naming_the_sbatch_fix(plain_machine):
  with pytest.raises(ValueError, match=r"^SLURM task 2 sees 8 GPUs, shared by the 3 tasks on its "
                     r"node, which cannot split them evenly: run a task a GPU \(--ntasks-per-node"
                     r"=G --gpus-per-task=1\) or a task a node"):
    distributed.cluster(task(2, "3(x2)", ALL_EIGHT))


def test_jax_alone_asks_a_bound_task_for_an_ordinal_it_does_not_have(plain_machine, monkeypatch):
  """Why the decision is ours (this test alone reads JAX's private detection, to pin the bug):
  under --gpus-per-task=1, task 3 sees one GPU and JAX asks for ordinal 3 of it."""
  from jax._src import clusters

  for name, value in task(3, "8(x2)", "3", SLURM_GPUS_PER_TASK="1").items():
    monkeypatch.setenv(name, value)
  *_, jax_ids = clusters.ClusterEnv.auto_detect_unset_distributed_params(
      None, None, None, None, None, 300)
  assert jax_ids == [3] and distributed.cluster()["local_device_ids"] == [0]


def test_gpus_are_counted_from_cuda_visible_devices_or_the_device_files(monkeypatch):
  assert distributed.visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == 2
  assert distributed.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0  # none, deliberately
  assert distributed.visible_gpus({}) == len(glob.glob("/dev/nvidia[0-9]*"))


def test_a_plain_machine_and_a_job_of_one_process_are_no_cluster(plain_machine, monkeypatch):
  assert distributed.cluster(dict(os.environ)) is None
  one = task(0, "1", ALL_EIGHT)
  assert distributed.cluster(one) is None  # one task: JAX would restrict it to GPU 0
  assert distributed.cluster({**one, "SLURM_NTASKS": "2",
                              "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}) is not None
  assert distributed.cluster({"OMPI_COMM_WORLD_SIZE": "1"}) is None
  assert distributed.cluster({"OMPI_COMM_WORLD_SIZE": "4",  # Open MPI 4: JAX's detection
                              "OMPI_MCA_orte_hnp_uri": "1234.0;tcp://10.0.0.1:5678"}) == {}
  assert distributed.cluster({"RANK": "0", "WORLD_SIZE": "1"}) is None
  assert distributed.cluster({"JOB_COMPLETION_INDEX": "0"}) is None  # (maybe a job of one)
  # a Kubernetes job (launch/gke-gpu-jobset.yaml): JAX reads the coordinator's address itself
  assert distributed.cluster({"JAX_COORDINATOR_ADDRESS": "job-0.job:1234"}) == {}


OPEN_MPI_4 = {"OMPI_MCA_orte_hnp_uri": "1234.0;tcp://10.0.0.1:5678", "OMPI_COMM_WORLD_SIZE": "16"}


@pytest.mark.parametrize("env, drives", [
    # Open MPI 4, one process a node seeing its 8 GPUs: all 8 (JAX alone: GPU 0, 7 idle)
    ({**OPEN_MPI_4, "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"},
     list(range(8))),
    # one a GPU: its own
    ({**OPEN_MPI_4, "OMPI_COMM_WORLD_LOCAL_RANK": "5", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, [5]),
    # JAX_COORDINATOR_ADDRESS given to torchrun-style processes, 8 a node: GPU LOCAL_RANK each
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "RANK": "11", "WORLD_SIZE": "16",
      "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}, [3]),
    # ... or to MPICH's, 2 a node: 4 each
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "PMI_RANK": "3", "PMI_SIZE": "4",
      "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, [4, 5, 6, 7]),
])
def test_every_launcher_that_joins_drives_all_its_gpus(plain_machine, env, drives):
  assert distributed.cluster({**env, "CUDA_VISIBLE_DEVICES": ALL_EIGHT}) == {
      "local_device_ids": drives}


@pytest.mark.parametrize("env, launcher, numbers", [
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2"},
     "Open MPI 5 (no OMPI_MCA_orte_hnp_uri)",
     "--process_id=$OMPI_COMM_WORLD_RANK --num_processes=$OMPI_COMM_WORLD_SIZE"),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, "MPICH or Intel MPI (PMI)",
     "--process_id=$PMI_RANK --num_processes=$PMI_SIZE"),
    ({"RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
      "LOCAL_RANK": "3"}, "torchrun-style variables",
     "--process_id=$RANK --num_processes=$WORLD_SIZE"),
    ({"JOB_COMPLETION_INDEX": "1"}, "a Kubernetes Indexed Job",
     "--process_id=$JOB_COMPLETION_INDEX --num_processes=N"),
    ({"PMIX_RANK": "1", "PMIX_NAMESPACE": "prterun-node0-4242@1"},
     "a PMIx launcher (PRRTE's prterun)", "--process_id=$PMIX_RANK --num_processes=N"),
])
def test_a_launcher_jax_does_not_find_is_refused_not_run_n_times(plain_machine, env, launcher,
                                                                 numbers):
  """Each process would otherwise start a run of its own, all on one workdir."""
  with pytest.raises(ValueError) as e:
    distributed.cluster(env)
  assert str(e.value) == (
      f"{launcher} started this process, and JAX does not find such a job by itself: set "
      f"JAX_COORDINATOR_ADDRESS=<the first process's host>:<a free port> for every process and "
      f"give {numbers} (or launch with SLURM or Open MPI 4).")


def test_launchers_jax_finds_join_with_pmix_variables_beside_theirs(plain_machine):
  """srun --mpi=pmix and Open MPI 4 set PMIX_RANK as well: still joined, not refused."""
  pmix = {"PMIX_RANK": "1", "PMIX_NAMESPACE": "slurm.pmix.4242.0"}
  assert distributed.cluster({**pmix, **OPEN_MPI_4}) == {}
  assert distributed.cluster({**pmix, **task(1, "2", "")}) == {}


def test_cpu_and_tpu_slurm_tasks_leave_the_devices_to_jax(plain_machine, monkeypatch):
  """No GPU seen (CUDA_VISIBLE_DEVICES empty, no /dev/nvidia*): JAX's choice."""
  assert distributed.cluster(task(1, "2", "")) == {}


def test_tpu_hosts_join_only_on_a_tpu_vm(plain_machine, monkeypatch, tmp_path):
  """A GKE TPU job names its hosts in TPU_PROCESS_ADDRESSES or TPU_WORKER_HOSTNAMES: on a TPU VM
  (libtpu installed and a TPU device file) the run joins the others; elsewhere nothing is asked
  of any server."""
  env = {"TPU_PROCESS_ADDRESSES": "10.0.0.1:8471,10.0.0.2:8471", "TPU_WORKER_ID": "1"}
  monkeypatch.setattr(distributed.importlib.util, "find_spec", lambda name: None)
  assert distributed.cluster(env) is None  # no libtpu
  monkeypatch.setattr(distributed.importlib.util, "find_spec", lambda name: name == "libtpu")
  real_glob = glob.glob
  monkeypatch.setattr(distributed.glob, "glob",
                      lambda pattern: ["/dev/accel0"] if "accel" in pattern else real_glob(pattern))
  assert distributed.cluster(env) == {}
  assert distributed.cluster({"TPU_WORKER_HOSTNAMES": "t1v-0"}) is None  # one host
  assert distributed.cluster({}) == {}  # a Cloud TPU VM: JAX asks its metadata server


def test_the_project_uses_no_private_jax_module():
  """jax._src moves between releases: no module of the project (tests aside) imports it."""
  offenders = [path for path in glob.glob(f"{PROJECT}/**/*.py", recursive=True)
               if "/tests/" not in path and "jax._src" in open(path).read()]
  assert not offenders


# A process under clusters/watched.py that writes a log line and `sys.argv[1]` to its standard
# error, then ends as `sys.argv[2]` says: abort (as JAX's distributed service ends a survivor),
# exit 3, or wait for a signal (SIGTERM: exit 143).
CHILD = """
import os, signal, sys, time
sys.stderr.write(f"I1128 00:00:00.000000 {os.getpid()} train.py:1] step 10/100\\n")
sys.stderr.write(sys.argv[1])
sys.stderr.flush()
if sys.argv[2] == "abort":
  os.abort()
if sys.argv[2] == "wait":
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  time.sleep(60)
sys.exit(3)
"""
# The last words of process 0 of 2 when process 1 was SIGKILLed (JAX 0.12, CPU, the default
# heartbeat), from the first line the watcher holds back (its stack dumps shortened).
LOST_PROCESS_1 = (
    "E1128 03:08:44.132272    4677 coordination_service.cc:1518] [16124307152456746073] Use "
    "error polling to propagate the following error to all tasks: UNAVAILABLE: The following "
    "tasks are unhealthy (stopped sending heartbeats):\n1\nThe tasks have crashed. Check the "
    "task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to debug "
    "further. [type.googleapis.com/tensorflow.CoordinationServiceError='']\n"
    "=== Source Location Trace: ===\n"
    "external/xla+/xla/pjrt/distributed/coordination/coordination_service.cc:232\n\n"
    "E1128 03:08:44.134527    4688 coordination_service_agent.cc:288] Polled an error from "
    "coordination service (this can be an error from this or another task).\n"
    "F1128 03:08:44.134682    4688 client.h:86] Terminating process because the JAX distributed "
    "service detected fatal errors. This most likely indicates that another task died; see the "
    "other task logs for more details. Disable Python buffering, i.e. `python -u`, to be sure to "
    "see all the previous output. absl::Status: UNAVAILABLE: The following tasks are unhealthy "
    "(stopped sending heartbeats):\n1\nThe tasks have crashed.\n\n"
    "*** Check failure stack trace: ***\n"
    "    @     0x7f6cb88f81b4  absl::lts_20260526::log_internal::LogMessage::SendToLog()\n"
    "Fatal Python error: Aborted\n\nThread 0x00007f6b70b626c0 (most recent call first):\n"
    '  File "/usr/lib/python3.12/threading.py", line 1030 in _bootstrap\n')


def supervised(*args: str) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "clusters/watched.py", "-c", CHILD, *args],
                          cwd=PROJECT, stderr=subprocess.PIPE, text=True)


def test_a_lost_process_is_one_line_from_the_survivors_watcher():
  """The survivor's abort (JAX's distributed service: another task stopped sending heartbeats)
  is one `error:` line naming the lost process, exit 1, the log before it passed on as it was;
  any other end is passed on whole, with the child's status (an abort: 134)."""
  child = supervised(LOST_PROCESS_1, "abort")
  _, stderr = child.communicate(timeout=60)
  lines = stderr.splitlines()
  assert child.returncode == 1 and len(lines) == 2, stderr
  assert lines[0].endswith("train.py:1] step 10/100")
  assert lines[1] == (
      "error: the job lost process 1 (no heartbeat from it: killed, out of memory, or its host "
      "gone), so this one stopped too; once every process can run, the same command on each "
      "resumes from the last checkpoint.")
  other = "Fatal Python error: Segmentation fault\n\nCurrent thread 0x01 (most recent call):\n"
  child = supervised(other, "abort")
  _, stderr = child.communicate(timeout=60)
  assert child.returncode == 128 + signal.SIGABRT and stderr.endswith(other), stderr
  child = supervised("error: something else\n", "exit")
  _, stderr = child.communicate(timeout=60)
  assert child.returncode == 3 and stderr.endswith("] step 10/100\nerror: something else\n")


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_the_watcher_passes_signals_on_and_its_process_ends_with_it(how):
  """SIGTERM to clusters/watched.py reaches its process (which exits 143, and so does the
  watcher); a SIGKILL of the watcher ends its process within seconds (Linux: PR_SET_PDEATHSIG)."""
  child = supervised("", "wait")
  first = child.stderr.readline()  # (the child's: it runs)
  pid = int(first.split()[2])
  assert pid != child.pid
  child.send_signal(getattr(signal, how))
  assert child.wait(timeout=30) == (143 if how == "SIGTERM" else -signal.SIGKILL)
  deadline = time.monotonic() + 10
  while os.path.exists(f"/proc/{pid}") and "zombie" not in open(f"/proc/{pid}/status").read():
    assert time.monotonic() < deadline, f"the watcher's process {pid} outlived it"
    time.sleep(0.1)


def test_a_held_back_dump_is_bounded_and_passed_on_whole():
  """A watch holds at most `HOLD_MAX_BYTES` of what looks like a survivor's last words: a longer
  stream from such a line is passed on as it came (nothing lost), and its end is not taken for a
  lost process."""
  out = io.BytesIO()
  watching = watch.Watch(out)
  stream = b"F1128 00:00:00 x.cc:1] boom\n" + b"x" * 100 + b"\n"
  stream += b"".join(b"line %d\n" % i for i in range(3 * watch.HOLD_MAX_BYTES // 8))
  for start in range(0, len(stream), 4096):  # (as a pipe gives it: cut anywhere)
    watching.feed(stream[start:start + 4096])
    assert watching.held_bytes <= watch.HOLD_MAX_BYTES + 200
  assert watching.end(134) is None and out.getvalue() == stream


def test_a_long_line_without_an_end_is_passed_on_whole_in_linear_time():
  """A process that writes 64 MiB without a newline (as a pipe gives it, 64 KiB a read): kept in
  place until its end, not joined anew at every read (quadratic: 0.8 s for 8 MiB, 2.7 s for 16,
  ~43 s for 64 here), then passed on whole. Here 0.34 s: the bound, 8 s, is over 20x that."""
  out = io.BytesIO()
  watching = watch.Watch(out)
  piece = b"y" * (1 << 16)
  start = time.perf_counter()
  for _ in range(1 << 10):
    watching.feed(piece)
  watching.feed(b"\nafter\n")
  elapsed = time.perf_counter() - start
  print(f"64 MiB in one line passed on in {elapsed:.2f} s")
  assert out.getvalue() == piece * (1 << 10) + b"\nafter\n" and elapsed < 8, elapsed


@pytest.mark.parametrize("environ", [
    {"SLURM_STEP_NODELIST": "node[001,007-015],host2", "SLURM_JOB_ID": "123456"},
    {"SLURM_STEP_NODELIST": "gpu17", "SLURM_JOB_ID": "7"},
    {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"},
    {"SLURM_STEP_NODELIST": "gpu17", "SLURM_JOB_ID": "7", "JAX_COORDINATOR_PORT": "4321"},
], ids=["slurm_ranges", "slurm_one_node", "open_mpi", "a_port_given"])
def test_the_join_timeout_names_the_address_jax_derives(environ, monkeypatch):
  """The address the join timeout's line names is the one JAX's own cluster detection derives
  (its private classes, read here only to compare)."""
  from jax._src.clusters import ompi_cluster, slurm_cluster

  for name, value in environ.items():
    monkeypatch.setenv(name, value)
  found = (slurm_cluster.SlurmCluster if "SLURM_JOB_ID" in environ else ompi_cluster.OmpiCluster)
  assert distributed.coordinator(environ) == found.get_coordinator_address(
      None, environ.get("JAX_COORDINATOR_PORT"))


@pytest.mark.slow  # (JAX alone: the TPU plugin's start waits for a metadata server, ~60 s here)
def test_a_cpu_machine_with_the_accelerators_compilers_starts_without_their_tracebacks():
  """On a machine without a GPU's or TPU's device file, JAX_PLATFORMS unset (as a user's shell
  leaves it), an entry point's start (`process.initialize`) takes the CPU alone: the plugins of
  the cuda12 and tpu extras (aot.py's compilers, installed beside training) print nothing, where
  JAX alone lets each print its failure. Skipped, with the reason, where neither is installed
  or the host has an accelerator, and after the check where JAX alone prints nothing either."""
  import importlib.util

  from {{cookiecutter.project_slug}} import process

  if not any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "libtpu")):
    pytest.skip("neither the GPU's nor the TPU's compiler is installed here: nothing to quiet")
  if any(glob.glob(pattern) for pattern in process.ACCELERATOR_FILES):
    pytest.skip("this host has an accelerator's device file")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  backend = "import jax; print(jax.default_backend())"
  started = subprocess.run(
      [sys.executable, "-c", "from {{cookiecutter.project_slug}} import process; "
       f"process.cpu_where_no_accelerator(); {backend}"], cwd=PROJECT, env=env,
      capture_output=True, text=True, timeout=120)
  assert started.stdout.strip() == "cpu" and started.stderr == "", started.stderr[-3000:]
  bare = subprocess.run([sys.executable, "-c", backend], cwd=PROJECT, env=env,
                        capture_output=True, text=True, timeout=120)
  assert bare.stdout.strip() == "cpu", bare.stderr[-3000:]
  if not bare.stderr:  # some machines' plugins fail quietly (no driver library at all)
    pytest.skip("JAX alone printed nothing here either: the start was quiet, the contrast "
                "not shown")
