"""Text corpora as training batches: Parquet, JSON Lines or plain text, tokenised by Grain workers, packed or not.

    corpus = Corpus.from_file("corpus.parquet", tokenizer_dir, batch_size=8, seq_len=512, text_column="text",
                              pack=True, seed=0)
    corpus.batch(i)          # {"input_ids": [B, S], "segment_ids": [B, S]} (packed) or {"input_ids", "attention_mask"}

Reading: `.parquet` (pyarrow) and `.jsonl` / `.json` (one JSON object per line) take the `text_column` of each
record; `.txt` is one document per non-empty line; `.array_record` records are UTF-8 JSON objects (their
`text_column`) or UTF-8 text. In a multi-process job each process reads and tokenises only its share
(`DataShard`: contiguous records; Parquet reads only the row groups that hold them, ArrayRecord only those
records, line formats parse only their lines) and packs its own rows of every batch, as MaxText's per-host
Grain pipelines do: a resume on the same data layout continues exactly, a different layout reads the corpus in
other shares (other batches). Tokenising runs once, up front, through a Grain pipeline:
`MapDataset.source(texts).map(Tokenize)` with `workers` worker processes (`mp_prefetch`; each loads the
checkpoint's tokenizer once), or in this process with 0 workers; document order is kept.

Batches are a pure function of (seed, batch index), so a replayed step gets its batch again and a resumed run
continues on exactly the next batch from the `data_position` in its train state (the position is the iterator's
state). Every epoch shuffles the documents by (seed, epoch). Packed (`pack=True`): an epoch's documents are
concatenated in that order and cut into rows of `seq_len` tokens; `segment_ids` number each row's pieces 1, 2, ...
(a document cut at a row's end continues as the first piece of the next row; the last row's tail is padding,
segment 0), so attention and the loss never cross a document (`moe_jax.models.core.step_math`). Unpacked: one
document per row, cut at `seq_len` or padded after it (`attention_mask`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TEXT_FORMATS = (".parquet", ".jsonl", ".json", ".txt", ".array_record", ".arrayrecord")
TOKENIZE_CHUNK = 256   # documents per Grain element


@dataclass(frozen=True)
class DataShard:
    """One process's share of a corpus: share `index` of `count` (the contiguous records
    [index * N // count, (index + 1) * N // count) of the file's N), filling `rows` (sorted positions) of every
    global batch. `data.data_shard` derives it from the batch's sharding."""

    index: int
    count: int
    rows: tuple[int, ...]

    def records(self, total: int) -> tuple[int, int]:
        return self.index * total // self.count, (self.index + 1) * total // self.count

    def describe(self) -> str:
        return "" if self.count == 1 else f" (share {self.index + 1} of {self.count})"


def _check_column(path: Path, columns: list[str], text_column: str) -> None:
    if text_column not in columns:
        raise ValueError(f"{path} has no column {text_column!r} (its columns: {', '.join(columns)}); "
                         "pass --text-column NAME.")


def _parquet_texts(path: Path, text_column: str, share: DataShard | None) -> list:
    """Only the row groups that hold this share's records are read."""
    import pyarrow.parquet as parquet

    file = parquet.ParquetFile(path)
    _check_column(path, file.schema_arrow.names, text_column)
    total = file.metadata.num_rows
    low, high = (0, total) if share is None else share.records(total)
    texts, first = [], 0
    for group in range(file.num_row_groups):
        rows = file.metadata.row_group(group).num_rows
        if first < high and first + rows > low:
            values = file.read_row_group(group, columns=[text_column]).column(text_column).to_pylist()
            texts += values[max(low - first, 0):high - first]
        first += rows
    return texts


def _line_texts(path: Path, share: DataShard | None, parse) -> list:
    """Non-empty lines (one record each); only this share's are parsed (`parse(line, number)`)."""
    with path.open(encoding="utf-8") as file:
        total = sum(1 for line in file if line.strip())
    low, high = (0, total) if share is None else share.records(total)
    texts, record = [], 0
    with path.open(encoding="utf-8") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            if low <= record < high:
                texts.append(parse(line.rstrip("\n"), number))
            record += 1
    return texts


def _json_record(path: Path, text_column: str):
    def parse(line: str, number: int):
        try:
            record = json.loads(line)
        except ValueError:
            raise ValueError(f"{path}:{number}: not a JSON object (JSON Lines: one object per line).") from None
        if not isinstance(record, dict) or text_column not in record:
            raise ValueError(f"{path}:{number}: no {text_column!r} field (pass --text-column NAME).")
        return record[text_column]
    return parse


def _array_record_texts(path: Path, text_column: str, share: DataShard | None, stop: int | None = None) -> list:
    """ArrayRecord: each record a UTF-8 JSON object (its `text_column`) or UTF-8 text (the document); read by
    index, so a share reads only its own records (`stop`: at most the first `stop` records)."""
    from array_record.python.array_record_module import ArrayRecordReader

    reader = ArrayRecordReader(str(path))
    try:
        total = reader.num_records() if stop is None else min(reader.num_records(), stop)
        low, high = (0, total) if share is None else share.records(total)
        records = reader.read(low, high) if high > low else []
    finally:
        reader.close()
    texts = []
    for number, raw in enumerate(records, low):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{path}: record {number} is not UTF-8 text or a JSON object.") from None
        record = None
        if text.lstrip().startswith("{"):
            try:
                record = json.loads(text)
            except ValueError:
                record = None
        if isinstance(record, dict):
            if text_column not in record:
                raise ValueError(f"{path}: record {number} has no {text_column!r} field (pass --text-column NAME).")
            text = record[text_column]
        texts.append(text)
    return texts


def read_texts(path, text_column: str = "text", share: DataShard | None = None) -> list[str]:
    """The documents of a corpus file (see the module docstring), or of `share`'s records only; a clear error for
    a missing file or column, an empty corpus, or values that are not text."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file.")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        texts = _parquet_texts(path, text_column, share)
    elif suffix in (".jsonl", ".json"):
        texts = _line_texts(path, share, _json_record(path, text_column))
    elif suffix == ".txt":
        texts = _line_texts(path, share, lambda line, number: line)
    elif suffix in (".array_record", ".arrayrecord"):
        texts = _array_record_texts(path, text_column, share)
    else:
        raise ValueError(f"{path}: unknown corpus format {suffix!r}; use one of {', '.join(TEXT_FORMATS)} "
                         "(or a .npy of token ids).")
    bad = next((i for i, text in enumerate(texts) if not isinstance(text, str)), None)
    if bad is not None:
        raise ValueError(f"{path}: document {bad} of column {text_column!r} is {type(texts[bad]).__name__}, not text.")
    texts = [text for text in texts if text]
    if not texts:
        raise ValueError(f"{path}{'' if share is None else share.describe()}: holds no text (empty file or column).")
    return texts


def check_corpus(path, text_column: str = "text") -> None:
    """What can be checked of a corpus file without reading its documents (every process runs it before the job
    starts): it exists, its format is known, it has the text column and at least one record."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file.")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as parquet

        file = parquet.ParquetFile(path)
        _check_column(path, file.schema_arrow.names, text_column)
        empty = file.metadata.num_rows == 0
    elif suffix in (".jsonl", ".json", ".txt"):
        with path.open(encoding="utf-8") as file:
            number, first = next(((n, line) for n, line in enumerate(file, 1) if line.strip()), (0, None))
        empty = first is None
        if first is not None and suffix != ".txt":
            _json_record(path, text_column)(first, number)
    elif suffix in (".array_record", ".arrayrecord"):
        from array_record.python.array_record_module import ArrayRecordReader

        reader = ArrayRecordReader(str(path))
        empty = reader.num_records() == 0
        reader.close()
        if not empty:   # the first record: its text column, when it is a JSON object
            _array_record_texts(path, text_column, None, stop=1)
    else:
        raise ValueError(f"{path}: unknown corpus format {suffix!r}; use one of {', '.join(TEXT_FORMATS)} "
                         "(or a .npy of token ids).")
    if empty:
        raise ValueError(f"{path}: holds no text (empty file or column).")


class Tokenize:
    """A Grain map: a chunk of texts -> their token ids with the checkpoint's tokenizer, loaded once per worker
    (picklable)."""

    def __init__(self, tokenizer_dir):
        self.tokenizer_dir, self._encode = str(tokenizer_dir), None

    def __call__(self, texts: list[str]) -> list[list[int]]:
        # Lists, not arrays: Grain hands a worker's numpy results over in shared memory, one segment (and one open
        # file) per element until the main process lets go, which a corpus of 20k documents exhausted. A chunk of
        # documents per element: one hand-over per chunk, not per document.
        if self._encode is None:
            from ..tokenization import load_checkpoint_tokenizer

            self._encode = load_checkpoint_tokenizer(
                self.tokenizer_dir, instead="give token ids with --data FILE.npy").encode
        return [list(self._encode(text)) for text in texts]

    def __getstate__(self):
        return {"tokenizer_dir": self.tokenizer_dir, "_encode": None}


def tokenize(texts: list[str], tokenizer_dir, *, workers: int = 0) -> list[np.ndarray]:
    """Every document's token ids, in order, through Grain (`workers` worker processes, or this one)."""
    import grain

    from ..tokenization import load_checkpoint_tokenizer

    load_checkpoint_tokenizer(tokenizer_dir, instead="give token ids with --data FILE.npy")   # fails here, once
    chunks = [texts[i:i + TOKENIZE_CHUNK] for i in range(0, len(texts), TOKENIZE_CHUNK)]
    dataset = grain.MapDataset.source(chunks).map(Tokenize(tokenizer_dir))
    if workers < 1:
        return [np.asarray(ids, np.int32) for i in range(len(dataset)) for ids in dataset[i]]
    from absl import flags

    if not flags.FLAGS.is_parsed():   # Grain's workers read absl flags; nothing here sets any
        flags.FLAGS.mark_as_parsed()
    iterator = dataset.to_iter_dataset().mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return [np.asarray(ids, np.int32) for chunk in iterator for ids in chunk]


@dataclass
class Corpus:
    """Tokenised documents as a batch source (`batch(i)`, `batch_rows(i, rows)`; see the module docstring).

    rows: the positions of each global batch of `batch_size` rows that these documents fill (a process's share,
    `DataShard.rows`); None: all of them."""

    documents: list[np.ndarray]
    batch_size: int
    seq_len: int
    pack: bool = True
    seed: int = 0
    source: str = "corpus"
    rows: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.batch_size < 1 or self.seq_len < 1:
            raise ValueError(f"batch size {self.batch_size} and seq_len {self.seq_len} must be >= 1.")
        self.rows = tuple(range(self.batch_size)) if self.rows is None else tuple(sorted(self.rows))
        if not self.rows or self.rows[0] < 0 or self.rows[-1] >= self.batch_size:
            raise ValueError(f"rows {self.rows} are not positions of a batch of {self.batch_size}.")
        self.documents = [doc for doc in self.documents if len(doc)]
        if not self.documents:
            raise ValueError(f"{self.source}: no document has a token.")
        self._epochs: dict[int, dict[str, np.ndarray]] = {}
        if self.num_sequences < self.rows_per_batch:
            needed = (f"one batch of {self.batch_size}" if self.rows_per_batch == self.batch_size else
                      f"the {self.rows_per_batch} rows of each batch of {self.batch_size} this share fills")
            raise ValueError(f"{self.source}: {self.num_sequences} rows of {self.seq_len} tokens, fewer than {needed}; "
                             "use a larger corpus, a smaller --batch-size or --seq-len.")

    @classmethod
    def from_file(cls, path, tokenizer_dir, *, batch_size: int, seq_len: int, text_column: str = "text",
                  pack: bool = True, seed: int = 0, workers: int = 0, share: DataShard | None = None) -> Corpus:
        """The corpus of `path`, or of `share`'s records only (read and tokenised by this process alone)."""
        texts = read_texts(path, text_column, share)
        source = str(path) + ("" if share is None else share.describe())
        return cls(tokenize(texts, tokenizer_dir, workers=workers), batch_size, seq_len, pack, seed, source,
                   None if share is None else share.rows)

    @property
    def rows_per_batch(self) -> int:
        """The rows of each batch these documents fill."""
        return len(self.rows)

    # ---- rows ----------------------------------------------------------------------------------------
    @property
    def total_tokens(self) -> int:
        return sum(len(doc) for doc in self.documents)

    @property
    def num_sequences(self) -> int:
        """Rows per epoch."""
        return -(-self.total_tokens // self.seq_len) if self.pack else len(self.documents)

    @property
    def packing_efficiency(self) -> float:
        """Real tokens over the tokens of an epoch's rows."""
        real = self.total_tokens if self.pack else sum(min(len(doc), self.seq_len) for doc in self.documents)
        return real / (self.num_sequences * self.seq_len)

    def epoch_rows(self, epoch: int) -> dict[str, np.ndarray]:
        """Every row of epoch `epoch` (its documents in the order (seed, epoch) shuffles them)."""
        if epoch not in self._epochs:
            order = np.random.default_rng((self.seed, epoch)).permutation(len(self.documents))
            docs = [self.documents[i] for i in order]
            self._epochs = {epoch: self._packed(docs) if self.pack else self._one_per_row(docs)}
        return self._epochs[epoch]

    def _packed(self, docs: list[np.ndarray]) -> dict[str, np.ndarray]:
        rows, width = self.num_sequences, self.seq_len
        ids = np.zeros(rows * width, np.int32)
        document = np.zeros(rows * width, np.int64)
        stream = np.concatenate(docs)
        ids[:len(stream)] = stream
        document[:len(stream)] = np.repeat(np.arange(1, len(docs) + 1), [len(doc) for doc in docs])
        ids, document = ids.reshape(rows, width), document.reshape(rows, width)
        # Number each row's pieces 1, 2, ... (a new piece where the document changes); padding stays 0.
        starts = np.concatenate([np.ones((rows, 1), bool), document[:, 1:] != document[:, :-1]], axis=1)
        segments = np.where(document > 0, np.cumsum(starts, axis=1), 0).astype(np.int32)
        return {"input_ids": ids, "segment_ids": segments}

    def _one_per_row(self, docs: list[np.ndarray]) -> dict[str, np.ndarray]:
        ids = np.zeros((len(docs), self.seq_len), np.int32)
        mask = np.zeros((len(docs), self.seq_len), np.int32)
        for row, doc in enumerate(docs):
            piece = doc[:self.seq_len]
            ids[row, :len(piece)], mask[row, :len(piece)] = piece, 1
        return {"input_ids": ids, "attention_mask": mask}

    # ---- the batch source ------------------------------------------------------------------------------
    def batch(self, index: int) -> dict[str, np.ndarray]:
        if self.rows_per_batch != self.batch_size:
            raise ValueError(f"{self.source} fills rows {list(self.rows)} of each batch, not the whole batch: ask "
                             "for them with batch_rows (each process places its own rows).")
        return self.batch_rows(index, np.arange(self.batch_size))

    def batch_rows(self, index: int, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Rows `rows` (positions within the batch, among `self.rows`) of batch `index`. The documents' own row
        (position of `rows` in `self.rows`, + index * rows per batch) // rows per epoch is the epoch, the rest the
        row within it."""
        rows = np.asarray(rows)
        local = np.searchsorted(self.rows, rows)
        if len(rows) and (local.max() >= len(self.rows) or np.any(np.asarray(self.rows)[local] != rows)):
            raise ValueError(f"{self.source} fills rows {list(self.rows)} of each batch; asked for {rows.tolist()}.")
        positions = index * self.rows_per_batch + local
        epochs, within = np.divmod(positions, self.num_sequences)
        fields = {}
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            for name, array in self.epoch_rows(int(epoch)).items():
                fields.setdefault(name, np.zeros((len(positions), self.seq_len), np.int32))[chosen] = array[within[chosen]]
        return fields

    def check_vocabulary(self, vocab_size: int) -> None:
        high = max(int(doc.max()) for doc in self.documents)
        if high >= vocab_size:
            raise ValueError(f"{self.source}: the tokenizer gives ids up to {high}, outside the model's vocabulary "
                             f"[0, {vocab_size}).")
