"""Expert sort, row gather and unpermute, including their gather-only gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.ops.permute import gather_rows, invert_permutation, sort_by_expert, take_rows, unpermute

NUM_TOKENS, TOP_K, NUM_EXPERTS, HIDDEN = 13, 3, 5, 6


def _routing(seed=0, with_sentinels=False):
    rng = np.random.default_rng(seed)
    high = NUM_EXPERTS + 1 if with_sentinels else NUM_EXPERTS
    return rng.integers(0, high, size=(NUM_TOKENS, TOP_K)).astype(np.int32)


def _rand(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("with_sentinels", [False, True])
def test_sort_by_expert_is_stable_and_counts_only_real_experts(with_sentinels):
    top_k_index = _routing(seed=1, with_sentinels=with_sentinels)
    order, group_sizes = sort_by_expert(jnp.asarray(top_k_index), NUM_EXPERTS)
    flat = top_k_index.reshape(-1)
    np.testing.assert_array_equal(np.asarray(order), np.argsort(flat, kind="stable"))
    np.testing.assert_array_equal(
        np.asarray(group_sizes), np.bincount(flat, minlength=NUM_EXPERTS + 1)[:NUM_EXPERTS]
    )
    assert order.dtype == jnp.int32 and group_sizes.dtype == jnp.int32
    # Sentinel pairs are the tail, after every counted row.
    assert np.all(flat[np.asarray(order)][int(group_sizes.sum()) :] == NUM_EXPERTS)


def test_invert_permutation():
    order = np.random.default_rng(2).permutation(17).astype(np.int32)
    inverse = np.asarray(invert_permutation(jnp.asarray(order)))
    np.testing.assert_array_equal(inverse[order], np.arange(17))


def test_gather_rows_value_and_gradient_match_plain_indexing():
    order, _ = sort_by_expert(jnp.asarray(_routing(seed=3)), NUM_EXPERTS)
    x = _rand((NUM_TOKENS, HIDDEN), seed=4)
    cotangent = _rand((NUM_TOKENS * TOP_K, HIDDEN), seed=5)

    def plain(x):
        return x[order // TOP_K]

    got, got_vjp = jax.vjp(lambda x: gather_rows(x, order, TOP_K), x)
    want, want_vjp = jax.vjp(plain, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(
        np.asarray(got_vjp(cotangent)[0]), np.asarray(want_vjp(cotangent)[0]), rtol=1e-6, atol=1e-6
    )


def test_gather_rows_backward_has_no_scatter():
    order, _ = sort_by_expert(jnp.asarray(_routing(seed=3)), NUM_EXPERTS)
    x = _rand((NUM_TOKENS, HIDDEN), seed=4)
    grad_fn = jax.grad(lambda x, order: jnp.sum(gather_rows(x, order, TOP_K) ** 2))
    # The program JAX hands to XLA (the suite's XLA:CPU flags expand scatters into loops when compiling).
    program = str(jax.make_jaxpr(grad_fn)(x, order))
    scatters = [line.strip() for line in program.splitlines() if "= scatter" in line]
    # The only scatter allowed is the int32 one inside invert_permutation;
    # plain x[order // K] becomes an f32 scatter-add here.
    float_scatters = [line for line in scatters if ":f32[" in line]
    assert not float_scatters, float_scatters
    assert any(":i32[" in line for line in scatters), program


def test_unpermute_value_and_gradients_match_plain_version():
    top_k_index = jnp.asarray(_routing(seed=6))
    order, _ = sort_by_expert(top_k_index, NUM_EXPERTS)
    y_sorted = _rand((NUM_TOKENS * TOP_K, HIDDEN), seed=7)
    weights = _rand((NUM_TOKENS, TOP_K), seed=8)
    cotangent = _rand((NUM_TOKENS, HIDDEN), seed=9)

    def plain(y_sorted, weights):
        y_pairs = jnp.zeros_like(y_sorted).at[order].set(y_sorted)
        return jnp.sum(y_pairs.reshape(NUM_TOKENS, TOP_K, HIDDEN) * weights[..., None], axis=1)

    got, got_vjp = jax.vjp(lambda y, w: unpermute(y, order, w), y_sorted, weights)
    want, want_vjp = jax.vjp(plain, y_sorted, weights)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    for g, w in zip(got_vjp(cotangent), want_vjp(cotangent), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("weights_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_unpermute_sums_in_fp32_for_low_precision_operands(weights_dtype):
    """bf16 expert outputs with fp32 (Mixtral), bf16 (Qwen3-MoE in bf16) or fp16 routing weights: products and
    the sum over K run in fp32 and come back in fp32, so the caller rounds once. A bf16 or fp16 sum would be off
    by ~1e-3 here."""
    order, _ = sort_by_expert(jnp.asarray(_routing(seed=10)), NUM_EXPERTS)
    y_sorted = _rand((NUM_TOKENS * TOP_K, HIDDEN), seed=11).astype(jnp.bfloat16)
    weights = _rand((NUM_TOKENS, TOP_K), seed=12).astype(weights_dtype)
    out = unpermute(y_sorted, order, weights)
    assert out.dtype == jnp.float32
    y_pairs = np.zeros((NUM_TOKENS * TOP_K, HIDDEN), np.float64)
    y_pairs[np.asarray(order)] = np.asarray(y_sorted.astype(jnp.float32))
    want = np.einsum("tkh,tk->th", y_pairs.reshape(NUM_TOKENS, TOP_K, HIDDEN), np.asarray(weights, np.float64))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6, atol=1e-6)


def _partial_injection(num_rows, copies, num_out, seed):
    """A random partial map from output rows to (row, copy) entries, each entry read at most once, and its
    inverse; out-of-range markers where an output row reads nothing / an entry is read by nobody."""
    rng = np.random.default_rng(seed)
    entries = rng.permutation(num_rows * copies)[:num_out]
    entries[rng.random(num_out) < 0.3] = -1  # output rows that read nothing
    index = np.where(entries >= 0, entries // copies, num_rows).astype(np.int32)
    inverse = np.full(num_rows * copies, num_out, np.int32)
    inverse[entries[entries >= 0]] = np.flatnonzero(entries >= 0)
    return index, inverse


@pytest.mark.parametrize("copies, num_out", [(1, 9), (3, 20), (3, 39)])
def test_take_rows_value_and_gradient_match_plain_indexing(copies, num_out):
    index, inverse = _partial_injection(NUM_TOKENS, copies, num_out, seed=copies + num_out)
    x = _rand((NUM_TOKENS, HIDDEN), seed=6)
    cotangent = _rand((num_out, HIDDEN), seed=7)

    def plain(x):  # rows past the end read zeros
        return jnp.concatenate([x, jnp.zeros((1, HIDDEN))])[np.minimum(index, NUM_TOKENS)]

    got, got_vjp = jax.vjp(lambda x: take_rows(x, jnp.asarray(index), jnp.asarray(inverse)), x)
    want, want_vjp = jax.vjp(plain, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.any(np.asarray(got)[index == NUM_TOKENS])
    np.testing.assert_allclose(np.asarray(got_vjp(cotangent)[0]), np.asarray(want_vjp(cotangent)[0]),
                               rtol=1e-6, atol=1e-6)
    program = str(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(take_rows(x, index, inverse) ** 2)))(x))
    assert "scatter" not in program, program


def test_take_rows_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"not a multiple of x's 13 rows"):
        take_rows(jnp.zeros((NUM_TOKENS, HIDDEN)), jnp.zeros((4,), jnp.int32), jnp.zeros((14,), jnp.int32))
    with pytest.raises(ValueError, match=r"x \[N, H\], index \[S\]"):
        take_rows(jnp.zeros((NUM_TOKENS,)), jnp.zeros((4,), jnp.int32), jnp.zeros((13,), jnp.int32))


def test_shape_errors_name_the_shapes():
    order, _ = sort_by_expert(jnp.asarray(_routing()), NUM_EXPERTS)
    with pytest.raises(ValueError, match=r"M = T \* K = 26"):
        gather_rows(jnp.zeros((NUM_TOKENS, HIDDEN)), order, top_k=2)
    with pytest.raises(ValueError, match=r"top_k_index must be \[T, K\]"):
        sort_by_expert(jnp.zeros((NUM_TOKENS,), jnp.int32), NUM_EXPERTS)
