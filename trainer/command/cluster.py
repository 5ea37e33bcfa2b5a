"""Which job this process belongs to, and the ``jax.distributed`` arguments for it.

JAX recognises several managed environments ("cluster types", the classes
that ``jax.distributed.initialize()`` tries in turn):

* a Cloud TPU VM pod slice: the GCE metadata server lists the workers;
* a GKE TPU pod: ``TPU_WORKER_HOSTNAMES`` / ``TPU_WORKER_ID``;
* several slices (multislice): ``MEGASCALE_*``, from the environment or the
  metadata server, on top of either of the above;
* SLURM (``srun``) and Open MPI (``mpirun``) tasks;
* Kubernetes jobs (with the ``kubernetes`` package installed).

:func:`detect` asks the very detectors JAX uses, in JAX's order, so every
environment JAX knows starts the runtime, and nothing starts on a laptop. On a
machine without TPU chips the TPU detectors return before asking the metadata
server (JAX looks for chips on the PCI bus first), so no run waits on it.

Devices: JAX's own detection gives each SLURM or Open MPI process the single
GPU of its local rank, which leaves 7 of 8 GPUs idle when one process runs per
node. The trainer is one process per host (like on TPU pods), so a process
that is the only one of its job on its host gets every device it can see; only
when a host runs several processes of the job does each keep the device of its
local rank (JAX's rule, one task per GPU). TPU processes always see all local
chips (JAX never restricts them).
"""

from __future__ import annotations

import dataclasses
import os

import jax

from trainer import jax_internals
from trainer.errors import ConfigError

# JAX exports no way to ask which environment jax.distributed.initialize() would
# join: its detectors are private, read through trainer/jax_internals.py's table.


@dataclasses.dataclass(frozen=True)
class Job:
    """What ``jax.distributed.initialize`` needs to join this process to its job.

    Attributes:
      environment: who described the job: ``"flags"``, or the name of JAX's
        cluster type (``"slurm"``, ``"ompi"``, ``"gcetpu"``, ``"gketpu"``, ...).
      coordinator_address: ``host:port`` of process 0's coordinator service.
      num_processes: processes in the job.
      process_id: this process's index in the job.
      local_device_ids: the local devices this process uses; None = every
        device it can see.
    """

    environment: str
    coordinator_address: str
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None


def _managed_environment():
    """JAX's cluster type that recognises this process, or None.

    The same search ``jax.distributed.initialize()`` makes: registration order,
    skipping the opt-in-only types (mpi4py).
    """
    for env in jax_internals.private("cluster types"):
        if not env.opt_in_only_method and env.is_env_present():
            return env
    return None


def _alone_on_host(environment: str) -> bool | None:
    """Whether this is the job's only process on this host (None: unknown)."""
    if environment == "slurm":
        # srun spreads tasks over the step's nodes, at least one on each: as
        # many tasks as nodes means one per node.
        tasks, nodes = os.environ.get("SLURM_NTASKS"), os.environ.get("SLURM_STEP_NUM_NODES")
        return None if tasks is None or nodes is None else int(tasks) == int(nodes)
    if environment == "ompi":
        local_size = os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
        return None if local_size is None else int(local_size) == 1
    return None


def detect(
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    timeout_s: int = 300,
) -> Job | None:
    """Describes this process's job, or returns None if nothing describes one.

    Explicit arguments (the command-line flags) describe the job completely
    and skip detection; otherwise JAX's cluster detection decides.

    Args:
      coordinator_address: ``host:port`` of process 0; with the two below.
      num_processes: processes in the job.
      process_id: this process's index.
      timeout_s: how long to wait for the coordinator's host name to resolve
        (TPU pods, where workers boot at different times).

    Returns:
      The job (one of a single process on a lone Cloud TPU VM), or None where
      neither flags nor a managed environment describe one (a laptop, a
      workstation): then nothing is started.

    Raises:
      ConfigError: if only some of the three explicit arguments are given.
    """
    given = [v is not None for v in (coordinator_address, num_processes, process_id)]
    if any(given) and not all(given):
        raise ConfigError(
            "--coordinator_address, --num_processes and --process_id go together "
            f"(got {coordinator_address=}, {num_processes=}, {process_id=})"
        )
    if all(given):
        return Job("flags", coordinator_address, num_processes, process_id, None)
    env = _managed_environment()
    if env is None:
        return None
    address = os.environ.get("JAX_COORDINATOR_ADDRESS") or env.get_coordinator_address(
        timeout_secs=timeout_s, override_coordinator_port=os.environ.get("JAX_COORDINATOR_PORT")
    )
    name = env.name or env.__name__
    local_rank = env.get_local_process_id()
    every_device = (
        jax_internals.private("on a Cloud TPU VM") or local_rank is None or _alone_on_host(name)
    )
    devices = None if every_device else (local_rank,)
    return Job(name, address, env.get_process_count(), env.get_process_id(), devices)


def initialize(job: Job, *, heartbeat_timeout_s: int, shutdown_timeout_s: int) -> None:
    """Starts JAX's multi-controller runtime for ``job``.

    Args:
      job: from :func:`detect`.
      heartbeat_timeout_s: JAX's coordination service takes a process silent this
        long for dead, and aborts the others (the job's own watch,
        :mod:`trainer.command.peers`, says so first, in one line).
      shutdown_timeout_s: a leaving process waits at most this long for the others
        at the runtime's shutdown barrier.
    """
    jax.distributed.initialize(
        coordinator_address=job.coordinator_address,
        num_processes=job.num_processes,
        process_id=job.process_id,
        local_device_ids=None if job.local_device_ids is None else list(job.local_device_ids),
        # Everything is resolved: without this, JAX would detect again and pin
        # a SLURM or Open MPI process to the one GPU of its local rank.
        cluster_detection_method="deactivate",
        heartbeat_timeout_seconds=heartbeat_timeout_s,
        shutdown_timeout_seconds=shutdown_timeout_s,
        initialization_timeout=max(heartbeat_timeout_s, 60),
    )
