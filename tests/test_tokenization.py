"""A checkpoint's tokenizer: Transformers' when installed, else `tokenizers` on tokenizer.json, else a clear error."""

from __future__ import annotations

import json
import sys

import pytest

from moe_jax.tokenization import load_checkpoint_tokenizer, write_byte_tokenizer

INSTEAD = "give token ids with --data FILE.npy"


def word_level_tokenizer(directory):
    tokenizers = pytest.importorskip("tokenizers")
    words = ["[UNK]", "hello", "world"]
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)},
                                                                 unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def test_without_transformers_tokenizer_json_is_read_by_tokenizers(tmp_path, monkeypatch):
    word_level_tokenizer(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if transformers were not installed
    tokenizer = load_checkpoint_tokenizer(tmp_path, instead=INSTEAD)
    assert tokenizer.encode("hello world hello") == [1, 2, 1]
    assert tokenizer.decode([2, 1]) == "world hello"


def test_without_either_library_the_error_names_the_install(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ValueError, match=r"needs the tokenizers library.*pip install tokenizers.*--data FILE.npy"):
        load_checkpoint_tokenizer(tmp_path, instead=INSTEAD)


def test_a_directory_without_tokenizer_files_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"has no tokenizer \(none of tokenizer.json.*--data FILE.npy"):
        load_checkpoint_tokenizer(tmp_path, instead=INSTEAD)
    with pytest.raises(ValueError, match="pass --model with a checkpoint directory"):
        load_checkpoint_tokenizer(tmp_path / "missing", instead=INSTEAD)


def test_the_demo_byte_tokenizer_loads_with_transformers_and_with_tokenizers(tmp_path, monkeypatch):
    """What `moe-jax demo` writes next to its checkpoint: id i is byte i, text round-trips through both."""
    pytest.importorskip("tokenizers")
    write_byte_tokenizer(tmp_path)
    text = "Hello,  wörld ! 1+1"
    for library in ("transformers", "tokenizers"):
        if library == "tokenizers":
            monkeypatch.setitem(sys.modules, "transformers", None)   # as if transformers were not installed
        tokenizer = load_checkpoint_tokenizer(tmp_path, instead=INSTEAD)
        assert tokenizer.encode(text) == list(text.encode("utf-8")), library
        assert tokenizer.decode(tokenizer.encode(text)) == text, library
