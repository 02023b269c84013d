"""What a training run records of its settings and what later commands do with them: a resume that lengthens a
decaying schedule says so (and --lr-decay-steps keeps the first run's length); `moe-jax eval` defaults to the
training run's data settings, so it reports the perplexity the run's own --eval-data did, and prints them."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from moe_jax.cli import main
from moe_jax.training.schedules import learning_rate_schedule

from .hf_training import CHECKPOINT


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train(tmp_path, *extra) -> list[str]:
    """The built-in tiny model on synthetic tokens, cosine schedule, a checkpoint every 2 steps."""
    return ["train", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--lr", "1e-2", "--lr-schedule", "cosine",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "2", "--metrics-jsonl",
            str(tmp_path / "metrics.jsonl"), "--no-progress", *extra]


# heavy: a resumed CLI run; resuming is the suite's in tests/training/test_train_job.py
@pytest.mark.heavy
def test_a_resume_that_lengthens_the_schedule_says_so_and_lr_decay_steps_keeps_it(tmp_path, capsys):
    assert main(train(tmp_path)) == 0
    shutil.copytree(tmp_path / "ckpt", tmp_path / "first")
    capsys.readouterr()
    assert main(train(tmp_path, "--steps", "4", "--resume")) == 0
    out = capsys.readouterr().out
    assert ("note: the cosine schedule now decays over 4 updates, not the 2 the checkpoint trained with: update 3 "
            "runs at 0.005 instead of 0; pass --lr-decay-steps 2 to keep the checkpoint's schedule.") in out
    lengthened = [record["lr"] for record in read_jsonl(tmp_path / "metrics.jsonl")][2:]
    np.testing.assert_allclose(lengthened, [learning_rate_schedule("cosine", 1e-2, 4)(step) for step in (2, 3)],
                               rtol=1e-6, atol=1e-12)

    shutil.rmtree(tmp_path / "ckpt")
    shutil.copytree(tmp_path / "first", tmp_path / "ckpt")
    assert main(train(tmp_path, "--steps", "4", "--resume", "--lr-decay-steps", "2")) == 0
    assert "note:" not in capsys.readouterr().out
    pinned = [record["lr"] for record in read_jsonl(tmp_path / "metrics.jsonl")][2:]
    assert pinned == [0.0, 0.0]      # the first run's schedule, which ended at its floor


def test_lr_decay_steps_needs_a_decaying_schedule(tmp_path, capsys):
    assert main(["train", "--lr-decay-steps", "5", "--metrics-jsonl", str(tmp_path / "m.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --lr-decay-steps needs a decaying --lr-schedule (cosine or linear); constant does not "
                   "decay."]
    assert not (tmp_path / "m.jsonl").exists()


# heavy: a second CLI run; eval's settings are unit-tested in tests/training/test_evaluation.py
@pytest.mark.heavy
def test_moe_jax_eval_follows_the_training_run_s_data_settings_and_prints_them(tmp_path, capsys):
    """(was: eval read the file at seq 512, one document per row, and gave another perplexity than the run's own
    evaluation of the same file at seq 32, packed)"""
    pytest.importorskip("grain")
    from moe_jax.tokenization import write_byte_tokenizer

    model = tmp_path / "model"
    shutil.copytree(CHECKPOINT, model)
    write_byte_tokenizer(model)
    words = ("moe", "jax", "expert", "token", "router", "layer", "page", "slot")
    rng = np.random.default_rng(0)
    for name, count in (("train", 40), ("heldout", 24)):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(
            json.dumps({"body": " ".join(rng.choice(words, int(rng.integers(2, 14))))}) for _ in range(count)))
    export, metrics = tmp_path / "trained", tmp_path / "metrics.jsonl"
    assert main(["train", "--model", str(model), "--data", str(tmp_path / "train.jsonl"), "--text-column", "body",
                 "--pack", "--seq-len", "32", "--batch-size", "4", "--steps", "1", "--eval-data",
                 str(tmp_path / "heldout.jsonl"), "--metrics-jsonl", str(metrics), "--export-hf", str(export),
                 "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["eval", "--model", str(export), "--data", str(tmp_path / "heldout.jsonl")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == (f"eval settings: batch size 4, seq len 32, packed, text column body; batch size, seq len, "
                        f"pack, text column as the training run recorded in {export / 'moe_jax_training.json'}")
    reported, trained = json.loads(lines[-1]), read_jsonl(metrics)[-1]
    assert reported["eval_tokens"] == trained["eval_tokens"]
    assert reported["eval_loss"] == pytest.approx(trained["eval_loss"], rel=1e-5)
    # A flag still wins over the record.
    assert main(["eval", "--model", str(export), "--data", str(tmp_path / "heldout.jsonl"), "--no-pack"]) == 0
    assert capsys.readouterr().out.startswith("eval settings: batch size 4, seq len 32, one document per row, "
                                              "text column body; batch size, seq len, text column as")
