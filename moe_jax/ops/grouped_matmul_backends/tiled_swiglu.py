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

Against the chained loops (`python scripts/ab_train_step.py fused-swiglu [--forward]`, docs/benchmarks.md, 2-core
CPU): bench_vs_reference's model forward 129 -> 118 ms and train step 456 -> 447 ms on one device, 436 -> 414 ms on
fsdp4/ep4; its large size forward and train step 6% faster. The backward gains least on two cores: the chain's
input-gradient and weight-gradient loops are independent and XLA:CPU runs them side by side, this loop's dots
one after another.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from ..accumulation import accumulation_dtype
from ..varying import vary_like
from .tile_plan import TileVisits, over_live_visits, plan_tile_schedules
from .tiled_scan import (
    add_expert_grad,
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


def _expert(w: jax.Array, v: TileVisits) -> jax.Array:
    return lax.dynamic_index_in_dim(w, v.expert, axis=0, keepdims=False)


def _forward(x, gate_up, down, group_sizes, act, tile_rows, remainder_rows, keep_h: bool):
    """-> (y [M, H], h [M, 2I] or None)."""
    schedules = plan_tile_schedules(group_sizes, x.shape[0], tile_rows, remainder_rows)
    visited = [v for v, _ in schedules]
    y = vary_like(jnp.zeros((x.shape[0], down.shape[1]), down.dtype), x, gate_up, down, *visited)
    h_rows = (vary_like(jnp.zeros((x.shape[0], gate_up.shape[1]), gate_up.dtype), x, gate_up, *visited)
              if keep_h else None)
    for visits, rows in schedules:
        def visit(carry, v: TileVisits, rows=rows):
            y, h_rows = carry
            h = window_times_weight(_window(x, v, rows), _expert(gate_up, v), "in_features", gate_up.dtype)
            a = gated(h, act).astype(down.dtype)
            y = set_chunk_rows(y, window_times_weight(a, _expert(down, v), "in_features", down.dtype), v, rows)
            if h_rows is not None:
                h_rows = set_chunk_rows(h_rows, h, v, rows)
            return y, h_rows

        y, h_rows = over_live_visits(visit, (y, h_rows), visits)
    return y, h_rows


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _tiled_swiglu(x, gate_up, down, group_sizes, act, tile_rows, remainder_rows):
    return _forward(x, gate_up, down, group_sizes, act, tile_rows, remainder_rows, keep_h=False)[0]


def _tiled_swiglu_fwd(x, gate_up, down, group_sizes, act, tile_rows, remainder_rows):
    y, h_rows = _forward(x, gate_up, down, group_sizes, act, tile_rows, remainder_rows, keep_h=True)
    return y, (x, gate_up, down, group_sizes, h_rows)


def _tiled_swiglu_bwd(act, tile_rows, remainder_rows, residuals, grad_y):
    x, gate_up, down, group_sizes, h_rows = residuals
    schedules = plan_tile_schedules(group_sizes, x.shape[0], tile_rows, remainder_rows)
    visited = [v for v, _ in schedules]
    grad_x = vary_like(jnp.zeros(x.shape, gate_up.dtype), x, gate_up, down, grad_y, *visited)
    grad_gate_up = vary_like(
        jnp.zeros(gate_up.shape, accumulation_dtype(x.dtype, gate_up.dtype)), x, gate_up, grad_y, *visited)
    grad_down = vary_like(
        jnp.zeros(down.shape, accumulation_dtype(down.dtype, grad_y.dtype)), h_rows, down, grad_y, *visited)
    for visits, rows in schedules:
        def visit(carry, v: TileVisits, rows=rows):
            grad_x, grad_gate_up, grad_down = carry
            # Rows outside the chunk belong to other experts: zeroed here, they add nothing below.
            g = keep_chunk_rows(_window(grad_y, v, rows), v, rows)                       # [R, H]
            h = _window(h_rows, v, rows)                                                  # [R, 2I]
            a, gated_vjp = jax.vjp(lambda h: gated(h, act).astype(down.dtype), h)        # [R, I]
            grad_down = add_expert_grad(grad_down, window_weight_grad(g, a, grad_down.dtype), v.expert)
            grad_a = window_times_weight(g, _expert(down, v), "out_features", down.dtype)  # [R, I]
            (grad_h,) = gated_vjp(grad_a)                                                 # [R, 2I]
            grad_gate_up = add_expert_grad(
                grad_gate_up, window_weight_grad(grad_h, _window(x, v, rows), grad_gate_up.dtype), v.expert)
            grad_x_window = window_times_weight(grad_h, _expert(gate_up, v), "out_features", gate_up.dtype)
            return set_chunk_rows(grad_x, grad_x_window, v, rows), grad_gate_up, grad_down

        grad_x, grad_gate_up, grad_down = over_live_visits(visit, (grad_x, grad_gate_up, grad_down), visits)
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
