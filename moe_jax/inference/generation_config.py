"""Generation defaults as Transformers resolves them: its global defaults, then the checkpoint's
`generation_config.json` (else the model config's special tokens), then the call's arguments."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

GENERATION_CONFIG_FILE = "generation_config.json"
# Transformers' defaults for unset values (GenerationConfig._get_default_generation_params).
DEFAULT_MAX_LENGTH = 20


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int | None = None
    max_length: int | None = None
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float = 1.0
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @classmethod
    def from_values(cls, values: dict) -> GenerationConfig:
        """From a generation_config.json / config.json dict: known keys only, None means unset."""
        known = {field.name for field in dataclasses.fields(cls)}
        chosen = {key: value for key, value in values.items() if key in known and value is not None}
        if "eos_token_id" in chosen:
            chosen["eos_token_id"] = eos_tuple(chosen["eos_token_id"])
        return cls(**chosen)

    @classmethod
    def for_checkpoint(cls, directory, model_config: dict) -> GenerationConfig:
        """The checkpoint's generation_config.json over the model config's special tokens (Transformers
        takes eos / pad from config.json when generation_config.json does not set them)."""
        base = {key: model_config.get(key) for key in ("eos_token_id", "pad_token_id")}
        path = Path(directory) / GENERATION_CONFIG_FILE
        if path.is_file():
            base |= {key: value for key, value in json.loads(path.read_text()).items() if value is not None}
        return cls.from_values(base)

    def updated(self, **overrides) -> GenerationConfig:
        """A copy with the non-None `overrides` (a `generate` call's arguments)."""
        chosen = {key: value for key, value in overrides.items() if value is not None}
        if "eos_token_id" in chosen:
            chosen["eos_token_id"] = eos_tuple(chosen["eos_token_id"])
        return dataclasses.replace(self, **chosen)

    def new_tokens(self, prompt_length: int) -> int:
        """How many tokens to generate after a prompt of `prompt_length` (max_new_tokens wins over
        max_length, whose default is Transformers' 20 in total)."""
        if self.max_new_tokens is not None:
            count = self.max_new_tokens
        else:
            count = (self.max_length or DEFAULT_MAX_LENGTH) - prompt_length
        if count < 1:
            raise ValueError(
                f"nothing to generate: max_new_tokens={self.max_new_tokens}, max_length={self.max_length} with a "
                f"prompt of {prompt_length} tokens; pass max_new_tokens >= 1."
            )
        return count

    def padding_token(self) -> int:
        """pad_token_id, else the first EOS id (as Transformers, which warns), else 0 (no EOS: rows never
        finish early, so nothing is ever padded)."""
        if self.pad_token_id is not None:
            return self.pad_token_id
        return self.eos_token_id[0] if self.eos_token_id else 0


def eos_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
