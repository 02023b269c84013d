"""The model core: each family as data and free functions (`Family`), the shared decoder and the step.

Importing this package registers every family under its HF `model_type` (`FAMILIES`). The classes users hold
(`Qwen3MoeForCausalLM`, ...) are the facade's: `moe_jax.causal_lm`.
"""

from .deepseek_v3 import DeepseekV3Config
from .family import FAMILIES, Family, register_family
from .gpt_oss import GptOssConfig
from .llama4 import Llama4TextConfig
from .mixtral import MixtralConfig
from .olmoe import OlmoeConfig
from .qwen2_moe import Qwen2MoeConfig
from .qwen3_moe import Qwen3MoeConfig

__all__ = [
    "FAMILIES",
    "DeepseekV3Config",
    "Family",
    "GptOssConfig",
    "Llama4TextConfig",
    "MixtralConfig",
    "OlmoeConfig",
    "Qwen2MoeConfig",
    "Qwen3MoeConfig",
    "register_family",
]
