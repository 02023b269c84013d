"""A checkpoint's own tokenizer, from local files only: Transformers' `AutoTokenizer` when it is installed,
else the `tokenizers` library on tokenizer.json (a dependency of the package) with the chat template rendered
by `moe_jax.chat_template` (jinja2).

    tokenizer = load_checkpoint_tokenizer("ckpt/", instead="give token ids with --data FILE.npy")
    ids = tokenizer.encode("hello world"); text = tokenizer.decode(ids)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])   # None without a chat template
    ids = tokenizer.apply_chat_template(messages, tools=[{"type": "function", "function": {...}}])
    write_byte_tokenizer("ckpt/")        # a 256-id byte-level tokenizer (the demo's vocabulary)
    copy_tokenizer_files("ckpt/", "trained/")
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class CheckpointTokenizer:
    """encode: text -> ids; decode: ids -> text (special tokens skipped); decode_special: ids -> text with the special
    tokens (tool-call markers may be special tokens); apply_chat_template: chat messages ([{"role": ...,
    "content": ...}], optionally with `tools=` OpenAI's function tools) -> the prompt's ids, ending with the
    assistant's turn (Transformers' `apply_chat_template(messages, tools=tools, add_generation_prompt=True)`);
    None when the checkpoint has no chat template. max_token_chars: the most characters one token of the
    vocabulary spells (a bound on the text a number of tokens can hold: the server refuses a prompt too long
    for its context before tokenizing it); None when unknown. tokenizer_json: the tokenizer as tokenizer.json's
    text (structured output builds llguidance's tokenizer from it); None when not known."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    apply_chat_template: Callable[..., list[int]] | None = None
    max_token_chars: int | None = None
    decode_special: Callable[[list[int]], str] | None = None
    tokenizer_json: str | None = None


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
                                   decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                   apply_chat_template=_chat_template(tokenizer),
                                   max_token_chars=_longest_token(tokenizer.get_vocab()),
                                   decode_special=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
                                   tokenizer_json=_fast_tokenizer_json(tokenizer))
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
                               decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                               apply_chat_template=_rendered_chat_template(directory, tokenizer),
                               max_token_chars=_longest_token(tokenizer.get_vocab()),
                               decode_special=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
                               tokenizer_json=tokenizer.to_str())


def _fast_tokenizer_json(tokenizer) -> str | None:
    """A Transformers fast tokenizer's tokenizer.json text (its added tokens included); None for a slow one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return None if backend is None else backend.to_str()


def _longest_token(vocabulary: dict[str, int]) -> int | None:
    """The longest token's characters as the vocabulary spells it (a byte-level token spells each byte as one
    character, so its text has at most as many characters)."""
    return max(map(len, vocabulary), default=None)


def _rendered_chat_template(directory: Path, tokenizer) -> Callable[..., list[int]] | None:
    """The checkpoint's chat template through `moe_jax.chat_template` (as Transformers renders it), the text
    encoded without added special tokens (the template writes the ones it wants); None without a template."""
    from .chat_template import read_chat_template, render_chat_template, special_tokens

    template = read_chat_template(directory)
    if template is None:
        return None
    tokens = special_tokens(directory)

    def apply(messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        text = render_chat_template(template, messages, tokens, tools=tools)
        return tokenizer.encode(text, add_special_tokens=False).ids

    return apply


def _chat_template(tokenizer) -> Callable[..., list[int]] | None:
    """A Transformers tokenizer's chat template as messages -> ids, or None when it has none. The template's
    text holds the special tokens it wants (BOS among them), so it is encoded without adding any."""
    if not getattr(tokenizer, "chat_template", None):
        return None

    def apply(messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return apply


# Besides TOKENIZER_FILES, what a saved Transformers tokenizer may consist of.
TOKENIZER_EXTRA_FILES = ("special_tokens_map.json", "added_tokens.json", "merges.txt", "chat_template.jinja")


def copy_tokenizer_files(source, destination) -> list[str]:
    """Copies the tokenizer files of checkpoint `source` into `destination` (an exported checkpoint of a
    model trained from it); returns the names copied (none when `source` has no tokenizer)."""
    copied = []
    for name in TOKENIZER_FILES + TOKENIZER_EXTRA_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, Path(destination) / name)
            copied.append(name)
    return copied


def _byte_characters() -> list[str]:
    """GPT-2's printable stand-in for each byte 0..255 (what a ByteLevel pre-tokenizer turns bytes into)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = (byte for byte in range(256) if byte not in printable)
    characters = {byte: chr(byte) for byte in printable}
    characters.update({byte: chr(256 + n) for n, byte in enumerate(others)})
    return [characters[byte] for byte in range(256)]


# A minimal chat template for the byte tokenizer: `<role>content` lines, then `<assistant>` (what `moe-jax serve`'s
# /v1/chat/completions applies to the demo checkpoint).
BYTE_CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<assistant>{% endif %}")


def write_byte_tokenizer(directory, *, chat_template: str | None = None) -> None:
    """Writes a byte-level tokenizer into `directory`: id i is the byte i of the UTF-8 text (256 ids, no
    merges, no special tokens), as tokenizer.json + tokenizer_config.json, which both the `tokenizers`
    library and Transformers' AutoTokenizer load. Written as JSON: neither library is needed to write it."""
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level}, "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "merges": [],
                  "vocab": {character: byte for byte, character in enumerate(_byte_characters())}},
    }
    directory = Path(directory)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    # Decoding must give back the text as it was: no "clean up" of spaces before punctuation.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
