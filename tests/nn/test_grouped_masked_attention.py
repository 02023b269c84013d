"""Attention under an explicit mask with a key/value head's query heads in one dot, against
`jax.nn.dot_product_attention`'s XLA path (values and gradients), and `attend`'s choice of it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax.nn.attention_core as attention_module
from moe_jax.nn.attention_core import attend, grouped_masked_attention, visibility_mask


def _qkv(queries, keys, heads, kv_heads, dim=8, batch=3, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, queries, heads, dim)), dtype)
    k = jnp.asarray(rng.standard_normal((batch, keys, kv_heads, dim)), dtype)
    v = jnp.asarray(rng.standard_normal((batch, keys, kv_heads, dim)), dtype)
    return q, k, v


def _mask(queries, keys, batch=3, seed=1):
    """[B, 1, S, T]: random visibility, one query that sees nothing, one that sees every key."""
    mask = np.random.default_rng(seed).random((batch, 1, queries, keys)) < 0.5
    mask[0, 0, 0] = False
    mask[-1, 0, -1] = True
    return jnp.asarray(mask)


def _value_and_grads(fn, q, k, v):
    cotangent = jnp.sin(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape).astype(q.dtype)
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(cotangent))


@pytest.mark.parametrize("queries, keys", [(1, 37), (5, 16), (12, 12)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (4, 1)])
def test_equals_the_xla_path_values_and_gradients(queries, keys, heads, kv_heads):
    q, k, v = _qkv(queries, keys, heads, kv_heads)
    mask, scale = _mask(queries, keys), 0.3
    got = jax.jit(functools.partial(_value_and_grads, functools.partial(grouped_masked_attention, mask=mask,
                                                                        scale=scale)))(q, k, v)
    want = jax.jit(functools.partial(_value_and_grads, functools.partial(
        jax.nn.dot_product_attention, mask=mask, scale=scale, implementation="xla")))(q, k, v)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5, err_msg=name)
    # The query that sees no key gets equal weights on every key, as the XLA path gives it (no NaN).
    np.testing.assert_allclose(np.asarray(got[0][0, 0, 0]), np.asarray(jnp.mean(v[0, :, 0], axis=0)), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_equals_the_xla_path(dtype):
    q, k, v = _qkv(3, 20, 4, 2, dtype=dtype)
    mask = _mask(3, 20)
    got = attention_module._masked_attention(q, k, v, mask=mask, scale=0.35, implementation=None)
    want = attention_module._masked_attention(q, k, v, mask=mask, scale=0.35, implementation="xla")
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)


def test_sinks_take_probability_and_no_value():
    q, k, v = _qkv(2, 9, 4, 2)
    mask = _mask(2, 9)
    plain = grouped_masked_attention(q, k, v, mask=mask, scale=0.35)
    # A sink far below every logit changes nothing; one far above takes all the weight (output 0).
    low = grouped_masked_attention(q, k, v, mask=mask, scale=0.35, sinks=jnp.full((4,), -1e4))
    high = grouped_masked_attention(q, k, v, mask=mask, scale=0.35, sinks=jnp.full((4,), 1e4))
    np.testing.assert_allclose(np.asarray(low)[mask[:, 0].any(-1)], np.asarray(plain)[mask[:, 0].any(-1)],
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(high), 0.0, atol=1e-6)
    with pytest.raises(ValueError, match=r"sinks must be \[num_heads\] = \[4\]"):
        grouped_masked_attention(q, k, v, mask=mask, scale=0.35, sinks=jnp.zeros((2,)))


def test_attend_takes_it_on_cpu_for_masked_queries(monkeypatch):
    calls = []
    grouped = attention_module.grouped_masked_attention
    monkeypatch.setattr(attention_module, "grouped_masked_attention",
                        lambda *a, **kw: calls.append(a[0].shape) or grouped(*a, **kw))
    q, k, v = _qkv(12, 12, 4, 2)
    assert jax.default_backend() == "cpu"
    query_index = jnp.broadcast_to(jnp.arange(9, 12), (3, 3))
    padding = jnp.arange(12)[None, :] >= jnp.array([[0], [2], [5]])
    got = attend(q[:, 9:], k, v, query_index=query_index, key_padding_mask=padding, sliding_window=6)
    mask = visibility_mask(query_index, 12, key_padding_mask=padding, sliding_window=6)
    want = jax.nn.dot_product_attention(q[:, 9:], k, v, mask=mask, scale=8 ** -0.5, implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert calls == [(3, 3, 4, 8)]
    # Packed documents take it too; "xla" by name and whole causal sequences (query blocks) do not.
    attend(q, k, v, segment_ids=jnp.ones((3, 12), jnp.int32))
    attend(q[:, 9:], k, v, query_index=query_index, implementation="xla")
    attend(q, k, v)
    assert calls == [(3, 3, 4, 8), (3, 12, 4, 8)]


def test_a_models_attention_follows_its_devices_and_fused_takes_cudnn_where_it_takes_the_heads():
    from types import SimpleNamespace

    from moe_jax.nn.attention_core import attention_for_device, fused_kernel

    gpu = lambda capability: SimpleNamespace(platform="gpu", compute_capability=capability)  # noqa: E731
    assert [attention_for_device(device) for device in (gpu("9.0"), gpu("10.0"), gpu("7.5"))] == ["fused", "fused", None]
    assert attention_for_device(jax.devices("cpu")[0]) == "blocked" and attention_for_device(None) is None
    q = jnp.zeros((1, 16, 4, 128), jnp.bfloat16)
    assert fused_kernel(q, None) == fused_kernel(q.astype(jnp.float16), None) == "cudnn"
    assert fused_kernel(q.astype(jnp.float32), None) == "xla"
    assert fused_kernel(jnp.zeros((1, 16, 4, 192), jnp.bfloat16), None) == "xla"       # wider than 128
    assert fused_kernel(q, jnp.ones((1, 1, 1, 16), bool)) == "xla"                    # a padding mask


def test_fused_hands_a_whole_causal_sequence_to_cudnn_and_masked_attention_to_xla(monkeypatch):
    """"fused" (a model's step on a GPU) asks jax for "cudnn" for a whole unpadded causal sequence and for its XLA
    path under a padding mask; the results are the XLA path's."""
    asked, xla_attention = [], jax.nn.dot_product_attention

    def record(q, k, v, *, implementation=None, **options):
        asked.append(implementation)
        return xla_attention(q, k, v, implementation="xla", **options)

    monkeypatch.setattr(attention_module.jax.nn, "dot_product_attention", record)
    q, k, v = _qkv(8, 8, 4, 2, dim=16, dtype=jnp.bfloat16)
    fused = attend(q, k, v, implementation="fused")
    attend(q, k, v, key_padding_mask=jnp.ones((3, 8), bool), implementation="fused")
    assert asked == ["cudnn", "xla"]
    np.testing.assert_array_equal(np.asarray(fused, np.float32),
                                  np.asarray(attend(q, k, v, implementation="xla"), np.float32))
