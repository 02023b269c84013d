"""Where one attention layer's cached keys and values live, and how S new tokens join them.

An attention layer with a cache projects its new tokens' keys and values, hands them to its `LayerKV`, and attends
over what comes back; the layer never knows the storage:

    (keys, values), mask_options, stored = layer_kv.store(k, v)     # k, v: [B, S, K, D]
    out = attend(q, keys, values, **mask_options)                    # query_index, key_padding_mask

Three storages (what a "value" is per token is the layer's: DeepSeek stores its latent and rotated key):
    ContiguousKV  [B, T, K, D], every row writes its new tokens at the same slot (`generate`'s cache)
    RingKV        [B, R, K, D], a sliding window's last R tokens in order (the oldest drop off)
    PagedKV       a pool of fixed-size pages [G, pages, P, K, D] shared by the rows of each data-parallel group
                  (G groups), a page table per row and each row's own length (continuous batching)

`first_index` is the cache index of each row's first new token ([B, 1], or a scalar every row shares); with
continuous batching it is also the token's position, since a slot's sequence starts at index 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class ContiguousKV:
    """arrays: (keys, values) [B, T, ...]; the new tokens go to slots [slot, slot + S) of every row.
    key_mask: [B, T], 1 for every stored real token, the new ones included."""

    arrays: tuple[jax.Array, jax.Array]
    slot: jax.Array
    key_mask: jax.Array

    @property
    def first_index(self) -> jax.Array:
        return self.slot

    def store(self, *new: jax.Array):
        """new: (keys, values) [B, S, ...] -> ((keys, values) [B, T, ...] to attend over, mask options, stored)."""
        seq = new[0].shape[1]
        stored = tuple(jax.lax.dynamic_update_slice(array, update.astype(array.dtype), (0, self.slot, 0, 0))
                       for array, update in zip(self.arrays, new))
        return stored, dict(key_padding_mask=self.key_mask, query_index=self.slot + jnp.arange(seq)), stored


@dataclass(frozen=True)
class RingKV:
    """arrays: (keys, values) [B, R, ...], a sliding window's last R tokens, oldest first; the new tokens are
    appended and the oldest dropped. key_mask: [B, R + S], the ring's mask followed by the new tokens'."""

    arrays: tuple[jax.Array, jax.Array]
    key_mask: jax.Array

    @property
    def first_index(self) -> jax.Array:
        return jnp.asarray(self.arrays[0].shape[1])

    def store(self, *new: jax.Array):
        ring, seq = self.arrays[0].shape[1], new[0].shape[1]
        joined = tuple(jnp.concatenate([array, update.astype(array.dtype)], axis=1)
                       for array, update in zip(self.arrays, new))                 # [B, R + S, ...]
        stored = tuple(array[:, -ring:] for array in joined)
        return joined, dict(key_padding_mask=self.key_mask, query_index=ring + jnp.arange(seq)), stored


@dataclass(frozen=True)
class PagedKV:
    """One layer's page pools and the rows' view of them.

    arrays: (keys, values) [G, pages, P, ...], G data-parallel groups, each row reading only its group's pool
    page_table: [B, M] each row's pages, in order, as indices into its group's pool (rows g*B/G .. (g+1)*B/G - 1
        are group g's); a row's token i lives in page page_table[i // P] at offset i % P
    lengths: [B] tokens each row has stored before this step
    new_mask: [B, S] 1 for a real new token (a row's real tokens come first); the others are neither stored nor
        seen (an idle slot, the tail of a prompt's last chunk)
    The view a row attends over is its M pages in order, [M * P] keys; index = position."""

    arrays: tuple[jax.Array, jax.Array]
    page_table: jax.Array
    lengths: jax.Array
    new_mask: jax.Array

    @property
    def first_index(self) -> jax.Array:
        return self.lengths[:, None]

    def store(self, *new: jax.Array):
        groups, pages, page_size = self.arrays[0].shape[:3]
        batch, seq = new[0].shape[:2]
        index = self.lengths[:, None] + jnp.arange(seq)                                 # [B, S]
        page = jnp.take_along_axis(self.page_table, jnp.minimum(index // page_size, self.page_table.shape[1] - 1),
                                   axis=1)
        page = jnp.where(self.new_mask > 0, page, pages)          # out of range: dropped by the scatter below
        per_group = lambda a: a.reshape(groups, batch // groups, *a.shape[1:])  # noqa: E731
        stored = tuple(jax.vmap(_write_pages)(array, per_group(page), per_group(index % page_size),
                                              per_group(update.astype(array.dtype)))
                       for array, update in zip(self.arrays, new))
        views = tuple(jax.vmap(_read_pages)(array, per_group(self.page_table)).reshape(
            batch, -1, *array.shape[3:]) for array in stored)
        count = jnp.sum(self.new_mask > 0, axis=1)
        key_mask = jnp.arange(views[0].shape[1])[None, :] < (self.lengths + count)[:, None]
        return views, dict(key_padding_mask=key_mask, query_index=index), stored


def _write_pages(pool: jax.Array, page: jax.Array, offset: jax.Array, update: jax.Array) -> jax.Array:
    """pool: [pages, P, ...]; page, offset: [b, S]; update: [b, S, ...] -> the pool with each token written (a page
    index past the pool drops its token)."""
    return pool.at[page, offset].set(update, mode="drop")


def _read_pages(pool: jax.Array, page_table: jax.Array) -> jax.Array:
    """pool: [pages, P, ...]; page_table: [b, M] -> [b, M, P, ...]."""
    return pool[page_table]
