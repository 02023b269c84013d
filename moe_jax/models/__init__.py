"""Model families. Importing this package registers each under its HF `model_type`."""

from .base import MODEL_CLASSES, MoeForCausalLM, register_model
from .mixtral import MixtralConfig, MixtralForCausalLM
from .olmoe import OlmoeConfig, OlmoeForCausalLM
from .qwen2_moe import Qwen2MoeConfig, Qwen2MoeForCausalLM
from .qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM

__all__ = [
    "MODEL_CLASSES",
    "MixtralConfig",
    "MixtralForCausalLM",
    "MoeForCausalLM",
    "OlmoeConfig",
    "OlmoeForCausalLM",
    "Qwen2MoeConfig",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "register_model",
]
