"""Model families. Importing this package registers each under its HF `model_type`."""

from .base import MoeForCausalLM
from .deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from .gpt_oss import GptOssConfig, GptOssForCausalLM
from .llama4 import Llama4ForCausalLM, Llama4TextConfig
from .mixtral import MixtralConfig, MixtralForCausalLM
from .olmoe import OlmoeConfig, OlmoeForCausalLM
from .qwen2_moe import Qwen2MoeConfig, Qwen2MoeForCausalLM
from .qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from .registry import MODEL_CLASSES, register_model

__all__ = [
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    "GptOssConfig",
    "GptOssForCausalLM",
    "Llama4ForCausalLM",
    "Llama4TextConfig",
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
