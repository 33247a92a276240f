"""Several processes, one program: every entry point (train.py, evaluate.py, predict.py,
export.py) joins JAX's distributed runtime first, with the same flags, then does its share.

  python launch.py --num_processes=2 --devices_per_process=4 --script=evaluate.py -- \
      --workdir=/tmp/run   # this machine; adds the three flags below to each process

On SLURM, Open MPI, Cloud TPU pods, GKE and Kubernetes JAX finds the job by itself; elsewhere
give each process --coordinator_address, --num_processes and --process_id. Whatever prints or
writes a file does it on process 0 alone (`is_first`).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import parallel

_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0, to run several processes without a "
    "cluster that JAX detects by itself (SLURM, Open MPI, Cloud TPU pods).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "With --coordinator_address.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "With --coordinator_address.")
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout_seconds", 100, "After this long without news of a process, the others "
    "stop with an error instead of waiting for it.")

def cluster_detected() -> bool:
  """A job of several processes that jax.distributed.initialize() configures by itself: JAX's
  own detection (SLURM, Open MPI, Cloud TPU VMs, GKE, Kubernetes; mpi4py only when asked), or
  JAX_COORDINATOR_ADDRESS. A job of one process is left alone (JAX would restrict it to one GPU
  under SLURM and Open MPI). On a plain machine it reads environment variables only: JAX asks
  the TPU metadata server only on a Cloud TPU VM."""
  if "JAX_COORDINATOR_ADDRESS" in os.environ:
    return True
  from jax._src import clusters  # JAX's detection: no public API gives it

  cluster = next((env for env in clusters.ClusterEnv._cluster_types
                  if not env.opt_in_only_method and env.is_env_present()), None)
  return cluster is not None and cluster.get_process_count() > 1


def initialize() -> None:
  """Joins JAX's distributed runtime when this is one of several processes; else does nothing."""
  timeouts = dict(heartbeat_timeout_seconds=_HEARTBEAT.value, initialization_timeout=300)
  if _COORDINATOR.value:
    host = _COORDINATOR.value.rsplit(":", 1)[0]
    bind = _COORDINATOR.value if host in ("127.0.0.1", "localhost") else None  # loopback only
    jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                               coordinator_bind_address=bind, **timeouts)
  elif cluster_detected():
    jax.distributed.initialize(**timeouts)  # JAX reads the cluster's environment
  else:
    return
  logging.info("Process %d of %d, %d local devices of %d", jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count())
  if jax.default_backend() == "cpu":
    connect_cpu_collectives()
  if jax.process_index() > 0:
    logging.set_verbosity(logging.WARNING)  # process 0 logs progress and metrics


def connect_cpu_collectives() -> None:
  """Connects XLA:CPU's collectives (gloo) between the processes now, while they are in step:
  gloo connects a group of devices at its first collective, and fails there when one process
  comes 30 s after another (still reading or compiling, under load); a collective of a group
  already connected waits as long as XLA lets it. The groups the programs use: one device of
  each process (Orbax's barriers, multihost_utils) and every device (the steps' mesh)."""
  multihost_utils.sync_global_devices("distributed.connect_cpu_collectives")
  mesh = parallel.make_mesh()
  ones = jax.make_array_from_process_local_data(
      NamedSharding(mesh, P(parallel.DATA_AXIS)),
      np.ones(jax.local_device_count(), np.float32))
  jax.jit(jnp.sum, out_shardings=parallel.replicated(mesh))(ones).block_until_ready()


def is_first() -> bool:
  """Whether this is process 0: the one that prints, logs and writes files."""
  return jax.process_index() == 0


def share() -> dict[str, int]:
  """This process's share of a stream of batches (`input_pipeline.LoadBatches`' arguments)."""
  return dict(process_index=jax.process_index(), process_count=jax.process_count())
