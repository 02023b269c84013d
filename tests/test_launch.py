"""`moe-jax launch`: N processes with their job's environment, prefixed output, and one failure stopping
the rest within a bounded time, nothing left running.

The failure tests end within 30 s each and check the process named: the first to fail (at start-up,
raising between collectives, killed), not a peer that failed because of it nor one left hanging, and a
SIGTERM to the launcher stops everything.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_jax.cli.launch import process_environ, resolve_command

ROOT = Path(__file__).resolve().parents[1]


JOB_LIMIT_S = 30  # a failed job must end within this


def launch(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moe_jax.cli", "launch", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def start_launcher(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moe_jax.cli", "launch", *argv], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(launcher: subprocess.Popen, began: float) -> tuple[str, str]:
    """The launcher's output once it ends, within JOB_LIMIT_S of `began`; else it is stopped, test failed."""
    try:
        stdout, stderr = launcher.communicate(timeout=max(began + JOB_LIMIT_S - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        launcher.send_signal(signal.SIGTERM)  # stops its processes too
        try:
            stdout, stderr = launcher.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            launcher.kill()
            stdout, stderr = launcher.communicate()
        pytest.fail(f"the job did not end within {JOB_LIMIT_S} s:\n{stderr[-3000:]}")
    return stdout, stderr


def timed_launch(*argv: str) -> tuple[subprocess.CompletedProcess, float]:
    """`moe-jax launch ARGV`, which must end within JOB_LIMIT_S, and the seconds it took."""
    began = time.monotonic()
    launcher = start_launcher(*argv)
    stdout, stderr = finish(launcher, began)
    took = time.monotonic() - began
    return subprocess.CompletedProcess(launcher.args, launcher.returncode, stdout, stderr), took


def assert_named(result: subprocess.CompletedProcess, index: int, end: str, last_line: str) -> None:
    """The launcher blamed process `index`, said how it ended, and repeated its last lines."""
    verdict = result.stderr[result.stderr.rindex("moe-jax launch: "):]
    assert verdict.startswith(f"moe-jax launch: process {index} (pid "), result.stderr[-3000:]
    assert f"{end}, the first to fail" in verdict and f"\n[{index}] {last_line}" in verdict, verdict


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


def test_the_launcher_and_the_command_list_start_without_importing_jax():
    # The launcher only starts processes (each imports JAX itself) and `moe-jax --help` only lists commands:
    # neither waits seconds on JAX, flax and orbax imports; moe_jax's top-level names load on first use.
    script = ("import sys; import moe_jax, moe_jax.cli, moe_jax.cli.launch; moe_jax.cli.build_parser(); "
              "print(sorted(name for name in ('jax', 'flax', 'orbax') if name in sys.modules)); "
              "from moe_jax import DistributedConfig; print('jax' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", "False"]
    import moe_jax

    assert moe_jax.AutoModelForCausalLM.__name__ == "AutoModelForCausalLM" and "DistributedConfig" in dir(moe_jax)
    assert "importlib" not in dir(moe_jax) and "TYPE_CHECKING" not in dir(moe_jax) and "causal_lm" in dir(moe_jax)
    with pytest.raises(AttributeError, match="no attribute 'AutoModel'"):
        moe_jax.AutoModel  # noqa: B018


def test_subpackages_are_attributes_imported_on_first_access():
    # As `import jax; jax.distributed.initialize()`: `import moe_jax` alone imports no JAX, and each subpackage
    # is imported when it is first named.
    script = ("import sys; import moe_jax; print('jax' in sys.modules); moe_jax.distributed.initialize; "
              "moe_jax.DistributedConfig; print('jax' in sys.modules); "
              "moe_jax.training.make_train_step; moe_jax.inference; moe_jax.nnx; moe_jax.serving; "
              "print('jax' in sys.modules, 'moe_jax.nnx' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["False", "False", "True True"]
    import moe_jax

    assert {"distributed", "training", "inference", "nnx", "serving"} <= set(dir(moe_jax))
    with pytest.raises(AttributeError, match="no attribute 'distributd'"):
        moe_jax.distributd  # noqa: B018


def test_device_environment_of_a_process():
    environ = process_environ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=x",
                               "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, 1, 2, 1234, 4)
    assert environ["XLA_FLAGS"] == "--xla_dump_to=x --xla_force_host_platform_device_count=4"
    assert environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    with pytest.raises(ValueError, match="needs 8 GPUs but CUDA_VISIBLE_DEVICES lists 2"):
        process_environ({"CUDA_VISIBLE_DEVICES": "0,1"}, 0, 2, 1234, 4)


# Both processes join the job and run collectives; process 1 then SIGKILLs itself while process 0 waits in
# the next collective.
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
    print("process 1 kills itself", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
multihost_utils.sync_global_devices("never reached by process 1")
time.sleep(600)
"""


def test_a_process_killed_with_sigkill_stops_the_job_and_nothing_is_left(tmp_path):
    # Process 0 fails right after (its collective loses its peer): it must not be the one named.
    result, took = timed_launch("--nproc", "2", "--devices-per-process", "1", "--grace", "2", "--",
                                sys.executable, "-c", DYING_WORKER, str(tmp_path))
    assert result.returncode == 128 + 9, result.stderr[-3000:]
    assert_named(result, 1, "was killed by SIGKILL", "process 1 kills itself")
    print(f"killed: the job ended in {took:.1f} s")
    for index in range(2):
        pid = int((tmp_path / f"pid_{index}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_process_failing_at_start_up_ends_the_job_and_is_named():
    """The issue's job: process 1 of two `moe-jax train` processes names a missing data file. It is refused
    before process 1 joins the runtime; process 0, waiting for it to join, is stopped at once."""
    script = ('if [ "$JAX_PROCESS_ID" = 1 ]; then exec moe-jax train --fsdp 8 --ep 8 --steps 5 --data '
              '/nonexistent.npy; else exec moe-jax train --fsdp 8 --ep 8 --steps 5; fi')
    result, took = timed_launch("--nproc", "2", "--devices-per-process", "4", "--", "bash", "-c",
                                script.replace("moe-jax", f"{sys.executable} -m moe_jax.cli"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert_named(result, 1, "exited with status 2", "error: --data /nonexistent.npy")
    print(f"start-up failure: the job ended in {took:.1f} s")


# Both processes run a few steps, each with a collective; process 1 raises after step 2, when process 0 is
# already in step 3's collective: process 1 must leave at once (not wait in JAX's shutdown barrier, keeping
# process 0 blocked for minutes), and process 0, which fails a moment later, must not be named.
RAISING_WORKER = """
import moe_jax.distributed
moe_jax.distributed.initialize()
import jax, jax.numpy as jnp
from jax.experimental import multihost_utils
for step in range(1, 6):
    total = multihost_utils.process_allgather(jnp.full((), step)).sum()
    print(f"step {step}: {total}", flush=True)
    if step == 2 and jax.process_index() == 1:
        raise RuntimeError("process 1 failed in step 2")
"""


def test_a_process_raising_mid_run_ends_the_job_and_is_named():
    result, took = timed_launch("--nproc", "2", "--devices-per-process", "1", "--grace", "2", "--",
                                sys.executable, "-c", RAISING_WORKER)
    assert result.returncode == 1, result.stderr[-3000:]
    assert_named(result, 1, "exited with status 1", "RuntimeError: process 1 failed in step 2")
    assert "[1] step 2: 4" in result.stdout
    print(f"raise mid-run: the job ended in {took:.1f} s")


# Process 0 ignores SIGTERM and would sleep for ten minutes; process 1 fails.
HANGING_OR_FAILING = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(os.getpid(), flush=True)
if os.environ["JAX_PROCESS_ID"] == "1":
    time.sleep(0.5)
    sys.exit("process 1 gives up")
time.sleep(600)
"""


def test_a_hanging_process_is_killed_after_the_grace_period():
    result, took = timed_launch("--nproc", "2", "--grace", "1", "--", sys.executable, "-c",
                                HANGING_OR_FAILING)
    assert result.returncode == 1, result.stderr[-3000:]
    assert_named(result, 1, "exited with status 1", "process 1 gives up")
    assert "stopped the other 1 running process(es)" in result.stderr
    hanging = int(next(line for line in result.stdout.splitlines() if line.startswith("[0] ")).split()[1])
    with pytest.raises(ProcessLookupError):
        os.kill(hanging, 0)
    print(f"hanging peer: the job ended in {took:.1f} s")


# Process 1 holds a lock and then fails; process 0 takes the lock the moment process 1's files close and
# fails at once, as a peer does whose collective lost its other end. Process 0 often ends first (measured:
# in about a third of runs), so the launcher needs the failure reports `leave` writes to name process 1.
CHAINED_FAILURE = """
import fcntl, os, sys, time
from moe_jax.distributed.runtime import leave
lock = open(sys.argv[1] + "/lock", "a")
if os.environ["JAX_PROCESS_ID"] == "1":
    fcntl.flock(lock, fcntl.LOCK_EX)
    open(sys.argv[1] + "/locked", "w").close()
    time.sleep(0.3)
    print("process 1 fails first", flush=True)
    leave(5)
while not os.path.exists(sys.argv[1] + "/locked"):
    time.sleep(0.01)
fcntl.flock(lock, fcntl.LOCK_EX)
leave(6)
"""


def test_a_peer_failing_because_of_the_first_failure_is_not_named(tmp_path):
    result, _ = timed_launch("--nproc", "2", "--", sys.executable, "-c", CHAINED_FAILURE, str(tmp_path))
    assert result.returncode == 5, result.stderr[-3000:]
    assert_named(result, 1, "exited with status 5", "process 1 fails first")


def test_sigterm_to_the_launcher_stops_every_process():
    script = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "print(os.getpid(), flush=True); time.sleep(600)")
    began = time.monotonic()
    launcher = start_launcher("--nproc", "2", "--grace", "1", "--", sys.executable, "-c", script)
    pids = [int(launcher.stdout.readline().split()[1]) for _ in range(2)]  # both processes are running
    launcher.send_signal(signal.SIGTERM)
    _, stderr = finish(launcher, began)
    assert launcher.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "moe-jax launch: got SIGTERM; stopped 2 running process(es)." in stderr
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_processes_that_end_on_their_own_after_sigterm_make_the_launcher_exit_0():
    """What a training run does when preempted (saves, exits 0): the launcher passes the signal on once, waits,
    and exits 0 too, so a scheduler's requeue logic sees a clean stop."""
    script = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
              "print(os.getpid(), flush=True); time.sleep(600)")
    began = time.monotonic()
    launcher = start_launcher("--nproc", "2", "--grace", "20", "--", sys.executable, "-c", script)
    [launcher.stdout.readline() for _ in range(2)]
    launcher.send_signal(signal.SIGTERM)
    _, stderr = finish(launcher, began)
    assert launcher.returncode == 0, stderr[-3000:]
    assert "moe-jax launch: got SIGTERM; every process stopped on its own and exited 0." in stderr


def test_a_signal_that_comes_while_a_process_starts_reaches_it_too(tmp_path, monkeypatch):
    """The launcher's handler runs between any two of its bytecodes: here after the second process has started
    but before the launcher lists it (what a loaded machine made of the test above). It must reach that process
    too, or the launcher waits out its grace and kills a process that would have stopped on its own."""
    import io

    from moe_jax.cli import launch as launcher

    script = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
              f"open(os.path.join({str(tmp_path)!r}, str(os.getpid())), 'w').close(); time.sleep(600)")
    start = launcher._start

    def start_then_signalled(command, index, *args, **kwargs):
        child = start(command, index, *args, **kwargs)
        ready = time.monotonic() + 60
        while not (tmp_path / str(child.process.pid)).exists() and time.monotonic() < ready:
            time.sleep(0.01)   # its handler is installed
        if index == 1:
            os.kill(os.getpid(), signal.SIGTERM)   # handled here, before the launcher lists the process
        return child

    monkeypatch.setattr(launcher, "_start", start_then_signalled)
    stderr = io.BytesIO()
    began = time.monotonic()
    code = launcher.launch([sys.executable, "-c", script], 2, grace_s=20, stdout=io.BytesIO(), stderr=stderr)
    assert code == 0, stderr.getvalue()[-3000:]
    assert b"every process stopped on its own and exited 0" in stderr.getvalue()
    assert time.monotonic() - began < 15        # neither waited out the grace


@pytest.mark.heavy
def test_a_two_process_training_run_sent_sigterm_saves_one_step_and_the_same_command_continues_bit_exactly(
        tmp_path):
    def train(name, steps="8"):
        return ["--nproc", "2", "--devices-per-process", "2", "--", "moe-jax", "train", "--steps", steps, "--fsdp",
                "4", "--ep", "4", "--batch-size", "8", "--no-progress", "--checkpoint-dir", str(tmp_path / name),
                "--save-every", "100", "--resume", "--metrics-jsonl", str(tmp_path / f"{name}.jsonl")]

    assert launch(*train("full"), timeout=300).returncode == 0
    records = lambda name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]  # noqa: E731
    launcher = start_launcher(*train("preempted"))
    jsonl = tmp_path / "preempted.jsonl"
    deadline = time.monotonic() + 300
    while not (jsonl.exists() and any(r["step"] >= 3 for r in records("preempted"))):
        assert launcher.poll() is None and time.monotonic() < deadline, "the job ended or stalled"
        time.sleep(0.05)
    signalled = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    stdout, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 0 and time.monotonic() - signalled < 30, stderr[-3000:]
    assert "preemption_notifier" not in stdout + stderr                 # JAX's C++ notice: only with --verbose
    stopped = {int(m) for m in re.findall(r"SIGTERM: stopped at step (\d+) of 8", stdout)}
    assert len(stopped) == 1 and "[0] SIGTERM" in stdout and "[1] SIGTERM" in stdout      # both, the same step
    assert [p.name for p in (tmp_path / "preempted").iterdir() if p.name.isdigit()] == [str(*stopped)]
    assert launch(*train("preempted"), timeout=300).returncode == 0
    assert [r["loss"] for r in records("preempted")] == [r["loss"] for r in records("full")]


def test_a_missing_command_is_refused():
    result = launch("--nproc", "2")
    assert result.returncode == 2 and "needs a command after `--`" in result.stderr
    result = launch("--nproc", "2", "--", "no-such-program-here")
    assert result.returncode == 2 and "cannot start 'no-such-program-here'" in result.stderr


def test_use_cpu_devices_keeps_the_users_count_unless_told_to_override(monkeypatch):
    from moe_jax.host_devices import use_cpu_devices

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=x")
    use_cpu_devices(4)
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=x --xla_force_host_platform_device_count=4"
    use_cpu_devices(8)   # the count already there (the user's) stays
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=x --xla_force_host_platform_device_count=4"
    use_cpu_devices(2, override=True)
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=x --xla_force_host_platform_device_count=2"
    monkeypatch.delenv("XLA_FLAGS")
    use_cpu_devices(3)
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=3"
