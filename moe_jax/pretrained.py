"""Hugging Face checkpoints in and out of moe_jax models (the layer above `converters/` and `models/`).

    model = AutoModelForCausalLM.from_pretrained("Qwen3-30B-A3B/", DistributedConfig(tp_size=2, fsdp_size=4, ep_size=4))
    model.save_pretrained("out/")        # HF layout: per-expert keys, sharded safetensors + index + config.json

Loading computes every parameter's sharding first and reads only the bytes each device needs; experts a
device does not own are never read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp

from converters import load_params, save_params
from converters.key_maps import checkpoint_key_map

from .checkpoint_files import local_checkpoint, read_config
from .inference.generation_config import GenerationConfig
from .parameter_dtypes import parameter_dtype


def checkpoint_dtype(config: dict):
    """The parameter dtype config.json records (transformers 5 writes "dtype", 4.x "torch_dtype")."""
    return parameter_dtype(config.get("dtype") or config.get("torch_dtype") or "float32", "config.json dtype")


def from_pretrained(path, distributed_config=None, *, model_class, dtype=None, progress: bool = True,
                    dequantize: bool = True, **model_kwargs):
    """Build a `model_class` on the mesh of `distributed_config` and load `path` directly into its shardings
    (`AutoModelForCausalLM.from_pretrained` picks the class from config.json).

    dtype: parameter dtype, "float32", "bfloat16" or "float16" ("float64" with jax_enable_x64 on); default:
        the checkpoint's, from config.json. Checked before anything is read.
    dequantize: a quantised checkpoint's weights (config.json's `quantization_config`: MXFP4, FP8) are decoded
        to `dtype` at load (True, Transformers' default), or kept in their format on the devices and decoded
        inside the step (False; `model.kept_quantization`): the quantised bytes, inference only.
    """
    dtype = parameter_dtype(dtype) if dtype is not None else None
    directory = local_checkpoint(path)
    config = read_config(directory)
    dtype = dtype if dtype is not None else checkpoint_dtype(config)
    if not dequantize:
        model_kwargs["kept_quantization"] = quantization_method(config, directory)
    model = model_class(config, distributed_config, dtype=dtype, **model_kwargs)
    model.generation_config = GenerationConfig.for_checkpoint(directory, config)
    model.name_or_path = str(path)   # Transformers' attribute; an adapter's base_model_name_or_path
    return load_weights(model, directory, progress=progress)


def quantization_method(config: dict, directory) -> str:
    """config.json's `quantization_config.quant_method`, or a ValueError for a checkpoint that is not quantised."""
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method is None:
        raise ValueError(f"dequantize=False keeps a quantised checkpoint's weights quantised, but {directory} has no "
                         "quantization_config in its config.json; load it without dequantize=False.")
    return method


def load_weights(model, path, *, progress: bool = True):
    """Read the HF checkpoint at `path` into `model.params`, in the model's shardings and dtype."""
    model.params = load_params(local_checkpoint(path), model.module_tree,
                               checkpoint_key_map(model.model_type, model.config, getattr(model, "kept_quantization", None)),
                               model.storage_shardings(), dtype=model.storage_dtypes(), progress=progress,
                               layer_stack=model.layer_stack)
    return model


def save_pretrained(model, out_dir: str | os.PathLike, *, params=None, max_shard_bytes: int = 5 * 2**30,
                    progress: bool = True) -> Path:
    """Write `params` (default `model.params`; storage layout) as an HF checkpoint (hub key layout) into
    `out_dir`, atomically."""
    params = model.params if params is None else params
    if params is None:
        raise ValueError("The model has no parameters to save: call init_params() or from_pretrained() first.")
    config = saved_config(model)
    json.dumps(config)
    key_map = checkpoint_key_map(model.model_type, model.config, getattr(model, "kept_quantization", None))
    return save_params(model.hf_params(params), key_map, out_dir,
                       config=config, max_shard_bytes=max_shard_bytes, progress=progress)


def saved_config(model) -> dict:
    """The config.json written with the model's weights: its dtype set, no `distributed_config` (as
    transformers' `_remove_keys_not_serialized`), and no `quantization_config` unless the weights were kept
    quantised (`dequantize=False`): otherwise they were dequantised on load and are written dequantised."""
    config = {**model.config.to_dict(), "dtype": jnp.dtype(model.dtype).name}
    config.pop("distributed_config", None)
    if getattr(model, "kept_quantization", None) is None:
        config.pop("quantization_config", None)
    return config
