"""Model families. Importing this package registers each under its HF `model_type`."""

from .base import MODEL_CLASSES, MoeForCausalLM, register_model
from .qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM

__all__ = ["MODEL_CLASSES", "MoeForCausalLM", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "register_model"]
