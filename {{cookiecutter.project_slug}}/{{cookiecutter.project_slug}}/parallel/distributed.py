"""Which job of several processes this one is part of, read from its launcher's environment
(`cluster`): what process.initialize passes to jax.distributed.initialize() beyond what JAX reads
itself, including which GPUs a process drives. Loaded only by process.py, as a run starts.

Under SLURM, Open MPI 4 and on Cloud TPU pods (GKE's too) JAX finds the job by itself; elsewhere
give each process --coordinator_address (or JAX_COORDINATOR_ADDRESS: clusters/gke-gpu-jobset.yaml),
--num_processes and --process_id. The launchers JAX does not find (Open MPI 5, MPICH,
torchrun-style, a Kubernetes Indexed Job, PMIx alone) are refused in one line until those are
given, never started as N runs of one process.
"""

import glob
import importlib.util
import os
import re


def tasks_on_this_node(environ) -> int:
  """SLURM's tasks on this task's node: its entry in SLURM_STEP_TASKS_PER_NODE ('8(x2),4': 8 on
  each of the first 2 nodes, 4 on the third), by SLURM_NODEID."""
  spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
  if not spec:
    return int(environ.get("SLURM_NTASKS_PER_NODE", environ["SLURM_NTASKS"]))
  counts = []
  for part in spec.split(","):
    count, _, times = part.partition("(x")
    counts += [int(count)] * int(times.rstrip(")") or 1)
  return counts[int(environ.get("SLURM_NODEID", 0))]


def visible_gpus(environ) -> int:
  """The NVIDIA GPUs this process sees: those CUDA_VISIBLE_DEVICES lists, else the device files."""
  if "CUDA_VISIBLE_DEVICES" in environ:
    return len([d for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()])
  return len(glob.glob("/dev/nvidia[0-9]*"))


def slurm_gpus(environ, gpus: int) -> list[int] | None:
  """The GPUs a SLURM task drives (indices into the `gpus` it sees), decided from what SLURM sets;
  None when it sees none (CPUs, TPUs: JAX's choice). JAX alone would drive GPU SLURM_LOCALID,
  right in one layout only: a task a GPU, each task seeing all the node's GPUs. Here also:
  a task a GPU bound to it (--gpus-per-task=1 or --gpu-bind=single:1: it sees one, ordinal 0),
  a task a node (all it sees), and any even split (2 tasks of a node's 8 GPUs: 4 each, by
  SLURM_LOCALID). Raises ValueError, naming the sbatch fix, for a layout it cannot serve."""
  if not gpus:
    return None
  tasks, local = tasks_on_this_node(environ), int(environ["SLURM_LOCALID"])
  if environ.get("SLURM_GPUS_PER_TASK", "").isdigit() and gpus == int(
      environ["SLURM_GPUS_PER_TASK"]) or gpus == 1:  # bound: the GPUs it sees are its own
    return list(range(gpus))
  if gpus % tasks == 0:  # every task sees the node's GPUs: an even share each
    return list(range(local * gpus // tasks, (local + 1) * gpus // tasks))
  raise ValueError(
      f"SLURM task {local} sees {gpus} GPUs, shared by the {tasks} tasks on its node, which "
      "cannot split them evenly: run a task a GPU (--ntasks-per-node=G --gpus-per-task=1) or a "
      "task a node (--ntasks-per-node=1 --gpus-per-node=G).")


# Launchers whose processes JAX does not find by itself: (what names them, the variables of the
# process's rank and of the job's size).
NOT_FOUND_BY_JAX = (
    ("Open MPI 5 (no OMPI_MCA_orte_hnp_uri)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("MPICH or Intel MPI (PMI)", "PMI_RANK", "PMI_SIZE"),
    ("torchrun-style variables", "RANK", "WORLD_SIZE"),
    ("a Kubernetes Indexed Job", "JOB_COMPLETION_INDEX", None),  # (its size: not told; pod 0
    ("a PMIx launcher (PRRTE's prterun)", "PMIX_RANK", None),    # alone may be a job of one)
)
# Launchers' local rank and local size: a process's share of its node's GPUs.
LOCAL_RANKS = (("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
               ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE"))


def local_gpus(environ, gpus: int) -> list[int] | None:
  """The GPUs (of the `gpus` it sees) that a process drives, from its launcher's local rank and
  size: all of them for one process a node, an even share for several; None where no launcher
  says (or no GPU: JAX's choice). Raises ValueError for an uneven split."""
  for rank, size in LOCAL_RANKS:
    if gpus and rank in environ and size in environ:
      local, tasks = int(environ[rank]), int(environ[size])
      if gpus % tasks:
        raise ValueError(f"{tasks} processes on this node share its {gpus} GPUs unevenly "
                         f"({rank}={local}); start one a GPU, or one a node.")
      return list(range(local * gpus // tasks, (local + 1) * gpus // tasks))
  return None


def cluster(environ=os.environ) -> dict | None:
  """How this process joins a job of several processes whose launcher JAX detects: the arguments
  of jax.distributed.initialize() beyond what JAX reads from the environment itself, or None for
  no such job (a plain machine, a job of one process). Read from environment variables only,
  those JAX's own detectors read (SLURM, Open MPI, Cloud TPU on GKE; JAX_COORDINATOR_ADDRESS);
  on a Cloud TPU VM (libtpu and a TPU device file) JAX asks the VM's metadata server."""
  if "JAX_COORDINATOR_ADDRESS" in environ:
    gpus = local_gpus(environ, visible_gpus(environ))
    return {} if gpus is None else {"local_device_ids": gpus}
  slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
           "SLURM_LOCALID")
  if all(name in environ for name in slurm):  # srun's variables, as JAX's detection reads them
    if int(environ["SLURM_NTASKS"]) == 1:
      return None  # one task: JAX would restrict it to GPU 0
    gpus = slurm_gpus(environ, visible_gpus(environ))
    return {} if gpus is None else {"local_device_ids": gpus}
  if int(environ.get("OMPI_COMM_WORLD_SIZE", 1)) > 1 and "OMPI_MCA_orte_hnp_uri" in environ:
    gpus = local_gpus(environ, visible_gpus(environ))  # (JAX alone: GPU LOCAL_RANK, one each)
    return {} if gpus is None else {"local_device_ids": gpus}
  for launcher, rank, size in NOT_FOUND_BY_JAX:  # N runs of one process each, on one workdir
    if rank in environ and (int(environ.get(size, 1)) > 1 if size else int(environ[rank]) > 0):
      numbers = (f"--process_id=${rank}" + (f" --num_processes=${size}" if size else
                                             " --num_processes=N"))
      raise ValueError(
          f"{launcher} started this process, and JAX does not find such a job by itself: set "
          f"JAX_COORDINATOR_ADDRESS=<the first process's host>:<a free port> for every process "
          f"and give {numbers} (or launch with SLURM or Open MPI 4).")
  tpu_vm = importlib.util.find_spec("libtpu") is not None and bool(
      glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))
  hosts = environ.get("TPU_PROCESS_ADDRESSES") or environ.get("TPU_WORKER_HOSTNAMES")
  if tpu_vm and (len(hosts.split(",")) > 1 if hosts else True):
    return {}
  return None


def coordinator(environ=os.environ) -> str:
  """The address of the job's coordinator (process 0) as JAX derives it for the job `cluster`
  found (its rules: SLURM's first node, or Open MPI's launcher host, at JAX_COORDINATOR_PORT or a
  port in 61440-65535 from the job's id; a TPU slice's worker 0 at 8482), for the join
  timeout's line."""
  if "JAX_COORDINATOR_ADDRESS" in environ:
    return environ["JAX_COORDINATOR_ADDRESS"]
  port = environ.get("JAX_COORDINATOR_PORT")
  if "SLURM_STEP_NODELIST" in environ:
    first = re.match(r"([^,\[]*)(?:\[([^,\-\]]*))?", environ["SLURM_STEP_NODELIST"])
    port = port or int(environ["SLURM_JOB_ID"]) % 4096 + 61440
    return f"{first.group(1)}{first.group(2) or ''}:{port}"
  if uri := environ.get("OMPI_MCA_orte_hnp_uri"):
    host = re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri)
    port = port or int(uri.split(".", 1)[0]) // 4096 % 4096 + 61440
    return f"{next(h for h in host.groups() if h) if host else '?'}:{port}"
  hosts = (environ.get("MEGASCALE_COORDINATOR_ADDRESS") or environ.get("TPU_WORKER_HOSTNAMES")
           or "TPU worker 0 (its address from the VM's metadata server)")
  return f"{hosts.split(',')[0].split(':')[0]}:{port or 8482}"
