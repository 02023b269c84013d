"""The KV cache: every layer's keys and values, laid out like the attention heads that produce them.

    cache = init_cache(model, batch=4, max_length=256)     # zeros, sharded; max_length bucketed
    out = model.apply(params, prompt, attention_mask=mask, positions=pos, cache=cache)   # prefill
    out = model.apply(params, next_ids, positions=pos + 1, cache=out.cache)              # one decode step

Storage follows the model's layer runs (`moe_jax.models.layer_stack`; with pipeline stages its groups, rows
split over `pp` as their parameters' are): run "1-47" holds keys/values
[L, B, T, K, D] for its L layers (what a layer stores per token is the model's `cache_heads()`: DeepSeek's
latent attention keeps its compressed latent and rotated key instead), so a scanned run carries its cache
through the same scan. The batch is
split over the data axes as the activations are, the KV heads over tp as the k/v projections' outputs are
(replicated when tp does not divide them). Every row writes its new tokens to the same slots: `length` is
one scalar, and a left-padded prompt's padding is masked by `key_mask`, not skipped.

A sliding-window run whose window is shorter than the cache keeps only its window: a ring of the last
`sliding_window - 1` tokens in order (each step appends and drops the oldest), with its own mask in
`window_masks` (what a query sees besides itself and the other new tokens). The `KVCache` pytree is
`caches.py`'s.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..distributed.mesh import PP, spec_entry
from .caches import KVCache

# Cache lengths are rounded up to a multiple of this (or to a power of two below it), so generations of
# nearby lengths share one compilation.
LENGTH_BUCKET = 128


def ring_length(model, layer: int, max_length: int) -> int | None:
    """The ring a sliding-window layer's run keeps in a cache of `max_length` (None: it keeps every slot)."""
    window = model.attention_options(layer).get("sliding_window")
    if window is None or window - 1 >= max_length:
        return None
    return max(window - 1, 1)


def bucket_length(length: int) -> int:
    """The cache length used for `length` tokens: the next power of two up to LENGTH_BUCKET, then the next
    multiple of LENGTH_BUCKET."""
    if length < 1:
        raise ValueError(f"a cache needs room for at least one token, got length {length}.")
    if length <= LENGTH_BUCKET:
        return 1 << (length - 1).bit_length()
    return -(-length // LENGTH_BUCKET) * LENGTH_BUCKET


def cache_shardings(model, batch: int, max_length: int) -> KVCache:
    """The NamedSharding of every cache array (a KVCache of shardings)."""
    layout = model.layout
    batch_entry = spec_entry(layout.batch_axes) if batch % model.data_parallel_size == 0 else None

    stage_axis = PP if model.layer_stack.pipeline is not None else None  # pipeline rows: stage by stage

    def per_layer(heads: int) -> NamedSharding:
        heads_entry = spec_entry(layout.tp_axes) if heads % layout.tp_size == 0 else None
        return NamedSharding(model.mesh, P(stage_axis, batch_entry, None, heads_entry, None))

    (key_heads, _), (value_heads, _) = model.cache_heads()
    rows = NamedSharding(model.mesh, P(batch_entry, None))
    entries = model.layer_stack.cache_entries()
    rings = {key: rows for key, layer, _ in entries if ring_length(model, layer, max_length) is not None}
    return KVCache(keys={key: per_layer(key_heads) for key, _, _ in entries},
                   values={key: per_layer(value_heads) for key, _, _ in entries}, key_mask=rows,
                   length=NamedSharding(model.mesh, P()), window_masks=rings)


def init_cache(model, batch: int, max_length: int, *, dtype=None, bucket: bool = True) -> KVCache:
    """An empty cache for `batch` rows of up to `max_length` tokens (rounded up by `bucket_length`), in the
    model's dtype (or `dtype`), placed with `cache_shardings`."""
    if batch % model.data_parallel_size:
        raise ValueError(f"a cache of {batch} rows cannot be split over the {model.data_parallel_size} "
                         f"data-parallel groups of this layout; use a multiple of {model.data_parallel_size}.")
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if max_positions is not None and max_length > max_positions:
        raise ValueError(f"a cache of {max_length} tokens is longer than the model's {max_positions} positions "
                         "(config.max_position_embeddings); generate fewer tokens or shorten the prompt.")
    length = bucket_length(max_length) if bucket else max_length
    if max_positions is not None:
        length = min(length, max_positions)
    dtype = jnp.dtype(dtype or model.dtype)
    shardings = cache_shardings(model, batch, length)

    entries = model.layer_stack.cache_entries()
    slots = {key: ring_length(model, layer, length) or length for key, layer, _ in entries}
    key_heads, value_heads = model.cache_heads()

    # jnp.zeros straight into each sharding: created on the devices, one cached program per shape.
    def per_layer(key, rows, heads, sharding):
        return jnp.zeros((rows, batch, slots[key], *heads), dtype, device=sharding)

    return KVCache(
        keys={key: per_layer(key, rows, key_heads, shardings.keys[key]) for key, _, rows in entries},
        values={key: per_layer(key, rows, value_heads, shardings.values[key]) for key, _, rows in entries},
        key_mask=jnp.zeros((batch, length), jnp.int32, device=shardings.key_mask),
        length=jnp.zeros((), jnp.int32, device=shardings.length),
        window_masks={key: jnp.zeros((batch, slots[key]), jnp.int32, device=sharding)
                      for key, sharding in shardings.window_masks.items()},
    )
