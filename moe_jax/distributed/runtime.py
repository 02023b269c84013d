"""Starting JAX's multi-controller runtime: one call, arguments or the launcher's environment.

    import moe_jax.distributed
    moe_jax.distributed.initialize()        # before any other JAX call; a no-op in a one-process job

Every process of a multi-process job runs the same program; `jax.distributed.initialize` connects them
through a coordinator (process 0) so that `jax.devices()` lists the devices of all of them and one `Mesh`
spans the job. Where the coordinator address, process count and process id come from, first match wins:

    arguments            initialize("10.0.0.1:1234", num_processes=2, process_id=0)
    JAX / moe-jax launch JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID
    torchrun             MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK (coordinator port MASTER_PORT + 1:
                         torchrun's own rendezvous store listens on MASTER_PORT)
    SLURM (srun)         SLURM_NTASKS, SLURM_PROCID; JAX's SLURM detection picks the coordinator (first node)

On CPU, collectives across processes need an implementation: gloo is selected (it has no effect on the
GPU and TPU backends), so the same code runs on one machine with several processes and on a cluster.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

TORCHRUN_PORT_OFFSET = 1


@dataclass(frozen=True)
class ProcessEnvironment:
    """Where this process sits in its job. `coordinator_address` None: JAX's cluster detection finds it."""

    num_processes: int
    process_id: int
    coordinator_address: str | None
    source: str  # "arguments", "JAX_*", "torchrun", "SLURM" or "single process"

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1


def _integer(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} in the environment is not an integer.") from None


def process_environment(coordinator_address: str | None = None, num_processes: int | None = None,
                        process_id: int | None = None, environ: Mapping[str, str] | None = None
                        ) -> ProcessEnvironment:
    """The job this process belongs to, from the arguments or else the environment (see the module doc)."""
    environ = os.environ if environ is None else environ
    if num_processes is not None or process_id is not None or coordinator_address is not None:
        found = ProcessEnvironment(1 if num_processes is None else num_processes,
                                   0 if process_id is None else process_id, coordinator_address, "arguments")
        if found.multi_process and coordinator_address is None:
            raise ValueError(f"num_processes={num_processes} needs a coordinator_address (host:port of process 0).")
    elif "JAX_NUM_PROCESSES" in environ:
        found = ProcessEnvironment(_integer(environ, "JAX_NUM_PROCESSES"), _integer(environ, "JAX_PROCESS_ID")
                                   if "JAX_PROCESS_ID" in environ else 0,
                                   environ.get("JAX_COORDINATOR_ADDRESS"), "JAX_*")
        missing = [name for name in ("JAX_PROCESS_ID", "JAX_COORDINATOR_ADDRESS") if name not in environ]
        if found.multi_process and missing:
            raise ValueError(f"JAX_NUM_PROCESSES={found.num_processes} is set but {' and '.join(missing)} "
                             "is not: a multi-process job needs all three (moe-jax launch sets them).")
    elif "WORLD_SIZE" in environ and "RANK" in environ:
        address = None
        if "MASTER_ADDR" in environ and "MASTER_PORT" in environ:
            address = f"{environ['MASTER_ADDR']}:{_integer(environ, 'MASTER_PORT') + TORCHRUN_PORT_OFFSET}"
        found = ProcessEnvironment(_integer(environ, "WORLD_SIZE"), _integer(environ, "RANK"), address, "torchrun")
        if found.multi_process and address is None:
            raise ValueError(f"WORLD_SIZE={found.num_processes} and RANK are set but MASTER_ADDR / MASTER_PORT are "
                             "not: set them to process 0's host and a free port.")
    elif all(name in environ for name in ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_STEP_NODELIST")):
        found = ProcessEnvironment(_integer(environ, "SLURM_NTASKS"), _integer(environ, "SLURM_PROCID"), None,
                                   "SLURM")
    else:
        found = ProcessEnvironment(1, 0, None, "single process")
    if found.num_processes < 1 or not 0 <= found.process_id < found.num_processes:
        raise ValueError(f"process id {found.process_id} of {found.num_processes} process(es) (from "
                         f"{found.source}) is not a valid rank: it must be in [0, num_processes).")
    return found


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids: int | Sequence[int] | None = None,
               initialization_timeout: int = 300, environ: Mapping[str, str] | None = None
               ) -> ProcessEnvironment:
    """Join this process to its multi-process job (a no-op for a one-process job); call before any JAX work.

    Returns the `ProcessEnvironment` found. Calling it again in a started job with the same answer is a no-op.

    Raises:
        ValueError: an incomplete or inconsistent environment (names the variable).
        RuntimeError: JAX already ran computations in this process (the runtime must start first).
    """
    import jax

    found = process_environment(coordinator_address, num_processes, process_id, environ)
    if not found.multi_process:
        return found
    if jax.distributed.is_initialized():
        if (jax.process_count(), jax.process_index()) != (found.num_processes, found.process_id):
            raise RuntimeError(f"JAX's distributed runtime is already running as process {jax.process_index()} of "
                               f"{jax.process_count()}, not {found.process_id} of {found.num_processes} "
                               f"({found.source}).")
        return found
    # Cross-process collectives on the CPU backend; the GPU and TPU backends ignore this option.
    previous = jax.config.jax_cpu_collectives_implementation
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(found.coordinator_address, found.num_processes, found.process_id,
                                   local_device_ids=local_device_ids, initialization_timeout=initialization_timeout)
    except RuntimeError as error:
        jax.config.update("jax_cpu_collectives_implementation", previous)
        if "before any JAX" in str(error):
            raise RuntimeError(
                "moe_jax.distributed.initialize() must run before any JAX computation or device query in this "
                "process (it decides which devices exist); call it first thing in the program."
            ) from error
        raise
    return found


def job_devices() -> list:
    """Every device of the job in the reference's rank order: process by process, then by local position
    (rank = process_id * devices_per_process + local index), so consecutive ranks (TP and EP groups) stay
    inside one process when their size divides the devices per process."""
    import jax

    return sorted(jax.devices(), key=lambda device: (device.process_index, device.id))


def is_main_process() -> bool:
    """Process 0: the one that prints summaries and writes shared files."""
    import jax

    return jax.process_index() == 0
