"""Hugging Face safetensors checkpoint -> moe_jax parameters, each placed on its devices as it is read.

    params = load_params(checkpoint_dir, tree, "qwen3_moe", shardings)
    params["model.layers.1.mlp.experts.gate_up_proj"]     # jax.Array [E, 2I, H], sharded as asked

Every parameter is built block by block: each distinct device block of its sharding is read straight from
the checkpoint files, placed on its devices and dropped before the next is read. With experts split over 8
devices a device reads only its experts' tensors; with gate_up split on the fused dim a device reads only the
gate rows or only the up rows it holds. A large block of a scanned run's stacked parameter is read one layer
at a time into a buffer on its device (`LAYERWISE_READ_BYTES`), so the host holds at most one layer's slice
of it, never a whole stacked parameter.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from .key_maps import KeyMap, key_map_for
from .lazy_tensors import StackedTensor, ZerosTensor
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
        parts = [sources[name] for name in members if name is not None]
        if not layer_stack.is_stacked(storage):
            stacked[storage] = parts[0]
            continue
        zeros = ZerosTensor(parts[0].shape, parts[0].tensor.dtype)  # rows of a pipeline stage without the layer
        tensor = StackedTensor([zeros if name is None else sources[name].tensor for name in members])
        stacked[storage] = ParamSource(storage, tensor, tuple(key for part in parts for key in part.hub_keys),
                                       stacked_layers=True)
    return stacked


def _device_array(source: ParamSource, sharding: jax.sharding.Sharding, dtype: np.dtype) -> jax.Array:
    """`source` laid out by `sharding`: each distinct block is read once (`_block_on_device`), put on the first
    device that holds it and copied from there to the others, and let go before the next is read, so host
    memory holds one block at a time, or one layer of a large stacked block.

    Reads are tagged `(parameter name, block bounds, ids of the devices the block is for)` (`record_reads`).
    """
    blocks: dict[tuple[tuple[int, int], ...], tuple[tuple[slice, ...], list]] = {}
    for device, index in sharding.addressable_devices_indices_map(source.shape).items():
        index = normalize_index(index, source.shape)
        blocks.setdefault(_bounds(index), (index, []))[1].append(device)
    shards = []
    for index, devices in blocks.values():
        first = _block_on_device(source, index, dtype, devices[0], tuple(device.id for device in devices))
        shards += [first] + [jax.device_put(first, device) for device in devices[1:]]
        jax.block_until_ready(shards[-len(devices):])
    return jax.make_array_from_single_device_arrays(source.shape, sharding, shards)


# A stacked run's block above this size is read one layer at a time straight into a buffer on its device, so
# the host never holds more than max(this, one layer's slice): a device's block of a deep model's stacked
# experts is tens of GB (Qwen3-235B-A22B's gate_up over ep=8: 94 layers x 16 experts x [3072, 4096] bf16 =
# 38 GB), while smaller blocks are read whole (one transfer, no per-layer device writes).
LAYERWISE_READ_BYTES = 8 * 2**20


def _block_on_device(source: ParamSource, index: tuple[slice, ...], dtype: np.dtype, device,
                     device_ids: tuple[int, ...]) -> jax.Array:
    """Block `index` of `source` as `dtype` on `device`; reads are tagged for `device_ids`."""
    shape = tuple(s.stop - s.start for s in index)
    if not source.stacked_layers or shape[0] <= 1 or math.prod(shape) * dtype.itemsize <= LAYERWISE_READ_BYTES:
        with read_request((source.name, _bounds(index), device_ids)):
            block = source.tensor.read(index).astype(dtype, copy=False)
        return jax.device_put(block, device)
    layers = index[0]
    buffer = jnp.zeros(shape, dtype, device=device)
    for layer in range(layers.start, layers.stop):
        layer_index = (slice(layer, layer + 1), *index[1:])
        with read_request((source.name, _bounds(layer_index), device_ids)):
            piece = source.tensor.read(layer_index).astype(dtype, copy=False)
        buffer = _write_layer(buffer, jax.device_put(piece, device), layer - layers.start)
        buffer.block_until_ready()  # the layer is on the device before its host copy is dropped
        del piece
    return buffer


@functools.partial(jax.jit, donate_argnums=0)
def _write_layer(buffer: jax.Array, piece: jax.Array, at) -> jax.Array:
    """buffer: [L, ...]; piece: [1, ...] -> buffer with layer `at` replaced, in place (the buffer is donated)."""
    return jax.lax.dynamic_update_slice_in_dim(buffer, piece, at, axis=0)


def _bounds(index: tuple[slice, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((s.start, s.stop) for s in index)


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
