"""A 2-process x 4-CPU-device job (moe-jax launch + JAX's distributed runtime over gloo) against the same
work in this one 8-device process: logits on two layouts, 5 training steps, orbax train states restored
across the two, byte-identical export, per-process checkpoint and batch reads; the job's greedy generation
against Transformers' (committed fixture)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from converters.safetensors_io import checkpoint_shards
from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.training import TrainCheckpoints
from tests.models.hf_reference import LOGITS_ATOL
from tests.models.mxfp4_checkpoints import write_mxfp4_checkpoint
from tests.training.conftest import build_trainer
from tests.training.hf_training import CHECKPOINT

from .shared_work import (
    FORWARD_LAYOUTS,
    GENERATION,
    QUANTIZED_LAYOUT,
    TRAIN_LAYOUT,
    export_loaded,
    forward,
    quantized_loads,
    train,
)

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")


def launch(*command: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moe_jax.cli", "launch", *command], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The single-process side; it also leaves a train state in WORKDIR/state_1proc for the job to restore."""
    workdir = tmp_path_factory.mktemp("multiprocess")
    seen = {}
    for name, layout in FORWARD_LAYOUTS.items():
        model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, DistributedConfig(**layout), progress=False)
        seen[f"{name}/logits"] = forward(model)
    export_loaded(model, workdir / "export_1proc")
    write_mxfp4_checkpoint(workdir / "mxfp4")
    for name, (checkpoint, options, vocab_size) in quantized_loads(workdir).items():
        quantized = AutoModelForCausalLM.from_pretrained(checkpoint, DistributedConfig(**QUANTIZED_LAYOUT),
                                                         progress=False, **options)
        seen[f"{name}/logits"] = forward(quantized, vocab_size)
    model, train_step = build_trainer(TRAIN_LAYOUT)
    seen["losses"], seen["next_loss"] = train(train_step, TrainCheckpoints(workdir / "state_1proc", model,
                                                                           train_step, save_every=5))
    return workdir, seen, train_step


@pytest.fixture(scope="module")
def two_processes(one_process):
    workdir = one_process[0]
    began = time.perf_counter()
    result = launch("--nproc", "2", "--devices-per-process", "4", "--", sys.executable, str(WORKER), str(workdir))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    print(f"2-process job: {time.perf_counter() - began:.1f} s;", *(line for line in result.stdout.splitlines()
                                                                  if line.startswith("[0]")), sep="\n")
    return [dict(np.load(workdir / f"process_{i}.npz")) for i in range(2)]


@pytest.mark.parametrize("layout", list(FORWARD_LAYOUTS))
def test_logits_equal_the_one_process_run_and_pytorch(one_process, two_processes, layout):
    reference = np.load(CHECKPOINT / "reference.npz")
    real = reference["attention_mask"].astype(bool)
    for seen in two_processes:
        np.testing.assert_allclose(seen[f"{layout}/logits"], one_process[1][f"{layout}/logits"], rtol=0, atol=2e-6)
        np.testing.assert_allclose(seen[f"{layout}/logits"][real], reference["logits"][real], rtol=0,
                                   atol=LOGITS_ATOL)


def test_expert_parallel_groups_stay_inside_one_process(two_processes):
    # devices are ranked process by process: EP groups of 4 and 8 consecutive ranks
    assert two_processes[0]["tp2_fsdp4_ep4/ep_group_processes"].tolist() == [[0, 0, 0, 0], [1, 1, 1, 1]]
    assert two_processes[0]["fsdp8_ep8/ep_group_processes"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]


def test_each_process_reads_about_half_of_the_checkpoint(two_processes):
    total = sum(path.stat().st_size for path in checkpoint_shards(CHECKPOINT)[0])
    for layout in FORWARD_LAYOUTS:
        shares = [int(seen[f"{layout}/bytes_read"]) / total for seen in two_processes]
        print(layout, "share of the checkpoint read per process:", [f"{share:.3f}" for share in shares])
        assert all(0.4 < share < 0.6 for share in shares), shares


def test_quantised_weights_load_in_each_process_for_its_devices_only(one_process, two_processes):
    """Kept MXFP4: each process reads about half the checkpoint, as a plain load. Quantised on load, a device's
    codes and its scales are each computed from the plain rows or blocks covering them (read twice), and the
    fixture's matrices are single 128 x 128 blocks, so every device of a row-split matrix reads all of it: still
    well short of the whole checkpoint."""
    workdir, seen, _ = one_process
    limits = {"kept_mxfp4": (0.4, 0.6), "fp8_on_load": (0.4, 0.8)}
    for name, (checkpoint, _, _) in quantized_loads(workdir).items():
        total = sum(path.stat().st_size for path in checkpoint_shards(checkpoint)[0])
        shares = [int(job[f"{name}/bytes_read"]) / total for job in two_processes]
        print(name, "share of the checkpoint read per process:", [f"{share:.3f}" for share in shares])
        low, high = limits[name]
        assert all(low < share < high for share in shares), (name, shares)
        for job in two_processes:
            np.testing.assert_allclose(job[f"{name}/logits"], seen[f"{name}/logits"], rtol=0, atol=2e-6)


def test_five_training_steps_match_and_train_states_restore_across_process_counts(one_process, two_processes):
    workdir, seen, train_step = one_process
    for job in two_processes:
        np.testing.assert_allclose(job["losses"], seen["losses"], rtol=1e-6)
        np.testing.assert_allclose(job["next_loss"], seen["next_loss"], rtol=1e-6)
        # the job restored the state this process saved, and took the same next step
        np.testing.assert_allclose(job["next_loss_from_1proc_state"], seen["next_loss"], rtol=1e-6)
    # and this process restores the state the job saved
    _, next_loss = train(train_step, restore_from=TrainCheckpoints(workdir / "state_2proc", train_step.model,
                                                                   train_step))
    np.testing.assert_allclose(next_loss, seen["next_loss"], rtol=1e-6)


def test_the_export_is_byte_identical(one_process, two_processes):
    workdir = one_process[0]
    ours, theirs = workdir / "export_2proc", workdir / "export_1proc"
    names = sorted(path.name for path in theirs.iterdir())
    assert sorted(path.name for path in ours.iterdir()) == names and len(names) > 3  # sharded + index + config
    for name in names:
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name


def test_greedy_generation_equals_transformers(two_processes):
    for job in two_processes:  # each process runs the same host loop and returns every row
        np.testing.assert_array_equal(job["generated"], GENERATION["greedy"])


def test_continuous_batching_equals_transformers_across_processes(two_processes):
    """generate_batch run alike by both processes, and a manager on process 0 leading process 1 (how
    `moe-jax serve` runs multi-process): the same greedy tokens as Transformers' generate."""
    width = GENERATION["input_ids"].shape[1]
    expected = GENERATION["greedy"][:, width:]
    for job in two_processes:
        np.testing.assert_array_equal(job["batch_generated"], expected)
    np.testing.assert_array_equal(two_processes[0]["served"], expected)


def test_each_process_reads_only_its_rows_of_a_batch(two_processes):
    rows = np.arange(16 * 12, dtype=np.int32).reshape(16, 12)
    asked = [set(job["rows_asked"].tolist()) for job in two_processes]
    assert asked[0].isdisjoint(asked[1]) and asked[0] | asked[1] == set(range(8))
    for job in two_processes:
        np.testing.assert_array_equal(job["batch_1"], rows[8:16])
    assert jax.process_count() == 1  # this side really is one process


def test_moe_jax_commands_join_the_job_the_launcher_starts():
    flags = ["plan", "--model", str(CHECKPOINT), "--train"]
    result = launch("--nproc", "2", "--devices-per-process", "4", "--", "moe-jax", *flags, "--tp", "2", "--fsdp", "4",
                    "--ep", "4", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for index in range(2):  # both processes built the 8-device mesh and its train state
        assert f"[{index}] train state (adamw" in result.stdout


def test_a_layout_smaller_than_the_job_is_refused(monkeypatch):
    from moe_jax.cli.layout_flags import layout_devices

    monkeypatch.setattr(jax, "process_count", lambda: 2)  # this process's 8 devices stand for a 2-process job
    with pytest.raises(ValueError, match="The layout covers 2 device\\(s\\) but this job of 2 processes has 8"):
        layout_devices(2, "plan")


# heavy: a second 2-process job; the suite's job already runs a manager on process 0 leading process 1
# (test_continuous_batching_equals_transformers_across_processes)
@pytest.mark.heavy
def test_moe_jax_serve_in_a_two_process_job_answers_and_stops_on_sigterm(tmp_path):
    """Process 0 listens and leads; process 1 runs every step it sends. A greedy completion equals the one-process
    model's `generate`; SIGTERM to the launcher drains process 0, which releases process 1: both end cleanly."""
    import re
    import signal
    import threading

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from moe_jax.tokenization import BYTE_CHAT_TEMPLATE, write_byte_tokenizer

    checkpoint = tmp_path / "model"
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, devices=jax.devices()[:1], progress=False)
    model.save_pretrained(checkpoint, progress=False)
    write_byte_tokenizer(checkpoint, chat_template=BYTE_CHAT_TEMPLATE)
    command = [sys.executable, "-m", "moe_jax.cli", "launch", "--nproc", "2", "--devices-per-process", "4", "--",
               "moe-jax", "serve", "--model", str(checkpoint), "--fsdp", "4", "--ep", "2", "--tp", "2", "--port", "0",
               "--max-slots", "4", "--max-model-len", "64", "--log-level", "warning"]
    launcher = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(300, launcher.kill)
    watchdog.start()
    lines = []
    try:
        for line in launcher.stdout:
            lines.append(line)
            if (found := re.search(r"^\[0\] serving \S+ at (http://\S+)/v1 ", line)) is not None:
                break
        assert found is not None, "".join(lines[-20:])
        prompt = [72, 101, 108, 108, 111]
        response = httpx.post(f"{found.group(1)}/v1/completions", timeout=120,
                              json={"prompt": prompt, "max_tokens": 6, "temperature": 0}).json()
        expected = model.generate(np.array([prompt]), max_new_tokens=6)[0, len(prompt):]
        assert response["usage"]["completion_tokens"] == 6
        assert response["choices"][0]["text"] == bytes(expected.tolist()).decode("utf-8", "replace")
        launcher.send_signal(signal.SIGTERM)
        rest = launcher.stdout.read()
        # The launcher reports the signal it got (128 + SIGTERM); both processes finished their own way first.
        assert launcher.wait(120) == 128 + signal.SIGTERM, (rest or "")[-3000:]
        assert "[1] stopped: ran the" in rest and "[0] stopped: 1 requests finished" in rest, rest[-3000:]
        assert "Traceback" not in rest
    finally:
        watchdog.cancel()
        if launcher.poll() is None:
            launcher.kill()
