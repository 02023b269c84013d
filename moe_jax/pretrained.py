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

import jax
import jax.numpy as jnp

from converters import load_params, save_params
from converters.key_maps import CONFIG_KEY_MAPS, checkpoint_key_map, with_fp8_scales
from converters.quantize import dequantizing_fp8_key_map, quantizing_key_map
from converters.safetensors_io import checkpoint_shards, read_header

from .checkpoint_files import copy_companion_files, local_checkpoint, read_config
from .inference.generation_config import GenerationConfig
from .models.mtp import held_mtp_layers
from .models.weight_only import (
    EXPERTS_TARGET,
    FP8_BLOCK,
    WeightQuantization,
    quantized_weights_candidates,
    supports_weight_only,
)
from .parameter_dtypes import parameter_dtype


def checkpoint_dtype(config: dict):
    """The parameter dtype config.json records (transformers 5 writes "dtype", 4.x "torch_dtype")."""
    return parameter_dtype(config.get("dtype") or config.get("torch_dtype") or "float32", "config.json dtype")


def from_pretrained(path, distributed_config=None, *, model_class, dtype=None, progress: bool = True,
                    dequantize: bool = True, quantize: str | None = None,
                    quantize_modules: tuple[str, ...] | list[str] | None = None, **model_kwargs):
    """Build a `model_class` on the mesh of `distributed_config` and load `path` directly into its shardings
    (`AutoModelForCausalLM.from_pretrained` picks the class from config.json).

    dtype: parameter dtype, "float32", "bfloat16" or "float16" ("float64" with jax_enable_x64 on); default:
        the checkpoint's, from config.json. Checked before anything is read.
    dequantize: a quantised checkpoint's weights (config.json's `quantization_config`: MXFP4, FP8) are decoded
        to `dtype` at load (True, Transformers' default), or kept in their format on the devices and decoded
        inside the step (False; `model.kept_quantization`): the quantised bytes, inference only.
    quantize: weight-only quantisation of an unquantised checkpoint as it is read (vLLM's `--quantization`):
        "int8" (symmetric, one scale per output row) or "fp8" (e4m3, 128 x 128 block scales, DeepSeek's and
        Transformers' FineGrainedFP8 format, which `save_pretrained` writes); of the routed experts, or of
        `quantize_modules` ("experts" and / or linear module names such as "o_proj"); inference only
        (`models.weight_only`).
    On abstract target devices (`moe_jax.distributed.target_devices`) only config.json is read: the model is
    built for compiling, its parameters left unset.
    A family with multi-token-prediction layers (DeepSeek-V3) holds those the checkpoint has (`models.mtp`;
    `mtp_layers=` overrides): none for a checkpoint without them, whatever num_nextn_predict_layers says.
    """
    dtype = parameter_dtype(dtype) if dtype is not None else None
    directory = local_checkpoint(path)
    config = read_config(directory)
    dtype = dtype if dtype is not None else checkpoint_dtype(config)
    if quantize is not None or quantize_modules is not None:
        model_kwargs["weight_quantization"] = weight_quantization(config, directory, quantize, quantize_modules)
    if not dequantize:
        model_kwargs["kept_quantization"] = quantization_method(config, directory)
    if "mtp_layers" not in model_kwargs:
        model_kwargs["mtp_layers"] = checkpoint_mtp_layers(config, directory, model_class)
    model = model_class(config, distributed_config, dtype=dtype, **model_kwargs)
    model.generation_config = GenerationConfig.for_checkpoint(directory, config)
    model.name_or_path = str(path)   # Transformers' attribute; an adapter's base_model_name_or_path
    model.source_checkpoint = directory   # whose tokenizer and generation files `save_pretrained` carries over
    if model.compiles_only:
        # Abstract target devices (`target_devices`) hold nothing: the config is all a compile needs, the
        # parameters are `training.state.abstract_parameters(model)`.
        return model
    return load_weights(model, directory, progress=progress)


def checkpoint_mtp_layers(config: dict, directory, model_class=None) -> int:
    """How many multi-token-prediction layers the checkpoint at `directory` holds (`models.mtp.held_mtp_layers`):
    0 for a family without them, and for a directory without weights (a config to compile for). model_class: the
    model's (default: config.json's model_type's)."""
    if model_class is None:
        from .causal_lm.families import model_class_for   # the model classes import this module

        model_class = model_class_for(config)
    values = model_class.config_class.from_dict(config)
    if not model_class.family.max_mtp_layers(values):
        return 0
    try:
        files, weight_map = checkpoint_shards(directory)
    except FileNotFoundError:
        return 0
    return held_mtp_layers(values, weight_map if weight_map is not None else read_header(files[0]))


def quantization_method(config: dict, directory) -> str:
    """config.json's `quantization_config.quant_method`, or a ValueError for a checkpoint that is not quantised."""
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method is None:
        raise ValueError(f"dequantize=False keeps a quantised checkpoint's weights quantised, but {directory} has no "
                         "quantization_config in its config.json; load it without dequantize=False.")
    return method


def weight_quantization(config: dict, directory, quantize: str | None, modules) -> WeightQuantization:
    """What `quantize=` / `quantize_modules=` ask of the checkpoint at `directory`, or a ValueError."""
    if quantize is None:
        raise ValueError("quantize_modules names what quantize= quantises; pass quantize='int8' or 'fp8' with it.")
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method is not None:
        raise ValueError(f"{directory} is already quantised ({method}); quantize={quantize!r} quantises unquantised "
                         "checkpoints. Keep its own format with dequantize=False, or load it without quantize= to "
                         "dequantise it.")
    return WeightQuantization(quantize, tuple(modules) if modules is not None else (EXPERTS_TARGET,))


def quantized_weight_names(model) -> list[str]:
    """The parameters `model.weight_quantization` holds as codes (each with its scale beside it)."""
    suffix = model.weight_quantization.format.scale_suffix
    return [name for name in model.module_tree.params if name + suffix in model.module_tree.params]


def load_key_map(model):
    """How the model's parameters are read: its family's table; the kept-quantised one (an FP8 checkpoint of a
    SwiGLU family: codes and scales under Transformers' names); the table quantising the chosen weights as they
    are read (`quantize=`); or, for an FP8 checkpoint dequantised on load, the family's table with its FP8 twins."""
    kept = getattr(model, "kept_quantization", None)
    key_map = checkpoint_key_map(model.model_type, model.config, kept, getattr(model, "mtp_layers", 0))
    quantization = getattr(model, "weight_quantization", None)
    if quantization is not None:
        if kept is not None:
            return with_fp8_scales(key_map)
        return quantizing_key_map(key_map, quantized_weight_names(model), quantization.scheme)
    quantization_config = model.config.to_dict().get("quantization_config") or {}
    if (kept is None and quantization_config.get("quant_method") == "fp8"
            and model.model_type not in CONFIG_KEY_MAPS and supports_weight_only(model.family)):
        return dequantizing_fp8_key_map(key_map, quantized_weights_candidates(model.module_tree),
                                        tuple(quantization_config.get("weight_block_size") or FP8_BLOCK))
    return key_map


def load_weights(model, path, *, progress: bool = True):
    """Read the HF checkpoint at `path` into `model.params`, in the model's shardings and dtype."""
    model.params = load_params(local_checkpoint(path), model.module_tree, load_key_map(model),
                               model.storage_shardings(), dtype=model.storage_dtypes(), progress=progress,
                               layer_stack=model.layer_stack)
    return model


def export_key_map(model):
    """How the model's parameters are written: as `load_key_map`, with quantised-on-load FP8 codes and scales
    under Transformers' FineGrainedFP8 names; int8 has no format Transformers reads, and is refused."""
    key_map = checkpoint_key_map(model.model_type, model.config, getattr(model, "kept_quantization", None),
                                 getattr(model, "mtp_layers", 0))
    quantization = getattr(model, "weight_quantization", None)
    if quantization is None:
        return key_map
    if quantization.format.export_method is None:
        raise ValueError(f"quantize={quantization.scheme!r} weights have no checkpoint format Transformers reads; "
                         "quantise with quantize='fp8' to write a quantised checkpoint, or save the model loaded "
                         "without quantize=.")
    return with_fp8_scales(key_map)


def save_pretrained(model, out_dir: str | os.PathLike, *, params=None, max_shard_bytes: int = 5 * 2**30,
                    progress: bool = True) -> Path:
    """Write `params` (default `model.params`; storage layout) as an HF checkpoint (hub key layout) into
    `out_dir`, atomically, with the tokenizer, chat template and generation config of the checkpoint the model was
    loaded from (`checkpoint_files.copy_companion_files`)."""
    params = model.params if params is None else params
    if params is None:
        raise ValueError("The model has no parameters to save: call init_params() or from_pretrained() first.")
    key_map = export_key_map(model)
    config = saved_config(model)
    json.dumps(config)
    out_dir = save_params(model.hf_params(params), key_map, out_dir,
                          config=config, max_shard_bytes=max_shard_bytes, progress=progress)
    source = getattr(model, "source_checkpoint", None)
    if source is not None and jax.process_index() == 0 and Path(source).resolve() != Path(out_dir).resolve():
        copy_companion_files(source, out_dir)   # quantised or not: `generate --prompt` reads the tokenizer
    return out_dir


def saved_config(model) -> dict:
    """The config.json written with the model's weights: its dtype set, no `distributed_config` (as
    transformers' `_remove_keys_not_serialized`), and no `quantization_config` unless the weights were kept
    quantised (`dequantize=False`): otherwise they were dequantised on load and are written dequantised. A model
    quantised on load (`quantize="fp8"`) writes Transformers' FineGrainedFP8 `quantization_config`."""
    config = {**model.config.to_dict(), "dtype": jnp.dtype(model.dtype).name}
    config.pop("distributed_config", None)
    if getattr(model, "kept_quantization", None) is None:
        config.pop("quantization_config", None)
    if getattr(model, "kept_quantization", None) is None and getattr(model, "weight_quantization", None) is not None:
        config["quantization_config"] = fp8_quantization_config(model)
    return config


def fp8_quantization_config(model) -> dict:
    """FineGrainedFP8Config's fields for the model's quantised-on-load FP8 weights: every other linear module
    (by its name's tail, as Transformers matches `modules_to_not_convert`) listed as not converted."""
    quantized = {name.rpartition(".")[0] for name in quantized_weight_names(model)}
    kept_full = set()
    for name, spec in model.module_tree.params.items():
        module = name.rpartition(".")[0]
        if name.endswith(".weight") and len(spec.shape) == 2 and module not in quantized and "embed_tokens" not in name:
            kept_full.add(module.split(".", 3)[3] if module.startswith("model.layers.") else module)
    if not any(".experts" in module for module in quantized):
        kept_full.add("mlp.experts")
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(FP8_BLOCK), "modules_to_not_convert": sorted(kept_full)}
