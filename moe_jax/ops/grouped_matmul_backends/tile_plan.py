"""Static-size schedule of row tiles for a grouped matmul with dynamic group sizes.

Shape letters: E experts, M rows, R tile rows, V visits.

Each expert's contiguous rows are cut into chunks of at most R rows, and each
chunk is one "visit": multiply an R-row window of the input by that expert's
weight and keep the chunk's rows. The number of chunks depends on the group
sizes, which are only known at run time, but it is bounded:

    sum_e ceil(g_e / R) <= (sum_e g_e + E * (R - 1)) / R <= (M + E * (R - 1)) / R

so a schedule of `max_visits(M, E, R)` entries always suffices; the entries past
the real chunks are marked dead and skipped.

Two levels (`plan_tile_schedules`): each expert's R-row chunks, then its last rows,
when fewer than R / 2, in chunks of r < R rows. A group of g rows then costs
ceil(g / R) * R rows when g mod R >= R / 2 (one large dot beats three small ones)
and floor(g / R) * R + ceil((g mod R) / r) * r otherwise, instead of always
ceil(g / R) * R: the waste per expert is under R / 2 rows, mostly in large dots.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from jax import lax

from ..permute import count_at_most


class TileVisits(NamedTuple):
    """One entry per visit, all [V]; V = max_visits(M, E, R)."""

    live: jax.Array  # bool: False for the spare entries after the last real chunk
    expert: jax.Array  # int32: whose weight this chunk uses (clamped to E - 1 when dead)
    window_start: jax.Array  # int32: first row of the R-row window, within [0, M - R]
    chunk_start: jax.Array  # int32: first row of the chunk (window_start <= chunk_start)
    chunk_end: jax.Array  # int32: one past the chunk's last row (<= window_start + R)


def window_rows(num_rows: int, tile_rows: int) -> int:
    """Rows per window: the tile, or all rows when there are fewer than a tile."""
    if tile_rows < 1:
        raise ValueError(f"tile_rows={tile_rows} must be a positive number of rows, e.g. 128.")
    return min(tile_rows, num_rows)


def max_visits(num_rows: int, num_experts: int, tile_rows: int) -> int:
    """Static upper bound on the number of chunks (see the module docstring)."""
    return (num_rows + num_experts * (tile_rows - 1)) // tile_rows


def plan_tile_visits(group_sizes: jax.Array, num_rows: int, tile_rows: int, *,
                     group_start: jax.Array | None = None, visit_count: int | None = None) -> TileVisits:
    """The chunk schedule for rows sorted by group.

    group_sizes: [E] int; rows past sum(group_sizes) belong to no group
    tile_rows: R, must be <= num_rows (use `window_rows`)
    group_start: [E] int, each group's first row (default: the groups back to back from row 0)
    visit_count: V, the schedule's length (default `max_visits(M, E, R)`; must bound the chunks)
    returns TileVisits of [V] arrays, chunks in row order

    If sum(group_sizes) exceeds num_rows the excess is silently dropped: the
    rows do not exist, and this runs under jit where it cannot raise.
    """
    num_experts = group_sizes.shape[0]
    group_sizes = group_sizes.astype(jnp.int32)
    if group_start is None:
        group_start = jnp.cumsum(group_sizes) - group_sizes
    group_end = group_start + group_sizes

    chunks_per_expert = (group_sizes + tile_rows - 1) // tile_rows
    chunk_count_end = jnp.cumsum(chunks_per_expert)
    chunk_count_start = chunk_count_end - chunks_per_expert

    if visit_count is None:
        visit_count = max_visits(num_rows, num_experts, tile_rows)
    visit = jnp.arange(visit_count, dtype=jnp.int32)
    # Visit v belongs to the first expert whose running chunk count exceeds v;
    # empty experts have no chunks and are skipped by side="right".
    owner = count_at_most(chunk_count_end, visit)
    live = owner < num_experts
    expert = jnp.minimum(owner, num_experts - 1)

    chunk_start = group_start[expert] + (visit - chunk_count_start[expert]) * tile_rows
    chunk_end = jnp.minimum(group_end[expert], chunk_start + tile_rows)
    chunk_end = jnp.where(live, jnp.minimum(chunk_end, num_rows), chunk_start)
    # A chunk near the bottom keeps its R-row window inside the array by starting
    # it earlier; the rows before chunk_start are masked out, never overwritten.
    window_start = jnp.clip(chunk_start, 0, num_rows - tile_rows)
    return TileVisits(live, expert, window_start, chunk_start, chunk_end)


def plan_tile_schedules(group_sizes: jax.Array, num_rows: int, tile_rows: int, remainder_rows: int | None
                        ) -> tuple[tuple[TileVisits, int], ...]:
    """The schedules covering every group's rows once -> ((visits, rows per window), ...).

    remainder_rows None (or >= the window): one schedule of R-row chunks. Otherwise two: R-row chunks of each
    group's first floor(g / R) * R rows, and of its last g mod R rows too when they are at least R / 2 (one
    large dot costs less than three or more small ones); then the last rows of the other groups (< R / 2) in
    chunks of r = remainder_rows.
    """
    tile_rows = window_rows(num_rows, tile_rows)
    if remainder_rows is None or remainder_rows >= tile_rows:
        return ((plan_tile_visits(group_sizes, num_rows, tile_rows), tile_rows),)
    num_experts = group_sizes.shape[0]
    group_sizes = group_sizes.astype(jnp.int32)
    group_start = jnp.cumsum(group_sizes) - group_sizes
    last = group_sizes % tile_rows
    small = jnp.where(2 * last >= tile_rows, 0, last)
    large = group_sizes - small
    # Each group: floor(g / R) chunks, plus one when its last rows are >= R / 2: at most (g + R / 2) / R.
    full = plan_tile_visits(large, num_rows, tile_rows, group_start=group_start,
                            visit_count=min(num_rows // tile_rows + num_experts // 2 + 1,
                                            max_visits(num_rows, num_experts, tile_rows)))
    short_rows = (tile_rows + 1) // 2 - 1            # a group's small remainder: at most ceil(R / 2) - 1 rows
    per_expert = -(-short_rows // remainder_rows)    # ... in ceil(short_rows / r) chunks
    rest = plan_tile_visits(small, num_rows, remainder_rows, group_start=group_start + large,
                            visit_count=min(num_experts * per_expert,
                                            max_visits(num_rows, num_experts, remainder_rows)))
    return (full, tile_rows), (rest, remainder_rows)


Carry = TypeVar("Carry")


def chunk_mask(v: TileVisits, rows_per_window: int) -> jax.Array:
    """[R] bool: which rows of visit v's window belong to its chunk."""
    rows = v.window_start + jnp.arange(rows_per_window, dtype=jnp.int32)
    return (rows >= v.chunk_start) & (rows < v.chunk_end)


def over_live_visits(visit: Callable[[Carry, TileVisits], Carry], carry: Carry, visits: TileVisits) -> Carry:
    """visit(carry, v) for each live visit in order: a loop of as many steps as there are live visits (they
    are the schedule's first entries), so the static schedule's spare entries cost nothing."""
    count = jnp.sum(visits.live.astype(jnp.int32))
    return lax.fori_loop(0, count, lambda i, carry: visit(carry, jax.tree.map(lambda a: a[i], visits)), carry)
