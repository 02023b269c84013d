"""Where `moe-jax train` and `moe-jax eval` read their batches: token rows (.npy), a text file cut into rows, a
text corpus (.parquet / .jsonl / .txt / .array_record; checked up front, read once the batch layout names this
process's share), or a synthetic stream. Every error names the flag that named the file."""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def training_source(args, config: dict, model_dir: Path | None):
    """The training batches: token rows, a synthetic stream, or a text corpus checked here and read once the batch
    layout names this process's share (`PendingCorpus.load`)."""
    from ..training.corpus import TEXT_FORMATS
    from ..training.data import SyntheticTokens, TokenRows

    if args.data is not None and Path(args.data).suffix.lower() in TEXT_FORMATS:
        return PendingCorpus(args.data, args, config, model_dir, args.batch_size, args.seq_len or 512, "--data")
    if args.data is not None:
        data = TokenRows.from_file(args.data, args.batch_size, args.seq_len)
    elif args.text is not None:
        data = TokenRows.from_text(args.text, model_dir, args.batch_size, args.seq_len or 64)
    else:
        return SyntheticTokens(config["vocab_size"], args.batch_size, args.seq_len or 64, args.seed)
    data.check_vocabulary(config["vocab_size"])
    return data


@dataclass
class PendingCorpus:
    """A text corpus (`moe_jax.training.corpus`) checked before the job starts (file, format, column, tokenizer);
    `load(share)` reads and tokenises this process's share. Its errors name the flag."""

    path: str
    args: argparse.Namespace
    config: dict
    model_dir: Path | None
    batch_size: int
    seq_len: int
    flag: str

    def __post_init__(self):
        from ..tokenization import load_checkpoint_tokenizer
        from ..training.corpus import check_corpus

        if self.model_dir is None:
            raise ValueError(f"{self.flag} {self.path} is text: it needs the checkpoint's tokenizer (pass --model), "
                             "or give token ids as a .npy.")
        with _naming(self.flag):
            check_corpus(self.path, getattr(self.args, "text_column", "text"))
            load_checkpoint_tokenizer(self.model_dir, instead="give token ids with --data FILE.npy")

    def load(self, share=None):
        from ..training.corpus import Corpus

        args = self.args
        with _naming(self.flag):
            corpus = Corpus.from_file(self.path, self.model_dir, batch_size=self.batch_size, seq_len=self.seq_len,
                                      text_column=getattr(args, "text_column", "text"),
                                      pack=getattr(args, "pack", False), seed=getattr(args, "seed", 0),
                                      workers=getattr(args, "data_workers", 0), share=share)
            corpus.check_vocabulary(self.config["vocab_size"])
        return corpus


@contextmanager
def _naming(flag: str):
    """Errors of a data file, prefixed with the flag that named it."""
    try:
        yield
    except (ValueError, OSError) as error:
        raise type(error)(f"{flag} {error}") from None


def eval_source(path, config: dict, model_dir: Path | None, batch_size: int, seq_len: int, flag: str, args=None):
    """Held-out data at the training batch shape: a .npy of token ids, a corpus (.parquet / .jsonl / .txt /
    .array_record, as --data; returned pending with `args`, to `load(share)`), or another text file cut into rows
    through the checkpoint's tokenizer."""
    from ..training.corpus import TEXT_FORMATS
    from ..training.data import TokenRows

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {path}: no such file.")
    if path.suffix == ".npy":
        data = TokenRows.from_file(path, batch_size, seq_len)
    elif path.suffix.lower() in TEXT_FORMATS and args is not None:
        return PendingCorpus(str(path), args, config, model_dir, batch_size, seq_len, flag)
    else:
        data = TokenRows.from_text(path, model_dir, batch_size, seq_len)
    data.check_vocabulary(config["vocab_size"])
    return data


def check_sequence(seq_len: int, config: dict) -> None:
    limit = config.get("max_position_embeddings")
    if limit is not None and seq_len > limit:
        raise ValueError(f"sequences of {seq_len} tokens are longer than the model's max_position_embeddings "
                         f"({limit}); use --seq-len {limit} or less.")
