"""The model class of each family, by HF `model_type`: `AutoModelForCausalLM` looks them up here.

Each class is the facade (`MoeForCausalLM`) on one `moe_jax.models` family; it sets only `family`. Its name is
HF's, so plan errors and user code read as with Transformers.
"""

from __future__ import annotations

from ..models import deepseek_v3, gpt_oss, llama4, mixtral, olmoe, qwen2_moe, qwen3_moe
from .model import MoeForCausalLM

MODEL_CLASSES: dict[str, type[MoeForCausalLM]] = {}


def register_model(model_class: type[MoeForCausalLM]) -> type[MoeForCausalLM]:
    """Make a model class loadable by `AutoModelForCausalLM` under its family's HF `model_type`."""
    MODEL_CLASSES[model_class.model_type] = model_class
    return model_class


def model_class_for(config: dict) -> type[MoeForCausalLM]:
    """The model class of a config dict, by its `model_type`."""
    model_type = config.get("model_type")
    if model_type not in MODEL_CLASSES:
        raise ValueError(
            f"model_type={model_type!r} is not supported; moe_jax supports {sorted(MODEL_CLASSES)}."
        )
    return MODEL_CLASSES[model_type]


@register_model
class Qwen3MoeForCausalLM(MoeForCausalLM):
    family = qwen3_moe.FAMILY


@register_model
class Qwen2MoeForCausalLM(MoeForCausalLM):
    family = qwen2_moe.FAMILY


@register_model
class OlmoeForCausalLM(MoeForCausalLM):
    family = olmoe.FAMILY


@register_model
class MixtralForCausalLM(MoeForCausalLM):
    family = mixtral.FAMILY


@register_model
class GptOssForCausalLM(MoeForCausalLM):
    family = gpt_oss.FAMILY


@register_model
class DeepseekV3ForCausalLM(MoeForCausalLM):
    family = deepseek_v3.FAMILY


@register_model
class Llama4ForCausalLM(MoeForCausalLM):
    family = llama4.FAMILY


@register_model
class Llama4ForCausalLMOfMultimodal(Llama4ForCausalLM):
    """The text model of a multimodal Llama 4 checkpoint (`llama4`), as Transformers' `AutoModelForCausalLM`
    loads it: the `text_config`, the weights under `language_model.`; it saves as a text model."""

    family = llama4.MULTIMODAL_FAMILY
