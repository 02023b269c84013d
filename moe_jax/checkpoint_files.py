"""Where a checkpoint's files are: a local directory or a Hub repo id, and its `config.json`."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path


def read_config(path_or_config: str | os.PathLike | dict) -> dict:
    """A config dict from a dict, a `config.json` path, or a checkpoint directory holding one."""
    if isinstance(path_or_config, dict):
        return dict(path_or_config)
    path = Path(path_or_config)
    if not path.exists():
        # Only from_pretrained resolves hub repo ids (it downloads the weights too); configs are read locally.
        raise FileNotFoundError(
            f"{path} does not exist. Pass a local checkpoint directory or config.json path; for a Hugging Face "
            "Hub model, download its config first: huggingface-cli download REPO_ID config.json --local-dir DIR."
        )
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"No config.json at {path}. Pass a checkpoint directory that holds config.json, or the path of a "
            "config.json."
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:  # json.JSONDecodeError and UnicodeDecodeError: name the file
        raise ValueError(f"{path} is not valid JSON: {error}.") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not the object of a model config.")
    return config


# Hub repo ids are "name" or "org/name"; anything else that does not exist is a mistyped local path.
_REPO_ID = re.compile(r"(?:\w[\w.-]*/)?\w[\w.-]*")


def local_checkpoint(path: str | os.PathLike) -> Path:
    """A local directory as is; otherwise a hub repo id resolved through huggingface_hub (when installed)."""
    local = Path(path)
    if local.exists():
        return local
    if not _REPO_ID.fullmatch(str(path)):
        raise FileNotFoundError(
            f"{path} does not exist. Pass a local checkpoint directory (config.json + safetensors) or a Hugging "
            "Face Hub repo id of the form 'org/name'."
        )
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FileNotFoundError(
            f"{path} is not a local directory, and huggingface_hub is not installed to resolve it as a repo id "
            "(pip install huggingface_hub)."
        ) from None
    return Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors"]))


# Besides its weights and config.json, what a checkpoint holds for the commands that read or write text and pick
# generation defaults (the tokenizer's own files: `tokenization.TOKENIZER_FILES` / `TOKENIZER_EXTRA_FILES`, the
# chat template among them), and the training data settings `moe-jax train --export-hf` records.
GENERATION_CONFIG_FILE = "generation_config.json"
TRAINING_SETTINGS_FILE = "moe_jax_training.json"
COMPANION_FILES = (GENERATION_CONFIG_FILE, "chat_template.json", TRAINING_SETTINGS_FILE)


def copy_companion_files(source: str | os.PathLike, destination: str | os.PathLike) -> list[str]:
    """Copies checkpoint `source`'s tokenizer files, chat template, generation config and training settings into
    `destination` byte for byte (a conversion or an export of it: the weights change form, not the rest); returns
    the names copied."""
    from .tokenization import copy_tokenizer_files

    copied = copy_tokenizer_files(source, destination)
    for name in COMPANION_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, Path(destination) / name)
            copied.append(name)
    return copied
