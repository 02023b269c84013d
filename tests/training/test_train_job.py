"""`moe-jax train` as users run it: a real SIGKILL and an exact resume, the JSONL, one device by default,
the HF export, and bad requests refused before any compute."""

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from moe_jax import AutoModelForCausalLM
from moe_jax.cli import main
from moe_jax.cli.demo import DEMO_CONFIG
from moe_jax.tokenization import write_byte_tokenizer
from moe_jax.training import TrainCheckpoints, make_train_step
from moe_jax.training.optimizers import build_optimizer
from moe_jax.training.schedules import learning_rate_schedule

from .hf_training import CHECKPOINT, training_batches
from .test_loop import ADVERSARIAL_TOKEN

ROOT = Path(__file__).resolve().parents[2]
ADVERSARIAL_STEP = 4


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> Path:
    """[80, 12] token ids; the batch of step 4 (rows 24-31) is one repeated id, routed to two experts of one
    EP device (tests/training/test_loop.py)."""
    rows = training_batches(128)[0].reshape(-1, 12)
    rows[(ADVERSARIAL_STEP - 1) * 8: ADVERSARIAL_STEP * 8] = ADVERSARIAL_TOKEN
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, rows)
    return path


def train_argv(token_file, *extra) -> list[str]:
    return ["train", "--model", str(CHECKPOINT), "--data", str(token_file), "--batch-size", "8", "--fsdp", "2",
            "--ep", "2", "--lr", "1e-2", "--no-progress", *extra]


# A warmup + cosine schedule, so the resume must also continue the rate (the optimizer's update count).
SCHEDULE = ("--lr-schedule", "cosine", "--warmup-steps", "2", "--min-lr-ratio", "0.1")


# heavy: the suite's kill-and-resume test is tests/training/test_corpus.py's (the same TrainLoop resume,
# on a packed corpus)
@pytest.mark.heavy
def test_sigkill_after_step_6_then_resume_gives_the_uninterrupted_losses(token_file, tmp_path, capsys):
    assert main(train_argv(token_file, "--steps", "10", *SCHEDULE, "--metrics-jsonl",
                           str(tmp_path / "full.jsonl"))) == 0
    full = read_jsonl(tmp_path / "full.jsonl")
    assert [r["step"] for r in full] == list(range(1, 11))
    schedule = learning_rate_schedule("cosine", 1e-2, 10, warmup_steps=2, min_lr_ratio=0.1)
    np.testing.assert_allclose([r["lr"] for r in full], [float(schedule(step)) for step in range(10)], rtol=1e-6)
    # The adversarial batch overflowed the first rung, was replayed at the top one, and the JSONL says so.
    adversarial = full[ADVERSARIAL_STEP - 1]
    assert adversarial["replayed"] and adversarial["capacity"] == 2.0 > full[0]["capacity"]
    assert all(key in adversarial for key in ("loss", "aux_loss", "grad_norm", "tokens_per_s", "capacity"))

    checkpoint_dir, killed_jsonl = tmp_path / "ckpt", tmp_path / "killed.jsonl"
    checkpointing = ["--checkpoint-dir", str(checkpoint_dir), "--save-every", "2", "--keep", "2"]
    command = [sys.executable, "-m", "moe_jax.cli",
               *train_argv(token_file, "--steps", "10", *SCHEDULE, *checkpointing, "--metrics-jsonl",
                           str(killed_jsonl))]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (killed_jsonl.exists() and any(r["step"] >= 6 for r in read_jsonl(killed_jsonl))):
        assert process.poll() is None and time.monotonic() < deadline, "the training process ended or stalled"
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    killed = read_jsonl(killed_jsonl)
    assert killed[-1]["step"] < 10, "the process finished before the kill"

    capsys.readouterr()
    assert main(train_argv(token_file, "--steps", "10", *SCHEDULE, *checkpointing, "--resume",
                           "--metrics-jsonl", str(killed_jsonl))) == 0
    resumed_from = int(re.search(r"resumed from step (\d+)", capsys.readouterr().out).group(1))
    # A checkpoint (--save-every 2) at or before the last record: the steps after it are trained twice ...
    assert resumed_from % 2 == 0 and resumed_from <= killed[-1]["step"]
    records = read_jsonl(killed_jsonl)
    # ... yet the JSONL the resume appended to has each step once (was: the retrained steps twice).
    assert [r["step"] for r in records] == list(range(1, 11))
    assert [r["loss"] for r in records[resumed_from:]] == [r["loss"] for r in full[resumed_from:]]
    assert [r["lr"] for r in records] == [r["lr"] for r in full]
    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in full], rtol=1e-6)
    kept = sorted(int(p.name) for p in checkpoint_dir.iterdir() if p.name.isdigit())
    assert kept == [8, 10]                                     # --save-every 2 --keep 2


@pytest.fixture(scope="module")
def one_device_run(token_file, tmp_path_factory):
    """Two SGD steps without layout flags from the fixture checkpoint given a tokenizer, exported with
    --export-hf, the step compiled up front (--precompile): (stdout, export dir, metrics)."""
    directory = tmp_path_factory.mktemp("one_device")
    export, jsonl, model_dir = directory / "hf", directory / "metrics.jsonl", directory / "model"
    shutil.copytree(CHECKPOINT, model_dir)
    write_byte_tokenizer(model_dir)
    argv = ["train", "--model", str(model_dir), "--data", str(token_file), "--batch-size", "4", "--steps", "2",
            "--optimizer", "sgd", "--lr", "0.5", "--no-progress", "--export-hf", str(export),
            "--metrics-jsonl", str(jsonl), "--precompile"]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(argv) == 0
    return stdout.getvalue(), export, read_jsonl(jsonl)


def test_without_layout_flags_it_trains_on_one_device_and_exports_an_hf_checkpoint(one_device_run):
    out, export, records = one_device_run
    assert "training on 1 cpu device (no layout flag; JAX sees 8 devices" in out
    assert "compiled the step for capacities [None] in " in out     # no dispatch buffers: one program
    assert [r["step"] for r in records] == [1, 2] and all(r["capacity"] is None for r in records)
    assert {"config.json", "model.safetensors"} <= {p.name for p in export.iterdir()}
    # The tokenizer comes along, so text commands work on the export (was: weights and config only).
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (export / name).read_bytes() == (export.parent / "model" / name).read_bytes()
    assert out.rstrip().endswith(f"(with {export.parent / 'model'}'s tokenizer)")
    from safetensors.numpy import load_file

    trained, original = load_file(export / "model.safetensors"), load_file(CHECKPOINT / "model.safetensors")
    assert trained.keys() == original.keys()
    assert not np.array_equal(trained["lm_head.weight"], original["lm_head.weight"])


@pytest.mark.reference
def test_transformers_loads_the_export_and_gives_our_logits(one_device_run, token_file):
    pytest.importorskip("torch")
    import transformers

    from tests.models.hf_reference import hf_logits

    _, export, _ = one_device_run
    ours = AutoModelForCausalLM.from_pretrained(export, devices=jax.devices()[:1], progress=False)
    input_ids = np.load(token_file)[:4]
    reference = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    np.testing.assert_allclose(np.asarray(ours(input_ids)), hf_logits(reference, input_ids), atol=1e-5, rtol=0)


def _bad_file(tmp_path, name, array):
    path = tmp_path / name
    np.save(path, array)
    return str(path)


BAD_REQUESTS = {
    "float data": (lambda tmp: ["--data", _bad_file(tmp, "f.npy", np.zeros((16, 12), np.float32))],
                   "token ids must be integers, got dtype float32"),
    "1-D data": (lambda tmp: ["--data", _bad_file(tmp, "r.npy", np.zeros(96, np.int32))],
                 "must be a 2-D array"),
    "ids outside the vocabulary": (lambda tmp: ["--data", _bad_file(tmp, "v.npy", np.full((16, 12), 999, np.int32))],
                                   r"outside the model's vocabulary \[0, 128\)"),
    "sequence too long": (lambda tmp: ["--data", _bad_file(tmp, "l.npy", np.zeros((16, 300), np.int32))],
                          "longer than the model's max_position_embeddings \\(256\\)"),
    "batch the layout cannot split": (lambda tmp: ["--batch-size", "6", "--fsdp", "8", "--ep", "8"],
                                      "--batch-size 6: batch size 6 cannot be split .* 8 data-parallel"),
    "unknown preemption signal": (lambda tmp: ["--preemption-signals", "SIGTERM,SIGNOPE"],
                                  "--preemption-signals SIGTERM,SIGNOPE: unknown or uncatchable signal 'SIGNOPE'"),
    "sgd with weight decay": (lambda tmp: ["--optimizer", "sgd", "--weight-decay", "0.1"], "plain SGD"),
    "text without a tokenizer": (lambda tmp: ["--text", str(CHECKPOINT / "config.json")],
                                 "has no tokenizer \\(none of tokenizer.json"),
}


@pytest.mark.parametrize("request_name", list(BAD_REQUESTS))
def test_a_bad_request_is_refused_with_one_error_line(request_name, tmp_path, capsys):
    extra, message = BAD_REQUESTS[request_name]
    jsonl = tmp_path / "metrics.jsonl"
    argv = ["train", "--model", str(CHECKPOINT), "--steps", "1", "--no-progress", "--metrics-jsonl", str(jsonl),
            *extra(tmp_path)]
    before = sorted(tmp_path.rglob("*"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert re.search(message, err), err
    # Refused before the first step, with nothing created (was: --resume --checkpoint-dir made the directory).
    assert sorted(tmp_path.rglob("*")) == before and not jsonl.exists()


def test_a_checkpoint_directory_of_another_model_is_refused(tmp_path, capsys):
    checkpoint_dir = tmp_path / "ckpt"
    # A train state of the built-in demo model (a different config) ...
    other = AutoModelForCausalLM.from_config(DEMO_CONFIG, devices=jax.devices()[:1])
    other.init_params(0)
    train_step = make_train_step(other, build_optimizer("adamw", 1e-3))
    checkpoints = TrainCheckpoints(checkpoint_dir, other, train_step)
    checkpoints.save(1, train_step.init_state(), None)
    checkpoints.close()
    # ... cannot be resumed by the fixture model, and a fresh run will not write over it.
    assert main(["train", "--model", str(CHECKPOINT), "--steps", "2", "--checkpoint-dir", str(checkpoint_dir),
                 "--resume", "--no-progress"]) == 2
    assert "holds a train state of another model" in capsys.readouterr().err
    assert main(["train", "--steps", "2", "--checkpoint-dir", str(checkpoint_dir), "--no-progress"]) == 2
    assert "already holds checkpoints (latest step 1); pass --resume" in capsys.readouterr().err


def test_a_resume_with_another_optimizer_says_so_in_one_line(tmp_path, capsys):
    """(was: orbax's tree-mismatch report, ending in advice to pass `partial_restore=True`)"""
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, devices=jax.devices()[:1], progress=False)
    train_step = make_train_step(model, build_optimizer("adamw", 1e-3))
    checkpoints = TrainCheckpoints(tmp_path, model, train_step)
    checkpoints.save(1, train_step.init_state(), None)
    checkpoints.close()
    assert main(["train", "--model", str(CHECKPOINT), "--steps", "2", "--checkpoint-dir", str(tmp_path), "--resume",
                 "--optimizer", "sgd", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"error: {tmp_path} holds a train state of another optimizer: its optimizer state is (ScaleByAdamState("
        "count, mu, nu), EmptyState(), EmptyState()), this optimizer's is (EmptyState(), EmptyState()). Resume with")


# heavy: staged steps replay at more capacities (each compiled); pipeline training is in the suite
# through tests/models/test_pipeline.py's training curve
@pytest.mark.heavy
def test_pipeline_stages_train_as_one_stage(token_file, tmp_path, capsys):
    """--pp 2 --pp-microbatches 2 on top of fsdp2/ep2 (8 devices) gives the 4-device run's losses. The dispatch
    capacity is per call, and a microbatch (half the tokens) overflows a rung the whole batch fits, so the staged
    run replays more steps; replays are exact, so the losses agree all the same."""
    assert main(train_argv(token_file, "--steps", "5", "--metrics-jsonl", str(tmp_path / "flat.jsonl"))) == 0
    assert main(train_argv(token_file, "--steps", "5", "--pp", "2", "--pp-microbatches", "2",
                           "--metrics-jsonl", str(tmp_path / "staged.jsonl"))) == 0
    assert "pp=2" in capsys.readouterr().out
    flat, staged = read_jsonl(tmp_path / "flat.jsonl"), read_jsonl(tmp_path / "staged.jsonl")
    assert [r["step"] for r in staged] == [r["step"] for r in flat] == [1, 2, 3, 4, 5]
    np.testing.assert_allclose([r["loss"] for r in staged], [r["loss"] for r in flat], rtol=1e-5)


def test_one_command_serves_the_first_launch_and_every_requeue(tmp_path, capsys):
    """The same command line with --resume: the first launch starts at step 0, a rerun after completion resumes
    at the end and replaces the job's own export; what a killed save left is removed with a note; a directory
    another job exported to is still refused."""
    checkpoint_dir, export = tmp_path / "ckpt", tmp_path / "hf"
    argv = ["train", "--model", str(CHECKPOINT), "--steps", "2", "--batch-size", "4", "--no-progress",
            "--checkpoint-dir", str(checkpoint_dir), "--save-every", "1", "--resume", "--export-hf", str(export)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "holds no checkpoint yet; starting at step 0" in out and "wrote the trained weights" in out
    first = (export / "model.safetensors").read_bytes()
    (checkpoint_dir / "3.orbax-checkpoint-tmp-1764500000000000").mkdir()        # a save killed half-way
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "removed 3.orbax-checkpoint-tmp-1764500000000000" in out and "resumed from step 2" in out
    assert "replaced the earlier export" in out and (export / "model.safetensors").read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]          # nothing left beside the export
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert main([*argv[:-1], str(foreign)]) == 2
    assert "not an export of this job's --checkpoint-dir" in capsys.readouterr().err


@pytest.mark.heavy
def test_sigterm_saves_the_step_it_stops_at_exits_0_and_the_same_command_continues_bit_exactly(token_file, tmp_path,
                                                                                                 capsys):
    assert main(train_argv(token_file, "--steps", "10", *SCHEDULE, "--metrics-jsonl",
                           str(tmp_path / "full.jsonl"))) == 0
    full = read_jsonl(tmp_path / "full.jsonl")
    checkpoint_dir, jsonl = tmp_path / "ckpt", tmp_path / "preempted.jsonl"
    argv = train_argv(token_file, "--steps", "10", *SCHEDULE, "--checkpoint-dir", str(checkpoint_dir),
                      "--save-every", "100", "--resume", "--metrics-jsonl", str(jsonl))
    process = subprocess.Popen([sys.executable, "-m", "moe_jax.cli", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (jsonl.exists() and any(r["step"] >= 3 for r in read_jsonl(jsonl))):
        assert process.poll() is None and time.monotonic() < deadline, "the training process ended or stalled"
        time.sleep(0.05)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0 and time.monotonic() - signalled < 30, err
    stopped = int(re.search(r"SIGTERM: stopped at step (\d+) of 10", out).group(1))
    assert "SIGTERM: stopping at the next step boundary" in err and "Traceback" not in err
    assert [int(p.name) for p in checkpoint_dir.iterdir() if p.name.isdigit()] == [stopped] and stopped < 10
    capsys.readouterr()
    assert main(argv) == 0
    assert f"resumed from step {stopped}" in capsys.readouterr().out
    records = read_jsonl(jsonl)
    assert [r["step"] for r in records] == list(range(1, 11))
    assert [r["loss"] for r in records] == [r["loss"] for r in full]
