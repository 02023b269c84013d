"""Moving (token, expert) pairs into expert order and back.

Shape letters: T tokens, K top-k, E experts, H hidden, M = T * K pair rows.

A token's K routing choices are "pairs", flattened token-major: pair p is token
p // K, choice p % K. `sort_by_expert` orders pairs by expert so each expert's
rows are contiguous for `grouped_matmul`; `gather_rows` builds those rows and
`unpermute` brings the results back to tokens.

Both directions are gathers in the forward pass, and `take_rows`'s custom VJP
keeps them gathers in the backward pass too: the default transpose of a gather is
a scatter-add, which serialises on XLA:CPU and is non-deterministic on GPU.
Because `order` is a permutation, every scatter here can be replaced by a gather
with the inverse permutation (the EP layer's dispatch buffers do the same with
partial, injective maps).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .accumulation import accumulating_einsum
from .varying import vary_like


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


@jax.custom_vjp
def _take_rows(x: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def _take_rows_fwd(x, index, inverse):
    return _take_rows(x, index, inverse), (inverse, x.shape[0])


def _take_rows_bwd(residuals, grad):
    inverse, num_rows = residuals
    # Output row i read (row, copy) index[i]; reading the gradient back by `inverse` hands every copy of a
    # row the gradient of the one output row that read it (zero if none did), and the copies add up.
    grad_copies = jnp.take(grad, inverse, axis=0, mode="fill", fill_value=0)
    grad_x = jnp.sum(jnp.reshape(grad_copies, (num_rows, inverse.shape[0] // num_rows, grad.shape[1])), axis=1)
    return grad_x, None, None


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def take_rows(x: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
    """Rows of `x` picked by an index that reads each row's copies at most once, with a gather as backward.

    x: [N, H]
    index: [S] int: output row i is x[index[i]]; an index >= N gives a zero row
    inverse: [N * R] int: for copy r of row n (entry n * R + r), the output row that read it (>= S: none)
    returns [S, H]

    Every output row reads at most one (row, copy) and no (row, copy) is read twice, so the transpose of this
    gather (a scatter-add, which serialises on XLA:CPU and is non-deterministic on GPU) is the gather
    grad[inverse] summed over each row's R copies. R > 1 sends a token's K routing choices to K places.
    """
    if x.ndim != 2 or index.ndim != 1 or inverse.ndim != 1:
        raise ValueError(f"take_rows needs x [N, H], index [S], inverse [N * R]; got shapes {x.shape}, "
                         f"{index.shape}, {inverse.shape}.")
    if inverse.shape[0] % x.shape[0]:
        raise ValueError(f"inverse has {inverse.shape[0]} entries, not a multiple of x's {x.shape[0]} rows: it "
                         "must hold, for every copy of every row of x, the output row that read it.")
    # Inside shard_map, rows of a value shared over an axis picked by an index that varies over it: marking x
    # varying first makes its gradient the sum over that axis (the mark's transpose), as a plain gather's is.
    return _take_rows(vary_like(x, index, inverse), index, inverse)


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
    # Sorted row i came from pair order[i]; in pair order a token's K copies sit next to each other.
    return take_rows(x, order // top_k, invert_permutation(order))


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
    y_pairs = take_rows(y_sorted, invert_permutation(order), order)
    y_pairs = jnp.reshape(y_pairs, (num_tokens, top_k, y_sorted.shape[1]))
    return accumulating_einsum("tkh,tk->th", y_pairs, top_k_weights)


def count_at_most(sorted_values: jax.Array, queries: jax.Array) -> jax.Array:
    """`jnp.searchsorted(sorted_values, queries, side="right")`: per query, how many values are <= it.

    sorted_values: [E] increasing; queries: [N] -> [N] int32. One [N, E] comparison (E is an expert count, small);
    jnp.searchsorted's own lowering fails on operands of mixed mesh variance (inside a pipeline stage's vmap)."""
    return jnp.sum(queries[:, None] >= sorted_values[None, :], axis=1, dtype=jnp.int32)
