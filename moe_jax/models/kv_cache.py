"""The KV cache's pytree: what the decoder's attention reads and writes, keyed by the model's layer runs.

Storage follows the layer runs (`moe_jax.models.layer_stack`): run "1-47" holds keys/values [L, B, T, K, D]
for its L layers (what a layer stores per token is the model's `cache_heads()`), so a scanned run carries its
cache through the same scan. A sliding-window run shorter than the cache keeps a ring of its window, with
its own mask in `window_masks`. Making, sizing and placing a cache is `moe_jax.inference.cache`'s
(`init_cache`); the structure lives here, with the decoder that fills it.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax


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


jax.tree_util.register_dataclass(
    KVCache, data_fields=["keys", "values", "key_mask", "length", "window_masks"], meta_fields=[])
