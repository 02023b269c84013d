"""A checkpoint's own tokenizer, from local files only: Transformers' `AutoTokenizer` when it is installed,
else the `tokenizers` library on tokenizer.json.

    tokenizer = load_checkpoint_tokenizer("ckpt/", instead="give token ids with --data FILE.npy")
    ids = tokenizer.encode("hello world"); text = tokenizer.decode(ids)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class CheckpointTokenizer:
    """encode: text -> ids; decode: ids -> text (special tokens skipped)."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]


def load_checkpoint_tokenizer(directory, *, instead: str) -> CheckpointTokenizer:
    """The tokenizer saved in checkpoint `directory`; `instead` completes the error messages with what the
    user can do without one (e.g. "give token ids with --data FILE.npy")."""
    directory = Path(directory) if directory is not None else None
    if directory is None or not directory.is_dir():
        raise ValueError(f"Text needs the checkpoint's tokenizer: pass --model with a checkpoint directory that "
                         f"holds one, or {instead}.")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{directory} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); {instead}.")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        AutoTokenizer = None
    if AutoTokenizer is not None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError) as error:
            raise ValueError(f"{directory}: transformers cannot load its tokenizer ({error}); {instead}.") from None
        return CheckpointTokenizer(encode=lambda text: tokenizer(text)["input_ids"],
                                   decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"{directory} has no tokenizer.json and transformers is not installed to read its other "
                         f"tokenizer files; {instead}.")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError(f"{tokenizer_file} needs the tokenizers library, which is not installed: "
                         f"`pip install tokenizers` (or transformers); {instead}.") from None
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    return CheckpointTokenizer(encode=lambda text: tokenizer.encode(text).ids,
                               decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
