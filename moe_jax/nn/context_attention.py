"""Attention over a sequence split between context-parallel devices (`distributed.context`).

Each device holds its slice of the queries, keys and values, in the zig-zag context order, and beside every
token what the masks compare: its original index, its document (packed rows), the start its Llama 4 attention
chunks count from (`chunk_origins`), and whether it is a real token. Two strategies see the other slices' keys:

    all_gather  gather every slice's keys and values (and their facts), then attend as one device would: the
                right choice for few KV heads (GQA, MLA's latent-expanded keys are not gathered twice)
    ring        pass the keys and values around the ring with `ppermute`, one hop per step, while the current
                block is attended; an online softmax merges the blocks. With the zig-zag order a block pair is
                either whole, half (the other half is causally masked and skipped) or the local diagonal, so
                every rank does the same work each step.

Both run flash-style: blocks of `CONTEXT_BLOCK` queries against blocks of as many keys with an online softmax,
each block recomputed for the backward pass and a block no query of it can see (causally later, or before the
window) skipped, so the scores in flight are one block's whatever the sequence length. A query that sees no key
at all (a padding row) gets finite, meaningless output, as in `attention_core` (here: from the blocks computed).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..distributed.activations import LogicalAxisRules
from ..distributed.context import ContextLayout
from ..ops.varying import vary_like
from .attention_core import MASKED_LOGIT

# Below MASKED_LOGIT: a running max no block has raised yet weighs nothing once one does.
_EMPTY_MAX = -float(jnp.finfo(jnp.float32).max)
# Query and key rows of one block of scores: [B, K, G, 512, 512] float32 in flight, whatever the sequence.
CONTEXT_BLOCK = 512


def chunk_origins(index: jax.Array, valid: jax.Array, segments: jax.Array | None) -> jax.Array:
    """The index each token's attention chunks count from, in any order of the tokens: its document's first token
    in a packed row, else its row's first real token (`visibility_mask`'s chunk rule).

    index: [S] each slot's original index; valid: [B, S] 1 = real token; segments: [B, S] packed rows' document
    ids or None -> [B, S] int32"""
    batch, length = valid.shape
    index = jnp.broadcast_to(index.astype(jnp.int32)[None, :], (batch, length))
    if segments is None:
        first_real = jnp.min(jnp.where(valid > 0, index, length), axis=1)
        return jnp.broadcast_to(first_real[:, None], (batch, length))
    groups = (jnp.arange(batch, dtype=jnp.int32)[:, None] * (length + 1) + segments).reshape(-1)
    firsts = jax.ops.segment_min(index.reshape(-1), groups, num_segments=batch * (length + 1))
    return firsts[groups].reshape(batch, length)


def token_visibility(queries: tuple, keys: tuple, sliding_window: int | None, chunk_size: int | None) -> jax.Array:
    """queries: (index, segment, origin, valid) each [B, Sq]; keys: the same [B, Tk] -> [B, 1, Sq, Tk] bool: the
    rules of `attention_core.visibility_mask` on each token's own facts instead of its slot."""
    q_index, q_segment, q_origin, _ = (array[:, :, None] for array in queries)
    k_index, k_segment, k_origin, k_valid = (array[:, None, :] for array in keys)
    visible = (k_index <= q_index) & (q_segment == k_segment) & (k_valid > 0)
    if sliding_window is not None:
        visible &= k_index > q_index - sliding_window
    if chunk_size is not None:
        visible &= (k_index - k_origin) // chunk_size == (q_index - q_origin) // chunk_size
    return visible[:, None]


def _block_partial(q, query_facts, k, v, key_facts, *, scale, sliding_window, chunk_size):
    """One query block against one key block: (running max [B, K, G, Sq], sum [B, K, G, Sq], weighted values
    [B, K, G, Sq, Dv]) in float32. q: [B, Sq, N, D]; k: [B, Tk, K, D]; v: [B, Tk, K, Dv]."""
    batch, length, heads, dim = q.shape
    kv_heads = k.shape[2]
    grouped = q.reshape(batch, length, kv_heads, heads // kv_heads, dim)
    logits = jnp.einsum("bskgd,btkd->bkgst", grouped, k, preferred_element_type=jnp.float32) * scale
    mask = token_visibility(query_facts, key_facts, sliding_window, chunk_size)
    logits = jnp.where(mask[:, :, None], logits, MASKED_LOGIT)
    running_max = jnp.max(logits, axis=-1)
    weights = jnp.exp(logits - running_max[..., None])
    values = jnp.einsum("bkgst,btkd->bkgsd", weights, v.astype(jnp.float32))
    return running_max, jnp.sum(weights, axis=-1), values


def _merge(first, second):
    """Two blocks' online-softmax partials of the same queries -> one."""
    (max_a, sum_a, out_a), (max_b, sum_b, out_b) = first, second
    new_max = jnp.maximum(max_a, max_b)
    scale_a, scale_b = jnp.exp(max_a - new_max), jnp.exp(max_b - new_max)
    return new_max, sum_a * scale_a + sum_b * scale_b, out_a * scale_a[..., None] + out_b * scale_b[..., None]


def _in_blocks(x: jax.Array, size: int) -> jax.Array:
    """x: [B, L, ...] -> [L / size, B, size, ...]."""
    return x.reshape(x.shape[0], x.shape[1] // size, size, *x.shape[2:]).swapaxes(0, 1)


def _block_size(length: int, block: int) -> int:
    """The block rows for `length` tokens: `block` where it divides them, else all of them."""
    return block if length > block and length % block == 0 else length


def _partials(q, query_facts, k, v, key_facts, *, scale, sliding_window, chunk_size, block):
    """Flash-style online softmax of q against k, v: query blocks (`lax.map`) against key blocks (`lax.scan`) of
    `block` tokens, each recomputed for the backward pass, and a key block that no query of the block can see
    (all later, or all before the window) skipped -> the partials of `_block_partial` for all of q."""
    attend_block = jax.checkpoint(partial(_block_partial, scale=scale, sliding_window=sliding_window,
                                          chunk_size=chunk_size))
    query_size, key_size = _block_size(q.shape[1], block), _block_size(k.shape[1], block)
    if query_size == q.shape[1] and key_size == k.shape[1]:   # one block: no loops
        return attend_block(q, tuple(query_facts), k, v, tuple(key_facts))
    key_blocks = (_in_blocks(k, key_size), _in_blocks(v, key_size), *(_in_blocks(x, key_size) for x in key_facts))

    def one_query_block(inputs):
        q_block, *facts = inputs
        first, last = jnp.min(facts[0]), jnp.max(facts[0])
        batch, length, heads = q_block.shape[:3]
        kv_heads = k.shape[2]
        shape = (batch, kv_heads, heads // kv_heads, length)
        empty = tuple(vary_like(x, q_block, k, v, *facts, *key_facts) for x in (
            jnp.full(shape, _EMPTY_MAX), jnp.zeros(shape), jnp.zeros((*shape, v.shape[-1]))))

        def step(running, block_inputs):
            k_block, v_block, *block_facts = block_inputs
            seen = jnp.min(block_facts[0]) <= last
            if sliding_window is not None:
                seen &= jnp.max(block_facts[0]) > first - sliding_window
            update = lambda: _merge(running, attend_block(q_block, tuple(facts), k_block, v_block,  # noqa: E731
                                                          tuple(block_facts)))
            return jax.lax.cond(seen, update, lambda: running), None

        return jax.lax.scan(step, empty, key_blocks)[0]

    partials = jax.lax.map(one_query_block, (_in_blocks(q, query_size),
                                             *(_in_blocks(x, query_size) for x in query_facts)))
    # [Q blocks, B, K, G, C, ...] -> [B, K, G, Sq, ...]
    return tuple(jnp.moveaxis(x, 0, 3).reshape(*x.shape[1:4], -1, *x.shape[5:]) for x in partials)


def _finish(partials, sinks, kv_heads: int, dtype) -> jax.Array:
    """Merged partials -> [B, Sq, N, Dv] in `dtype`; sinks: gpt-oss's [N] sink logits (one more softmax column per
    head, no value) or None."""
    row_max, row_sum, out = partials
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, kv_heads, -1, 1)
        top = jnp.maximum(row_max, sink)
        keep = jnp.exp(row_max - top)
        out = out * (keep / (row_sum * keep + jnp.exp(sink - top)))[..., None]
    else:
        out = out / row_sum[..., None]
    batch, _, _, length, width = out.shape
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, -1, width).astype(dtype)


def _gathered(q, k, v, *facts_and_sinks, layout: ContextLayout, mask_options: dict, block: int):
    """The all_gather strategy, on one device's slice: q [B, Sl, N, D], k, v [B, Sl, K, D] -> [B, Sl, N, Dv]."""
    facts, sinks = facts_and_sinks[:4], (facts_and_sinks[4] if len(facts_and_sinks) > 4 else None)
    gather = partial(jax.lax.all_gather, axis_name=layout.axes, axis=1, tiled=True)
    partials = _partials(q, facts, gather(k), gather(v), tuple(gather(x) for x in facts), block=block,
                         **mask_options)
    return _finish(partials, sinks, k.shape[2], v.dtype)


def _ring(q, k, v, *facts_and_sinks, layout: ContextLayout, mask_options: dict, block: int):
    """The ring strategy, on one device's slice (its zig-zag chunks r and 2 cp - 1 - r): q [B, Sl, N, D], k, v
    [B, Sl, K, D] -> [B, Sl, N, Dv]."""
    facts, sinks = facts_and_sinks[:4], (facts_and_sinks[4] if len(facts_and_sinks) > 4 else None)
    cp, rank, half = layout.size, layout.rank(), q.shape[1] // 2
    attend = partial(_partials, block=block, **mask_options)
    late = lambda x: x[:, half:]  # noqa: E731
    early = lambda x: x[:, :half]  # noqa: E731

    def from_earlier(kv):   # its chunk src < r: every query sees the early half of the keys only
        k_block, v_block, *key_facts = kv
        return attend(q, facts, early(k_block), early(v_block), tuple(map(early, key_facts)))

    def from_later(kv):     # src > r: only the late queries see anything, all of the keys
        k_block, v_block, *key_facts = kv
        row_max, row_sum, out = attend(late(q), tuple(map(late, facts)), k_block, v_block, tuple(key_facts))
        pad = lambda x, value: jnp.concatenate([jnp.full_like(x, value), x], axis=3)  # noqa: E731
        return pad(row_max, _EMPTY_MAX), pad(row_sum, 0.0), pad(out, 0.0)

    kv = (k, v, *facts)
    shift = [(i, (i + 1) % cp) for i in range(cp)]
    running = attend(q, facts, k, v, facts)            # step 0: the local diagonal
    for step in range(1, cp):
        kv = tuple(jax.lax.ppermute(array, layout.axes, shift) for array in kv)   # now from rank - step
        source = (rank - step) % cp
        running = _merge(running, jax.lax.cond(source < rank, from_earlier, from_later, kv))
    return _finish(running, sinks, k.shape[2], v.dtype)


STRATEGY_CORES = {"all_gather": _gathered, "ring": _ring}


@dataclass(frozen=True)
class ContextAttention:
    """`attend` for one step under context parallelism: the model's layout and this batch's token facts."""

    layout: ContextLayout
    rules: LogicalAxisRules | None = None   # the model's: batch and heads split as its activations are

    def _entries(self, q: jax.Array, k: jax.Array) -> tuple:
        """(batch entry, heads entry) of the shard_map's specs: heads split only where q's and k's heads split
        over the same tp axes (a query head then finds its key/value head on its own device)."""
        if self.rules is None:
            return None, None
        batch = self.rules.spec(("batch",), q.shape[:1])[0]
        q_heads, k_heads = (self.rules.spec((None, name), x.shape[1:3])[1]
                            for name, x in (("heads", q), ("kv_heads", k)))
        return batch, q_heads if q_heads == k_heads else None

    def index(self, length: int) -> jax.Array:
        """[S] each slot's original index in the row (the context order)."""
        return jnp.asarray(self.layout.order(length), jnp.int32)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float | None = None,
               key_padding_mask: jax.Array | None = None, query_index: jax.Array | None = None,
               sliding_window: int | None = None, implementation: str | None = None,
               query_chunk_size: int | None = None, sinks: jax.Array | None = None,
               attention_chunk_size: int | None = None, segment_ids: jax.Array | None = None) -> jax.Array:
        """`attention_core.attend`'s arguments for a whole sequence in the context order, split over cp.

        q: [B, S, N, D]; k, v: [B, S, K, D]; key_padding_mask, segment_ids: [B, S] in the context order -> [B, S, N, D]
        """
        if query_index is not None:
            raise ValueError("context-parallel attention runs over a whole sequence (training, scoring): a KV "
                             "cache's queries are not split over cp.")
        batch, length = q.shape[:2]
        shape = (batch, length)
        valid = jnp.ones(shape, jnp.int32) if key_padding_mask is None else key_padding_mask.astype(jnp.int32)
        segments = jnp.zeros(shape, jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
        index = self.index(length)
        origin = (jnp.zeros(shape, jnp.int32) if attention_chunk_size is None else
                  chunk_origins(index, valid, segment_ids))
        facts = (jnp.broadcast_to(index[None, :], shape), segments, origin, valid)
        del implementation   # the strategies' own blocked core
        mask_options = dict(scale=q.shape[-1] ** -0.5 if scale is None else scale, sliding_window=sliding_window,
                            chunk_size=attention_chunk_size)
        core = partial(STRATEGY_CORES[self.layout.strategy], layout=self.layout, mask_options=mask_options,
                       block=query_chunk_size or CONTEXT_BLOCK)
        batch_entry, heads_entry = self._entries(q, k)
        heads = self.layout.sequence_spec(batch_entry, heads_entry, None)
        rows = self.layout.sequence_spec(batch_entry)
        in_specs = (heads, heads, heads, *(rows for _ in facts)) + (() if sinks is None else (P(heads_entry),))
        arguments = (q, k, v, *facts) + (() if sinks is None else (sinks,))
        return self.layout.shard_sequence(core, arguments, in_specs, heads)
