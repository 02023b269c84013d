"""Where one attention layer's cached keys and values live, and how S new tokens join them.

An attention layer with a cache projects its new tokens' keys and values, hands them to its `LayerKV`, and attends
over what comes back; the layer never knows the storage:

    (keys, values), mask_options, stored = layer_kv.store(k, v)     # k, v: [B, S, K, D]
    out = attend(q, keys, values, **mask_options)                    # query_index, key_padding_mask

Three storages (what a "value" is per token is the layer's: DeepSeek stores its latent and rotated key):
    ContiguousKV  [B, T, K, D], every row writes its new tokens at the same slot (`generate`'s cache)
    RingKV        [B, R, K, D], a sliding window's last R tokens in order (the oldest drop off)
    PagedKV       pools of fixed-size pages [G, L, pages, P, K, D] shared by the rows of each data-parallel group
                  (G groups), a page table per row and each row's own length (continuous batching)

`first_index` is the cache index of each row's first new token ([B, 1], or a scalar every row shares); with
continuous batching it is also the token's position, since a slot's sequence starts at index 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp


def _layer_slice(array: jax.Array, layer) -> jax.Array:
    return array if layer is None else jax.lax.dynamic_index_in_dim(array, layer, keepdims=False)


@dataclass(frozen=True)
class ContiguousKV:
    """arrays: (keys, values) [B, T, ...], or the whole run's [L, B, T, ...] with `layer` the row to use (a
    scanned run carries its cache whole, so each layer's write is a small in-place update rather than a copy of
    its slice); the new tokens go to slots [slot, slot + S) of every row.
    key_mask: [B, T], 1 for every stored real token, the new ones included."""

    arrays: tuple[jax.Array, jax.Array]
    slot: jax.Array
    key_mask: jax.Array
    layer: jax.Array | None = None

    @property
    def first_index(self) -> jax.Array:
        return self.slot

    def store(self, *new: jax.Array):
        """new: (keys, values) [B, S, ...] -> ((keys, values) [B, T, ...] to attend over, mask options, the stored
        arrays in the form they came)."""
        seq = new[0].shape[1]
        if self.layer is None:
            stored = tuple(jax.lax.dynamic_update_slice(array, update.astype(array.dtype), (0, self.slot, 0, 0))
                           for array, update in zip(self.arrays, new))
            views = stored
        else:
            stored = tuple(jax.lax.dynamic_update_slice(array, update[None].astype(array.dtype),
                                                        (self.layer, 0, self.slot, 0, 0))
                           for array, update in zip(self.arrays, new))
            views = tuple(_layer_slice(array, self.layer) for array in stored)
        return views, dict(key_padding_mask=self.key_mask, query_index=self.slot + jnp.arange(seq)), stored


@dataclass(frozen=True)
class RingKV:
    """arrays: (keys, values) [B, R, ...] (or [L, B, R, ...] with `layer`), a sliding window's last R tokens,
    oldest first; the new tokens are appended and the oldest dropped. key_mask: [B, R + S], the ring's mask
    followed by the new tokens'."""

    arrays: tuple[jax.Array, jax.Array]
    key_mask: jax.Array
    layer: jax.Array | None = None

    @property
    def first_index(self) -> jax.Array:
        return jnp.asarray(self.arrays[0].shape[-3])

    def store(self, *new: jax.Array):
        rings = tuple(_layer_slice(array, self.layer) for array in self.arrays)
        ring, seq = rings[0].shape[1], new[0].shape[1]
        joined = tuple(jnp.concatenate([array, update.astype(array.dtype)], axis=1)
                       for array, update in zip(rings, new))                       # [B, R + S, ...]
        kept = tuple(array[:, -ring:] for array in joined)
        if self.layer is not None:
            kept = tuple(jax.lax.dynamic_update_index_in_dim(array, update, self.layer, 0)
                         for array, update in zip(self.arrays, kept))
        return joined, dict(key_padding_mask=self.key_mask, query_index=ring + jnp.arange(seq)), kept


@dataclass(frozen=True)
class PagedKV:
    """One layer's view of a run's page pools.

    arrays: (keys, values) [G, L, pages, P, ...]: the run's pools (G data-parallel groups, each row reading only
        its group's pool; L layers); `layer`: this layer's row of them
    page_table: [B, W] each row's pages, in order, as indices into its group's pool (rows g*B/G .. (g+1)*B/G - 1
        are group g's); a row's token i lives in page page_table[i // P] at offset i % P
    lengths: [B] tokens each row has stored before this step
    new_mask: [B, S] 1 for a real new token (a row's real tokens come first); the others are neither stored nor
        seen (an idle slot, the tail of a prompt's last chunk)
    The view a row attends over is its W pages in order, [W * P] keys; index = position. The new tokens are
    scattered into the pools in place (the pools ride through the layer scan whole)."""

    arrays: tuple[jax.Array, jax.Array]
    page_table: jax.Array
    lengths: jax.Array
    new_mask: jax.Array
    layer: jax.Array = 0

    @property
    def first_index(self) -> jax.Array:
        return self.lengths[:, None]

    def store(self, *new: jax.Array):
        groups, _, pages, page_size = self.arrays[0].shape[:4]
        batch, seq = new[0].shape[:2]
        width = self.page_table.shape[1]
        index = self.lengths[:, None] + jnp.arange(seq)                                 # [B, S]
        page = jnp.take_along_axis(self.page_table, jnp.minimum(index // page_size, width - 1), axis=1)
        page = jnp.where(self.new_mask > 0, page, pages)          # out of range: dropped by the scatter below
        per_group = lambda a: a.reshape(groups, batch // groups, *a.shape[1:])  # noqa: E731
        write = jax.vmap(partial(_write_pages, layer=self.layer))   # over the groups: no collective
        stored = tuple(write(array, per_group(page), per_group(index % page_size), per_group(update.astype(array.dtype)))
                       for array, update in zip(self.arrays, new))
        read = jax.vmap(partial(_read_pages, layer=self.layer))
        views = tuple(read(array, per_group(self.page_table)).reshape(batch, width * page_size, *array.shape[4:])
                      for array in stored)
        count = jnp.sum(self.new_mask > 0, axis=1)
        key_mask = jnp.arange(width * page_size)[None, :] < (self.lengths + count)[:, None]
        return views, dict(key_padding_mask=key_mask, query_index=index), stored


def _write_pages(pools: jax.Array, page: jax.Array, offset: jax.Array, update: jax.Array, *, layer) -> jax.Array:
    """pools: [L, pages, P, ...] (one group's); page, offset: [b, S]; update: [b, S, ...] -> the pools with each
    token written at layer `layer` (a page index past the pool drops its token)."""
    return pools.at[layer, page, offset].set(update, mode="drop")


def _read_pages(pools: jax.Array, page_table: jax.Array, *, layer) -> jax.Array:
    """pools: [L, pages, P, ...]; page_table: [b, W] -> layer `layer`'s pages [b, W, P, ...]."""
    return pools[layer, page_table]
