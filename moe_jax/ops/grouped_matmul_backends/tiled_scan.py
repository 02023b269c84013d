"""Dropless grouped matmul as a `lax.scan` over fixed-size row tiles.

Shape letters: M rows, H in features, O out features, E experts, R tile rows.

Every visit of the `tile_plan` schedule multiplies one R-row window of x by one
expert's [O, H] weight (a plain dense dot) and
writes only that chunk's rows into the output carry. Work is the real rows plus
less than R / 2 rows of waste per expert (two-level schedules, `plan_tile_schedules`;
R - 1 with one level), with static shapes throughout.
The loop runs as many steps as there are live visits (a `fori_loop` with a traced
trip count), so the static schedule length costs nothing beyond the chunks that exist.

Differentiation uses a custom VJP with the same schedule:
  dx = the same loop with w contracted over O instead of H,
  dw[e] = sum over e's chunks of g_chunk^T @ x_chunk, accumulated in fp32 or wider.
Letting JAX differentiate the scan instead saves every window as a residual; in
prototype runs on CPU it was much slower than this VJP, never faster.

Under `vmap` (pipeline stages run as one vmapped program) a loop with a per-stage
trip count runs the longest one for every stage, the others' extra steps masked.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..accumulation import accumulation_dtype
from ..quantized import expert_weight, is_quantized
from ..varying import vary_like
from .tile_plan import TileVisits, chunk_mask, over_live_visits, plan_tile_schedules

Schedules = tuple[tuple[TileVisits, int], ...]   # (visits, rows per window)

# Tile rows follow the average group size M / E, rounded down to a power of two
# and kept within these bounds. A tile near the average group size wastes at most
# about one group's worth of rows per expert, while the dots stay as large as the
# split allows. scripts/bench/bench_grouped_matmul.py (docs/benchmarks.md, "Grouped matmul")
# times each tile size against a dense matmul of the same FLOPs for 8, 32 and 128 experts:
# 512-row tiles win only for perfectly balanced groups, hence the cap of 256; 16-row tiles
# lost to 32, hence the floor.
# Calls whose groups average under SMALL_GROUP_ROWS rows (decoding: a few tokens x top-k
# over many experts) take SMALL_TILE_ROWS instead: a 32-row window there computes mostly
# masked rows. Measured on one layer's SwiGLU experts (docs/benchmarks.md, "Grouped
# matmul"): small tiles win below 16 rows a group and lose above, hence the threshold.
# On a GPU each visit is a loop step of a few kernel launches, large against a 256-row dot: the tile follows the
# average group up to MAX_TILE_ROWS_GPU there (an H100 ran Qwen3-30B-A3B's 1024-row groups fastest in 1024-row
# tiles of those swept, 128 to 1024: docs/benchmarks.md, "GPU check").
MIN_TILE_ROWS = 32
MAX_TILE_ROWS = 256
MAX_TILE_ROWS_GPU = 1024
SMALL_GROUP_ROWS = 16
SMALL_TILE_ROWS = 8


def default_tile_rows(num_rows: int, num_experts: int, platform: str | None = None) -> int:
    """Power-of-two tile near the average group size, within [MIN_TILE_ROWS, MAX_TILE_ROWS] (MAX_TILE_ROWS_GPU
    when `platform`, JAX's default backend unless given, is "gpu"); SMALL_TILE_ROWS when the groups average fewer
    than SMALL_GROUP_ROWS rows."""
    average_group = max(num_rows // max(num_experts, 1), 1)
    if average_group < SMALL_GROUP_ROWS:
        return SMALL_TILE_ROWS
    tile = 1 << int(math.floor(math.log2(average_group)))
    platform = jax.default_backend() if platform is None else platform
    return min(max(tile, MIN_TILE_ROWS), MAX_TILE_ROWS_GPU if platform == "gpu" else MAX_TILE_ROWS)


# How an R-row window meets one expert weight [O, H]: which weight axis is
# contracted -> (dot_general dimension numbers, the weight axis that survives).
_WEIGHT_CONTRACTIONS = {
    "in_features": ((((1,), (1,)), ((), ())), 1),  # forward: [R, H] x [O, H] -> [R, O]
    "out_features": ((((1,), (0,)), ((), ())), 2),  # input grad: [R, O] x [O, H] -> [R, H]
}
_CONTRACT_WINDOW_ROWS = (((0,), (0,)), ((), ()))  # weight grad: [R, O] x [R, H] -> [O, H]


def window_times_weight(window: jax.Array, expert_weight: jax.Array, contract: str, out_dtype) -> jax.Array:
    """One visit's dot: window [R, H] x weight [O, H] -> [R, O] (contract="in_features"), or window [R, O] x
    weight [O, H] -> [R, H] ("out_features"); summed in the accumulation dtype, returned in out_dtype."""
    dimension_numbers, _ = _WEIGHT_CONTRACTIONS[contract]
    return lax.dot_general(
        window, expert_weight, dimension_numbers, preferred_element_type=accumulation_dtype(out_dtype)
    ).astype(out_dtype)


def window_weight_grad(g_window: jax.Array, x_window: jax.Array, accumulate_dtype) -> jax.Array:
    """g_window [R, O] x x_window [R, H] -> [O, H]: one visit's weight gradient, in accumulate_dtype."""
    return lax.dot_general(g_window, x_window, _CONTRACT_WINDOW_ROWS, preferred_element_type=accumulate_dtype)


def keep_chunk_rows(window: jax.Array, v: TileVisits, rows_per_window: int) -> jax.Array:
    """window [R, ...] with the rows outside visit v's chunk set to 0."""
    keep = chunk_mask(v, rows_per_window).reshape((-1,) + (1,) * (window.ndim - 1))
    return jnp.where(keep, window, jnp.zeros_like(window))


def set_chunk_rows(out: jax.Array, window_values: jax.Array, v: TileVisits, rows_per_window: int) -> jax.Array:
    """out [M, ...] with visit v's chunk rows set from window_values [R, ...] (its window's rows); the window's
    other rows keep their values."""
    keep = chunk_mask(v, rows_per_window).reshape((-1,) + (1,) * (out.ndim - 1))
    previous = lax.dynamic_slice_in_dim(out, v.window_start, rows_per_window, axis=0)
    updated = jnp.where(keep, window_values, previous)
    return lax.dynamic_update_slice_in_dim(out, updated, v.window_start, axis=0)


def add_expert_grad(grad_w: jax.Array, chunk_grad: jax.Array, expert: jax.Array) -> jax.Array:
    """grad_w [E, O, H] with chunk_grad [O, H] added to expert's slice."""
    running = lax.dynamic_index_in_dim(grad_w, expert, axis=0, keepdims=True)
    return lax.dynamic_update_index_in_dim(grad_w, running + chunk_grad[None], expert, axis=0)


def default_remainder_rows(tile_rows: int) -> int | None:
    """The tile of each group's last rows (None: one level): a quarter of the tile, from 64-row tiles.

    Isolated forward + backward against one level (realistic top-4 routing), two levels are closer to a dense
    matmul for 64- and 256-row tiles; 32-row tiles with 8-row remainders gained less and are left at one level
    (docs/benchmarks.md, "Train-step choices")."""
    return tile_rows // 4 if tile_rows >= 64 else None


def _rows_times_expert_weights(lhs: jax.Array, w: jax.Array, schedules: Schedules, contract: str) -> jax.Array:
    """out[m] = lhs[m] . w[group(m)], contracting the weight axis named by `contract`.

    lhs: [M, H] with contract="in_features", or [M, O] with contract="out_features"
    w: [E, O, H]
    schedules: `plan_tile_schedules`' (visits, rows per window) pairs, one loop each over the same output
    returns [M, O] or [M, H] (the weight axis not contracted); rows in no group are 0
    """
    num_rows = lhs.shape[0]
    out_features = w.shape[_WEIGHT_CONTRACTIONS[contract][1]]
    out_dtype = jnp.result_type(lhs.dtype, w.dtype)
    # Inside shard_map the carry must vary over the axes the visited values vary over (no-op outside).
    out = vary_like(jnp.zeros((num_rows, out_features), out_dtype), lhs, w, *(v for v, _ in schedules))
    for visits, rows_per_window in schedules:
        out = _visit_rows(out, lhs, w, visits, rows_per_window, contract)
    return out


def _visit_rows(out, lhs, w, visits: TileVisits, rows_per_window: int, contract: str) -> jax.Array:
    """`out` with every live visit's chunk rows set to lhs's window times the visit's expert weight."""
    out_dtype = out.dtype

    def visit(out, v: TileVisits):
        window = lax.dynamic_slice_in_dim(lhs, v.window_start, rows_per_window, axis=0)
        product = window_times_weight(window, expert_weight(w, v.expert), contract, out_dtype)
        return set_chunk_rows(out, product, v, rows_per_window)

    return over_live_visits(visit, out, visits)


def _expert_weight_grads(x: jax.Array, grad_out: jax.Array, schedules: Schedules, num_experts: int) -> jax.Array:
    """dw[e] = sum over rows m of group e of outer(grad_out[m], x[m]).

    x: [M, H]; grad_out: [M, O]
    returns [E, O, H] in the accumulation dtype (>= fp32)
    """
    accumulate_dtype = accumulation_dtype(x.dtype, grad_out.dtype)
    grad_w = vary_like(jnp.zeros((num_experts, grad_out.shape[1], x.shape[1]), accumulate_dtype), x, grad_out,
                       *(v for v, _ in schedules))
    for visits, rows_per_window in schedules:
        grad_w = _accumulate_weight_grads(grad_w, x, grad_out, visits, rows_per_window)
    return grad_w


def _accumulate_weight_grads(grad_w, x, grad_out, visits: TileVisits, rows_per_window: int) -> jax.Array:
    """grad_w plus every live visit's chunk outer products, per the visit's expert."""
    accumulate_dtype = grad_w.dtype

    def visit(grad_w, v: TileVisits):
        x_window = lax.dynamic_slice_in_dim(x, v.window_start, rows_per_window, axis=0)
        g_window = lax.dynamic_slice_in_dim(grad_out, v.window_start, rows_per_window, axis=0)
        g_window = keep_chunk_rows(g_window, v, rows_per_window)
        return add_expert_grad(grad_w, window_weight_grad(g_window, x_window, accumulate_dtype), v.expert)

    return over_live_visits(visit, grad_w, visits)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _tiled(x, w, group_sizes, tile_rows, remainder_rows):
    schedules = plan_tile_schedules(group_sizes, x.shape[0], tile_rows, remainder_rows)
    return _rows_times_expert_weights(x, w, schedules, "in_features")


def _tiled_fwd(x, w, group_sizes, tile_rows, remainder_rows):
    return _tiled(x, w, group_sizes, tile_rows, remainder_rows), (x, w, group_sizes)


def _tiled_bwd(tile_rows, remainder_rows, residuals, grad_out):
    x, w, group_sizes = residuals
    schedules = plan_tile_schedules(group_sizes, x.shape[0], tile_rows, remainder_rows)
    grad_x = _rows_times_expert_weights(grad_out, w, schedules, "out_features")
    if is_quantized(w):   # kept-quantised weights are frozen: only the rows' gradient flows (adapters train)
        return grad_x.astype(x.dtype), jax.tree.map(_zero_cotangent, w), None
    grad_w = _expert_weight_grads(x, grad_out, schedules, w.shape[0])
    return grad_x.astype(x.dtype), grad_w.astype(w.dtype), None


def _zero_cotangent(leaf: jax.Array) -> jax.Array:
    """A frozen code array's cotangent: zeros of its type (float8 codes, varying where they vary), float0 for
    integer codes."""
    if jnp.issubdtype(leaf.dtype, jnp.floating):
        return leaf * jnp.zeros((), leaf.dtype)
    return np.zeros(leaf.shape, jax.dtypes.float0)


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def tiled_grouped_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, tile_rows: int | None = None,
    remainder_rows: int | str | None = "auto",
) -> jax.Array:
    """Grouped x @ w[e].T, one R-row tile at a time.

    x: [M, H] rows sorted by group
    w: [E, O, H], or a quantised stand-in (`ops.quantized`): each visit dequantises only its expert
    group_sizes: [E] int32
    returns [M, O]; rows past sum(group_sizes) are 0

    tile_rows: R; None picks `default_tile_rows(M, E)`. remainder_rows: r, the tile of a group's last g mod R
    rows when they are fewer than R / 2 (`plan_tile_schedules`; None: every chunk R rows; "auto":
    `default_remainder_rows(R)`).
    """
    if x.shape[0] == 0:
        return jnp.zeros((0, w.shape[1]), jnp.result_type(x.dtype, w.dtype))
    if tile_rows is None:
        tile_rows = default_tile_rows(x.shape[0], w.shape[0])
    if remainder_rows == "auto":
        remainder_rows = default_remainder_rows(tile_rows)
    return _tiled(x, w, group_sizes, tile_rows, remainder_rows)
