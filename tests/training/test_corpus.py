"""Text corpora (`moe_jax.training.corpus`, `moe-jax train --data corpus.parquet ...`): reading Parquet / JSON Lines /
text, tokenising through Grain (in worker processes too), packing into rows with segment ids, epochs, per-process
rows, the issue's end-to-end command, and one clear error line for each bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from moe_jax.cli import main
from moe_jax.tokenization import load_checkpoint_tokenizer, write_byte_tokenizer
from moe_jax.training.corpus import Corpus, DataShard, read_texts, tokenize

from .hf_training import CHECKPOINT

pyarrow = pytest.importorskip("pyarrow")
pytest.importorskip("grain")
import pyarrow.parquet as parquet  # noqa: E402

WORDS = ("moe", "jax", "expert", "token", "router", "layer", "page", "slot")


def texts(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(2, 14)))) for _ in range(count)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The fixture checkpoint with a byte tokenizer (vocabulary 128 covers ASCII)."""
    directory = tmp_path_factory.mktemp("corpus") / "model"
    shutil.copytree(CHECKPOINT, directory)
    write_byte_tokenizer(directory)
    return directory


def write_corpus(directory, documents: list[str]) -> dict[str, object]:
    parquet.write_table(pyarrow.table({"text": documents, "n": list(range(len(documents)))}),
                        directory / "corpus.parquet", row_group_size=5)
    (directory / "corpus.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in documents))
    (directory / "corpus.txt").write_text("\n\n".join(documents))
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(directory / "corpus.array_record"), "group_size:1")
    for number, document in enumerate(documents):   # JSON objects and plain text records, mixed
        writer.write((json.dumps({"text": document}) if number % 2 else document).encode())
    writer.close()
    return {suffix: directory / f"corpus.{suffix}" for suffix in ("parquet", "jsonl", "txt", "array_record")}


def test_every_format_reads_the_same_documents(tmp_path):
    documents = texts(12)
    for path in write_corpus(tmp_path, documents).values():
        assert read_texts(path) == documents, path


def test_shares_read_contiguous_disjoint_records_and_parquet_only_their_row_groups(tmp_path, monkeypatch):
    documents = texts(23)
    paths = write_corpus(tmp_path, documents)
    read_groups = []
    original = parquet.ParquetFile.read_row_group
    monkeypatch.setattr(parquet.ParquetFile, "read_row_group",
                        lambda self, group, **kw: read_groups.append(group) or original(self, group, **kw))
    for path in paths.values():
        shares = [read_texts(path, share=DataShard(index, 3, (index,))) for index in range(3)]
        assert shares == [documents[0:7], documents[7:15], documents[15:23]], path
    assert read_groups == [0, 1, 1, 2, 3, 4]   # groups of 5 records: share 2 (records 7-14) reads groups 1-2


def test_data_shares_follow_the_processes_that_hold_each_batch_row():
    class Device:
        def __init__(self, process_index):
            self.process_index = process_index

    class Layout:   # 2 processes x 4 devices: rows split over 4 data-parallel groups, 2 on each process
        def __init__(self, rows_of):
            self.rows_of = rows_of

        def devices_indices_map(self, shape):
            return {Device(process): (slice(*rows), slice(None)) for process, rows in self.rows_of}

    import jax

    from moe_jax.training.data import data_shard

    assert jax.process_index() == 0
    split = Layout([(0, (0, 2)), (0, (2, 4)), (1, (4, 6)), (1, (6, 8))])
    assert data_shard((8, 16), split) == DataShard(0, 2, (0, 1, 2, 3))
    replicated = Layout([(0, (0, 8)), (1, (0, 8))])   # e.g. tp across the processes: both read everything
    assert data_shard((8, 16), replicated) == DataShard(0, 1, tuple(range(8)))
    with pytest.raises(ValueError, match="overlapping sets"):
        data_shard((8, 16), Layout([(0, (0, 6)), (1, (4, 8))]))


def test_a_share_packs_its_own_rows_of_every_batch(checkpoint):
    docs = tokenize(texts(60), checkpoint)
    halves = [Corpus(docs[:30], batch_size=8, seq_len=16, seed=1, rows=(0, 1, 2, 3)),
              Corpus(docs[30:], batch_size=8, seq_len=16, seed=1, rows=(4, 5, 6, 7))]
    for half, rows in zip(halves, ((0, 1, 2, 3), (4, 5, 6, 7))):
        alone = Corpus(half.documents, batch_size=4, seq_len=16, seed=1)   # the share as a corpus of its own
        for index in (0, 5, alone.num_sequences // 4 + 2):                # across epochs
            part, expected = half.batch_rows(index, np.array(rows)), alone.batch(index)
            for name in expected:
                np.testing.assert_array_equal(part[name], expected[name])
        np.testing.assert_array_equal(half.batch_rows(3, np.array(rows[2:]))["input_ids"],
                                      alone.batch(3)["input_ids"][2:])
    with pytest.raises(ValueError, match=r"fills rows \[0, 1, 2, 3\] of each batch; asked for \[4\]"):
        halves[0].batch_rows(0, np.array([4]))
    with pytest.raises(ValueError, match="each process places its own rows"):
        halves[0].batch(0)
    with pytest.raises(ValueError, match="fewer than the 4 rows of each batch of 8 this share fills"):
        Corpus(docs[:2], batch_size=8, seq_len=16, pack=False, rows=(0, 1, 2, 3))


def test_packing_cuts_the_shuffled_stream_into_rows_with_pieces_numbered_per_row(checkpoint):
    docs = tokenize(texts(40), checkpoint)
    corpus = Corpus(docs, batch_size=4, seq_len=32, pack=True, seed=3)
    rows = corpus.epoch_rows(0)
    assert rows["input_ids"].shape == (corpus.num_sequences, 32) == (-(-sum(map(len, docs)) // 32), 32)
    order = np.random.default_rng((3, 0)).permutation(len(docs))
    stream = np.concatenate([docs[i] for i in order])
    np.testing.assert_array_equal(rows["input_ids"].reshape(-1)[:len(stream)], stream)
    segments = rows["segment_ids"]
    assert (segments[:, 0] == 1).all() and (segments.reshape(-1)[len(stream):] == 0).all()
    # A new piece starts exactly where a document starts (or a row does).
    starts = np.cumsum([0] + [len(docs[i]) for i in order])[:-1]
    flat_new = np.zeros(segments.size, bool)
    flat_new[starts] = True
    flat_new[::32] = True
    changes = np.concatenate([np.ones((len(segments), 1), bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    np.testing.assert_array_equal(changes.reshape(-1)[:len(stream)], flat_new[:len(stream)])
    assert corpus.packing_efficiency == pytest.approx(len(stream) / segments.size)
    assert not np.array_equal(corpus.epoch_rows(1)["input_ids"], rows["input_ids"])       # epochs reshuffle
    batch = corpus.batch(corpus.num_sequences // 4 + 1)                                     # crosses into epoch 1
    part = corpus.batch_rows(corpus.num_sequences // 4 + 1, np.array([1, 3]))
    for name in batch:
        np.testing.assert_array_equal(part[name], batch[name][[1, 3]])


# heavy: starts Grain's worker processes (each imports the library); the suite tokenises in-process
@pytest.mark.heavy
def test_grain_worker_processes_tokenise_as_this_process_does(checkpoint):
    documents = texts(30)
    encode = load_checkpoint_tokenizer(checkpoint, instead="-").encode
    in_process = tokenize(documents, checkpoint, workers=0)
    assert [list(ids) for ids in in_process] == [encode(text) for text in documents]
    workers = tokenize(documents, checkpoint, workers=2)
    assert [list(ids) for ids in workers] == [list(ids) for ids in in_process]


def test_the_issue_s_command_runs_end_to_end(checkpoint, tmp_path):
    write_corpus(tmp_path, texts(120))
    (tmp_path / "eval.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts(30, seed=1)))
    metrics = tmp_path / "metrics.jsonl"
    argv = ["train", "--model", str(checkpoint), "--data", str(tmp_path / "corpus.parquet"), "--text-column", "text",
            "--pack", "--seq-len", "64", "--lr-schedule", "cosine", "--warmup-steps", "2", "--eval-data",
            str(tmp_path / "eval.jsonl"), "--eval-every", "3", "--tensorboard", str(tmp_path / "tb"),
            "--batch-size", "4", "--steps", "6", "--metrics-jsonl", str(metrics), "--no-progress"]
    assert main(argv) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert [("eval_loss" in r) for r in records] == [False, False, True, False, False, True]
    assert records[0]["lr"] == 0.0 and 0.9 < records[0]["packing_efficiency"] <= 1.0
    assert any(path.name.startswith("events.out.tfevents") for path in (tmp_path / "tb").iterdir())


def test_moe_jax_eval_reads_a_corpus_as_train_does(checkpoint, tmp_path, capsys):
    (tmp_path / "eval.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts(30, seed=1)))
    assert main(["eval", "--model", str(checkpoint), "--data", str(tmp_path / "eval.jsonl"), "--seq-len", "64",
                 "--batch-size", "4", "--pack"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    corpus = Corpus.from_file(tmp_path / "eval.jsonl", checkpoint, batch_size=4, seq_len=64)
    assert result["batches"] == max(corpus.num_sequences // 4, 1) and result["eval_tokens"] > 0


@pytest.mark.parametrize("case,message", [
    ("missing_column", "has no column 'body'"),
    ("missing_field", "record 1 has no 'body' field"),
    ("empty", "holds no text"),
    ("short", "fewer than one batch"),
    ("no_tokenizer", "no tokenizer"),
])
def test_bad_corpora_are_one_error_line_and_nothing_written(case, message, checkpoint, tmp_path, capsys):
    write_corpus(tmp_path, texts(50))
    model, data, extra = checkpoint, tmp_path / "corpus.parquet", []
    if case == "missing_column":
        extra = ["--text-column", "body"]
    elif case == "missing_field":   # ArrayRecord: the first JSON record (record 0 is plain text) lacks the column
        data, extra = tmp_path / "corpus.array_record", ["--text-column", "body"]
    elif case == "empty":
        data = tmp_path / "empty.jsonl"
        data.write_text("")
    elif case == "short":
        extra = ["--batch-size", "64", "--pack"]
    else:
        model = CHECKPOINT   # no tokenizer files
    metrics, states = tmp_path / "metrics.jsonl", tmp_path / "states"
    argv = ["train", "--model", str(model), "--data", str(data), "--seq-len", "32", "--steps", "2",
            "--metrics-jsonl", str(metrics), "--checkpoint-dir", str(states), "--data-workers", "0", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not metrics.exists() and not states.exists()


@pytest.mark.heavy   # scripts/checks/check_corpus_resume.py runs it on 1 and 2 processes
def test_sigkill_then_resume_continues_on_exactly_the_next_packed_batch(checkpoint, tmp_path):
    """The corpus's batches are a function of the data position in the train state: a run killed mid-epoch and
    resumed gives the uninterrupted run's losses and learning rates (cosine schedule), step for step, across an
    epoch boundary."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    write_corpus(tmp_path, texts(20))
    base = ["train", "--model", str(checkpoint), "--data", str(tmp_path / "corpus.jsonl"), "--pack", "--seq-len", "32",
            "--batch-size", "4", "--steps", "12", "--lr", "1e-2", "--lr-schedule", "cosine", "--warmup-steps", "2",
            "--no-progress"]
    assert main([*base, "--metrics-jsonl", str(tmp_path / "full.jsonl")]) == 0
    full = [json.loads(line) for line in (tmp_path / "full.jsonl").read_text().splitlines()]
    corpus_rows = Corpus(tokenize(read_texts(tmp_path / "corpus.jsonl"), checkpoint), 4, 32).num_sequences
    assert 12 * 4 > corpus_rows   # the run crosses into the second epoch

    killed = tmp_path / "killed.jsonl"
    checkpointing = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "2"]
    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen([sys.executable, "-m", "moe_jax.cli", *base, *checkpointing, "--metrics-jsonl",
                                str(killed)], cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (killed.exists() and any(json.loads(line)["step"] >= 6 for line in killed.read_text().splitlines()
                                       if line.endswith("}"))):
        assert process.poll() is None and time.monotonic() < deadline, "the training process ended or stalled"
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    last = max(json.loads(line)["step"] for line in killed.read_text().splitlines() if line.endswith("}"))
    assert last < 12, "the process finished before the kill"
    assert main([*base, *checkpointing, "--resume", "--metrics-jsonl", str(killed)]) == 0
    resumed = [json.loads(line) for line in killed.read_text().splitlines()]
    assert [r["step"] for r in resumed] == list(range(1, 13))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]
    assert [r["lr"] for r in resumed] == [r["lr"] for r in full]   # the schedule resumes at the restored step
