"""`moe-jax train --cp N`: a context-parallel layout trains (losses finite and falling, the same as without cp);
a sequence cp cannot split, or --cp on a decoding command, is refused with one error line before loading."""

import json
from pathlib import Path

import numpy as np
import pytest

from moe_jax.cli import main

from .hf_training import CHECKPOINT


@pytest.fixture(scope="module")
def repeated_rows(tmp_path_factory) -> Path:
    """[16, 16] token ids: the same few sequences, so a few steps of training lower the loss."""
    rows = np.tile((np.arange(16)[None, :] * 7 + np.arange(4)[:, None] * 3) % 64, (4, 1)).astype(np.int32)
    path = tmp_path_factory.mktemp("data") / "rows.npy"
    np.save(path, rows)
    return path


def _losses(path) -> list[float]:
    return [json.loads(line)["loss"] for line in Path(path).read_text().splitlines() if line.strip()]


def _train(rows, tmp_path, name, *layout) -> list[float]:
    assert main(["train", "--model", str(CHECKPOINT), "--data", str(rows), "--batch-size", "4", "--steps", "4",
                 "--lr", "3e-2", "--no-progress", *layout, "--metrics-jsonl", str(tmp_path / name)]) == 0
    return _losses(tmp_path / name)


def test_a_cp_layout_trains_with_falling_losses(repeated_rows, tmp_path, capsys):
    losses = _train(repeated_rows, tmp_path, "cp.jsonl", "--fsdp", "4", "--cp", "2")
    assert "cp=2 (all_gather)" in capsys.readouterr().out
    assert np.isfinite(losses).all() and losses[-1] < losses[0] - 0.1


# heavy: three layouts compiled, the expert dispatch replayed at several capacities (about 40 s on 2 cores)
@pytest.mark.heavy
def test_expert_groups_spanning_cp_ranks_train_as_the_data_parallel_layout(repeated_rows, tmp_path):
    """--cp 4 --fsdp 2 --ep 4 (ep groups inside cp), all_gather and ring: the losses of --fsdp 4 --ep 4."""
    reference = _train(repeated_rows, tmp_path, "dp.jsonl", "--fsdp", "4", "--ep", "4")
    for strategy in ("all_gather", "ring"):
        losses = _train(repeated_rows, tmp_path, f"{strategy}.jsonl", "--cp", "4", "--fsdp", "2", "--ep", "4",
                        "--cp-strategy", strategy)
        np.testing.assert_allclose(losses, reference, rtol=2e-4)


@pytest.mark.parametrize("argv, message", [
    (["train", "--cp", "4", "--fsdp", "2", "--seq-len", "20"], "--seq-len 20 cannot be split over --cp 4"),
    (["train", "--cp-strategy", "ring"], "add --cp N"),
    (["generate", "--model", "/nowhere", "--cp", "2", "--prompt-ids", "1,2"], "use a layout without cp"),
    (["serve", "--model", "/nowhere", "--cp", "2"], "use a layout without cp"),
])
def test_what_cp_cannot_run_is_refused_before_loading(argv, message, capsys):
    assert main([*argv, "--no-progress"] if argv[0] == "train" else argv) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1
