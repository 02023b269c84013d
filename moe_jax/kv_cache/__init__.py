"""The KV cache, in one place: the whole model's cache pytrees, each layer's view of them, and making, sizing,
placing and (for pages) bookkeeping them.

    caches.py       KVCache (generate: [L, B, T, K, D] per layer run, one length), PagedKVCache (continuous
                    batching: page pools [G, L, pages, P, K, D] + page tables), CacheStep (one step's use)
    layer_views.py  one layer's storage, made by CacheStep.view: ContiguousKV, RingKV (a sliding window's ring),
                    PagedKV, SegmentedPagedKV (flat tokens of several sequence kinds); attend(core, q, k, v)
    contiguous.py   init_cache, cache_shardings, bucket_length, ring_length
    paged.py        init_page_pools, pool_sharding, pool_bytes
    page_book.py    PageBook (the host's record of free, held and cached pages), page_digests, root_digest

Names: a `...Cache` is the whole model's pytree that a step takes and returns; a `...KV` is one layer's view of
it inside the step; `init_...` makes the arrays, `..._sharding(s)` places them. The model math reads a cache only
through `begin` / `CacheStep` / a view's `attend`; `moe_jax.inference` fills it (generate, continuous batching).
"""

from .caches import CacheStep, KVCache, PagedKVCache
from .contiguous import LENGTH_BUCKET, bucket_length, cache_shardings, init_cache, ring_length
from .layer_views import ContiguousKV, PagedKV, RingKV, SegmentedPagedKV, segment_token_index, segment_tokens
from .page_book import PageBook, page_digests, root_digest
from .paged import init_page_pools, pool_bytes, pool_sharding

__all__ = [
    "LENGTH_BUCKET", "CacheStep", "ContiguousKV", "KVCache", "PageBook", "PagedKV", "PagedKVCache", "RingKV",
    "SegmentedPagedKV", "bucket_length", "cache_shardings", "init_cache", "init_page_pools", "pool_bytes",
    "page_digests", "pool_sharding", "ring_length", "root_digest", "segment_token_index", "segment_tokens",
]
