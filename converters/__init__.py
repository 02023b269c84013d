"""Hugging Face safetensors checkpoints <-> moe_jax parameters.

    from converters import load_params, save_params
    params = load_params("Qwen3-30B-A3B/", tree, "qwen3_moe", shardings)   # sharded as it is read
    save_params(params, "qwen3_moe", "out/", config=hf_config)             # hub layout, streamed

Modules: `key_maps` (per-architecture hub <-> parameter tables), `transforms` (their invertible steps),
`safetensors_io` (validated, sliced, counted reads), `load_plan` (strict key matching), `load`, `export`,
`shard_writer` (streamed safetensors files).
"""

from .errors import CheckpointFormatError, CheckpointMismatchError
from .export import save_params
from .key_maps import KEY_MAPS, KeyMap, KeyRule, key_map_for, rename
from .load import load_params
from .safetensors_io import SafetensorsCheckpoint, TensorRead, record_reads
from .transforms import ConcatGateUp, OneWayTransform, StackExperts, Transform

__all__ = [
    "KEY_MAPS",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "ConcatGateUp",
    "KeyMap",
    "KeyRule",
    "OneWayTransform",
    "SafetensorsCheckpoint",
    "StackExperts",
    "TensorRead",
    "Transform",
    "key_map_for",
    "load_params",
    "record_reads",
    "rename",
    "save_params",
]
