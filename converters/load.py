"""Hugging Face safetensors checkpoint -> moe_jax parameters, each placed on its devices as it is read.

    params = load_params(checkpoint_dir, tree, "qwen3_moe", shardings)
    params["model.layers.1.mlp.experts.gate_up_proj"]     # jax.Array [E, 2I, H], sharded as asked

Every parameter is built with `jax.make_array_from_callback`: for each device JAX asks for that device's
block, and the block is read straight from the checkpoint files. With experts split over 8 devices a device
reads only its experts' tensors; with gate_up split on the fused dim a device reads only the gate rows or
only the up rows it holds. No host ever holds a whole stacked parameter unless a device holds it whole.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import jax
import numpy as np
from tqdm.auto import tqdm

from .key_maps import KeyMap, key_map_for
from .lazy_tensors import StackedTensor
from .load_plan import ParamSource, plan_load
from .safetensors_io import SafetensorsCheckpoint, normalize_index, read_request

if TYPE_CHECKING:  # converters depend on no moe_jax module at import time
    from moe_jax.module_tree import ModuleTree


def load_params(
    checkpoint_dir: str | os.PathLike,
    tree: ModuleTree,
    key_map: KeyMap | str,
    shardings: Mapping[str, jax.sharding.Sharding] | None = None,
    dtype=None,
    progress: bool = True,
    layer_stack=None,
) -> dict[str, jax.Array]:
    """Load every parameter `tree` declares from the safetensors checkpoint in `checkpoint_dir`.

    Args:
        checkpoint_dir: a directory with `model.safetensors` or `model.safetensors.index.json` + shards.
        tree: the model's declared parameters (names and shapes in HF's in-memory layout).
        key_map: the architecture's `KeyMap`, or its name in `KEY_MAPS` ("qwen3_moe", "mixtral", ...).
        shardings: `{parameter name: jax Sharding}` covering every parameter; None puts everything on the
            first device.
        dtype: cast to this dtype after reading (per device block), or a mapping `{name: dtype}` (names as
            returned). None keeps the checkpoint's dtype, which must then equal each parameter's declared dtype.
        progress: show a tqdm bar over parameters.
        layer_stack: a `moe_jax.models.layer_stack.LayerStack`: return its storage layout instead, each
            scanned run's per-layer tensors stacked on a leading layer axis as they are read (a device
            still reads only its slices of each layer); `shardings` are then keyed by storage name.

    Returns:
        `{dotted name: jax.Array}` in the tree's declaration order (storage names with `layer_stack`).

    Raises:
        CheckpointFormatError: unreadable files or index (names the file and the fault).
        CheckpointMismatchError: missing, unexpected, duplicated keys, shape or dtype mismatches, all at once.
    """
    key_map = key_map_for(key_map)
    names = list(tree.params) if layer_stack is None else list(layer_stack.members)
    target_dtypes = _target_dtypes(names, dtype)
    placements = _check_shardings(names, shardings)
    with SafetensorsCheckpoint(checkpoint_dir, strip_prefix=key_map.hub_prefix) as checkpoint:
        sources = plan_load(tree, checkpoint, key_map, casts=dtype is not None)
        if layer_stack is not None:
            sources = stack_layer_sources(sources, layer_stack)
        params = {}
        for name, source in tqdm(sources.items(), desc="Loading parameters", unit="param", disable=not progress):
            dtype_on_device = target_dtypes.get(name) or source.tensor.dtype
            params[name] = _device_array(source, placements[name], dtype_on_device)
    return params


def _target_dtypes(names: list[str], dtype) -> dict[str, np.dtype]:
    """`dtype` (one dtype, or a mapping name -> dtype covering `names`) per name; {} for None."""
    if dtype is None:
        return {}
    if isinstance(dtype, Mapping):
        missing = [name for name in names if name not in dtype]
        if missing:
            raise ValueError(f"dtype mapping lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}; give every "
                             "parameter a dtype, or pass one dtype for all.")
        return {name: np.dtype(dtype[name]) for name in names}
    return dict.fromkeys(names, np.dtype(dtype))


def stack_layer_sources(sources: dict[str, ParamSource], layer_stack) -> dict[str, ParamSource]:
    """Per-layer sources -> one source per storage name (a scanned run: a lazy stack over its layers)."""
    stacked = {}
    for storage, members in layer_stack.members.items():
        parts = [sources[name] for name in members]
        if not layer_stack.is_stacked(storage):
            stacked[storage] = parts[0]
            continue
        tensor = StackedTensor([part.tensor for part in parts])
        stacked[storage] = ParamSource(storage, tensor, tuple(key for part in parts for key in part.hub_keys))
    return stacked


def _device_array(source: ParamSource, sharding: jax.sharding.Sharding, dtype: np.dtype) -> jax.Array:
    """`source` laid out by `sharding`: each distinct block is read once, put on every device that holds
    it, and let go before the next is read, so host memory holds one block at a time (a scanned run's
    stacked parameter is many layers: keeping all its blocks until the array exists would hold it whole).

    Reads are tagged `(parameter name, block bounds, ids of the devices the block is for)` (`record_reads`).
    """
    blocks: dict[tuple[tuple[int, int], ...], tuple[tuple[slice, ...], list]] = {}
    for device, index in sharding.addressable_devices_indices_map(source.shape).items():
        index = normalize_index(index, source.shape)
        bounds = tuple((s.start, s.stop) for s in index)
        blocks.setdefault(bounds, (index, []))[1].append(device)
    shards = []
    for bounds, (index, devices) in blocks.items():
        with read_request((source.name, bounds, tuple(device.id for device in devices))):
            block = source.tensor.read(index).astype(dtype, copy=False)
        shards += [jax.device_put(block, device) for device in devices]
        jax.block_until_ready(shards[-len(devices):])  # the transfer is done before the block is dropped
        del block
    return jax.make_array_from_single_device_arrays(source.shape, sharding, shards)


def _check_shardings(
    names: list[str], shardings: Mapping[str, jax.sharding.Sharding] | None
) -> Mapping[str, jax.sharding.Sharding]:
    if shardings is None:
        single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return dict.fromkeys(names, single)
    lacking = [name for name in names if name not in shardings]
    declared = set(names)
    foreign = [name for name in shardings if name not in declared]
    if lacking or foreign:
        raise ValueError(
            "`shardings` must give one jax Sharding per declared parameter; "
            + (f"missing for {lacking}" if lacking else "")
            + ("; " if lacking and foreign else "")
            + (f"given for undeclared {foreign}" if foreign else "")
            + "."
        )
    wrong = [name for name in names if not isinstance(shardings[name], jax.sharding.Sharding)]
    if wrong:
        raise TypeError(
            f"`shardings` values must be jax.sharding.Sharding objects, got {type(shardings[wrong[0]]).__name__} "
            f"for {wrong[0]!r} (and {len(wrong) - 1} more); wrap a PartitionSpec as NamedSharding(mesh, spec)."
        )
    return shardings
