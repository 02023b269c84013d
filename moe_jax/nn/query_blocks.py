"""Causal grouped-query self-attention by query blocks: each block of queries meets only the keys up to its end.

Shape letters: B batch, S queries = keys, N query heads, K key/value heads, G = N / K, D head dim, C block rows.

Over a whole sequence (training, prefill) a causal mask hides half of the [S, S] scores; computing them all and
masking them (`jax.nn.dot_product_attention`'s XLA path) spends half the dots and the softmax on nothing. Here
the queries go in blocks of C rows and block [s0, s1) is scored against keys [0, s1) only (a sliding window
also drops the keys before s0 - window + 1), so at 16 blocks about 47% of that work is skipped. A key/value
head's G query heads share its dots: each block's queries are laid out [B, K, G * C, D], one dot per key/value
head with G * C rows, instead of G dots of C rows or a key/value copy per query head.

Numerics are `jax.nn.dot_product_attention`'s XLA path: logits in float32 (or wider), masked logits set to
-0.7 * float32 max, softmax in float32, the weights cast to the keys' dtype for the value sum. A query that sees no
key at all (a left-padding row) gets what that path gives it, equal weights on every key of the sequence: the
mean of the values (HF's eager attention does the same).

On CPU this takes about half the time of `jax.nn.dot_product_attention` for one layer's forward and forward +
backward, and 32-row blocks measured best or level against 16- and 64-row ones (docs/benchmarks.md,
"Attention").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MIN_BLOCK_ROWS = 32
MAX_BLOCKS = 16   # bounds the program's size: longer sequences take longer blocks


def query_block_rows(seq: int) -> int:
    """C: 32 rows, or seq / MAX_BLOCKS (rounded up) when that is more."""
    return max(MIN_BLOCK_ROWS, -(-seq // MAX_BLOCKS))


def _logits_dtype(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def _block_visibility(start: int, end: int, first_key: int, groups: int, sliding_window: int | None) -> np.ndarray:
    """[G * C, end - first_key] bool (a trace-time constant): query s in [start, end) (its G heads' rows) sees key
    t in [first_key, end) when t <= s and, with a window, s - t < window."""
    query = np.arange(start, end)[:, None]
    key = np.arange(first_key, end)[None, :]
    visible = key <= query
    if sliding_window is not None:
        visible &= query - key < sliding_window
    return np.tile(visible, (groups, 1))


def causal_block_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
                           sliding_window: int | None = None, key_padding_mask: jax.Array | None = None,
                           block_rows: int | None = None) -> jax.Array:
    """Causal attention of a whole sequence with itself, query block by query block.

    q: [B, S, N, D]; k, v: [B, S, K, D] with N a multiple of K (query head n reads key/value head n // G)
    -> [B, S, N, D] in v's dtype
    sliding_window: keys visible per query, itself included (HF semantics), or None
    key_padding_mask: [B, S] bool, True for real tokens, or None
    block_rows: C, default `query_block_rows(S)`
    """
    batch, seq, heads, dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    block_rows = query_block_rows(seq) if block_rows is None else block_rows
    logits_dtype = _logits_dtype(q.dtype)
    masked_logit = -0.7 * float(jnp.finfo(jnp.float32).max)
    queries = q.reshape(batch, seq, kv_heads, groups, dim).transpose(0, 2, 3, 1, 4)   # [B, K, G, S, D]
    keys, values = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)                    # [B, K, S, D]
    blocks = []
    for start in range(0, seq, block_rows):
        end = min(start + block_rows, seq)
        first_key = 0 if sliding_window is None else max(0, start - sliding_window + 1)
        rows = end - start
        block_queries = queries[:, :, :, start:end].reshape(batch, kv_heads, groups * rows, dim)
        logits = jnp.einsum("bkmd,bktd->bkmt", block_queries, keys[:, :, first_key:end],
                            preferred_element_type=logits_dtype) * jnp.asarray(scale, logits_dtype)
        visible = jnp.asarray(_block_visibility(start, end, first_key, groups, sliding_window))
        if key_padding_mask is not None:
            visible = visible & key_padding_mask[:, None, None, first_key:end]                 # [B, 1, G*C, T']
        logits = jnp.where(visible, logits, masked_logit).astype(jnp.float32)
        weights = jax.nn.softmax(logits, axis=-1).astype(k.dtype)
        out = jnp.einsum("bkmt,bktd->bkmd", weights, values[:, :, first_key:end])
        blocks.append(out.reshape(batch, kv_heads, groups, rows, dim))
    out = jnp.concatenate(blocks, axis=3)                                                # [B, K, G, S, D]
    if key_padding_mask is not None:   # queries that see no key: equal weights on all S keys, as jax's path
        sees = _sees_a_key(key_padding_mask, sliding_window)[:, None, None, :, None]    # [B, 1, 1, S, 1]
        out = jnp.where(sees, out, jnp.mean(values, axis=2)[:, :, None, None, :].astype(out.dtype))
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, seq, heads, dim)


def _sees_a_key(key_padding_mask: jax.Array, sliding_window: int | None) -> jax.Array:
    """[B, S] bool: whether query s has a real key among those it may see ([s - window + 1, s], or [0, s])."""
    real_so_far = jnp.cumsum(key_padding_mask.astype(jnp.int32), axis=1)
    if sliding_window is not None:   # minus the real keys before the window
        real_so_far = real_so_far - jnp.pad(real_so_far, ((0, 0), (sliding_window, 0)))[:, :real_so_far.shape[1]]
    return real_so_far > 0
