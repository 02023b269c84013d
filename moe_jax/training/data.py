"""Batch sources for the training loop: indexable, so a replay or a resume asks for the same batch again.

    TokenRows(np.load("tokens.npy", mmap_mode="r"), batch_size=8)     # [num_sequences, seq_len] int ids
    TokenRows.from_text("corpus.txt", tokenizer_dir, batch_size=8, seq_len=512)
    SyntheticTokens(vocab_size=256, batch_size=8, seq_len=64, seed=0)
    Corpus.from_file("corpus.parquet", tokenizer_dir, batch_size=8, seq_len=512, pack=True)   # corpus.py

`batch(i)` returns `{"input_ids": [B, S] int32}`; labels are the inputs (the loss shifts them, as the
reference does). Step i of a token file trains on rows i*B .. i*B+B-1, wrapping around.

`place_batch(data, i, sharding)` makes batch i a global array: with `batch_rows(i, rows)` (every source
here has it) each process reads only the rows of the batch its own devices hold, so in a multi-process
job a token file is read in disjoint pieces. A text corpus goes further: `data_shard(shape, sharding)` names
the process's share, and `Corpus.from_file(..., share=)` reads, tokenises and packs only that share.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..distributed.host_arrays import global_rows, host_to_global, local_rows
from ..tokenization import load_checkpoint_tokenizer
from .corpus import Corpus, DataShard, read_texts, tokenize  # noqa: F401 - text corpora (Grain), a source like these


def data_shard(shape: tuple[int, int], sharding) -> DataShard:
    """This process's share of a corpus for global batches of `shape` [B, S] laid out by `sharding`: the
    processes that hold the same rows read the same share; the shares are numbered by their first row. One
    process (or rows replicated on every process): one share, the whole corpus."""
    import jax

    held: dict[int, set[int]] = {}
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        rows = range(*index[0].indices(shape[0])) if index else range(shape[0])
        held.setdefault(device.process_index, set()).update(rows)
    shares = sorted({tuple(sorted(rows)) for rows in held.values()})
    if sorted(row for share in shares for row in share) != list(range(shape[0])):
        raise ValueError(f"the batch's rows are split over processes in overlapping sets {shares}: a corpus can be "
                         "shared out only when each process's rows are another's or disjoint from them.")
    mine = tuple(sorted(held[jax.process_index()]))
    return DataShard(shares.index(mine), len(shares), mine)


def place_batch(data, index: int, sharding) -> dict:
    """Batch `index` of `data` as global jax.Arrays laid out by `sharding`. Sources with `batch_rows(index,
    rows)` and `batch_size` / `seq_len` are asked for this process's rows only; others build the whole batch
    (the same on every process) and each process keeps its rows."""
    if not hasattr(data, "batch_rows"):
        return {key: host_to_global(value, sharding) for key, value in data.batch(index).items()}
    shape = (data.batch_size, data.seq_len)
    part = data.batch_rows(index, local_rows(shape, sharding))
    return {key: global_rows((shape[0], *value.shape[1:]), sharding, lambda rows, value=value: value)
            for key, value in part.items()}


def corpus_packing_efficiency(corpus: Corpus, share: DataShard) -> float:
    """The packing efficiency of the whole corpus from its shares' (real tokens over the tokens of an epoch's rows,
    each share counted once): a collective, every process calls it."""
    if share.count == 1:
        return corpus.packing_efficiency
    from jax.experimental import multihost_utils

    # Rows and efficiency apart (int32 and float32): without x64, a share's token count could overflow int32.
    counts = multihost_utils.process_allgather(np.asarray([share.index, corpus.num_sequences], np.int32))
    shares = multihost_utils.process_allgather(np.asarray([corpus.packing_efficiency], np.float32))
    per_share = {int(index): (int(rows), float(efficiency)) for (index, rows), (efficiency,) in zip(counts, shares)}
    total_rows = sum(rows for rows, _ in per_share.values())
    return sum(rows * efficiency for rows, efficiency in per_share.values()) / total_rows


class TokenRows:
    """Rows of token ids; batch i = rows i*B .. i*B+B-1 (mod the row count), first `seq_len` columns."""

    def __init__(self, rows: np.ndarray, batch_size: int, seq_len: int | None = None, *, source: str = "tokens"):
        rows = np.asarray(rows) if not isinstance(rows, np.memmap) else rows
        if rows.ndim != 2:
            raise ValueError(f"{source}: token ids must be a 2-D array [num_sequences, seq_len], got shape "
                             f"{tuple(rows.shape)}.")
        if not np.issubdtype(rows.dtype, np.integer):
            raise ValueError(f"{source}: token ids must be integers, got dtype {rows.dtype}.")
        if rows.shape[0] == 0 or rows.shape[1] == 0:
            raise ValueError(f"{source}: holds no tokens (shape {tuple(rows.shape)}).")
        if batch_size < 1:
            raise ValueError(f"batch size {batch_size} must be >= 1.")
        seq_len = rows.shape[1] if seq_len is None else seq_len
        if not 1 <= seq_len <= rows.shape[1]:
            raise ValueError(f"seq_len={seq_len} is not within the {rows.shape[1]} tokens per row of {source}.")
        self.rows, self.batch_size, self.seq_len, self.source = rows, batch_size, seq_len, source

    @classmethod
    def from_file(cls, path, batch_size: int, seq_len: int | None = None) -> TokenRows:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"--data {path}: no such file (a .npy of int token ids [num_sequences, seq_len]).")
        try:
            rows = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as error:
            raise ValueError(f"--data {path}: not a .npy array file ({error}).") from None
        return cls(rows, batch_size, seq_len, source=str(path))

    @classmethod
    def from_text(cls, path, tokenizer_dir, batch_size: int, seq_len: int) -> TokenRows:
        """Tokenise a text file with the checkpoint's tokenizer and cut the token stream into rows."""
        tokenizer = load_tokenizer(tokenizer_dir)
        text = Path(path).read_text(encoding="utf-8")
        ids = np.asarray(tokenizer(text), dtype=np.int64)
        if len(ids) < seq_len:
            raise ValueError(f"--text {path}: {len(ids)} tokens, fewer than one sequence of --seq-len {seq_len}.")
        usable = len(ids) // seq_len * seq_len
        return cls(ids[:usable].reshape(-1, seq_len), batch_size, seq_len, source=str(path))

    @property
    def num_sequences(self) -> int:
        return self.rows.shape[0]

    def check_vocabulary(self, vocab_size: int) -> None:
        """Every id must index the embedding: checked once, before any compute."""
        low, high = int(np.min(self.rows)), int(np.max(self.rows))
        if low < 0 or high >= vocab_size:
            raise ValueError(f"{self.source}: token ids span [{low}, {high}], outside the model's vocabulary "
                             f"[0, {vocab_size}).")

    def batch(self, index: int) -> dict[str, np.ndarray]:
        return self.batch_rows(index, np.arange(self.batch_size))

    def batch_rows(self, index: int, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Rows `rows` (positions within the batch) of batch `index`; only those are read from the file."""
        rows = (index * self.batch_size + np.asarray(rows)) % self.num_sequences
        return {"input_ids": np.asarray(self.rows[rows, : self.seq_len], np.int32)}


class SyntheticTokens:
    """Uniform random token ids, batch i drawn from seed (seed, i): no data needed, same batch every time."""

    def __init__(self, vocab_size: int, batch_size: int, seq_len: int, seed: int = 0):
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch size {batch_size} and seq_len {seq_len} must be >= 1.")
        self.vocab_size, self.batch_size, self.seq_len, self.seed = vocab_size, batch_size, seq_len, seed

    def batch(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng((self.seed, index))
        return {"input_ids": rng.integers(0, self.vocab_size, (self.batch_size, self.seq_len)).astype(np.int32)}

    def batch_rows(self, index: int, rows: np.ndarray) -> dict[str, np.ndarray]:
        return {"input_ids": self.batch(index)["input_ids"][np.asarray(rows)]}


def load_tokenizer(directory):
    """`text -> list of ids` with the checkpoint's tokenizer, read from local files only."""
    return load_checkpoint_tokenizer(directory, instead="give token ids with --data FILE.npy instead").encode
