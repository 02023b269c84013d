"""Attention over blocks of keys in two passes, memory-bounded forward and backward, under explicit token masks.

Shape letters: B batch, Q queries, T keys, K key/value heads, G = N / K query heads per key/value head, D head
width, Dv value width, C block rows.

    pass 1  statistics: each query's running max and sum of exp(logit - max) over every key block
            -> the log-normaliser lse (gpt-oss's sink logit joins it)
    pass 2  values: sum over key blocks of exp(logit - lse) @ v, already normalised

Queries go in blocks of C (`lax.map`), keys in blocks of C (`lax.scan`), and each block's logits are recomputed
where the gradient needs them (`jax.checkpoint` on every block function), so no [Q, T] array and no per-block
copy of the [Q, Dv] accumulator is ever kept: the scans' carries are either small (pass 1's [Q] statistics) or
summed (pass 2's values, whose sum needs no residuals). A key block that no query of the query block can see
(causally later, or wholly before the sliding window) is skipped. The masks compare each token's facts
(`token_visibility`: index, document, chunk origin, real or padding), so any order of the tokens works.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from ..ops.varying import vary_like
from .attention_core import MASKED_LOGIT

# Below MASKED_LOGIT: a running max no block has raised yet weighs nothing once one does.
EMPTY_MAX = -float(jnp.finfo(jnp.float32).max)


def token_visibility(queries: tuple, keys: tuple, sliding_window: int | None, chunk_size: int | None) -> jax.Array:
    """queries: (index, segment, origin, valid) each [B, Q]; keys: the same [B, T] -> [B, 1, Q, T] bool: the
    rules of `attention_core.visibility_mask` on each token's own facts instead of its slot."""
    q_index, q_segment, q_origin, _ = (array[:, :, None] for array in queries)
    k_index, k_segment, k_origin, k_valid = (array[:, None, :] for array in keys)
    visible = (k_index <= q_index) & (q_segment == k_segment) & (k_valid > 0)
    if sliding_window is not None:
        visible &= k_index > q_index - sliding_window
    if chunk_size is not None:
        visible &= (k_index - k_origin) // chunk_size == (q_index - q_origin) // chunk_size
    return visible[:, None]


def block_logits(q, query_facts, k, key_facts, *, scale, sliding_window, chunk_size) -> jax.Array:
    """q: [B, Q, N, D]; k: [B, T, K, D] -> masked logits [B, K, G, Q, T] float32 (masked: MASKED_LOGIT)."""
    batch, length, heads, dim = q.shape
    kv_heads = k.shape[2]
    grouped = q.reshape(batch, length, kv_heads, heads // kv_heads, dim)
    logits = jnp.einsum("bskgd,btkd->bkgst", grouped, k, preferred_element_type=jnp.float32) * scale
    mask = token_visibility(query_facts, key_facts, sliding_window, chunk_size)
    return jnp.where(mask[:, :, None], logits, MASKED_LOGIT)


@dataclass(frozen=True)
class Masking:
    """The static options of one attention call: logit scale, masks, and the block rows."""

    scale: float
    sliding_window: int | None
    chunk_size: int | None
    block: int

    def logits(self, q, query_facts, k, key_facts):
        return block_logits(q, query_facts, k, key_facts, scale=self.scale, sliding_window=self.sliding_window,
                            chunk_size=self.chunk_size)

    def visible(self, query_facts, key_facts):
        return token_visibility(query_facts, key_facts, self.sliding_window, self.chunk_size)[:, :, None]

    def may_see(self, query_index, key_index):
        """Whether any query of a block can see any key of a block (else the pair is skipped)."""
        seen = jnp.min(key_index) <= jnp.max(query_index)
        if self.sliding_window is not None:
            seen &= jnp.max(key_index) > jnp.min(query_index) - self.sliding_window
        return seen


def _in_blocks(x: jax.Array, size: int, axis: int = 1) -> jax.Array:
    """x: [..., L, ...] (L at `axis`) -> [L / size, ..., size, ...]."""
    shape = x.shape[:axis] + (x.shape[axis] // size, size) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _joined(x: jax.Array, axis: int) -> jax.Array:
    """The inverse of `_in_blocks`: [L / C, ..., C, ...] -> [..., L, ...]."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def _block_size(length: int, block: int) -> int:
    """The block rows for `length` tokens: `block` where it divides them, else all of them."""
    return block if length > block and length % block == 0 else length


def _grouped(q: jax.Array, kv_heads: int) -> jax.Array:
    """[B, Q, N, D] -> [B, Q, K, G, D]."""
    return q.reshape(*q.shape[:2], kv_heads, q.shape[2] // kv_heads, q.shape[3])


def _forward_loops(masking: Masking, block_fn, q, query_facts, keys: tuple, key_facts, per_query: tuple, init,
                   combine):
    """block_fn(q block, its facts, *key block arrays, key block facts, *per-query block arrays) combined over the
    key blocks each query block may see, for every query block -> [B, K, G, Q, ...]. per_query: [B, K, G, Q, ...]."""
    query_size, key_size = _block_size(q.shape[1], masking.block), _block_size(keys[0].shape[1], masking.block)
    key_blocks = (*(_in_blocks(x, key_size) for x in keys), tuple(_in_blocks(x, key_size) for x in key_facts))

    def one_query_block(inputs):
        q_block, facts, extra = inputs

        def step(running, block_inputs):
            *key_block, block_facts = block_inputs
            update = lambda: combine(running, block_fn(q_block, facts, *key_block, block_facts, *extra))  # noqa: E731
            return jax.lax.cond(masking.may_see(facts[0], block_facts[0]), update, lambda: running), None

        start = jax.tree.map(lambda x: vary_like(x, q_block, *keys, *facts, *key_facts, *extra), init(q_block))
        return jax.lax.scan(step, start, key_blocks)[0]

    blocks = jax.lax.map(one_query_block, (_in_blocks(q, query_size),
                                           tuple(_in_blocks(x, query_size) for x in query_facts),
                                           tuple(_in_blocks(x, query_size, axis=3) for x in per_query)))
    return jax.tree.map(lambda x: _joined(x, 3), blocks)


def _backward_loops(masking: Masking, block_grads, q, query_facts, keys: tuple, key_facts, per_query: tuple):
    """The gradients of a blocked pass: block_grads(q block, facts, *key blocks, key facts, *per-query blocks) ->
    (per-query-block grads (dq [B, C, K, G, D], ...), per-key-block grads (dk, ...)), summed over the pairs each
    query block may see -> (per-query grads joined along Q, per-key grads [B, T, ...])."""
    query_size, key_size = _block_size(q.shape[1], masking.block), _block_size(keys[0].shape[1], masking.block)
    key_blocks = (*(_in_blocks(x, key_size) for x in keys), tuple(_in_blocks(x, key_size) for x in key_facts))
    q_blocks = (_in_blocks(q, query_size), tuple(_in_blocks(x, query_size) for x in query_facts),
                tuple(_in_blocks(x, query_size, axis=3) for x in per_query))
    probe = jax.eval_shape(block_grads, *(jax.tree.map(lambda x: x[0], q_blocks[:2])),
                           *(jax.tree.map(lambda x: x[0], key_blocks)), *(x[0] for x in q_blocks[2]))
    zeros = lambda tree, *like: jax.tree.map(  # noqa: E731
        lambda x: vary_like(jnp.zeros(x.shape, x.dtype), q, *keys, *per_query, *query_facts, *key_facts), tree)
    key_totals = tuple(jnp.zeros(key.shape[:2] + x.shape[2:], x.dtype) for key, x in zip(keys, probe[1]))

    def one_query_block(key_grads, inputs):
        q_block, facts, extra = inputs

        def step(query_grads, block_inputs):
            *key_block, block_facts = block_inputs

            def update():
                block_query, block_keys = block_grads(q_block, facts, *key_block, block_facts, *extra)
                return jax.tree.map(jnp.add, query_grads, block_query), block_keys

            skip = lambda: (query_grads, zeros(probe[1]))  # noqa: E731
            return jax.lax.cond(masking.may_see(facts[0], block_facts[0]), update, skip)

        query_grads, per_key_block = jax.lax.scan(step, zeros(probe[0]), key_blocks)
        key_grads = tuple(total + _joined(x, 1) for total, x in zip(key_grads, per_key_block))
        return key_grads, query_grads

    start = tuple(vary_like(x, q, *keys, *per_query) for x in key_totals)
    key_grads, query_grads = jax.lax.scan(one_query_block, start, q_blocks)
    return query_grads, key_grads


def _merge_statistics(first, second):
    """Two key sets' (max, sum) of the same queries -> those of both."""
    (max_a, sum_a), (max_b, sum_b) = first, second
    new_max = jnp.maximum(max_a, max_b)
    return new_max, sum_a * jnp.exp(max_a - new_max) + sum_b * jnp.exp(max_b - new_max)


# ---- pass 1: lse over a key set ------------------------------------------------------------------------------


def _key_lse_forward(masking: Masking, q, query_facts, k, key_facts):
    kv_heads = k.shape[2]

    def block_statistics(q_block, facts, k_block, block_facts):
        logits = masking.logits(q_block, facts, k_block, block_facts)
        row_max = jnp.max(logits, axis=-1)
        return row_max, jnp.sum(jnp.exp(logits - row_max[..., None]), axis=-1)

    def empty(q_block):
        shape = (q_block.shape[0], kv_heads, q_block.shape[2] // kv_heads, q_block.shape[1])
        return jnp.full(shape, EMPTY_MAX), jnp.zeros(shape)

    row_max, row_sum = _forward_loops(masking, block_statistics, q, query_facts, (k,), key_facts, (), empty,
                                      _merge_statistics)
    return row_max + jnp.log(row_sum)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def key_lse(masking: Masking, q, query_facts, k, key_facts) -> jax.Array:
    """Pass 1: log-sum-exp [B, K, G, Q] of each query's logits over the keys of k it sees. q: [B, Q, N, D]; k:
    [B, T, K, D]; facts: (index, segment, origin, valid) [B, Q] / [B, T]."""
    return _key_lse_forward(masking, q, query_facts, k, key_facts)


def _key_lse_fwd(masking, q, query_facts, k, key_facts):
    lse = _key_lse_forward(masking, q, query_facts, k, key_facts)
    return lse, (q, query_facts, k, key_facts, lse)


def _key_lse_bwd(masking, residuals, d_lse):
    q, query_facts, k, key_facts, lse = residuals
    kv_heads = k.shape[2]

    def block_grads(q_block, facts, k_block, block_facts, lse_block, d_lse_block):
        logits = masking.logits(q_block, facts, k_block, block_facts)
        d_logits = jnp.where(masking.visible(facts, block_facts),
                             jnp.exp(logits - lse_block[..., None]) * d_lse_block[..., None], 0.0) * masking.scale
        d_q = jnp.einsum("bkgst,btkd->bskgd", d_logits, k_block.astype(jnp.float32))
        d_k = jnp.einsum("bkgst,bskgd->btkd", d_logits, _grouped(q_block, kv_heads).astype(jnp.float32))
        return (d_q,), (d_k,)

    (d_q,), (d_k,) = _backward_loops(masking, block_grads, q, query_facts, (k,), key_facts, (lse, d_lse))
    d_q = _joined(d_q, 1).reshape(q.shape)
    return d_q.astype(q.dtype), None, d_k.astype(k.dtype), None


key_lse.defvjp(_key_lse_fwd, _key_lse_bwd)


# ---- pass 2: the normalised values ---------------------------------------------------------------------------


def _values_forward(masking: Masking, q, query_facts, k, v, key_facts, lse):
    kv_heads = k.shape[2]

    def block_values(q_block, facts, k_block, v_block, block_facts, lse_block):
        weights = jnp.exp(masking.logits(q_block, facts, k_block, block_facts) - lse_block[..., None])
        return jnp.einsum("bkgst,btkd->bkgsd", weights, v_block.astype(jnp.float32))

    def empty(q_block):
        return jnp.zeros((q_block.shape[0], kv_heads, q_block.shape[2] // kv_heads, q_block.shape[1], v.shape[-1]))

    return _forward_loops(masking, block_values, q, query_facts, (k, v), key_facts, (lse,), empty, jnp.add)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def weighted_values(masking: Masking, q, query_facts, k, v, key_facts, lse) -> jax.Array:
    """Pass 2: sum over the keys each query sees of exp(logit - lse) v -> [B, K, G, Q, Dv] float32."""
    return _values_forward(masking, q, query_facts, k, v, key_facts, lse)


def _values_fwd(masking, q, query_facts, k, v, key_facts, lse):
    return _values_forward(masking, q, query_facts, k, v, key_facts, lse), (q, query_facts, k, v, key_facts, lse)


def _values_bwd(masking, residuals, d_out):
    q, query_facts, k, v, key_facts, lse = residuals
    kv_heads = k.shape[2]

    def block_grads(q_block, facts, k_block, v_block, block_facts, lse_block, d_out_block):
        visible = masking.visible(facts, block_facts)
        weights = jnp.where(visible, jnp.exp(masking.logits(q_block, facts, k_block, block_facts)
                                             - lse_block[..., None]), 0.0)
        d_v = jnp.einsum("bkgst,bkgsd->btkd", weights, d_out_block)
        d_weights = jnp.einsum("bkgsd,btkd->bkgst", d_out_block, v_block.astype(jnp.float32))
        d_logits = weights * d_weights
        d_lse = -jnp.sum(d_logits, axis=-1)
        d_logits = d_logits * masking.scale
        d_q = jnp.einsum("bkgst,btkd->bskgd", d_logits, k_block.astype(jnp.float32))
        d_k = jnp.einsum("bkgst,bskgd->btkd", d_logits, _grouped(q_block, kv_heads).astype(jnp.float32))
        return (d_q, d_lse), (d_k, d_v)

    (d_q, d_lse), (d_k, d_v) = _backward_loops(masking, block_grads, q, query_facts, (k, v), key_facts,
                                                (lse, d_out))
    d_q = _joined(d_q, 1).reshape(q.shape)
    return (d_q.astype(q.dtype), None, d_k.astype(k.dtype), d_v.astype(v.dtype), None, _joined(d_lse, 3))


weighted_values.defvjp(_values_fwd, _values_bwd)


def with_sinks(lse: jax.Array, sinks: jax.Array | None, kv_heads: int) -> jax.Array:
    """lse [B, K, G, Q] with gpt-oss's [N] sink logits joined (one more softmax column per head that takes
    probability and no value), or as it is without sinks."""
    if sinks is None:
        return lse
    return jnp.logaddexp(lse, sinks.astype(jnp.float32).reshape(1, kv_heads, -1, 1))


def heads_last(out: jax.Array, dtype) -> jax.Array:
    """[B, K, G, Q, Dv] -> [B, Q, N, Dv] in `dtype`."""
    batch, _, _, length, width = out.shape
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, -1, width).astype(dtype)
