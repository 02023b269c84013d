"""`moe-jax launch`: run one command as N local processes of a JAX multi-process job (like torchrun).

    moe-jax launch --nproc 2 --devices-per-process 4 -- moe-jax train --fsdp 8 --ep 8
    moe-jax launch --nproc 2 -- python my_script.py          # my_script calls moe_jax.distributed.initialize()

Each process gets JAX_COORDINATOR_ADDRESS (127.0.0.1 and a free port), JAX_NUM_PROCESSES, JAX_PROCESS_ID and
LOCAL_RANK; with --devices-per-process M it also sees M CPU devices (JAX_NUM_CPU_DEVICES and XLA's host
device count) and, where CUDA_VISIBLE_DEVICES is set, its own M of those GPUs. Every output line is
prefixed with `[i] `, the process index. When a process fails (non-zero exit or a signal), the others are
stopped (SIGTERM, then SIGKILL after `--grace` seconds, whole process groups) and the launcher exits
non-zero naming the process and how it ended; it exits 0 when every process does. A command that starts with
`moe-jax` runs the launcher's own installation (`python -m moe_jax.cli` with the launcher's interpreter), so
the processes run the same moe_jax whether or not a virtual environment's bin directory is on PATH.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

POLL_S = 0.05
DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, required=True, help="number of processes to start on this machine")
    parser.add_argument("--devices-per-process", type=int, default=None,
                        help="devices each process sees: CPU devices to create, and a slice of CUDA_VISIBLE_DEVICES "
                             "where that is set (default: leave the device environment as it is)")
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds the others get to exit after SIGTERM when one process fails (default 10)")
    parser.add_argument("program", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help="the command every process runs, after --")


def run(args: argparse.Namespace) -> int:
    command = args.program[1:] if args.program[:1] == ["--"] else args.program
    return launch(command, args.nproc, devices_per_process=args.devices_per_process, port=args.port,
                  grace_s=args.grace)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def process_environ(base: Mapping[str, str], index: int, nproc: int, port: int,
                    devices_per_process: int | None) -> dict[str, str]:
    """The environment of process `index`: the parent's plus the job's coordinates and its device share."""
    environ = dict(base)
    environ.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(nproc),
                   JAX_PROCESS_ID=str(index), LOCAL_RANK=str(index), PYTHONUNBUFFERED="1")
    if devices_per_process is not None:
        count = devices_per_process
        environ["JAX_NUM_CPU_DEVICES"] = str(count)
        flags = DEVICE_COUNT_FLAG.sub("", environ.get("XLA_FLAGS", "")).strip()
        environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
        if environ.get("CUDA_VISIBLE_DEVICES"):
            visible = environ["CUDA_VISIBLE_DEVICES"].split(",")
            if len(visible) < nproc * count:
                raise ValueError(f"--nproc {nproc} x --devices-per-process {count} needs {nproc * count} GPUs but "
                                 f"CUDA_VISIBLE_DEVICES lists {len(visible)}.")
            environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible[index * count:(index + 1) * count])
    return environ


@dataclass
class _Child:
    index: int
    process: subprocess.Popen
    readers: list[threading.Thread]

    def describe_end(self) -> str:
        code = self.process.returncode
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with status {code}"


def _relay(stream, out, prefix: bytes, lock: threading.Lock) -> None:
    """Copy `stream` to `out` line by line, each line prefixed (whole lines only, so output never interleaves)."""
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + (line if line.endswith(b"\n") else line + b"\n"))
            out.flush()
    stream.close()


def _signal_group(child: _Child, signum: int) -> None:
    try:
        os.killpg(child.process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(children: Sequence[_Child], grace_s: float) -> None:
    """SIGTERM every running process group, then SIGKILL what is still there after `grace_s`."""
    running = [child for child in children if child.process.poll() is None]
    for child in running:
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(child.process.poll() is None for child in running):
        time.sleep(POLL_S)
    for child in children:  # also groups whose leader exited but left processes behind
        _signal_group(child, signal.SIGKILL)
    for child in children:
        child.process.wait()


def resolve_command(command: Sequence[str]) -> list[str]:
    """`moe-jax ...` -> this interpreter's `python -m moe_jax.cli ...`; any other command as given."""
    if command[0] == "moe-jax":
        return [sys.executable, "-m", "moe_jax.cli", *command[1:]]
    return list(command)


def launch(command: Sequence[str], nproc: int, *, devices_per_process: int | None = None, port: int | None = None,
           grace_s: float = 10.0, stdout=None, stderr=None) -> int:
    """Run `command` as `nproc` processes of one job; returns 0, or the failing process's status (128 + signal
    number for a signal), after every process has ended."""
    if not command:
        raise ValueError("moe-jax launch needs a command after `--`, e.g. moe-jax launch --nproc 2 -- moe-jax train")
    if nproc < 1:
        raise ValueError(f"--nproc {nproc} must be >= 1.")
    if devices_per_process is not None and devices_per_process < 1:
        raise ValueError(f"--devices-per-process {devices_per_process} must be >= 1.")
    if grace_s < 0:
        raise ValueError(f"--grace {grace_s} must be >= 0.")
    stdout = stdout or sys.stdout.buffer
    stderr = stderr or sys.stderr.buffer
    port = free_port() if port is None else port
    environs = [process_environ(os.environ, i, nproc, port, devices_per_process) for i in range(nproc)]
    lock = threading.Lock()
    children: list[_Child] = []
    previous_handlers = {}

    def forward_signal(signum, frame):
        for child in children:
            _signal_group(child, signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        previous_handlers[signum] = signal.signal(signum, forward_signal)
    try:
        for index, environ in enumerate(environs):
            try:
                process = subprocess.Popen(resolve_command(command), env=environ, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, start_new_session=True)
            except OSError as error:
                raise OSError(f"cannot start {command[0]!r}: {error.strerror}") from None
            prefix = f"[{index}] ".encode()
            readers = [threading.Thread(target=_relay, args=(stream, out, prefix, lock), daemon=True)
                       for stream, out in ((process.stdout, stdout), (process.stderr, stderr))]
            for reader in readers:
                reader.start()
            children.append(_Child(index, process, readers))
        failed = _wait_for_first_failure(children)
        if failed is not None:
            others = [child for child in children if child is not failed and child.process.poll() is None]
            _stop(children, grace_s)
            message = (f"moe-jax launch: process {failed.index} (pid {failed.process.pid}) {failed.describe_end()}; "
                       f"stopped the other {len(others)} running process(es).\n")
        for child in children:
            for reader in child.readers:
                reader.join(timeout=5)
        if failed is None:
            return 0
        with lock:
            stderr.write(message.encode())
            stderr.flush()
        code = failed.process.returncode
        return code if code > 0 else 128 - code
    finally:
        _stop(children, grace_s)  # nothing is left running, whatever happened here
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)


def _wait_for_first_failure(children: Sequence[_Child]) -> _Child | None:
    """Block until every process succeeded (None) or one failed (that one)."""
    while True:
        codes = [child.process.poll() for child in children]
        for child, code in zip(children, codes):
            if code is not None and code != 0:
                return child
        if all(code == 0 for code in codes):
            return None
        time.sleep(POLL_S)
