"""`moe-jax train` with frozen parts: a LoRA run resumed from its checkpoint continues with the uninterrupted
run's losses; `--freeze '*.mlp.gate.*'` trains everything but the routers, which keep their bytes; bad LoRA and
freeze flags are refused in one line before any step."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from safetensors.numpy import load_file

from moe_jax.cli import main

from ..training.hf_training import CHECKPOINT
from .test_train_command import LORA_FLAGS


def losses(path) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in map(json.loads, path.read_text().splitlines())}


def argv(tmp_path, steps: int, *extra) -> list[str]:
    return ["train", "--model", str(CHECKPOINT), "--fsdp", "2", "--ep", "2", "--steps", str(steps), "--seq-len", "16",
            "--lr", "1e-2", "--no-progress", *extra]


# heavy: resuming a run is the suite's in tests/training; the adapter's state restores in tests/lora
@pytest.mark.heavy
def test_a_lora_run_resumes_with_the_uninterrupted_losses(tmp_path):
    assert main(argv(tmp_path, 4, *LORA_FLAGS, "--metrics-jsonl", str(tmp_path / "whole.jsonl"))) == 0
    checkpoints = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "2"]
    assert main(argv(tmp_path, 2, *LORA_FLAGS, *checkpoints, "--metrics-jsonl", str(tmp_path / "parts.jsonl"))) == 0
    assert main(argv(tmp_path, 4, *LORA_FLAGS, *checkpoints, "--resume",
                     "--metrics-jsonl", str(tmp_path / "parts.jsonl"))) == 0
    whole, parts = losses(tmp_path / "whole.jsonl"), losses(tmp_path / "parts.jsonl")
    assert parts.keys() == whole.keys() == {1, 2, 3, 4}
    np.testing.assert_allclose([parts[step] for step in whole], list(whole.values()), rtol=1e-6)


def test_freeze_trains_everything_but_the_routers(tmp_path, capsys):
    assert main(["train", "--model", str(CHECKPOINT), "--steps", "2", "--seq-len", "16", "--lr", "1e-2",
                 "--no-progress", "--freeze", "*.mlp.gate.*", "--export-hf", str(tmp_path / "out")]) == 0
    assert "array(s); the rest of the model is frozen" in capsys.readouterr().out
    before, after = load_file(str(CHECKPOINT / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    routers = [name for name in before if name.endswith("mlp.gate.weight")]
    assert routers and all(np.array_equal(before[name], after[name]) for name in routers)
    assert not np.array_equal(before["model.layers.1.self_attn.q_proj.weight"],
                              after["model.layers.1.self_attn.q_proj.weight"])


BAD_FLAGS = {
    "rank 0": (["--lora-rank", "0"], r"--lora-rank / --lora-\*: LoRA rank r=0 must be a positive integer"),
    "alpha without a rank": (["--lora-alpha", "16"], r"--lora-alpha needs --lora-rank R"),
    "export without a rank": (["--export-adapter", "x"], r"--export-adapter needs --lora-rank R"),
    "a target that matches nothing": (["--lora-rank", "4", "--lora-target-modules", "q_porj"],
                                      r"'q_porj' matches no module of this model \(closest: q_proj"),
    "the router as a module": (["--lora-rank", "4", "--lora-target-modules", "gate"],
                               r"HF's router, which is not a torch.nn.Linear"),
    "a freeze that matches nothing": (["--freeze", "*.mlp.router.*"],
                                      r"--freeze '\*.mlp.router.\*' matches none of the model's parameters"),
    "a freeze outside the adapter": (["--lora-rank", "4", "--freeze", "*.mlp.gate.*"],
                                     r"--freeze '\*.mlp.gate.\*' matches none of the adapter's arrays"),
}


@pytest.mark.parametrize("name", list(BAD_FLAGS))
def test_bad_lora_and_freeze_flags_are_refused_in_one_line(name, tmp_path, capsys):
    extra, message = BAD_FLAGS[name]
    assert main(["train", "--model", str(CHECKPOINT), "--steps", "1", "--no-progress", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
