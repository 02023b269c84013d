"""The capacity ladder, buffer sizes, the required capacity, the schedule that moves the capacity and the
replay of a call that overflowed."""

from types import SimpleNamespace

import jax.numpy as jnp
import pytest

from moe_jax.distributed.capacity import (
    CapacitySchedule,
    CapacityState,
    CapacityTracker,
    DispatchStatistics,
    buffer_rows,
    capacity_ladder,
    replay_until_exact,
    required_capacity,
)


def test_buffer_rows_round_up_to_eight_and_never_exceed_all_pairs():
    assert buffer_rows(1.25, 64, 8) == 16  # ceil(10) -> 16
    assert buffer_rows(4.0, 64, 8) == 32
    assert buffer_rows(8.0, 64, 8) == 64
    assert buffer_rows(8.0, 5, 8) == 8  # at most round_up(pairs, 8)


def test_required_capacity_is_the_lowest_that_fits():
    ladder = capacity_ladder(8)
    # 64 pairs per device: 1.25, 1.5 and 2 hold 16 rows, 3 holds 24, 4 holds 32, 6 holds 48, 8 holds 64.
    expected = {0: 1.25, 16: 1.25, 17: 3.0, 24: 3.0, 25: 4.0, 32: 4.0, 33: 6.0, 48: 6.0, 49: 8.0, 64: 8.0}
    for peak, capacity in expected.items():
        assert float(required_capacity(jnp.int32(peak), 64, 8, ladder)) == capacity, peak


def test_statistics_combine_sums_counts_and_takes_maxima():
    a = DispatchStatistics(jnp.int32(1), jnp.int32(2), jnp.int32(16), jnp.float32(2.0))
    b = DispatchStatistics(jnp.int32(3), jnp.int32(4), jnp.int32(8), jnp.float32(4.0))
    total = a.combine(b)
    assert (int(total.dropped), int(total.padded), int(total.buffer_rows), float(total.required_capacity)) == (
        4, 6, 16, 4.0)


def test_schedule_climbs_straight_to_what_was_required():
    schedule = CapacitySchedule.for_ep(8)
    state = schedule.start()
    assert state.capacity == 1.25
    assert schedule.overflowed(state, 4.0)
    assert schedule.update(state, 4.0) == CapacityState(4.0)


def test_schedule_steps_down_one_capacity_after_patience_calm_calls():
    schedule = CapacitySchedule.for_ep(8, patience=3)
    state = CapacityState(8.0)
    for _ in range(2):
        state = schedule.update(state, 1.25)
        assert state.capacity == 8.0
    state = schedule.update(state, 2.0)
    assert state == CapacityState(6.0)  # one step down, not straight to what the calm calls needed
    for _ in range(3):
        state = schedule.update(state, 2.0)
    assert state == CapacityState(4.0)


def test_a_call_needing_the_current_capacity_breaks_the_calm_streak():
    schedule = CapacitySchedule.for_ep(8, patience=2)
    state = schedule.update(CapacityState(4.0), 1.25)
    assert state.calm_calls == 1
    state = schedule.update(state, 4.0)
    assert state == CapacityState(4.0)
    assert schedule.update(schedule.update(state, 2.0), 2.0) == CapacityState(3.0)


def test_a_call_needing_exactly_the_lower_capacity_counts_as_calm():
    """The boundary of stepping down: a call whose required capacity is the rung below fits there, so it counts
    towards the step down (a strict comparison would pin the capacity while every call needs that rung)."""
    schedule = CapacitySchedule.for_ep(8, patience=2)
    state = schedule.update(CapacityState(4.0), 3.0)
    assert state == CapacityState(4.0, calm_calls=1, calm_peak=3.0)
    assert schedule.update(state, 3.0) == CapacityState(3.0)
    # At the first rung there is nothing below: the state stays as it is.
    assert schedule.update(CapacityState(1.25), 1.25) == CapacityState(1.25)


def test_capacity_off_the_ladder_is_refused():
    schedule = CapacitySchedule.for_ep(8)
    with pytest.raises(ValueError, match=r"capacity=2.5 is not on the dispatch capacity ladder \[1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0\]"):
        schedule.check(2.5)
    with pytest.raises(ValueError, match="patience=0 must be >= 1"):
        CapacitySchedule((1.25, 2.0), patience=0)


class Needs:
    """A stand-in for a call whose busiest buffer needs `capacity`: it drops pairs below it (the counts an EP
    implementation reports; `always_drops`: a broken one, at every capacity) and records the capacities it ran
    at."""

    def __init__(self, capacity, always_drops=False):
        self.capacity, self.always_drops, self.ran_at = capacity, always_drops, []

    def __call__(self, capacity):
        self.ran_at.append(capacity)
        dropped = 5 if capacity < self.capacity or self.always_drops else 0
        statistics = DispatchStatistics(jnp.int32(dropped), jnp.int32(0), jnp.int32(16), jnp.float32(self.capacity))
        return SimpleNamespace(statistics=statistics)


def test_replay_until_exact_replays_once_at_the_required_capacity_and_moves_the_state_as_update_does():
    schedule = CapacitySchedule.for_ep(8, patience=2)
    call = Needs(3.0)
    output, state, capacity, recomputed = replay_until_exact(call, schedule, schedule.start())
    assert call.ran_at == [1.25, 3.0] and recomputed == 1          # straight to what it required
    assert capacity == 3.0 and int(output.statistics.dropped) == 0
    assert state == schedule.update(schedule.start(), 3.0) == CapacityState(3.0)
    # Calm calls (they fit 2.0): no replay; the state moves by `update`, one rung down after `patience`.
    for expected in (CapacityState(3.0, 1, 1.25), CapacityState(2.0)):
        calm = Needs(1.25)
        _, state, capacity, recomputed = replay_until_exact(calm, schedule, state)
        assert calm.ran_at == [3.0] and recomputed == 0 and state == expected


def test_replay_until_exact_checks_a_call_already_dispatched():
    schedule = CapacitySchedule.for_ep(8)
    call = Needs(4.0)
    dispatched = (call(1.25), 1.25)
    _, state, capacity, recomputed = replay_until_exact(call, schedule, schedule.start(), dispatched=dispatched)
    assert call.ran_at == [1.25, 4.0] and (capacity, recomputed) == (4.0, 1) and state == CapacityState(4.0)


def test_settle_climbs_at_least_a_rung_and_refuses_a_drop_at_the_largest_capacity():
    schedule = CapacitySchedule.for_ep(8)
    # A call that dropped pairs but claims to need no more than it had: replayed a rung up, not in place.
    assert schedule.settle(CapacityState(2.0), 2.0, 3, 1.25) == (CapacityState(3.0), True)
    assert schedule.settle(CapacityState(2.0), 2.0, 0, 1.25) == (CapacityState(2.0, 1, 1.25), False)
    with pytest.raises(RuntimeError, match=r"3 \(token, expert\) pairs were dropped at the largest capacity "
                                           r"\(8.0\); its buffers hold every pair a device sends"):
        schedule.settle(CapacityState(8.0), 8.0, 3, 8.0)
    always_drops = Needs(8.0, always_drops=True)
    with pytest.raises(RuntimeError, match="dropped at the largest capacity"):
        replay_until_exact(always_drops, schedule, schedule.start())
    assert always_drops.ran_at == [1.25, 8.0]


def test_a_tracker_holds_the_state_its_schedule_moves():
    schedule = CapacitySchedule.for_ep(8, patience=2)
    tracker = CapacityTracker(schedule)
    assert tracker.capacity == 1.25 and tracker.state == CapacityState(1.25)
    # An overflow: replay, at what the call required; the same decision as the schedule's.
    assert tracker.settle(1.25, 7, 3.0) is True and tracker.state == CapacityState(3.0)
    assert tracker.observe(Needs(1.25)(3.0).statistics, ran_at=3.0) is False
    assert tracker.state == CapacityState(3.0, 1, 1.25)
    replayed = tracker.run_exact(Needs(1.25))
    assert replayed.recomputed == 0 and tracker.state == CapacityState(2.0)   # patience 2: one rung down
    tracker.restart(4.0)
    assert tracker.state == CapacityState(4.0)
    with pytest.raises(ValueError, match=r"capacity=5.0 is not on the dispatch capacity ladder"):
        tracker.restart(5.0)
    resumed = CapacityTracker(schedule, CapacityState(3.0, 1, 2.0))
    assert resumed.capacity == 3.0 and resumed.state.calm_calls == 1


def test_a_tracker_without_dispatch_buffers_holds_no_capacity_and_refuses_a_drop():
    tracker = CapacityTracker(CapacitySchedule.for_ep(1), dispatches=False)
    assert tracker.state is None and tracker.capacity is None
    with pytest.raises(RuntimeError, match="dropped at the largest capacity"):
        tracker.settle(None, 1, 1.0)
