"""Host data -> global `jax.Array`s, each process supplying only the rows its own devices hold.

    ids = global_rows((B, S), batch_sharding, lambda rows: tokens[rows])     # reads only this process's rows
    logits = to_host(out.logits)                                             # the whole array, every process

In a multi-process job a global array is assembled from what each process puts on its own devices, so a
batch split over the data-parallel devices is read in pieces: process p asks for the rows of its devices
and nothing else. In a one-process job the same call reads every row (all devices are local).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np


def local_rows(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> np.ndarray:
    """Sorted global indices of the rows (first dimension) held by this process's devices."""
    rows = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows.update(range(*index[0].indices(shape[0])) if index else range(shape[0]))
    return np.asarray(sorted(rows), np.int64)


def global_rows(shape: tuple[int, ...], sharding: jax.sharding.Sharding,
                read_rows: Callable[[np.ndarray], np.ndarray]) -> jax.Array:
    """The global array of `shape` laid out by `sharding`, built from `read_rows(rows) -> [len(rows), ...]`,
    called once with the rows this process's devices hold (`local_rows`)."""
    rows = local_rows(shape, sharding)
    block = np.asarray(read_rows(rows))
    if block.shape != (len(rows), *shape[1:]):
        raise ValueError(f"read_rows returned shape {block.shape} for {len(rows)} rows of a {shape} array.")
    position = {int(row): i for i, row in enumerate(rows)}

    def device_block(index):
        wanted = range(*index[0].indices(shape[0])) if index else range(shape[0])
        return block[[position[row] for row in wanted]][(slice(None), *index[1:])]

    return jax.make_array_from_callback(shape, sharding, device_block)


def host_to_global(array, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host array holding the *whole* global value (the same on every process) -> a global jax.Array; a
    jax.Array is resharded if need be (jit would do the same)."""
    if isinstance(array, jax.Array):
        return array if array.sharding == sharding else jax.device_put(array, sharding)
    array = np.asarray(array)
    return global_rows(array.shape, sharding, lambda rows: array[rows])


def to_host(array) -> np.ndarray:
    """One array as a numpy array on every process: device shards assembled locally, or gathered across
    processes when the array spans them (every process must call this for the same array)."""
    if not isinstance(array, jax.Array) or array.is_fully_addressable or array.is_fully_replicated:
        return np.asarray(jax.device_get(array))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
