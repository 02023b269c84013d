"""Moving (token, expert) pairs into expert order and back.

Shape letters: T tokens, K top-k, E experts, H hidden, M = T * K pair rows.

A token's K routing choices are "pairs", flattened token-major: pair p is token
p // K, choice p % K. `sort_by_expert` orders pairs by expert so each expert's
rows are contiguous for `grouped_matmul`; `gather_rows` builds those rows and
`unpermute` brings the results back to tokens.

Both directions are gathers in the forward pass, and the custom VJPs below keep
them gathers in the backward pass too: the default transpose of a gather is a
scatter-add, which serialises on XLA:CPU and is non-deterministic on GPU.
Because `order` is a permutation, every scatter here can be replaced by a gather
with the inverse permutation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .accumulation import accumulating_einsum


def _check_order(order: jax.Array, num_pairs: int, what: str) -> None:
    if order.ndim != 1 or order.shape[0] != num_pairs:
        raise ValueError(
            f"order must be [M] with M = T * K = {num_pairs} ({what}), got shape {order.shape}; "
            "pass the `order` returned by sort_by_expert for the same top_k_index."
        )


def sort_by_expert(top_k_index: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Stable expert order of the (token, choice) pairs, and each expert's row count.

    top_k_index: [T, K] int, values in [0, E]; E (or more) is the "not mine" sentinel
    returns (order: [M] int32 with M = T * K, group_sizes: [E] int32)

    `order[i]` is the flat pair index (token * K + choice) of sorted row i. Pairs of
    the same expert keep token order (stable sort), so results are deterministic.
    Sentinel pairs sort after every real expert and are left out of
    `group_sizes`, which is how `grouped_matmul` learns to treat them as padding.
    """
    if top_k_index.ndim != 2:
        raise ValueError(f"top_k_index must be [T, K], got shape {top_k_index.shape}.")
    flat_expert = jnp.reshape(top_k_index, (-1,)).astype(jnp.int32)
    order = jnp.argsort(flat_expert, stable=True).astype(jnp.int32)
    # mode="drop" discards sentinel ids (>= E): those pairs are nobody's rows here.
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat_expert].add(1, mode="drop")
    return order, group_sizes


def invert_permutation(order: jax.Array) -> jax.Array:
    """inverse[order[i]] = i.

    order: [M] int, a permutation of 0..M-1
    returns inverse: [M] int32
    """
    num_rows = order.shape[0]
    positions = jnp.arange(num_rows, dtype=jnp.int32)
    # A scatter of M integers, far cheaper than the [M, H] scatter-add it replaces.
    return jnp.zeros((num_rows,), jnp.int32).at[order].set(positions, unique_indices=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gather_rows(x: jax.Array, order: jax.Array, top_k: int) -> jax.Array:
    return jnp.take(x, order // top_k, axis=0)


def _gather_rows_fwd(x, order, top_k):
    return _gather_rows(x, order, top_k), order


def _gather_rows_bwd(top_k, order, grad_rows):
    num_pairs, hidden = grad_rows.shape
    # Sorted row i came from pair order[i]; reading rows back in pair order puts
    # a token's K copies next to each other, and their gradients simply add up.
    grad_pairs = jnp.take(grad_rows, invert_permutation(order), axis=0)
    grad_x = jnp.sum(jnp.reshape(grad_pairs, (num_pairs // top_k, top_k, hidden)), axis=1)
    return grad_x, None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def gather_rows(x: jax.Array, order: jax.Array, top_k: int) -> jax.Array:
    """The token row of every sorted pair: x[order // top_k].

    x: [T, H]
    order: [M] int with M = T * K, a permutation (from `sort_by_expert`)
    returns [M, H]

    Backward is a gather with the inverse permutation plus a sum over K instead
    of a scatter-add.
    """
    if x.ndim != 2:
        raise ValueError(f"x must be [T, H], got shape {x.shape}.")
    _check_order(order, x.shape[0] * top_k, f"T={x.shape[0]}, K={top_k}")
    return _gather_rows(x, order, top_k)


@jax.custom_vjp
def _take_permuted(rows: jax.Array, permutation: jax.Array, inverse: jax.Array) -> jax.Array:
    return jnp.take(rows, permutation, axis=0)


def _take_permuted_fwd(rows, permutation, inverse):
    return _take_permuted(rows, permutation, inverse), inverse


def _take_permuted_bwd(inverse, grad):
    # Transpose of reading rows[permutation[i]] is reading grad[inverse[j]].
    return jnp.take(grad, inverse, axis=0), None, None


_take_permuted.defvjp(_take_permuted_fwd, _take_permuted_bwd)


def unpermute(y_sorted: jax.Array, order: jax.Array, top_k_weights: jax.Array) -> jax.Array:
    """Weighted sum of every token's K expert outputs, back in token order.

    y_sorted: [M, H] rows in `order` (M = T * K)
    order: [M] int, from `sort_by_expert`
    top_k_weights: [T, K]
    returns [T, H] in `accumulation_dtype` of y_sorted and top_k_weights (at least fp32)

    out[t] = sum_k top_k_weights[t, k] * y_sorted[i] where order[i] = t * K + k.
    The products and the sum over K run in at least fp32 (bf16 outputs with bf16
    or fp32 weights alike), as every EP implementation's combine does; casting
    back to the hidden dtype, once, is the caller's step.
    """
    if top_k_weights.ndim != 2:
        raise ValueError(f"top_k_weights must be [T, K], got shape {top_k_weights.shape}.")
    num_tokens, top_k = top_k_weights.shape
    if y_sorted.ndim != 2:
        raise ValueError(f"y_sorted must be [M, H], got shape {y_sorted.shape}.")
    _check_order(order, num_tokens * top_k, f"top_k_weights is [{num_tokens}, {top_k}]")
    if y_sorted.shape[0] != order.shape[0]:
        raise ValueError(
            f"y_sorted has {y_sorted.shape[0]} rows but order has {order.shape[0]}; "
            "pass the rows produced from gather_rows(x, order, top_k)."
        )
    inverse = invert_permutation(order)
    y_pairs = _take_permuted(y_sorted, inverse, order)
    y_pairs = jnp.reshape(y_pairs, (num_tokens, top_k, y_sorted.shape[1]))
    return accumulating_einsum("tkh,tk->th", y_pairs, top_k_weights)


def count_at_most(sorted_values: jax.Array, queries: jax.Array) -> jax.Array:
    """`jnp.searchsorted(sorted_values, queries, side="right")`: per query, how many values are <= it.

    sorted_values: [E] increasing; queries: [N] -> [N] int32. One [N, E] comparison (E is an expert count, small);
    jnp.searchsorted's own lowering fails on operands of mixed mesh variance (inside a pipeline stage's vmap)."""
    return jnp.sum(queries[:, None] >= sorted_values[None, :], axis=1, dtype=jnp.int32)
