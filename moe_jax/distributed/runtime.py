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

A failing process ends fast instead of holding its peers: after `initialize()`, an uncaught exception prints
its traceback and ends the process at once (`leave`), without JAX's shutdown barrier, which would keep it
alive (and its peers blocked in their next collective) for up to 5 minutes; `moe-jax` commands that fail
leave the same way. Peers notice a process that vanished within `heartbeat_timeout_seconds` (10 s here,
JAX's default is 100 s). Under `moe-jax launch`, a failing process first reports itself to the launcher
(`report_failure`), so that the launcher names it rather than a peer that failed because of it.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

TORCHRUN_PORT_OFFSET = 1
# Seconds without heartbeats after which the coordination service declares a process dead and fails the
# others' waits (barriers, the shutdown barrier); a C++ thread sends them, so a busy process still does.
HEARTBEAT_TIMEOUT_S = 10
# The file `moe-jax launch` gives its processes for failure reports (one process index a line).
FAILURE_REPORTS = "MOE_JAX_LAUNCH_FAILURES"


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
               initialization_timeout: int = 300, heartbeat_timeout_seconds: int = HEARTBEAT_TIMEOUT_S,
               environ: Mapping[str, str] | None = None) -> ProcessEnvironment:
    """Join this process to its multi-process job (a no-op for a one-process job); call before any JAX work.

    Returns the `ProcessEnvironment` found. Calling it again in a started job with the same answer is a no-op.
    `initialization_timeout`: seconds to wait for every process to join. `heartbeat_timeout_seconds`: how
    soon the others notice a process that died. Once joined, an uncaught exception ends the process at once
    (see `leave`).

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
                                   local_device_ids=local_device_ids,
                                   initialization_timeout=initialization_timeout,
                                   heartbeat_timeout_seconds=heartbeat_timeout_seconds)
    except RuntimeError as error:
        jax.config.update("jax_cpu_collectives_implementation", previous)
        if "before any JAX" in str(error):
            raise RuntimeError(
                "moe_jax.distributed.initialize() must run before any JAX computation or device query in this "
                "process (it decides which devices exist); call it first thing in the program."
            ) from error
        raise
    _leave_on_uncaught_exception()
    return found


def joined() -> bool:
    """Whether this process has joined a multi-process job (without importing JAX when nothing did)."""
    return "jax" in sys.modules and sys.modules["jax"].distributed.is_initialized()


def report_failure() -> None:
    """Tell `moe-jax launch` (if it started this process) that this process is failing.

    Written before the process leaves, so before any peer can notice it is gone: the report of a peer that
    fails because of it comes later, though the peer may well end first. One short O_APPEND write, whole.
    """
    path, index = os.environ.get(FAILURE_REPORTS), os.environ.get("JAX_PROCESS_ID")
    if path and index:
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_APPEND)
            try:
                os.write(descriptor, f"{index}\n".encode())
            finally:
                os.close(descriptor)
        except OSError:  # the launcher is gone: nobody to tell
            pass


def leave(code: int) -> NoReturn:
    """End this failed process now with exit status `code`, skipping JAX's shutdown barrier and other exit
    handlers; the launcher is told first (`report_failure`) and output written so far is flushed.

    At a normal exit JAX waits (up to 5 minutes) for every process to reach the shutdown barrier; a failed
    process would sit there, keeping its connections open, so its peers stay blocked in their next
    collective and a launcher cannot tell it failed.
    """
    report_failure()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can be said
            pass
    os._exit(code)


def handle_failure(code: int) -> None:
    """The end of work that failed with exit status `code` (!= 0): in a joined job, `leave` now; otherwise
    report it to the launcher (if any) and return."""
    if joined():
        leave(code)
    report_failure()


def _leave_on_uncaught_exception() -> None:
    """Make an uncaught exception print its traceback as usual and then `leave` (1; 130 for Ctrl-C)."""
    previous = sys.excepthook

    def print_and_leave(kind, value, traceback):
        previous(kind, value, traceback)
        leave(128 + signal.SIGINT if issubclass(kind, KeyboardInterrupt) else 1)

    sys.excepthook = print_and_leave


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
