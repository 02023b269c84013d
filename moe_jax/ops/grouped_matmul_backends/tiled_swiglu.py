"""The experts' whole gate/up -> activation -> down chain in one tile loop, forward and backward.

Shape letters: M rows (sorted by expert), H hidden, I intermediate, E experts, R tile rows.

The same values as `tiled_grouped_matmul(act_glu(tiled_grouped_matmul(x, gate_up)), down)`, visit for visit
(the same `plan_tile_schedules`, the same window dots in the same order), without what chaining two loops
costs between them: the [M, 2I] gate/up product zero-filled, masked into place and split, the activation as a
separate pass over it, and in the backward pass the [M, I] and [M, 2I] gradients written out, joined and read
back by the next loop (four loops there, one here). Each visit computes its window's

    h = x_w @ gate_up[e].T   [R, 2I]      a = act(h[:, :I]) * h[:, I:]   [R, I]      y_w = a @ down[e].T   [R, H]

and keeps its chunk's rows of y_w. Under differentiation the forward pass also keeps h (rows in place, [M, 2I])
for the backward pass, whose visits recompute a from it (elementwise) and take the four dots of the chain's
VJP; weight gradients sum per expert in the accumulation dtype, as the tiled grouped matmul's do.

The loops run expert by expert, each over that expert's visits (the schedule lists them in expert order): an
expert's two weights are read out of the [E, ...] stacks once, not once per visit, and its weight gradients sum
in a loop carry written once (a faster train step than one loop over all visits, forward level).

Against the chained loops (`python scripts/bench/ab_train_step.py fused-swiglu [--forward]`; docs/benchmarks.md,
"Train-step choices") the forward and the train step are faster on one device and on fsdp4/ep4. The backward gains least on two cores: the chain's
input-gradient and weight-gradient loops are independent and XLA:CPU runs them side by side, this loop's dots
one after another.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ..accumulation import accumulation_dtype
from ..varying import vary_like
from .tile_plan import TileVisits, plan_tile_schedules
from .tiled_scan import (
    default_remainder_rows,
    default_tile_rows,
    keep_chunk_rows,
    set_chunk_rows,
    window_times_weight,
    window_weight_grad,
)

Activation = Callable[[jax.Array], jax.Array]


def gated(h: jax.Array, act: Activation) -> jax.Array:
    """h: [M, 2I] (gate columns, then up) -> act(h[:, :I]) * h[:, I:]: [M, I]."""
    gate, up = jnp.split(h, 2, axis=-1)
    return act(gate) * up


def _window(array: jax.Array, v: TileVisits, rows: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(array, v.window_start, rows, axis=0)


class _ExpertVisits(NamedTuple):
    """One schedule's visits with where each expert's run of them starts and how long it is (both [E])."""

    visits: TileVisits
    rows: int
    first: jax.Array
    count: jax.Array


def _by_expert(schedules, num_experts: int) -> list[_ExpertVisits]:
    """The schedules' live visits come in expert order: each expert's are one run."""
    runs = []
    for visits, rows in schedules:
        owner = jnp.where(visits.live, visits.expert, num_experts)
        count = jnp.sum(owner[None, :] == jnp.arange(num_experts, dtype=owner.dtype)[:, None], axis=1,
                        dtype=jnp.int32)
        runs.append(_ExpertVisits(visits, rows, jnp.cumsum(count) - count, count))
    return runs


def _experts_with_visits(runs: list[_ExpertVisits], num_experts: int) -> tuple[jax.Array, jax.Array]:
    """-> (order [E]: the experts with visits first, in expert order, then the rest; how many have visits)."""
    visits = sum(run.count for run in runs)
    order = jnp.argsort(visits == 0, stable=True).astype(jnp.int32)
    return order, jnp.sum(visits > 0, dtype=jnp.int32)


def _over_expert_visits(visit, carry, run: _ExpertVisits, expert):
    """visit(carry, v) for each of expert's visits in `run`, in order."""
    first = run.first[expert]
    return lax.fori_loop(first, first + run.count[expert],
                         lambda i, carry: visit(carry, jax.tree.map(lambda a: a[i], run.visits)), carry)


def _forward(x, gate_up, down, group_sizes, act, tile_rows, remainder_rows, keep_h: bool):
    """-> (y [M, H], h [M, 2I] or None). Experts in an outer loop, so each expert's weights are read out of the
    stacks once, not once per visit."""
    num_experts = gate_up.shape[0]
    schedules = plan_tile_schedules(group_sizes, x.shape[0], tile_rows, remainder_rows)
    visited = [v for v, _ in schedules]
    y = vary_like(jnp.zeros((x.shape[0], down.shape[1]), down.dtype), x, gate_up, down, *visited)
    h_rows = (vary_like(jnp.zeros((x.shape[0], gate_up.shape[1]), gate_up.dtype), x, gate_up, *visited)
              if keep_h else None)
    runs = _by_expert(schedules, num_experts)

    def expert_visits(expert, carry):
        w_gate_up = lax.dynamic_index_in_dim(gate_up, expert, axis=0, keepdims=False)
        w_down = lax.dynamic_index_in_dim(down, expert, axis=0, keepdims=False)
        for run in runs:
            def visit(carry, v: TileVisits, rows=run.rows):
                y, h_rows = carry
                h = window_times_weight(_window(x, v, rows), w_gate_up, "in_features", gate_up.dtype)
                a = gated(h, act).astype(down.dtype)
                y = set_chunk_rows(y, window_times_weight(a, w_down, "in_features", down.dtype), v, rows)
                if h_rows is not None:
                    h_rows = set_chunk_rows(h_rows, h, v, rows)
                return y, h_rows

            carry = _over_expert_visits(visit, carry, run, expert)
        return carry

    # Only experts with rows: decoding a few tokens touches top-k of them, and every expert the loop enters
    # copies its two weights out of the stacks (E = 128, one token: 8 experts' copies instead of 128).
    order, entered = _experts_with_visits(runs, num_experts)
    return lax.fori_loop(0, entered, lambda i, carry: expert_visits(order[i], carry), (y, h_rows))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _tiled_swiglu(x, gate_up, down, group_sizes, act, tile_rows, remainder_rows):
    return _forward(x, gate_up, down, group_sizes, act, tile_rows, remainder_rows, keep_h=False)[0]


def _tiled_swiglu_fwd(x, gate_up, down, group_sizes, act, tile_rows, remainder_rows):
    y, h_rows = _forward(x, gate_up, down, group_sizes, act, tile_rows, remainder_rows, keep_h=True)
    return y, (x, gate_up, down, group_sizes, h_rows)


def _tiled_swiglu_bwd(act, tile_rows, remainder_rows, residuals, grad_y):
    x, gate_up, down, group_sizes, h_rows = residuals
    num_experts = gate_up.shape[0]
    schedules = plan_tile_schedules(group_sizes, x.shape[0], tile_rows, remainder_rows)
    visited = [v for v, _ in schedules]
    runs = _by_expert(schedules, num_experts)
    gate_up_sum = accumulation_dtype(x.dtype, gate_up.dtype)
    down_sum = accumulation_dtype(down.dtype, grad_y.dtype)
    grad_x = vary_like(jnp.zeros(x.shape, gate_up.dtype), x, gate_up, down, grad_y, *visited)

    def expert_grads(grad_x, expert):
        """-> (grad_x with this expert's rows, (its gate_up gradient, its down gradient))."""
        w_gate_up = lax.dynamic_index_in_dim(gate_up, expert, axis=0, keepdims=False)
        w_down = lax.dynamic_index_in_dim(down, expert, axis=0, keepdims=False)
        grad_gate_up = vary_like(jnp.zeros(w_gate_up.shape, gate_up_sum), x, gate_up, grad_y, *visited)
        grad_down = vary_like(jnp.zeros(w_down.shape, down_sum), h_rows, down, grad_y, *visited)
        carry = (grad_x, grad_gate_up, grad_down)
        for run in runs:
            def visit(carry, v: TileVisits, rows=run.rows):
                grad_x, grad_gate_up, grad_down = carry
                # Rows outside the chunk belong to other experts: zeroed here, they add nothing below.
                g = keep_chunk_rows(_window(grad_y, v, rows), v, rows)                       # [R, H]
                h = _window(h_rows, v, rows)                                                  # [R, 2I]
                a, gated_vjp = jax.vjp(lambda h: gated(h, act).astype(down.dtype), h)        # [R, I]
                grad_down = grad_down + window_weight_grad(g, a, down_sum)
                grad_a = window_times_weight(g, w_down, "out_features", down.dtype)          # [R, I]
                (grad_h,) = gated_vjp(grad_a)                                                 # [R, 2I]
                grad_gate_up = grad_gate_up + window_weight_grad(grad_h, _window(x, v, rows), gate_up_sum)
                grad_x_window = window_times_weight(grad_h, w_gate_up, "out_features", gate_up.dtype)
                return set_chunk_rows(grad_x, grad_x_window, v, rows), grad_gate_up, grad_down

            carry = _over_expert_visits(visit, carry, run, expert)
        grad_x, grad_gate_up, grad_down = carry
        return grad_x, (grad_gate_up, grad_down)

    grad_x, (grad_gate_up, grad_down) = lax.scan(expert_grads, grad_x, jnp.arange(num_experts))
    return grad_x.astype(x.dtype), grad_gate_up.astype(gate_up.dtype), grad_down.astype(down.dtype), None


_tiled_swiglu.defvjp(_tiled_swiglu_fwd, _tiled_swiglu_bwd)


def tiled_swiglu_mlp(
    x: jax.Array, gate_up: jax.Array, down: jax.Array, group_sizes: jax.Array, *, act: Activation = jax.nn.silu,
    tile_rows: int | None = None, remainder_rows: int | str | None = "auto",
) -> jax.Array:
    """Each row's expert MLP, `down[e] @ (act(gate[e] @ x) * (up[e] @ x))`, over rows sorted by expert.

    x: [M, H] rows sorted by group
    gate_up: [E, 2I, H] (HF's fused [gate; up] in [experts, out, in] layout)
    down: [E, H, I]
    group_sizes: [E] int32
    returns [M, H] in result_type(x, gate_up, down); rows past sum(group_sizes) are 0

    Dtypes as the chained grouped matmuls: h and the activation in result_type(x, gate_up), the down
    projection in result_type(that, down). tile_rows / remainder_rows as `tiled_grouped_matmul`'s.
    """
    inner = jnp.result_type(x.dtype, gate_up.dtype)
    outer = jnp.result_type(inner, down.dtype)
    if x.shape[0] == 0:
        return jnp.zeros((0, down.shape[1]), outer)
    if tile_rows is None:
        tile_rows = default_tile_rows(x.shape[0], gate_up.shape[0])
    if remainder_rows == "auto":
        remainder_rows = default_remainder_rows(tile_rows)
    return _tiled_swiglu(x.astype(inner), gate_up.astype(inner), down.astype(outer),
                         group_sizes.astype(jnp.int32), act, tile_rows, remainder_rows)
