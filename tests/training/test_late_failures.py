"""`moe-jax train` writes its metrics JSONL and TensorBoard event files only after every check that can be made
before them (the step compiled for the first batch, the eval program traced), so a refusal leaves nothing; a run
that fails later removes what it created and holds nothing, keeps what holds records, and says which."""

from __future__ import annotations

import json

import pytest

from moe_jax.cli import main
from moe_jax.training.data import SyntheticTokens
from moe_jax.training.step import TrainStep

pytest.importorskip("tensorboardX")


def argv(tmp_path, *extra) -> list[str]:
    """The built-in tiny model on synthetic tokens, writing every output a run can write."""
    return ["train", "--steps", "3", "--batch-size", "2", "--seq-len", "8", "--no-progress", "--metrics-jsonl",
            str(tmp_path / "run" / "metrics.jsonl"), "--tensorboard", str(tmp_path / "run" / "tb"),
            "--checkpoint-dir", str(tmp_path / "run" / "ckpt"), *extra]


def failing_from(monkeypatch, index: int) -> None:
    """Synthetic batches from `index` on raise, as a corrupt record met mid-run would."""
    batch, batch_rows = SyntheticTokens.batch, SyntheticTokens.batch_rows

    def refuse(at: int):
        if at >= index:
            raise ValueError(f"batch {at} is unreadable")

    monkeypatch.setattr(SyntheticTokens, "batch", lambda self, at: refuse(at) or batch(self, at))
    monkeypatch.setattr(SyntheticTokens, "batch_rows", lambda self, at, rows: refuse(at) or batch_rows(self, at, rows))


def test_a_step_refused_while_it_compiles_writes_nothing(tmp_path, monkeypatch, capsys):
    """(was: the model loaded, the JSONL and an event file were created, then the first step's trace refused the
    request, leaving both behind)"""
    (tmp_path / "run").mkdir()

    def refused(self, state, batch):
        raise ValueError("this step cannot run on this layout")

    monkeypatch.setattr(TrainStep, "_step", refused)
    assert main(argv(tmp_path)) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: this step cannot run on this layout"]
    assert list((tmp_path / "run").iterdir()) == []


def test_a_run_failing_before_its_first_record_removes_the_files_it_created(tmp_path, monkeypatch, capsys):
    (tmp_path / "run").mkdir()
    failing_from(monkeypatch, 1)   # batch 0 compiles and runs; batch 1 is read before step 1's record
    assert main(argv(tmp_path, "--save-every", "100")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"the run stopped early: removed the empty {tmp_path / 'run' / 'metrics.jsonl'}, "
                   f"{tmp_path / 'run' / 'tb'}'s event file without scalars.", "error: batch 1 is unreadable"]
    assert list((tmp_path / "run").iterdir()) == []


# heavy: a second failing CLI run; the failure before records stays in the suite
@pytest.mark.heavy
def test_a_run_failing_after_records_keeps_them_and_says_so(tmp_path, monkeypatch, capsys):
    (tmp_path / "run").mkdir()
    failing_from(monkeypatch, 2)   # steps 1-2 are recorded and saved (a save drains the queue) before batch 2
    assert main(argv(tmp_path, "--save-every", "1")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    run = tmp_path / "run"
    assert err == [f"the run stopped early: kept {run / 'metrics.jsonl'} (2 record(s) from this run), {run / 'tb'} "
                   f"(2 step(s) of scalars from this run), train-state checkpoints up to step 2 in {run / 'ckpt'}.",
                   "error: batch 2 is unreadable"]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert any(path.name.startswith("events.out.tfevents") for path in (run / "tb").iterdir())
