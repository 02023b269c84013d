"""The fused experts tile loop (`tiled_swiglu`) with LoRA updates on gate_up and / or down, forward and backward.

Shape letters: M rows (sorted by expert), H hidden, I intermediate, E experts, R tile rows, r LoRA rank.

Each visit computes its window's

    h = x_w Wgu_e^T + s (x_w Agu_e^T) Bgu_e^T     [R, 2I]      a = act(h[:, :I]) * h[:, I:]     [R, I]
    y_w = a Wd_e^T + s (a Ad_e^T) Bd_e^T           [R, H]

so an adapter costs four rank-r dots per visit in the same loop, instead of the four extra grouped-matmul loops
(and their backward loops) the chained form takes: one loop forward and one backward, as without an adapter.
The backward visit takes the chain's VJP the same way and sums each expert's factor gradients in its loop carry;
the base weights' gradients are formed there too, and XLA drops them when the weights are frozen (nothing reads
them): a LoRA step computes no experts' weight gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from ..accumulation import accumulation_dtype
from ..lora import LoraFactors
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
from .tiled_swiglu import _by_expert, _experts_with_visits, _over_expert_visits, _window, gated

Activation = Callable[[jax.Array], jax.Array]


def _expert_factors(factors: LoraFactors | None, expert) -> tuple[jax.Array, jax.Array] | None:
    """(A_e [r, in], B_e [out, r]) of one expert, or None without an adapter."""
    if factors is None:
        return None
    return (lax.dynamic_index_in_dim(factors.a, expert, axis=0, keepdims=False),
            lax.dynamic_index_in_dim(factors.b, expert, axis=0, keepdims=False))


def _project(window, weight, factors, scaling: float, dtype):
    """window [R, in] -> window W^T (+ scaling (window A^T) B^T): [R, out] in dtype."""
    out = window_times_weight(window, weight, "in_features", dtype)
    if factors is None:
        return out
    rank_rows = window_times_weight(window, factors[0], "in_features", dtype)                     # [R, r]
    return out + window_times_weight(rank_rows, factors[1], "in_features", dtype) * jnp.asarray(scaling, dtype)


def _project_backward(grad_out, window, weight, factors, scaling: float, dtype, sums):
    """The VJP of `_project` for one visit: (grad of the window [R, in], the weight's gradient in sums[0]'s
    dtype, (A's, B's) gradients or None)."""
    grad_weight = window_weight_grad(grad_out, window, sums[0])
    grad_window = window_times_weight(grad_out, weight, "out_features", dtype)
    if factors is None:
        return grad_window, grad_weight, None
    a, b = factors
    scale = jnp.asarray(scaling, dtype)
    rank_rows = window_times_weight(window, a, "in_features", dtype)                              # [R, r]
    grad_rank = window_times_weight(grad_out, b, "out_features", dtype) * scale                   # [R, r]
    grad_b = window_weight_grad(grad_out, rank_rows, sums[1]) * jnp.asarray(scaling, sums[1])     # [out, r]
    grad_a = window_weight_grad(grad_rank, window, sums[1])                                       # [r, in]
    grad_window = grad_window + window_times_weight(grad_rank, a, "out_features", dtype)
    return grad_window, grad_weight, (grad_a, grad_b)


def _forward(x, gate_up, down, lora_gate_up, lora_down, group_sizes, act, tile_rows, remainder_rows, keep_h):
    """-> (y [M, H], h [M, 2I] or None), experts in an outer loop as `tiled_swiglu`'s."""
    num_experts = gate_up.shape[0]
    schedules = plan_tile_schedules(group_sizes, x.shape[0], tile_rows, remainder_rows)
    visited = [v for v, _ in schedules]
    factors = [f for f in (lora_gate_up, lora_down) if f is not None]
    y = vary_like(jnp.zeros((x.shape[0], down.shape[1]), down.dtype), x, gate_up, down, factors, *visited)
    h_rows = (vary_like(jnp.zeros((x.shape[0], gate_up.shape[1]), gate_up.dtype), x, gate_up, factors, *visited)
              if keep_h else None)
    runs = _by_expert(schedules, num_experts)

    def expert_visits(expert, carry):
        w_gate_up = lax.dynamic_index_in_dim(gate_up, expert, axis=0, keepdims=False)
        w_down = lax.dynamic_index_in_dim(down, expert, axis=0, keepdims=False)
        f_gate_up, f_down = _expert_factors(lora_gate_up, expert), _expert_factors(lora_down, expert)
        for run in runs:
            def visit(carry, v: TileVisits, rows=run.rows):
                y, h_rows = carry
                h = _project(_window(x, v, rows), w_gate_up, f_gate_up, _scaling(lora_gate_up), gate_up.dtype)
                a = gated(h, act).astype(down.dtype)
                y = set_chunk_rows(y, _project(a, w_down, f_down, _scaling(lora_down), down.dtype), v, rows)
                if h_rows is not None:
                    h_rows = set_chunk_rows(h_rows, h, v, rows)
                return y, h_rows

            carry = _over_expert_visits(visit, carry, run, expert)
        return carry

    order, entered = _experts_with_visits(runs, num_experts)
    return lax.fori_loop(0, entered, lambda i, carry: expert_visits(order[i], carry), (y, h_rows))


def _scaling(factors: LoraFactors | None) -> float:
    return 0.0 if factors is None else factors.scaling


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _adapted_swiglu(x, gate_up, down, lora_gate_up, lora_down, group_sizes, act, tile_rows, remainder_rows):
    return _forward(x, gate_up, down, lora_gate_up, lora_down, group_sizes, act, tile_rows, remainder_rows,
                    keep_h=False)[0]


def _adapted_swiglu_fwd(x, gate_up, down, lora_gate_up, lora_down, group_sizes, act, tile_rows, remainder_rows):
    y, h_rows = _forward(x, gate_up, down, lora_gate_up, lora_down, group_sizes, act, tile_rows, remainder_rows,
                         keep_h=True)
    return y, (x, gate_up, down, lora_gate_up, lora_down, group_sizes, h_rows)


def _zeros_like_factors(factors: LoraFactors | None, dtype, *like):
    if factors is None:
        return None
    return (vary_like(jnp.zeros(factors.a.shape[1:], dtype), *like),
            vary_like(jnp.zeros(factors.b.shape[1:], dtype), *like))


def _add(total, part):
    return None if total is None else (total[0] + part[0], total[1] + part[1])


def _adapted_swiglu_bwd(act, tile_rows, remainder_rows, residuals, grad_y):
    x, gate_up, down, lora_gate_up, lora_down, group_sizes, h_rows = residuals
    num_experts = gate_up.shape[0]
    schedules = plan_tile_schedules(group_sizes, x.shape[0], tile_rows, remainder_rows)
    visited = [v for v, _ in schedules]
    runs = _by_expert(schedules, num_experts)
    gate_up_sum = accumulation_dtype(x.dtype, gate_up.dtype)
    down_sum = accumulation_dtype(down.dtype, grad_y.dtype)
    like = (x, gate_up, down, grad_y, h_rows, [f for f in (lora_gate_up, lora_down) if f is not None], *visited)
    grad_x = vary_like(jnp.zeros(x.shape, gate_up.dtype), *like)

    def expert_grads(grad_x, expert):
        """-> (grad_x with this expert's rows, this expert's gradients: gate_up, down, and the factors')."""
        w_gate_up = lax.dynamic_index_in_dim(gate_up, expert, axis=0, keepdims=False)
        w_down = lax.dynamic_index_in_dim(down, expert, axis=0, keepdims=False)
        f_gate_up, f_down = _expert_factors(lora_gate_up, expert), _expert_factors(lora_down, expert)
        carry = (grad_x, vary_like(jnp.zeros(w_gate_up.shape, gate_up_sum), *like),
                 vary_like(jnp.zeros(w_down.shape, down_sum), *like),
                 _zeros_like_factors(lora_gate_up, gate_up_sum, *like), _zeros_like_factors(lora_down, down_sum, *like))
        for run in runs:
            def visit(carry, v: TileVisits, rows=run.rows):
                grad_x, grad_gate_up, grad_down, grad_f_gate_up, grad_f_down = carry
                g = keep_chunk_rows(_window(grad_y, v, rows), v, rows)                       # [R, H]
                h = _window(h_rows, v, rows)                                                  # [R, 2I]
                a, gated_vjp = jax.vjp(lambda h: gated(h, act).astype(down.dtype), h)        # [R, I]
                grad_a, down_part, f_down_part = _project_backward(
                    g, a, w_down, f_down, _scaling(lora_down), down.dtype, (down_sum, down_sum))
                (grad_h,) = gated_vjp(grad_a)                                                 # [R, 2I]
                grad_window, gate_up_part, f_gate_up_part = _project_backward(
                    grad_h, _window(x, v, rows), w_gate_up, f_gate_up, _scaling(lora_gate_up), gate_up.dtype,
                    (gate_up_sum, gate_up_sum))
                return (set_chunk_rows(grad_x, grad_window, v, rows), grad_gate_up + gate_up_part,
                        grad_down + down_part, _add(grad_f_gate_up, f_gate_up_part), _add(grad_f_down, f_down_part))

            carry = _over_expert_visits(visit, carry, run, expert)
        grad_x, *grads = carry
        return grad_x, tuple(grads)

    grad_x, (grad_gate_up, grad_down, grad_f_gate_up, grad_f_down) = lax.scan(expert_grads, grad_x,
                                                                              jnp.arange(num_experts))
    return (grad_x.astype(x.dtype), grad_gate_up.astype(gate_up.dtype), grad_down.astype(down.dtype),
            _factor_grads(lora_gate_up, grad_f_gate_up), _factor_grads(lora_down, grad_f_down), None)


def _factor_grads(factors: LoraFactors | None, grads) -> LoraFactors | None:
    if factors is None:
        return None
    return LoraFactors(grads[0].astype(factors.a.dtype), grads[1].astype(factors.b.dtype), factors.scaling)


_adapted_swiglu.defvjp(_adapted_swiglu_fwd, _adapted_swiglu_bwd)


def tiled_adapted_swiglu_mlp(
    x: jax.Array, gate_up: jax.Array, down: jax.Array, group_sizes: jax.Array, lora_gate_up: LoraFactors | None,
    lora_down: LoraFactors | None, *, act: Activation = jax.nn.silu, tile_rows: int | None = None,
    remainder_rows: int | str | None = "auto",
) -> jax.Array:
    """`tiled_swiglu_mlp` with LoRA updates: each row's expert MLP with W + s B A for gate_up and / or down.

    x: [M, H] rows sorted by group; gate_up: [E, 2I, H]; down: [E, H, I]; group_sizes: [E] int32
    lora_gate_up: a [E, r, H], b [E, 2I, r] (or None); lora_down: a [E, r, I], b [E, H, r] (or None)
    returns [M, H] in result_type(x, gate_up, down); rows past sum(group_sizes) are 0
    """
    inner = jnp.result_type(x.dtype, gate_up.dtype)
    outer = jnp.result_type(inner, down.dtype)
    if x.shape[0] == 0:
        return jnp.zeros((0, down.shape[1]), outer)
    if tile_rows is None:
        tile_rows = default_tile_rows(x.shape[0], gate_up.shape[0])
    if remainder_rows == "auto":
        remainder_rows = default_remainder_rows(tile_rows)
    lora_gate_up = None if lora_gate_up is None else lora_gate_up.astype(inner)
    lora_down = None if lora_down is None else lora_down.astype(outer)
    return _adapted_swiglu(x.astype(inner), gate_up.astype(inner), down.astype(outer), lora_gate_up, lora_down,
                           group_sizes.astype(jnp.int32), act, tile_rows, remainder_rows)
