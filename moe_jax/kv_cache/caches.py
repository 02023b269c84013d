"""The whole model's cache pytrees, keyed by the model's layer runs, and the step that writes them.

Storage follows the layer runs (`moe_jax.models.layer_stack`): run "1-47" holds keys/values [L, B, T, K, D]
for its L layers (what a layer stores per token is the model's `cache_heads()`), so a scanned run carries its
cache through the same scan. A sliding-window run shorter than the cache keeps a ring of its window, with
its own mask in `window_masks`. `begin(attention_mask)` gives the step's `CacheStep`, whose `view` makes each
layer's storage (`layer_views`); making, sizing and placing the arrays is `contiguous.py`'s and `paged.py`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from .layer_views import ContiguousKV, PagedKV, RingKV, SegmentedPagedKV, segment_token_index, segment_tokens


@dataclass
class KVCache:
    """keys, values: run key -> [L, B, T, K, D] ([L, B, R, K, D] for a window ring); key_mask: [B, T]
    int32, 1 for a stored real token; length: int32 scalar, the tokens written so far (the next goes to slot
    `length`); window_masks: ring run key -> [B, R], the ring's key_mask."""

    keys: dict[str, jax.Array]
    values: dict[str, jax.Array]
    key_mask: jax.Array
    length: jax.Array
    window_masks: dict[str, jax.Array]

    @property
    def max_length(self) -> int:
        return self.key_mask.shape[1]

    @property
    def batch_size(self) -> int:
        return self.key_mask.shape[0]

    @property
    def next_index(self) -> jax.Array:
        """The cache index (and default position) of every row's next token."""
        return self.length

    def begin(self, attention_mask: jax.Array) -> CacheStep:
        """The step that stores S new tokens (attention_mask: [B, S], 1 for real ones) at slot `length`."""
        new_mask = attention_mask.astype(self.key_mask.dtype)
        key_mask = jax.lax.dynamic_update_slice(self.key_mask, new_mask, (0, self.length))
        ring_masks = {key: jnp.concatenate([ring, new_mask], axis=1) for key, ring in self.window_masks.items()}

        def view(key: str) -> Callable[[tuple, jax.Array], ContiguousKV | RingKV]:
            if key in ring_masks:
                return lambda arrays, layer: RingKV(arrays, ring_masks[key], layer)
            return lambda arrays, layer: ContiguousKV(arrays, self.length, key_mask, layer)

        def finish(stored: dict[str, tuple]) -> KVCache:
            windows = {key: mask[:, -self.window_masks[key].shape[1]:] for key, mask in ring_masks.items()}
            return KVCache(keys={key: pair[0] for key, pair in stored.items()},
                           values={key: pair[1] for key, pair in stored.items()}, key_mask=key_mask,
                           length=self.length + attention_mask.shape[1], window_masks=windows)

        return CacheStep(arrays=lambda key: (self.keys[key], self.values[key]), view=view, finish=finish)


jax.tree_util.register_dataclass(
    KVCache, data_fields=["keys", "values", "key_mask", "length", "window_masks"], meta_fields=[])


@dataclass
class PagedKVCache:
    """A continuous batch's cache: page pools shared by its rows, and this step's rows' page tables and lengths.

    keys, values: run key -> [G, L, pages, P, K, D], G data-parallel groups, each with its own pool (a row of group
    g reads and writes only pool g); page_table: [B, M] each row's pages in order (indices into its group's pool;
    rows g*B/G .. (g+1)*B/G - 1 are group g's); lengths: [B] int32 tokens each row holds. Which pages a row owns is
    the host's bookkeeping (`PageBook`); a step only reads the table. Sliding-window layers keep
    every page (their window is a mask).

    segments: None for a step of input_ids [B, S] (row b of the step is sequence b); or, for a step of flat tokens
    input_ids [G * Ng, 1] drawn from sequences of several lengths, ((sequences, tokens each), ...) of one group
    (`SegmentedPagedKV`), with page_table and lengths per sequence [G * Q, ...]."""

    keys: dict[str, jax.Array]
    values: dict[str, jax.Array]
    page_table: jax.Array
    lengths: jax.Array
    segments: tuple[tuple[int, int], ...] | None = None

    @property
    def batch_size(self) -> int:
        return self.page_table.shape[0]

    @property
    def page_size(self) -> int:
        return next(iter(self.keys.values())).shape[3]

    @property
    def groups(self) -> int:
        return next(iter(self.keys.values())).shape[0]

    @property
    def max_length(self) -> int:
        """The tokens a row's page table can address."""
        return self.page_table.shape[1] * self.page_size

    @property
    def next_index(self) -> jax.Array:
        """[B, 1] (or [G * Ng, 1] by segments): each row's (token's) next index, which is its position (a slot's
        sequence starts at 0)."""
        if self.segments is None:
            return self.lengths[:, None]
        return segment_token_index(self.lengths, self.segments, self.groups)[:, None]

    def begin(self, attention_mask: jax.Array) -> CacheStep:
        """The step that appends each row's real new tokens (attention_mask: [B, S], real tokens first; by
        segments [G * Ng, 1]) after its sequence's `lengths` stored ones."""
        if self.segments is None:
            added = jnp.sum(attention_mask > 0, axis=1)
            view = lambda arrays, layer: PagedKV(arrays, self.page_table, self.lengths,  # noqa: E731
                                                 attention_mask, layer)
        else:
            sequence, _ = segment_tokens(self.segments)
            real = (attention_mask.reshape(self.groups, -1) > 0).astype(self.lengths.dtype)       # [G, Ng]
            added = jax.vmap(lambda row: jnp.zeros(self.lengths.shape[0] // self.groups, row.dtype)
                             .at[sequence].add(row))(real).reshape(-1)
            view = lambda arrays, layer: SegmentedPagedKV(arrays, self.page_table, self.lengths,  # noqa: E731
                                                          attention_mask, self.segments, layer)

        def finish(stored: dict[str, tuple]) -> PagedKVCache:
            return PagedKVCache(keys={key: pair[0] for key, pair in stored.items()},
                                values={key: pair[1] for key, pair in stored.items()}, page_table=self.page_table,
                                lengths=self.lengths + added.astype(self.lengths.dtype), segments=self.segments)

        return CacheStep(arrays=lambda key: (self.keys[key], self.values[key]), view=lambda key: view,
                         finish=finish)


jax.tree_util.register_dataclass(
    PagedKVCache, data_fields=["keys", "values", "page_table", "lengths"], meta_fields=["segments"])


@dataclass(frozen=True)
class CacheStep:
    """One step's use of a cache. arrays(run key): the run's stored (keys, values) [L, ...]; view(run key): makes
    layer `layer`'s storage (`layer_views`) from the run's whole (keys, values) [L, ...] (they ride through the
    layer scan whole, updated in place); finish(stored): the cache after the step, from every run's arrays."""

    arrays: Callable[[str], tuple]
    view: Callable[[str], Callable[[tuple], object]]
    finish: Callable[[dict], object]
