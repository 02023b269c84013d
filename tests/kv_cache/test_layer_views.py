"""The KV storages of `moe_jax.kv_cache`: a step of flat tokens from sequences of several lengths
(`SegmentedPagedKV`) stores and attends exactly as separate `PagedKV` steps of each kind of sequence."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from moe_jax.kv_cache import PagedKV, SegmentedPagedKV, segment_token_index, segment_tokens
from moe_jax.nn.attention_core import attend

GROUPS, PAGES, PAGE, HEADS, KV_HEADS, DIM, WIDTH = 2, 12, 4, 4, 2, 8, 3


def test_segment_tokens_number_each_token_of_a_group():
    sequence, offset = segment_tokens(((2, 3), (3, 1)))
    assert sequence.tolist() == [0, 0, 0, 1, 1, 1, 2, 3, 4]
    assert offset.tolist() == [0, 1, 2, 0, 1, 2, 0, 0, 0]
    lengths = jnp.asarray([5, 0, 7, 8, 9, 1, 2, 3, 4, 5])   # 2 groups x 5 sequences
    assert segment_token_index(lengths, ((2, 3), (3, 1)), 2).tolist() == [
        5, 6, 7, 0, 1, 2, 7, 8, 9,
        1, 2, 3, 2, 3, 4, 3, 4, 5]


def test_a_mixed_step_equals_a_prefill_step_then_a_decode_step():
    """Per group: one prompt row of 3 tokens (the last padding) and 2 decoding rows (one idle). The mixed step's
    output rows and pools equal those of the prompt rows through `PagedKV`, then the decode rows through `PagedKV`
    on the pools the prompt step left (no row reads another's pages)."""
    rng = np.random.default_rng(0)
    pools = tuple(jnp.asarray(rng.normal(size=(GROUPS, 1, PAGES, PAGE, KV_HEADS, DIM)), jnp.float32)
                  for _ in range(2))
    segments = ((1, 3), (2, 1))
    # Sequences per group: prompt (2 stored, 2 new real), decoding (5 stored), idle (nothing).
    tables = jnp.asarray([[0, 1, 2], [3, 4, 5], [0, 0, 0], [6, 7, 8], [9, 10, 11], [0, 0, 0]], jnp.int32)
    lengths = jnp.asarray([2, 5, 0, 4, 9, 0], jnp.int32)
    real = np.asarray([1, 1, 0, 1, 0] * GROUPS, np.int32)[:, None]                 # [G * Ng, 1]
    tokens = real.shape[0]
    q = jnp.asarray(rng.normal(size=(tokens, 1, HEADS, DIM)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(tokens, 1, KV_HEADS, DIM)), jnp.float32) for _ in range(2))

    mixed, mixed_pools = SegmentedPagedKV(pools, tables, lengths, jnp.asarray(real), segments).attend(attend, q, k, v)

    def rows(array, part):   # [G * Ng, 1, ...] -> one kind of sequence's rows [G * n, s, ...]
        grouped = array.reshape(GROUPS, 5, *array.shape[2:])
        return (grouped[:, :3].reshape(GROUPS, 3, *array.shape[2:]) if part == "prompt" else
                grouped[:, 3:].reshape(GROUPS * 2, 1, *array.shape[2:]))

    prompt = PagedKV(pools, tables[jnp.asarray([0, 3])], lengths[jnp.asarray([0, 3])],
                     jnp.asarray(real.reshape(GROUPS, 5)[:, :3]))
    prompt_out, after_prompt = prompt.attend(attend, rows(q, "prompt"), rows(k, "prompt"), rows(v, "prompt"))
    decode_rows = jnp.asarray([1, 2, 4, 5])
    decode = PagedKV(after_prompt, tables[decode_rows], lengths[decode_rows], jnp.asarray(rows(real, "decode")))
    decode_out, after_decode = decode.attend(attend, rows(q, "decode"), rows(k, "decode"), rows(v, "decode"))

    grouped = mixed.reshape(GROUPS, 5, HEADS, DIM)
    np.testing.assert_allclose(grouped[:, :3], prompt_out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grouped[:, 3:].reshape(GROUPS * 2, 1, HEADS, DIM), decode_out, rtol=1e-6, atol=1e-6)
    for got, expected in zip(mixed_pools, after_decode):
        np.testing.assert_array_equal(got, expected)
    # The stored tokens landed where the prompt's and the decoding row's page tables say (group 1's prompt:
    # indices 4 and 5 -> page 7, offsets 0 and 1); nothing was written for padding or the idle slot.
    np.testing.assert_array_equal(mixed_pools[0][1, 0, 7, :2], k.reshape(GROUPS, 5, KV_HEADS, DIM)[1, :2])
    changed = np.argwhere(np.any(np.asarray(mixed_pools[0] != pools[0]), axis=(4, 5)))
    assert {tuple(int(i) for i in row) for row in changed} == {
        (0, 0, 0, 2), (0, 0, 0, 3), (0, 0, 4, 1), (1, 0, 7, 0), (1, 0, 7, 1), (1, 0, 11, 1)}


def test_first_index_is_each_flat_tokens_position():
    pools = tuple(jnp.zeros((GROUPS, 1, PAGES, PAGE, KV_HEADS, DIM)) for _ in range(2))
    storage = SegmentedPagedKV(pools, jnp.zeros((6, WIDTH), jnp.int32), jnp.asarray([2, 5, 0, 4, 9, 0]),
                               jnp.ones((10, 1), jnp.int32), ((1, 3), (2, 1)))
    assert storage.first_index.shape == (10, 1)
    assert storage.first_index[:, 0].tolist() == [2, 3, 4, 5, 0, 4, 5, 6, 9, 0]
