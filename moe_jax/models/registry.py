"""Model families by HF `model_type`: families register themselves; `AutoModelForCausalLM` looks them up."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import MoeForCausalLM

MODEL_CLASSES: dict[str, type[MoeForCausalLM]] = {}


def register_model(model_class: type[MoeForCausalLM]) -> type[MoeForCausalLM]:
    """Make a model family loadable by `AutoModelForCausalLM` under its HF `model_type`."""
    MODEL_CLASSES[model_class.model_type] = model_class
    return model_class


def model_class_for(config: dict) -> type[MoeForCausalLM]:
    """The family of a config dict, by its `model_type`."""
    model_type = config.get("model_type")
    if model_type not in MODEL_CLASSES:
        raise ValueError(
            f"model_type={model_type!r} is not supported; moe_jax supports {sorted(MODEL_CLASSES)}."
        )
    return MODEL_CLASSES[model_type]
