"""Attention over a sequence split between context-parallel devices (`distributed.context`).

Each device holds its slice of the queries, keys and values, in the zig-zag context order, and beside every
token what the masks compare: its original index, its document (packed rows), the start its Llama 4 attention
chunks count from (`chunk_origins`), and whether it is a real token. Two strategies see the other slices' keys:

    all_gather  gather every slice's keys and values (and their facts), then attend as one device would: the
                right choice for few KV heads (GQA, MLA's latent-expanded keys are not gathered twice)
    ring        pass the keys and values around the ring with `ppermute`, one hop per step, each rank's block
                attended as it arrives. With the zig-zag order a block pair is either whole, half (the other
                half is causally masked and skipped) or the local diagonal, so every rank does the same work.

Both attend in blocks of `CONTEXT_BLOCK` queries and keys, in two passes (`block_attention`: the softmax's
statistics, then the normalised values), each block recomputed for the backward pass and a block no query of it
can see skipped, so memory grows with the local slice, not with [S, S]. A query that sees no key at all (a padding
row) gets finite, meaningless output, as in `attention_core` (the ring's: from the blocks it computed).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..distributed.activations import LogicalAxisRules
from ..distributed.context import ContextLayout
from .block_attention import EMPTY_MAX, Masking, heads_last, key_lse, weighted_values, with_sinks

# Query and key rows of one block of logits: [B, K, G, 512, 512] float32 in flight, whatever the sequence.
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


def _gathered(q, k, v, *facts_and_sinks, layout: ContextLayout, masking: Masking):
    """The all_gather strategy, on one device's slice: q [B, Sl, N, D], k, v [B, Sl, K, D] -> [B, Sl, N, Dv]."""
    facts, sinks = facts_and_sinks[:4], (facts_and_sinks[4] if len(facts_and_sinks) > 4 else None)
    gather = partial(jax.lax.all_gather, axis_name=layout.axes, axis=1, tiled=True)
    keys, values, key_facts = gather(k), gather(v), tuple(gather(x) for x in facts)
    lse = with_sinks(key_lse(masking, q, facts, keys, key_facts), sinks, k.shape[2])
    return heads_last(weighted_values(masking, q, facts, keys, values, key_facts, lse), v.dtype)


def _ring(q, k, v, *facts_and_sinks, layout: ContextLayout, masking: Masking):
    """The ring strategy, on one device's slice (its zig-zag chunks r and 2 cp - 1 - r): q [B, Sl, N, D], k, v
    [B, Sl, K, D] -> [B, Sl, N, Dv].

    One trip around the ring brings every rank's keys; at step s they are rank r - s's, whose chunk src is
    earlier than r's (every query sees their early half only) or later (only the late queries see anything)."""
    facts, sinks = facts_and_sinks[:4], (facts_and_sinks[4] if len(facts_and_sinks) > 4 else None)
    cp, rank, half = layout.size, layout.rank(), q.shape[1] // 2
    early = lambda x, axis=1: jax.lax.slice_in_dim(x, 0, half, axis=axis)  # noqa: E731
    late = lambda x, axis=1: jax.lax.slice_in_dim(x, half, 2 * half, axis=axis)  # noqa: E731
    pad = lambda x, value: jnp.concatenate([jnp.full_like(x, value), x], axis=3)  # noqa: E731
    shift = [(i, (i + 1) % cp) for i in range(cp)]
    arrivals = [(k, v, *facts)]
    for _ in range(1, cp):
        arrivals.append(tuple(jax.lax.ppermute(array, layout.axes, shift) for array in arrivals[-1]))
    earlier = [(rank - step) % cp < rank for step in range(cp)]

    lse = key_lse(masking, q, facts, k, facts)            # step 0: the local diagonal
    for step in range(1, cp):
        k_step, _, *key_facts = arrivals[step]
        from_earlier = lambda k_step=k_step, key_facts=key_facts: key_lse(  # noqa: E731
            masking, q, facts, early(k_step), tuple(map(early, key_facts)))
        from_later = lambda k_step=k_step, key_facts=key_facts: pad(key_lse(  # noqa: E731
            masking, late(q), tuple(map(late, facts)), k_step, tuple(key_facts)), EMPTY_MAX)
        lse = jnp.logaddexp(lse, jax.lax.cond(earlier[step], from_earlier, from_later))
    lse = with_sinks(lse, sinks, k.shape[2])

    out = weighted_values(masking, q, facts, k, v, facts, lse)
    for step in range(1, cp):
        k_step, v_step, *key_facts = arrivals[step]
        from_earlier = lambda k_step=k_step, v_step=v_step, key_facts=key_facts: weighted_values(  # noqa: E731
            masking, q, facts, early(k_step), early(v_step), tuple(map(early, key_facts)), lse)
        from_later = lambda k_step=k_step, v_step=v_step, key_facts=key_facts: pad(weighted_values(  # noqa: E731
            masking, late(q), tuple(map(late, facts)), k_step, v_step, tuple(key_facts), late(lse, axis=3)), 0.0)
        out = out + jax.lax.cond(earlier[step], from_earlier, from_later)
    return heads_last(out, v.dtype)


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
        masking = Masking(float(q.shape[-1] ** -0.5 if scale is None else scale), sliding_window,
                          attention_chunk_size, query_chunk_size or CONTEXT_BLOCK)
        core = partial(STRATEGY_CORES[self.layout.strategy], layout=self.layout, masking=masking)
        batch_entry, heads_entry = self._entries(q, k)
        heads = self.layout.sequence_spec(batch_entry, heads_entry, None)
        rows = self.layout.sequence_spec(batch_entry)
        in_specs = (heads, heads, heads, *(rows for _ in facts)) + (() if sinks is None else (P(heads_entry),))
        # The facts are the same in every layer: through a barrier with q, so XLA cannot hoist the masks they make
        # out of a scan over layers (it did: every block pair's mask at once, [Q/C, T/C, ..., C, C]).
        q, *facts = jax.lax.optimization_barrier((q, *facts))
        arguments = (q, k, v, *facts) + (() if sinks is None else (sinks,))
        return self.layout.shard_sequence(core, arguments, in_specs, heads)
