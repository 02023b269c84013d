"""Where one attention layer's cached keys and values live, and how S new tokens join them.

An attention layer with a cache projects its new tokens' keys and values and hands them, with its queries and
its attention core, to its storage, which stores them and runs the core over what each query may see; the layer
never knows the storage:

    out, stored = layer_kv.attend(core, q, k, v)    # q: [B, S, N, D]; k, v: [B, S, K, D]
    # core(q, keys, values, **mask_options) -> [B', S', N, D]; mask_options: query_index, key_padding_mask

Four storages (what a "value" is per token is the layer's: DeepSeek stores its latent and rotated key):
    ContiguousKV      [B, T, K, D], every row writes its new tokens at the same slot (`generate`'s cache)
    RingKV            [B, R, K, D], a sliding window's last R tokens in order (the oldest drop off)
    PagedKV           pools of fixed-size pages [G, L, pages, P, K, D] shared by the rows of each data-parallel
                      group (G groups), a page table per row and each row's own length (continuous batching)
    SegmentedPagedKV  the same pools, for a step whose tokens come one per row ([N, 1]) from sequences of several
                      lengths (a prompt chunk's tokens and the decoding rows' one token each, in one program):
                      the core runs once per segment of equal-length sequences
The first three store, then run the core once over their views (`store`).

`first_index` is the cache index of each row's first new token ([B, 1], or a scalar every row shares); with
continuous batching it is also the token's position, since a slot's sequence starts at index 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np


def _layer_slice(array: jax.Array, layer) -> jax.Array:
    return array if layer is None else jax.lax.dynamic_index_in_dim(array, layer, keepdims=False)


class _AttendsOnce:
    """A storage whose rows are the queries' rows: store, then one call of the core over the views."""

    def attend(self, core, q: jax.Array, *new: jax.Array):
        """q: [B, S, N, D]; new: what the layer stores per token, [B, S, ...] each -> (core's output [B, S, N, D],
        the stored arrays)."""
        views, mask_options, stored = self.store(*new)
        return core(q, *views, **mask_options), stored


@dataclass(frozen=True)
class ContiguousKV(_AttendsOnce):
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
class RingKV(_AttendsOnce):
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
class PagedKV(_AttendsOnce):
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


def segment_tokens(segments: tuple[tuple[int, int], ...]) -> tuple[np.ndarray, np.ndarray]:
    """segments: ((sequences, tokens each), ...) of one data-parallel group, in order -> (the sequence [Ng] and the
    offset within it [Ng] of each of the group's Ng tokens, sequences numbered across segments)."""
    sequence, offset, first = [], [], 0
    for count, length in segments:
        sequence.append(np.repeat(np.arange(first, first + count), length))
        offset.append(np.tile(np.arange(length), count))
        first += count
    return np.concatenate(sequence).astype(np.int32), np.concatenate(offset).astype(np.int32)


def segment_token_index(lengths: jax.Array, segments: tuple[tuple[int, int], ...], groups: int) -> jax.Array:
    """lengths: [G * Q] tokens each sequence holds (Q sequences a group) -> [G * Ng] each flat token's cache index,
    which is its position."""
    sequence, offset = segment_tokens(segments)
    return (lengths.reshape(groups, -1)[:, sequence] + offset).reshape(-1)


@dataclass(frozen=True)
class SegmentedPagedKV:
    """One layer's view of the page pools for a step of flat tokens, one per row: [G * Ng, 1] queries, Ng tokens a
    data-parallel group, laid out group by group as `segments` says: ((sequences, tokens each), ...), e.g.
    ((1, 128), (8, 1)) for one prompt's 128-token chunk then 8 decoding rows' one token each.

    arrays: (keys, values) pools [G, L, pages, P, ...] (`PagedKV`); layer: this layer's row of them
    page_table: [G * Q, W] each sequence's pages (Q sequences a group, in segment order)
    lengths: [G * Q] tokens each sequence stored before this step
    new_mask: [G * Ng, 1] 1 for a real token (a sequence's real tokens come first)
    Every token is written first, then each segment's sequences attend as `PagedKV`'s rows do ([sequences, tokens]
    queries against their W pages): the same attention as separate steps, while everything outside attention
    (projections, experts) runs once over all the step's tokens."""

    arrays: tuple[jax.Array, jax.Array]
    page_table: jax.Array
    lengths: jax.Array
    new_mask: jax.Array
    segments: tuple[tuple[int, int], ...]
    layer: jax.Array = 0

    @property
    def first_index(self) -> jax.Array:
        """[G * Ng, 1]: each token's cache index (= its position)."""
        return segment_token_index(self.lengths, self.segments, self.arrays[0].shape[0])[:, None]

    def attend(self, core, q: jax.Array, *new: jax.Array):
        """q: [G * Ng, 1, N, D]; new: [G * Ng, 1, ...] each -> (core's output [G * Ng, 1, N, D], the pools with the
        new tokens written)."""
        groups, _, pages, page_size = self.arrays[0].shape[:4]
        width = self.page_table.shape[1]
        sequence, offset = segment_tokens(self.segments)
        tables = self.page_table.reshape(groups, -1, width)                              # [G, Q, W]
        lengths = self.lengths.reshape(groups, -1)                                       # [G, Q]
        real = self.new_mask.reshape(groups, -1) > 0                                     # [G, Ng]
        # Materialised apart: XLA:GPU (jaxlib 0.10.2) cannot emit a reduction fusion of this mask sliced out of
        # the step's concatenated inputs ("'scf.if' op ... successor operand type"). A tiny array.
        real = jax.lax.optimization_barrier(real)
        index = lengths[:, sequence] + offset                                            # [G, Ng]
        page = jnp.take_along_axis(tables[:, sequence], jnp.minimum(index // page_size, width - 1)[..., None],
                                   axis=2)[..., 0]
        page = jnp.where(real, page, pages)                       # out of range: dropped by the scatter
        write = jax.vmap(partial(_write_pages, layer=self.layer))
        per_group = lambda a: a.reshape(groups, -1, *a.shape[2:])  # noqa: E731   [G * Ng, 1, ...] -> [G, Ng, ...]
        stored = tuple(write(array, page, index % page_size, per_group(update.astype(array.dtype)))
                       for array, update in zip(self.arrays, new))
        read = jax.vmap(partial(_read_pages, layer=self.layer))
        queries = per_group(q)
        outputs, first_token, first_sequence = [], 0, 0
        for count, length in self.segments:
            rows = groups * count
            tokens = slice(first_token, first_token + count * length)
            sequences = slice(first_sequence, first_sequence + count)
            views = tuple(read(array, tables[:, sequences]).reshape(rows, width * page_size, *array.shape[4:])
                          for array in stored)
            stored_count = lengths[:, sequences] + real[:, tokens].reshape(groups, count, length).sum(axis=2)
            key_mask = jnp.arange(width * page_size)[None, :] < stored_count.reshape(rows, 1)
            query_index = lengths[:, sequences].reshape(rows, 1) + jnp.arange(length)
            segment_q = queries[:, tokens].reshape(rows, length, *q.shape[2:])
            out = core(segment_q, *views, key_padding_mask=key_mask, query_index=query_index)
            outputs.append(out.reshape(groups, count * length, *out.shape[2:]))
            first_token += count * length
            first_sequence += count
        return jnp.concatenate(outputs, axis=1).reshape(q.shape[0], 1, *outputs[0].shape[2:]), stored


def _write_pages(pools: jax.Array, page: jax.Array, offset: jax.Array, update: jax.Array, *, layer) -> jax.Array:
    """pools: [L, pages, P, ...] (one group's); page, offset: [b, S] (or [n]); update: [b, S, ...] (or [n, ...])
    -> the pools with each token written at layer `layer` (a page index past the pool drops its token)."""
    return pools.at[layer, page, offset].set(update, mode="drop")


def _read_pages(pools: jax.Array, page_table: jax.Array, *, layer) -> jax.Array:
    """pools: [L, pages, P, ...]; page_table: [b, W] -> layer `layer`'s pages [b, W, P, ...]."""
    return pools[layer, page_table]
