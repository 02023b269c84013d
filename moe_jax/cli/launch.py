"""`moe-jax launch`: run one command as N local processes of a JAX multi-process job (like torchrun).

    moe-jax launch --nproc 2 --devices-per-process 4 -- moe-jax train --fsdp 8 --ep 8
    moe-jax launch --nproc 2 -- python my_script.py          # my_script calls moe_jax.distributed.initialize()

Each process gets JAX_COORDINATOR_ADDRESS (127.0.0.1 and a free port), JAX_NUM_PROCESSES, JAX_PROCESS_ID and
LOCAL_RANK; with --devices-per-process M it also sees M CPU devices (JAX_NUM_CPU_DEVICES and XLA's host
device count) and, where CUDA_VISIBLE_DEVICES is set, its own M of those GPUs. Every output line is
prefixed with `[i] `, the process index (gloo's "[Gloo] Rank i is connected ..." lines, one per process and
collective group, only with --verbose, which also makes the processes verbose: `moe_jax.verbosity`). When a process fails (non-zero exit or a signal), the others are
stopped (SIGTERM, then SIGKILL after `--grace` seconds, whole process groups) and the launcher exits with
the failed process's status, naming it and repeating its last lines. The process named is the one that
failed first, not a peer that failed a moment later because of it (a collective whose other end vanished):
see `_blame`. SIGTERM or SIGINT to the launcher is passed on to every process, which get --grace seconds to end on their own
(a training run saves its checkpoint and exits 0: the launcher then exits 0 too), then are stopped the same way
(a second one: SIGKILL at
once). It exits 0 when every process does. A command that starts with `moe-jax` runs the launcher's own
installation (`python -m moe_jax.cli` with the launcher's interpreter), so the processes run the same
moe_jax whether or not a virtual environment's bin directory is on PATH.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..distributed.runtime import FAILURE_REPORTS
from ..host_memory import huge_page_tunables
from ..verbosity import VERBOSE, is_quiet_line, verbose

POLL_S = 0.05
SETTLE_S = 0.3  # after a first failure, for the others close behind it (see _blame)
LAST_LINES = 20  # of the failed process's output, repeated under the launcher's verdict
LAST_LINE_BYTES = 2000  # of each such line (a progress bar's line holds all its redraws)
DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, required=True, help="number of processes to start on this machine")
    parser.add_argument("--devices-per-process", type=int, default=None,
                        help="devices each process sees: CPU devices to create, and a slice of CUDA_VISIBLE_DEVICES "
                             "where that is set (default: leave the device environment as it is)")
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds the processes get to exit after SIGTERM, when one of them fails or the "
                             "launcher is stopped, before SIGKILL (default 10)")
    parser.add_argument("program", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help="the command every process runs, after --")


def run(args: argparse.Namespace) -> int:
    command = args.program[1:] if args.program[:1] == ["--"] else args.program
    return launch(command, args.nproc, devices_per_process=args.devices_per_process, port=args.port,
                  grace_s=args.grace, verbose=verbose())


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
    if (tunables := huge_page_tunables(environ)) is not None:
        environ["GLIBC_TUNABLES"] = tunables  # huge pages for XLA:CPU's buffers, any command (host_memory)
    return environ


@dataclass
class _Child:
    """One started process, the threads relaying its output, and its last lines."""

    index: int
    process: subprocess.Popen
    readers: list[threading.Thread] = field(default_factory=list)
    last_lines: deque = field(default_factory=lambda: deque(maxlen=LAST_LINES))

    def describe_end(self) -> str:
        code = self.process.returncode
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with status {code}"


def _relay(stream, out, prefix: bytes, lock: threading.Lock, last_lines: deque, verbose: bool = False) -> None:
    """Copy `stream` to `out` line by line, each line prefixed (whole lines only, so output never
    interleaves), keeping the last lines (as a terminal shows them: after the last carriage return) in
    `last_lines`; gloo's connection lines and JAX's preemption notice only when `verbose` (`moe_jax.verbosity`)."""
    for line in iter(stream.readline, b""):
        if not verbose and is_quiet_line(line):
            continue
        line = line if line.endswith(b"\n") else line + b"\n"
        with lock:
            out.write(prefix + line)
            out.flush()
            last_lines.append(prefix + line.rstrip(b"\r\n").rsplit(b"\r", 1)[-1][:LAST_LINE_BYTES] + b"\n")
    stream.close()


def _signal_group(child: _Child, signum: int) -> None:
    try:
        os.killpg(child.process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(children: Sequence[_Child], grace_s: float, spare: _Child | None = None) -> None:
    """SIGTERM every running process group but `spare`'s (a failed process ending on its own), then SIGKILL
    what is still there after `grace_s` (a process of a JAX job may outlive SIGTERM: JAX's preemption
    notifier takes that signal as a notice, not an end)."""
    running = [child for child in children if child.process.poll() is None]
    for child in running:
        if child is not spare:
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
           grace_s: float = 10.0, stdout=None, stderr=None, verbose: bool = False) -> int:
    """Run `command` as `nproc` processes of one job; returns 0, or the status of the process that failed
    first (128 + signal number for a signal), or 128 + the signal that stopped the launcher, after every
    process has ended. verbose: relay gloo's connection lines too, and make the processes verbose."""
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
    descriptor, reports = tempfile.mkstemp(prefix="moe_jax_launch_", suffix=".failures")
    os.close(descriptor)
    for environ in environs:
        environ[FAILURE_REPORTS] = reports
        if verbose:
            environ[VERBOSE] = "1"
    lock = threading.Lock()
    children: list[_Child] = []
    received: list[int] = []  # signals the launcher got
    previous_handlers = {}

    forwarded: set[int] = set()  # the processes the first signal has reached

    def forward(child: _Child, signum: int) -> None:
        forwarded.add(child.index)
        _signal_group(child, signum)

    def on_signal(signum, frame):
        # Forwarded at once; the wait below then ends and stops every process. A second signal is SIGKILL.
        received.append(signum)
        for child in children:
            forward(child, signum if len(received) == 1 else signal.SIGKILL)

    for signum in (signal.SIGINT, signal.SIGTERM):
        previous_handlers[signum] = signal.signal(signum, on_signal)
    try:
        for index, environ in enumerate(environs):
            if received:   # stopped while starting: the rest are not started
                break
            child = _start(command, index, environ, stdout, stderr, lock, verbose)
            children.append(child)
            # The handler runs between any two bytecodes: one that ran after this process started but before it
            # was listed did not reach it (it printed and waited, and the launcher waited out its grace).
            if received and child.index not in forwarded:
                forward(child, received[0])
        failed = _wait_for_first_failure(children, received, Path(reports))
        if failed is None and received and _ended_on_their_own(children, grace_s):
            for child in children:
                for reader in child.readers:
                    reader.join(timeout=5)
            _report(stderr, lock, f"moe-jax launch: got {signal.Signals(received[0]).name}; every process stopped "
                                  "on its own and exited 0.\n".encode())
            return 0
        running = [child for child in children if child is not failed and child.process.poll() is None]
        _stop(children, grace_s, spare=failed)
        for child in children:
            for reader in child.readers:
                reader.join(timeout=5)
        if failed is not None:
            _report(stderr, lock, f"moe-jax launch: process {failed.index} (pid {failed.process.pid}) "
                                  f"{failed.describe_end()}, the first to fail; stopped the other "
                                  f"{len(running)} running process(es). Its last lines:\n".encode(),
                    *failed.last_lines)
            code = failed.process.returncode
            return code if code > 0 else 128 - code
        if received:
            _report(stderr, lock, f"moe-jax launch: got {signal.Signals(received[0]).name}; stopped "
                                  f"{len(running)} running process(es).\n".encode())
            return 128 + received[0]
        return 0
    finally:
        _stop(children, grace_s)  # nothing is left running, whatever happened here
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)
        os.unlink(reports)


def _start(command: Sequence[str], index: int, environ: Mapping[str, str], stdout, stderr,
           lock: threading.Lock, verbose: bool = False) -> _Child:
    """Process `index` in its own process group (so stopping it stops what it started), its output relayed."""
    try:
        process = subprocess.Popen(resolve_command(command), env=environ, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, start_new_session=True)
    except OSError as error:
        raise OSError(f"cannot start {command[0]!r}: {error.strerror}") from None
    child = _Child(index, process)
    prefix = f"[{index}] ".encode()
    child.readers = [threading.Thread(target=_relay, args=(stream, out, prefix, lock, child.last_lines, verbose),
                                      daemon=True)
                     for stream, out in ((process.stdout, stdout), (process.stderr, stderr))]
    for reader in child.readers:
        reader.start()
    return child


def _report(stderr, lock: threading.Lock, *lines: bytes) -> None:
    with lock:
        stderr.write(b"".join(lines))
        stderr.flush()


def _ended_on_their_own(children: Sequence[_Child], grace_s: float) -> bool:
    """After a forwarded signal: whether every process exits 0 within `grace_s` (a training run saves a checkpoint
    at its next step boundary and exits 0 on SIGTERM: `training.preemption`), before any second signal."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(child.process.poll() is None for child in children):
        time.sleep(POLL_S)
    return all(child.process.poll() == 0 for child in children)


def _wait_for_first_failure(children: Sequence[_Child], received: Sequence[int],
                            reports: Path) -> _Child | None:
    """Block until every process succeeded (None), the launcher got a signal (None; `received` says so), or a
    process failed or reported failing: then, after SETTLE_S for the failures close behind it, the one that
    failed first (see `_blame`)."""
    ended: list[_Child] = []  # in the order seen
    while not received:
        ended += [child for child in children if child not in ended and child.process.poll() is not None]
        if any(child.process.returncode != 0 for child in ended) or _reported(reports):
            time.sleep(SETTLE_S)
            ended += [child for child in children if child not in ended and child.process.poll() is not None]
            return _blame(children, ended, _reported(reports))
        if len(ended) == len(children):
            return None
        time.sleep(POLL_S)
    return None


def _blame(children: Sequence[_Child], ended: Sequence[_Child], reported: Sequence[int]) -> _Child:
    """The process that failed first, of those that ended non-zero (`ended`, in the order seen) or reported
    failing (`reported`, process indices in the order they reported; they are ending).

    The order processes are seen to end in is no guide: a peer whose collective lost its other end fails
    within a millisecond, often before the failed process, tearing down its threads and memory, can be
    reaped. So: first a process killed by a signal other than SIGABRT (nothing in a job kills a process:
    something outside did, or it crashed); then the first to report, since a moe_jax process reports before
    it leaves (`moe_jax.distributed.runtime.report_failure`) and a peer failing because of it reports after;
    then the first seen to end non-zero (SIGABRT is how JAX ends the processes whose coordinator vanished).
    """
    failed = [child for child in ended if child.process.returncode != 0]
    killed = [child for child in failed
              if child.process.returncode < 0 and child.process.returncode != -signal.SIGABRT]
    reporting = [children[index] for index in reported if 0 <= index < len(children)]
    return (killed or reporting or failed)[0]


def _reported(reports: Path) -> list[int]:
    """The process indices in the failure reports file, in the order written."""
    try:
        return [int(line) for line in reports.read_text().split() if line.isdigit()]
    except OSError:
        return []
