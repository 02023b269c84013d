"""`AutoModelForCausalLM`: pick the model family from a checkpoint's `config.json` (`model_type`)."""

from __future__ import annotations

import os

from ..checkpoint_files import local_checkpoint, read_config
from ..parameter_dtypes import parameter_dtype
from .families import model_class_for
from .model import MoeForCausalLM

# The model's options (`MoeForCausalLM.__init__`) but dtype, one line each: both entry points take them as keywords.
MODEL_OPTIONS = """
        devices: the mesh's devices in rank order (default: the first that many of `jax.devices()`).
        experts_backend: the experts' grouped matmul, "ragged_dot", "tiled" or "tokamax" (default: the platform's).
        scan_layers: run each run of identical layers as one `jax.lax.scan`: True, False or "auto" (from 16 layers).
        remat: what each layer keeps for the backward pass: "none" (default), "full" or "dots_saveable".
        pipeline_microbatches: with pp_size > 1, the microbatches a batch is cut into (default: pp_size).
        pipeline_schedule: with pp_size > 1, "gpipe" (default, the reference's) or "circular".
        pipeline_repeats: with a circular schedule, the chunks of layers per stage (default 1).
        num_redundant_experts: extra expert slots per sparse layer for replicas of busy experts (default 0).
        mtp_layers: the multi-token-prediction layers held (DeepSeek-V3; from_pretrained: the checkpoint's).
        abstract: resolve plans and shardings without devices or a mesh, for planning tools (default False).
        kept_quantization: the checkpoint's quant_method kept on the devices (from_pretrained's dequantize=False).
        weight_quantization: a `WeightQuantization` of the weights read (from_pretrained's quantize= sets it).
"""

LOADING_OPTIONS = """
        path: a checkpoint directory, or a Hugging Face hub repo id (downloaded to the hub cache).
        distributed_config: the layout, a `DistributedConfig` or its dict (default: one device).
        dtype: the parameters' dtype, "float32", "bfloat16" or "float16" (default: config.json's); checked first.
        progress: show a progress bar while the weights are read (default True).
        dequantize: decode a quantised checkpoint (MXFP4, FP8) to `dtype` (True, default) or keep it quantised.
        quantize: quantise an unquantised checkpoint's experts as they are read: "int8" or "fp8" (inference only).
        quantize_modules: what quantize= quantises: "experts" and / or linear module names (default: experts).
"""


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

    from_config.__func__.__doc__ = f"""A model of config.json's family with its parameters unset (`init_params`,
    `set_params` or `load_weights` fill them).

    Args:
        config: a config dict, a config.json file, or a checkpoint directory.
        distributed_config: the layout, a `DistributedConfig` or its dict (default: one device).
        dtype: the parameters' dtype, "float32" (default), "bfloat16" or "float16".{MODEL_OPTIONS}"""
    from_pretrained.__func__.__doc__ = f"""Build the checkpoint's family on the mesh of `distributed_config` and
    read its weights directly into their shardings (`moe_jax.pretrained.from_pretrained`).

    Args:{LOADING_OPTIONS.rstrip()}{MODEL_OPTIONS}"""
