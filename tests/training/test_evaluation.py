"""Evaluation (`moe_jax.training.Evaluator`, `TrainLoop(evaluate=...)`, `moe-jax train --eval-data`,
`moe-jax eval`): the loss is the mean cross-entropy of the model's logits, the same on a sharded layout,
evaluating leaves the training curve unchanged, and the command line reports it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_jax.cli import main
from moe_jax.training import Evaluator, TrainLoop
from moe_jax.training.corpus import Corpus
from moe_jax.training.data import TokenRows

from ..heavy import representative
from .conftest import FixtureBatches, build_trainer
from .hf_training import CHECKPOINT


def cross_entropy(logits: np.ndarray, ids: np.ndarray, mask: np.ndarray | None = None) -> tuple[float, int]:
    """Sum of -log p(next token) over the predicted positions, and their count (numpy, float64)."""
    logits = logits[:, :-1].astype(np.float64)
    log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    chosen = np.take_along_axis(log_probs, ids[:, 1:, None], axis=-1)[..., 0]
    keep = np.ones_like(chosen, bool) if mask is None else (mask[:, 1:] > 0)
    return float(-(chosen * keep).sum()), int(keep.sum())


@pytest.fixture(scope="module")
def rows() -> np.ndarray:
    return np.random.default_rng(3).integers(0, 128, (16, 24)).astype(np.int32)


@pytest.mark.parametrize("layout", representative([None, dict(tp_size=2, fsdp_size=4, ep_size=4)],
                                                    suite=("tp2_fsdp4_ep4",), ids=["one_device", "tp2_fsdp4_ep4"]))
def test_the_loss_is_the_mean_cross_entropy_of_the_logits(layout, rows):
    model, _ = build_trainer(layout)
    result = Evaluator(model, loss_chunk=7).run(model.params, TokenRows(rows, batch_size=8))
    total, count = 0.0, 0
    for batch in (rows[:8], rows[8:]):
        ce, n = cross_entropy(np.asarray(model.forward(batch).logits), batch)
        total, count = total + ce, count + n
    assert result["eval_tokens"] == count == 16 * 23
    assert result["eval_loss"] == pytest.approx(total / count, rel=1e-5)
    assert result["eval_perplexity"] == pytest.approx(np.exp(total / count), rel=1e-5)


def documents(lengths: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [rng.integers(1, 128, length).astype(np.int32) for length in lengths]


def alone(model, pieces: list[np.ndarray], width: int) -> tuple[float, int]:
    """Cross-entropy sum and predicted tokens of each token sequence run alone from position 0 (right-padded
    to `width`: causal attention keeps padding out of the real positions' logits)."""
    ids, mask = np.zeros((len(pieces), width), np.int32), np.zeros((len(pieces), width), np.int32)
    for row, piece in enumerate(pieces):
        ids[row, :len(piece)], mask[row, :len(piece)] = piece, 1
    return cross_entropy(np.asarray(model.apply(model.params, ids).logits), ids, mask)


def test_packed_rows_score_each_document_piece_alone(trainers):
    """Packed rows (`segment_ids`): the loss counts each piece's own next-token predictions, none across a
    document's end and none from the last row's padding, with attention and positions as if the piece ran
    alone. 55 tokens in rows of 10: 6 rows (the last half padding), 3 whole batches of 2."""
    model, _ = trainers("one_device")
    corpus = Corpus(documents([5, 9, 3, 7, 4, 6, 11, 8, 2]), batch_size=2, seq_len=10)
    result = Evaluator(model, loss_chunk=4).run(model.params, corpus)
    pieces = []
    for index in range(3):
        batch = corpus.batch(index)
        for ids, segments in zip(batch["input_ids"], batch["segment_ids"]):
            pieces += [ids[segments == piece] for piece in np.unique(segments[segments > 0])]
    total, count = alone(model, pieces, 10)
    assert count == 55 - len(pieces) and result["eval_tokens"] == count
    assert result["eval_loss"] == pytest.approx(total / count, rel=1e-5)


def test_padded_rows_score_only_their_real_tokens(trainers):
    """One document per row (`attention_mask`, padding after it; a long one cut at seq_len, a one-token one
    predicting nothing): the loss counts each row's real next-token predictions only. 7 rows make 3 whole
    batches of 2; one pass stops there (the 7th row's batch would wrap into the next epoch)."""
    model, _ = trainers("one_device")
    corpus = Corpus(documents([5, 12, 3, 9, 1, 7, 4]), batch_size=2, seq_len=8, pack=False)
    result = Evaluator(model, loss_chunk=4).run(model.params, corpus)
    # The documents' ids are never 0, the padding's always: a row's real tokens are its nonzero ids.
    pieces = [ids[ids > 0] for index in range(3) for ids in corpus.batch(index)["input_ids"]]
    total, count = alone(model, pieces, 8)
    assert count == sum(len(piece) - 1 for piece in pieces if len(piece)) and result["eval_tokens"] == count
    assert result["eval_loss"] == pytest.approx(total / count, rel=1e-5)


def test_evaluating_during_training_leaves_the_curve_unchanged(rows):
    model, train_step = build_trainer(None)
    evaluator = Evaluator(model, loss_chunk=5)
    held_out = TokenRows(rows, batch_size=8)
    plain, evaluated = [], []
    state = train_step.init_state(params=model.params)
    TrainLoop(train_step, FixtureBatches(), on_step=plain.append).run(state, 4)
    state = train_step.init_state(params=model.params)
    final, _ = TrainLoop(train_step, FixtureBatches(), on_step=evaluated.append,
                         evaluate=lambda step, state: evaluator.run(state.params, held_out, batches=1),
                         should_evaluate=lambda step: step % 2 == 0).run(state, 4)
    assert [r["loss"] for r in evaluated] == [r["loss"] for r in plain]
    assert ["eval_loss" in r for r in evaluated] == [False, True, False, True]
    # After step 4 the evaluation saw exactly the state the loop returns.
    assert evaluated[-1]["eval_loss"] == evaluator.run(final.params, held_out, batches=1)["eval_loss"]


def test_train_with_eval_data_then_moe_jax_eval_reports_the_same_loss(tmp_path, rows, capsys):
    np.save(tmp_path / "heldout.npy", rows)
    np.save(tmp_path / "train.npy", np.random.default_rng(4).integers(0, 128, (32, 24)).astype(np.int32))
    metrics, export = tmp_path / "metrics.jsonl", tmp_path / "trained"
    assert main(["train", "--model", str(CHECKPOINT), "--data", str(tmp_path / "train.npy"), "--steps", "4",
                 "--eval-data", str(tmp_path / "heldout.npy"), "--eval-every", "2", "--eval-batches", "2",
                 "--metrics-jsonl", str(metrics), "--export-hf", str(export), "--no-progress"]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [("eval_loss" in r) for r in records] == [False, True, False, True]
    capsys.readouterr()
    assert main(["eval", "--model", str(export), "--data", str(tmp_path / "heldout.npy"), "--batches", "2",
                 "--tp", "2", "--ep", "2", "--fsdp", "2"]) == 0
    reported = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert reported["eval_tokens"] == records[-1]["eval_tokens"] == 16 * 23
    assert reported["eval_loss"] == pytest.approx(records[-1]["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("argv,message", [
    (["train", "--eval-every", "2"], "--eval-every needs --eval-data"),
    (["train", "--eval-data", "missing.npy"], "--eval-data missing.npy: no such file"),
    (["eval", "--model", str(CHECKPOINT), "--data", "missing.npy"], "--data missing.npy: no such file"),
    (["eval", "--model", str(CHECKPOINT), "--data", "x.npy", "--batches", "0"], "--batches 0 must be >= 1"),
])
def test_bad_eval_requests_are_one_error_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_an_evaluator_compiles_once_for_its_batch_shape(rows):
    model, _ = build_trainer(None)
    evaluator = Evaluator(model)
    first = evaluator.run(model.params, TokenRows(rows, batch_size=8))
    assert evaluator.run(model.params, TokenRows(rows, batch_size=8)) == first
    assert evaluator._jit._cache_size() == 1
