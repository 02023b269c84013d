"""`AutoModelForCausalLM`: pick the model family from a checkpoint's `config.json` (`model_type`)."""

from __future__ import annotations

import os

from ..checkpoint_files import local_checkpoint, read_config
from ..parameter_dtypes import parameter_dtype
from .families import model_class_for
from .model import MoeForCausalLM


class AutoModelForCausalLM:
    """Entry points that dispatch on `config.json`'s `model_type`."""

    @staticmethod
    def from_config(config: dict | str | os.PathLike, distributed_config=None, **kwargs) -> MoeForCausalLM:
        values = read_config(config)
        return model_class_for(values)(values, distributed_config, **kwargs)

    @staticmethod
    def from_pretrained(path: str | os.PathLike, distributed_config=None, **kwargs) -> MoeForCausalLM:
        if kwargs.get("dtype") is not None:
            parameter_dtype(kwargs["dtype"])  # a bad dtype is refused before any file is looked at
        directory = local_checkpoint(path)
        return model_class_for(read_config(directory)).from_pretrained(directory, distributed_config, **kwargs)
