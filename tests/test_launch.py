"""`moe-jax launch`: N processes with their job's environment, prefixed output, and one failure stopping
the rest within a bounded time, nothing left running."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_jax.launch import process_environ, resolve_command

ROOT = Path(__file__).resolve().parents[1]


def launch(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moe_jax.cli", "launch", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_each_process_gets_its_rank_and_devices_and_its_output_is_prefixed():
    script = ("import os; print(os.environ['JAX_PROCESS_ID'], os.environ['JAX_NUM_PROCESSES'], "
              "os.environ['JAX_NUM_CPU_DEVICES'], os.environ['JAX_COORDINATOR_ADDRESS'].startswith('127.0.0.1:'))")
    result = launch("--nproc", "3", "--devices-per-process", "2", "--", sys.executable, "-c", script)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0] 0 3 2 True", "[1] 1 3 2 True", "[2] 2 3 2 True"]


def test_moe_jax_commands_run_the_launchers_own_installation():
    assert resolve_command(["moe-jax", "train", "--ep", "4"]) == [sys.executable, "-m", "moe_jax.cli", "train",
                                                                   "--ep", "4"]
    assert resolve_command(["python", "x.py"]) == ["python", "x.py"]


def test_device_environment_of_a_process():
    environ = process_environ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=x",
                               "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, 1, 2, 1234, 4)
    assert environ["XLA_FLAGS"] == "--xla_dump_to=x --xla_force_host_platform_device_count=4"
    assert environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    with pytest.raises(ValueError, match="needs 8 GPUs but CUDA_VISIBLE_DEVICES lists 2"):
        process_environ({"CUDA_VISIBLE_DEVICES": "0,1"}, 0, 2, 1234, 4)


# Both processes join the job and run collectives; process 1 then SIGKILLs itself while process 0 waits in
# the next collective, which would never complete on its own.
DYING_WORKER = """
import os, signal, sys, time
from pathlib import Path
import moe_jax.distributed
moe_jax.distributed.initialize()
import jax, jax.numpy as jnp
from jax.experimental import multihost_utils
Path(sys.argv[1], f"pid_{jax.process_index()}").write_text(str(os.getpid()))
multihost_utils.sync_global_devices("started")
if jax.process_index() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
multihost_utils.sync_global_devices("never reached by process 1")
time.sleep(600)
"""


def test_a_process_killed_with_sigkill_stops_the_job_within_60_s_and_nothing_is_left(tmp_path):
    began = time.monotonic()
    # JAX's runtime keeps a process alive through SIGTERM: the launcher's SIGKILL after --grace ends it.
    result = launch("--nproc", "2", "--devices-per-process", "1", "--grace", "2", "--", sys.executable, "-c",
                    DYING_WORKER, str(tmp_path))
    took = time.monotonic() - began
    assert result.returncode == 128 + 9, result.stderr[-3000:]
    assert "moe-jax launch: process 1 (pid" in result.stderr and "was killed by SIGKILL" in result.stderr
    assert took < 60, took
    for index in range(2):
        pid = int((tmp_path / f"pid_{index}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_missing_command_is_refused():
    result = launch("--nproc", "2")
    assert result.returncode == 2 and "needs a command after `--`" in result.stderr
    result = launch("--nproc", "2", "--", "no-such-program-here")
    assert result.returncode == 2 and "cannot start 'no-such-program-here'" in result.stderr
