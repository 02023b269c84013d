"""The HF-shaped facade: one model class per family (`MoeForCausalLM` on a `moe_jax.models` family) and
`AutoModelForCausalLM`, which picks the class from a checkpoint's `config.json`."""

from .auto import AutoModelForCausalLM
from .families import (
    MODEL_CLASSES,
    DeepseekV3ForCausalLM,
    GptOssForCausalLM,
    Llama4ForCausalLM,
    Llama4ForCausalLMOfMultimodal,
    MixtralForCausalLM,
    OlmoeForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
    model_class_for,
    register_model,
)
from .model import MoeForCausalLM

__all__ = [
    "MODEL_CLASSES",
    "AutoModelForCausalLM",
    "DeepseekV3ForCausalLM",
    "GptOssForCausalLM",
    "Llama4ForCausalLM",
    "Llama4ForCausalLMOfMultimodal",
    "MixtralForCausalLM",
    "MoeForCausalLM",
    "OlmoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "model_class_for",
    "register_model",
]
