"""Dispatch capacity: static buffer sizes for token dispatch, what a call needed, and when to change them.

A jitted step has static shapes, so the buffers that carry (token, expert) pairs between devices have a
fixed number of rows. Their size is set by the *capacity*, a multiple of the balanced share:

    buffer_rows(capacity, pairs, ep) = min(round_up(capacity * pairs / ep, 8), round_up(pairs, 8))

where `pairs` = rows * top_k a device sends (all_to_all: per peer; all_reduce: its local pairs). The
dropless *ladder* lists the capacities a step may be compiled for, in steps of at most 1.5x up to `ep`, whose
buffers hold everything a device sends (nothing can overflow there):

    capacity_ladder(8) == (1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)

Every call reports, in `DispatchStatistics`, how many pairs it `dropped` at the capacity in force and the
`required_capacity`: the lowest ladder capacity whose buffers would have held its busiest peer. The
caller keeps its capacity in a `CapacityTracker` and moves it by the model's `CapacitySchedule`: straight up
to the required capacity after an overflow (that call must then be recomputed: its output lacks the dropped
pairs), and one step down after `patience` calls in a row that all fitted the lower capacity, so one skewed
batch does not pin the largest buffers forever.

The capacity is an argument all the way down, never a global: the caller passes it to `model.apply(capacity=)`
(static: one compilation per rung), the step hands it to each experts module (`ShardedExperts.__call__`), which
passes it, with this device's experts function, to its EP implementation's `__call__`; the implementation sizes
its buffers by it (`CapacityBuffers.buffer_rows(pairs, capacity)`).

    caller           CapacityTracker   forward (`model.forward_capacity`), TrainLoop, the NNX face
      | capacity (static argument of the jitted step)
    step_math -> decoder layer -> ShardedExperts(..., capacity=) -> EP implementation(..., capacity=)
      | DispatchStatistics (dropped, required_capacity), summed over devices and layers
    caller           tracker.settle / observe / run_exact: the next capacity, and whether to replay

`generate` and the serving engine pass `capacity=None` (the largest rung, which never drops): they hold no
tracker and read no statistics.

(An in-graph alternative, extra dispatch rounds under `lax.cond`, deadlocked XLA:CPU's in-process
collectives, so overflow is handled between calls; see docs/design.md, "Expert parallelism".)

Glossary (one meaning per name, everywhere in moe_jax):

    capacity           a dispatch buffer's size as a multiple of the balanced share (pairs / ep): a rung of
                       the ladder, static per compilation; None where a capacity is taken: the largest
    ladder             the capacities a call may run at, increasing; `largest` is its last, ep, whose
                       buffers hold every pair (it never drops)
    capacity_factor    a fixed multiple for buffers that drop on purpose (not dropless; never moves)
    pairs              the (token, expert) pairs one device routes: rows * top_k
    buffer_rows        rows of one dispatch buffer (per peer for all_to_all, per device for all_reduce): the
                       function of (capacity, pairs, ep), and in `DispatchStatistics` a call's largest one
    busiest_rows       the rows a call's fullest buffer needed (more than `buffer_rows`: pairs dropped)
    dropped            pairs a call did not compute because a buffer was full (> 0: replay the call)
    required_capacity  the lowest ladder capacity whose buffers hold a call's busiest buffer
    CapacitySchedule   the ladder and how the capacity moves along it (`patience`): one per model,
                       `model.capacity_schedule`, the same object its EP implementations size buffers by
    CapacityTracker    the one holder of a caller's capacity: its `state`, moved by its schedule
    CapacityState      a tracker's state as a value (capacity, calm streak): what checkpoints save and
                       `TrainLoop.run` takes and returns
    calm_calls         calls in a row that fitted the rung below the capacity; `calm_peak`: the largest
                       capacity they required
    replay             running a call again, at the capacity it required (routing is deterministic, so it
                       fits there); `recomputed` / `replays` count them
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ..ops.varying import vary_over

# The ladder's first capacity: buffers 1.25x the balanced share (scripts/bench/bench_moe_layer.py reports the
# padding it costs).
DEFAULT_FIRST_CAPACITY = 1.25
# Buffer rows are rounded up to this many (sublane-friendly tiles).
ROW_MULTIPLE = 8
# Calls in a row that must fit the lower capacity before the schedule steps down.
DEFAULT_PATIENCE = 16


def capacity_ladder(ep_size: int, first: float = DEFAULT_FIRST_CAPACITY) -> tuple[float, ...]:
    """Capacities from `first` up to `ep_size` (buffers that hold everything; never overflow), in steps of at
    most 1.5x: `first`, then 1.5, 2, 3, 4, 6, 8, 12, ... above it. Doubling steps made a batch that just missed
    1.25 hold 2x buffers; the middle rungs cost one more compilation each, once."""
    if first <= 0:
        raise ValueError(f"The first capacity must be > 0, got {first}.")
    rungs = (multiple * 2.0 ** power for power in range(int(ep_size).bit_length()) for multiple in (1.5, 2.0))
    middle = [rung for rung in rungs if first < rung < ep_size]
    return (float(first), *middle, *([float(ep_size)] if ep_size > first else []))


def _round_up(value: int, multiple: int) -> int:
    return max(multiple, -(-value // multiple) * multiple)


def buffer_rows(capacity: float, pairs: int, ep_size: int) -> int:
    """Rows of a dispatch buffer for `pairs` pairs held by one device at `capacity` (static)."""
    return min(_round_up(math.ceil(capacity * pairs / ep_size), ROW_MULTIPLE), _round_up(pairs, ROW_MULTIPLE))


def required_capacity(busiest_rows: jax.Array, pairs: int, ep_size: int,
                      ladder: tuple[float, ...]) -> jax.Array:
    """The lowest capacity of `ladder` whose buffers hold `busiest_rows` (float32 scalar, traced).

    busiest_rows: the rows this call's fullest buffer needed. The last capacity always fits when it is
    `ep_size`.
    """
    rows = jnp.asarray([buffer_rows(capacity, pairs, ep_size) for capacity in ladder], jnp.int32)
    index = jnp.minimum(jnp.sum(busiest_rows > rows), len(ladder) - 1)
    return jnp.asarray(ladder, jnp.float32)[index]


class DispatchStatistics:
    """Counts of one call (token, expert) pairs, summed over devices and layers:

    dropped            pairs not computed because a buffer was full (0 for a dropless result)
    padded             buffer rows that carried nothing
    buffer_rows        the largest buffer's rows (per peer for all_to_all, per device for all_reduce)
    required_capacity  the lowest ladder capacity that would have dropped nothing (max over devices/layers)
    expert_load        [E] one layer's real tokens routed to each expert (the decoder layer counts them; None
                       elsewhere: totals over layers do not keep it, `ModelOutput.expert_load` has it per layer)
    ep_rank_load       [ep] one layer's real (token, expert) pairs each ep rank computed under an expert
                       placement with redundant slots (None elsewhere, like `expert_load`)
    routing            [T, K] int32 one layer's chosen (logical) expert ids per token, when the step records
                       them (`ModelOutput.routing`; None elsewhere, like `expert_load`)
    """

    def __init__(self, dropped, padded, buffer_rows, required_capacity, expert_load=None, ep_rank_load=None,
                 routing=None):
        self.dropped = dropped
        self.padded = padded
        self.buffer_rows = buffer_rows
        self.required_capacity = required_capacity
        self.expert_load = expert_load
        self.ep_rank_load = ep_rank_load
        self.routing = routing

    def with_expert_load(self, expert_load) -> DispatchStatistics:
        return DispatchStatistics(self.dropped, self.padded, self.buffer_rows, self.required_capacity, expert_load,
                                  self.ep_rank_load, self.routing)

    def with_ep_rank_load(self, ep_rank_load) -> DispatchStatistics:
        return DispatchStatistics(self.dropped, self.padded, self.buffer_rows, self.required_capacity,
                                  self.expert_load, ep_rank_load, self.routing)

    def with_routing(self, routing) -> DispatchStatistics:
        return DispatchStatistics(self.dropped, self.padded, self.buffer_rows, self.required_capacity,
                                  self.expert_load, self.ep_rank_load, routing)

    @classmethod
    def zeros(cls) -> DispatchStatistics:
        zero = jnp.zeros((), jnp.int32)
        return cls(zero, zero, zero, jnp.zeros((), jnp.float32))

    def combine(self, other: DispatchStatistics) -> DispatchStatistics:
        """Both calls' counts together (e.g. two layers; per-layer `expert_load`, `ep_rank_load` are not kept)."""
        return DispatchStatistics(
            self.dropped + other.dropped, self.padded + other.padded,
            jnp.maximum(self.buffer_rows, other.buffer_rows),
            jnp.maximum(self.required_capacity, other.required_capacity),
        )

    def over_devices(self, axes: tuple[str, ...]) -> DispatchStatistics:
        """Inside shard_map: totals over the mesh `axes` (sums of counts, maxima of sizes)."""
        total = lambda value, reduce: reduce(vary_over(value, axes), axes)  # noqa: E731
        return DispatchStatistics(
            total(self.dropped, jax.lax.psum), total(self.padded, jax.lax.psum),
            total(self.buffer_rows, jax.lax.pmax), total(self.required_capacity, jax.lax.pmax),
        )

    def as_dict(self) -> dict[str, jax.Array]:
        return {"dropped": self.dropped, "padded": self.padded, "buffer_rows": self.buffer_rows,
                "required_capacity": self.required_capacity}

    def __repr__(self) -> str:
        return f"DispatchStatistics({', '.join(f'{k}={v}' for k, v in self.as_dict().items())})"


jax.tree_util.register_pytree_node(
    DispatchStatistics,
    lambda s: ((s.dropped, s.padded, s.buffer_rows, s.required_capacity, s.expert_load, s.ep_rank_load, s.routing),
               None),
    lambda _, children: DispatchStatistics(*children),
)


@dataclass(frozen=True)
class CapacityState:
    """A caller's dispatch capacity and its calm streak (calls in a row that fitted the lower capacity, and
    the largest capacity they required), as a value: a `CapacityTracker`'s `state`, what checkpoints save."""

    capacity: float
    calm_calls: int = 0
    calm_peak: float = 0.0


@dataclass(frozen=True)
class CapacitySchedule:
    """The capacity ladder and when to change the capacity: up at once on overflow, one step down after
    `patience` calm calls. A model makes one (`model.capacity_schedule`) and passes it to its EP
    implementations, whose `required_capacity` is a rung of this ladder.

        tracker = CapacityTracker(model.capacity_schedule)         # at the ladder's first rung
        out = model.apply(params, ids, capacity=tracker.capacity)
        if tracker.observe(out.statistics, ran_at=tracker.capacity):   # out dropped pairs: replay it
            out = model.apply(params, ids, capacity=tracker.capacity)

    (`CapacityTracker.run_exact` is that loop; `settle` is the pure decision it moves by.)
    """

    ladder: tuple[float, ...]
    patience: int = DEFAULT_PATIENCE

    def __post_init__(self):
        if not self.ladder or list(self.ladder) != sorted(set(self.ladder)):
            raise ValueError(f"The capacity ladder must be increasing and non-empty, got {self.ladder}.")
        if self.patience < 1:
            raise ValueError(f"patience={self.patience} must be >= 1 (calls that fit before stepping down).")

    @classmethod
    def for_ep(cls, ep_size: int, *, first: float = DEFAULT_FIRST_CAPACITY,
               patience: int = DEFAULT_PATIENCE) -> CapacitySchedule:
        return cls(capacity_ladder(ep_size, first), patience)

    @property
    def largest(self) -> float:
        """The capacity that never overflows."""
        return self.ladder[-1]

    def start(self) -> CapacityState:
        return CapacityState(self.ladder[0])

    def check(self, capacity: float) -> float:
        """`capacity` if it is on the ladder; a clear error otherwise."""
        for value in self.ladder:
            if math.isclose(value, capacity):
                return value
        raise ValueError(f"capacity={capacity} is not on the dispatch capacity ladder {list(self.ladder)}.")

    def overflowed(self, state: CapacityState, required: float) -> bool:
        """Whether a call made at `state.capacity` dropped pairs (its results must be recomputed)."""
        return required > state.capacity + 1e-6

    def update(self, state: CapacityState, required: float) -> CapacityState:
        """The state after a call made at `state.capacity` that required `required`."""
        if self.overflowed(state, required):
            return CapacityState(self.check(required))
        position = self.ladder.index(self.check(state.capacity))
        lower = self.ladder[position - 1] if position > 0 else None
        if lower is None or required > lower + 1e-6:
            return CapacityState(state.capacity)
        calm_calls, calm_peak = state.calm_calls + 1, max(state.calm_peak, required)
        if calm_calls >= self.patience:
            return CapacityState(lower)
        return CapacityState(state.capacity, calm_calls, calm_peak)

    def settle(self, state: CapacityState | None, ran_at: float | None, dropped: int, required: float
               ) -> tuple[CapacityState, bool]:
        """After one call made at capacity `ran_at` (None: the largest) that dropped `dropped` pairs and
        required `required`: (the state for the next call, whether this call must be replayed).

        A call that dropped pairs lacks them: it is replayed at the returned state's capacity, what it
        required and at least one rung above `ran_at` (each replay climbs). The largest capacity holds every
        pair, so a drop there is a bug in the EP implementation: RuntimeError. Otherwise the state moves by
        `update` (`state` may be None only for a call that dropped pairs)."""
        if dropped <= 0:
            return self.update(state, required), False
        if ran_at is None or ran_at >= self.largest:
            at = self.largest if ran_at is None else ran_at
            raise RuntimeError(
                f"{int(dropped)} (token, expert) pairs were dropped at the largest capacity ({at}); its "
                "buffers hold every pair a device sends, so this is a bug in the EP implementation."
            )
        rung_above = self.ladder[self.ladder.index(self.check(ran_at)) + 1]
        return CapacityState(self.check(max(required, rung_above))), True


class Replayed(NamedTuple):
    """What `replay_until_exact` returns."""

    output: Any              # the call's output at `capacity`, which dropped nothing
    state: CapacityState     # the schedule's state for the next call
    capacity: float | None   # the capacity `output` ran at
    recomputed: int          # replays it took


def replay_until_exact(call: Callable[[float | None], Any], schedule: CapacitySchedule,
                       state: CapacityState, *, dispatched: tuple[Any, float | None] | None = None,
                       statistics: Callable[[Any], DispatchStatistics] = attrgetter("statistics"),
                       ) -> Replayed:
    """Run `call(capacity)` at `state.capacity` and replay it where `schedule.settle` says until it dropped
    no pair; the schedule's state moves once, by the exact call's counts.

    dispatched: (output, capacity) of a call already made (`forward` dispatches at once and checks on the
    first read). statistics: the call's `DispatchStatistics` from its output. Each check is one host read
    of two scalars (dropped, required_capacity); routing is deterministic, so the replay at the capacity a
    call required fits, and an overflowing call is computed twice.
    """
    output, capacity = dispatched if dispatched is not None else (call(state.capacity), state.capacity)
    recomputed = 0
    while True:
        counts = statistics(output)
        dropped, required = jax.device_get((counts.dropped, counts.required_capacity))
        state, replay = schedule.settle(state, capacity, int(dropped), float(required))
        if not replay:
            return Replayed(output, state, capacity, recomputed)
        capacity = state.capacity
        output = call(capacity)
        recomputed += 1


class CapacityTracker:
    """One caller's dispatch capacity: the one place it is kept, moved along `schedule`'s ladder.

    `state`: where it starts (default the ladder's first rung); `dispatches=False`: the caller runs without
    dispatch buffers (ep 1), its `state` and `capacity` are None. Holders: `forward`
    (`model.forward_capacity[inference]`), `TrainLoop.run` (which takes and returns its `state`, as checkpoints
    save it) and the NNX face (`MoeCausalLM.capacity_tracker`). Host bookkeeping only: nothing here is traced.
    """

    def __init__(self, schedule: CapacitySchedule, state: CapacityState | None = None, *, dispatches: bool = True):
        self.schedule = schedule
        self.state: CapacityState | None = None if not dispatches else state if state is not None else schedule.start()

    @property
    def capacity(self) -> float | None:
        """The capacity the next call runs at."""
        return None if self.state is None else self.state.capacity

    def restart(self, capacity: float) -> None:
        """Run at `capacity` (a rung of the ladder) from the next call on, with no calm streak."""
        self.state = CapacityState(self.schedule.check(capacity))

    def settle(self, ran_at: float | None, dropped: int, required: float) -> bool:
        """After one call made at `ran_at` that dropped `dropped` pairs and required `required`: move the
        state (`CapacitySchedule.settle`) and return whether that call must be replayed."""
        self.state, replay = self.schedule.settle(self.state, ran_at, dropped, required)
        return replay

    def observe(self, statistics: DispatchStatistics, ran_at: float | None) -> bool:
        """`settle` by a call's statistics: one host read of two scalars (dropped, required_capacity)."""
        dropped, required = jax.device_get((statistics.dropped, statistics.required_capacity))
        return self.settle(ran_at, int(dropped), float(required))

    def run_exact(self, call: Callable[[float | None], Any], *, dispatched: tuple[Any, float | None] | None = None,
                  statistics: Callable[[Any], DispatchStatistics] = attrgetter("statistics")) -> Replayed:
        """`replay_until_exact` from this tracker's state, which it then holds."""
        replayed = replay_until_exact(call, self.schedule, self.state, dispatched=dispatched, statistics=statistics)
        self.state = replayed.state
        return replayed

    def __repr__(self) -> str:
        return f"CapacityTracker({self.state}, ladder={list(self.schedule.ladder)})"
