"""Causal attention by query blocks against `jax.nn.dot_product_attention`'s XLA path (values and gradients), and
`attend`'s choice of it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax.nn.attention_core as attention_module
from moe_jax.nn.attention_core import attend
from moe_jax.nn.query_blocks import MAX_BLOCKS, MIN_BLOCK_ROWS, causal_block_attention, query_block_rows

from tests.heavy import HEAVY


def _qkv(seq, heads, kv_heads, dim=8, batch=2, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, seq, heads, dim)), dtype)
    k = jnp.asarray(rng.standard_normal((batch, seq, kv_heads, dim)), dtype)
    v = jnp.asarray(rng.standard_normal((batch, seq, kv_heads, dim)), dtype)
    return q, k, v


def _xla(q, k, v, sliding_window=None, key_padding_mask=None):
    window = None if sliding_window is None else (sliding_window - 1, 0)
    mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, local_window_size=window,
                                        implementation="xla", scale=q.shape[-1] ** -0.5)


# [B=2, S=13] padding masks: left padding (its first queries see no key), right padding, holes.
PADDING = {
    "none": None,
    "left": np.arange(13)[None, :] >= np.array([[5], [0]]),
    "right": np.arange(13)[None, :] < np.array([[13], [7]]),
    "holes": np.random.default_rng(3).random((2, 13)) < 0.6,
}


def _value_and_grads(fn, q, k, v):
    cotangent = jnp.cos(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape).astype(q.dtype)
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(cotangent))


SEQUENCES = [(13, 4), (16, 4), (5, 8), (40, None), (33, 32)]   # (seq, block_rows)
HEADS = [(4, 4), (6, 2), (4, 1)]                                 # (heads, kv_heads)
WINDOWS = [None, 1, 6]


def covering_cases() -> list:
    """The whole grid, with the suite running a Latin square of it: every pair of a sequence, a head grouping and a
    window once (15 of 45 cases); --heavy runs the rest."""
    cases = []
    for i, sequence in enumerate(SEQUENCES):
        for j, heads in enumerate(HEADS):
            for k, window in enumerate(WINDOWS):
                marks = () if k == (i + j) % len(WINDOWS) else HEAVY
                cases.append(pytest.param(*sequence, *heads, window, marks=marks))
    return cases


@pytest.mark.parametrize("seq, block_rows, heads, kv_heads, sliding_window", covering_cases())
def test_blocks_equal_the_xla_path_values_and_gradients(seq, block_rows, heads, kv_heads, sliding_window):
    q, k, v = _qkv(seq, heads, kv_heads)
    blocked = functools.partial(causal_block_attention, scale=q.shape[-1] ** -0.5, sliding_window=sliding_window,
                                block_rows=block_rows)
    got = jax.jit(functools.partial(_value_and_grads, blocked))(q, k, v)
    want = jax.jit(functools.partial(_value_and_grads, functools.partial(_xla, sliding_window=sliding_window)))(
        q, k, v)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("padding", PADDING)
@pytest.mark.parametrize("sliding_window", [None, 4])
def test_padding_masks_equal_the_xla_path_even_for_queries_that_see_no_key(padding, sliding_window):
    q, k, v = _qkv(13, 6, 2)
    mask = None if PADDING[padding] is None else jnp.asarray(PADDING[padding])
    blocked = functools.partial(causal_block_attention, scale=q.shape[-1] ** -0.5, sliding_window=sliding_window,
                                key_padding_mask=mask, block_rows=4)
    xla = functools.partial(_xla, sliding_window=sliding_window, key_padding_mask=mask)
    got = jax.jit(functools.partial(_value_and_grads, blocked))(q, k, v)
    want = jax.jit(functools.partial(_value_and_grads, xla))(q, k, v)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_follows_the_xla_path(dtype):
    """Logits and softmax in fp32, weights cast to the keys' dtype for the value sum (fp16 widened on CPU by
    `attend`), gradients in the operands' dtypes."""
    q, k, v = _qkv(24, 4, 2, dtype=dtype)
    got = jax.jit(functools.partial(_value_and_grads, functools.partial(attend, implementation="blocked")))(q, k, v)
    want = jax.jit(functools.partial(_value_and_grads, functools.partial(attend, implementation="xla")))(q, k, v)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert g.dtype == w.dtype == dtype, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2e-2, atol=2e-2,
                                   err_msg=name)


def test_block_rows_grow_with_the_sequence_so_the_block_count_stays_bounded():
    assert query_block_rows(1) == MIN_BLOCK_ROWS
    assert query_block_rows(128) == MIN_BLOCK_ROWS
    assert query_block_rows(MIN_BLOCK_ROWS * MAX_BLOCKS) == MIN_BLOCK_ROWS
    assert query_block_rows(4096) == 4096 // MAX_BLOCKS
    assert query_block_rows(4097) == 4096 // MAX_BLOCKS + 1
    for seq in (1, 100, 513, 4097, 10000):
        assert -(-seq // query_block_rows(seq)) <= MAX_BLOCKS


def test_attend_takes_query_blocks_on_cpu_for_a_whole_causal_sequence(monkeypatch):
    calls = []
    blocked = attention_module.causal_block_attention
    monkeypatch.setattr(attention_module, "causal_block_attention",
                        lambda *a, **k: calls.append(k.get("sliding_window")) or blocked(*a, **k))
    q, k, v = _qkv(12, 4, 2)
    expected = _xla(q, k, v)
    assert jax.default_backend() == "cpu"
    np.testing.assert_allclose(np.asarray(attend(q, k, v)), np.asarray(expected), rtol=2e-5, atol=2e-5)
    attend(q, k, v, sliding_window=4)
    assert calls == [None, 4]
    attend(q, k, v, key_padding_mask=jnp.ones((2, 12), bool))
    assert calls == [None, 4, None]
    # The other paths: jax's XLA path by name, queries against more keys, packed documents.
    attend(q, k, v, implementation="xla")
    attend(q[:, -3:], k, v)
    attend(q, k, v, segment_ids=jnp.ones((2, 12), jnp.int32))
    assert calls == [None, 4, None]
