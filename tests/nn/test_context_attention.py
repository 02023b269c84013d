"""Attention split over cp ranks equals one device's `attend`, for both strategies and every mask the families use."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from moe_jax.distributed.context import ContextLayout
from moe_jax.nn.attention_core import attend
from moe_jax.nn.context_attention import ContextAttention

B, S, N, K, D = 2, 32, 4, 2, 8


def context_layout(strategy: str, cp: int = 4) -> ContextLayout:
    mesh = Mesh(np.asarray(jax.devices()[:2 * cp]).reshape(2, cp), ("efsdp", "cp"))
    return ContextLayout(mesh, ("cp",), cp, strategy)


def inputs(seed: int = 0, value_width: int = D):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (B, S, N, D))
    k = jax.random.normal(keys[1], (B, S, K, D))
    v = jax.random.normal(keys[2], (B, S, K, value_width))
    return q, k, v, jax.random.normal(keys[3], (N,))


def split_attend(layout, q, k, v, *, key_padding_mask=None, segment_ids=None, **options):
    """`attend` through `ContextAttention`: inputs and output in the natural order."""
    order = layout.to_context_order
    out = jax.jit(lambda q, k, v, m, s: ContextAttention(layout).attend(
        q, k, v, key_padding_mask=m, segment_ids=s, **options))(
        order(q), order(k), order(v), None if key_padding_mask is None else order(key_padding_mask),
        None if segment_ids is None else order(segment_ids))
    return layout.to_natural_order(out)


LEFT_PADDED = np.ones((B, S), np.int32)
LEFT_PADDED[1, :5] = 0
PACKED = np.repeat(np.asarray([[1] * 11 + [2] * 14 + [3] * 5 + [0] * 2, [1] * 32]), 1, axis=0).astype(np.int32)

CASES = {
    "causal": {},
    "left padding": dict(key_padding_mask=LEFT_PADDED),
    "sliding window": dict(key_padding_mask=LEFT_PADDED, sliding_window=6),
    "sinks": dict(sliding_window=6, sinks=True),
    "chunked, left padding": dict(key_padding_mask=LEFT_PADDED, attention_chunk_size=6),
    "packed, chunked": dict(key_padding_mask=(PACKED > 0).astype(np.int32), segment_ids=PACKED,
                            attention_chunk_size=4),
}


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.parametrize("case", list(CASES))
def test_each_strategy_equals_one_devices_attention(strategy, case):
    q, k, v, sinks = inputs()
    options = dict(CASES[case])
    if options.pop("sinks", False):
        options["sinks"] = sinks
    expected = attend(q, k, v, **options)
    got = split_attend(context_layout(strategy), q, k, v, **options)
    seen = options.get("key_padding_mask", np.ones((B, S))).astype(bool)   # rows that see a key
    np.testing.assert_allclose(np.asarray(got)[seen], np.asarray(expected)[seen], atol=2e-6)


def test_the_ring_on_eight_ranks_and_both_in_blocks_of_four_tokens_equal_one_device():
    """Blocks of 4 (`query_chunk_size`): causally later key blocks and those before the window are skipped."""
    q, k, v, sinks = inputs(1)
    options = dict(key_padding_mask=LEFT_PADDED, sliding_window=7, sinks=sinks)
    expected = attend(q, k, v, **options)
    mesh = Mesh(np.asarray(jax.devices()), ("cp",))
    ring = split_attend(ContextLayout(mesh, ("cp",), 8, "ring"), q, k, v, **options)
    blocked = [split_attend(context_layout(strategy), q, k, v, query_chunk_size=4, **options)
               for strategy in ("all_gather", "ring")]
    seen = LEFT_PADDED.astype(bool)
    for got in (ring, *blocked):
        np.testing.assert_allclose(np.asarray(got)[seen], np.asarray(expected)[seen], atol=2e-6)


@pytest.mark.parametrize("block", [None, 4])
@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_gradients_equal_one_devices(strategy, block):
    """Block 4: the backward passes' loops over blocks, with skipped pairs and a padded row."""
    q, k, v, sinks = inputs(2)
    weights = jax.random.normal(jax.random.key(9), (B, S, N, D)) * LEFT_PADDED[:, :, None, None]
    layout = context_layout(strategy)

    def loss(split, q, k, v, sinks):
        options = dict(sliding_window=9, sinks=sinks, key_padding_mask=LEFT_PADDED)
        if not split:
            return jnp.sum(attend(q, k, v, **options) * weights)
        order = layout.to_context_order
        out = ContextAttention(layout).attend(order(q), order(k), order(v), query_chunk_size=block,
                                              **{**options, "key_padding_mask": order(LEFT_PADDED)})
        return jnp.sum(layout.to_natural_order(out) * weights)

    expected = jax.grad(lambda *a: loss(False, *a), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    got = jax.jit(jax.grad(lambda *a: loss(True, *a), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=2e-5)


def test_a_kv_cache_query_is_refused():
    layout = context_layout("ring")
    q, k, v, _ = inputs()
    with pytest.raises(ValueError, match="a KV cache's queries are not split over cp"):
        ContextAttention(layout).attend(q, k, v, query_index=jnp.arange(S))


def test_every_strategy_the_config_accepts_has_a_core():
    from moe_jax.distributed.config import CP_STRATEGIES
    from moe_jax.nn.context_attention import STRATEGY_CORES

    assert tuple(STRATEGY_CORES) == CP_STRATEGIES
