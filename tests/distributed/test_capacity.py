"""The capacity ladder, buffer sizes, the required capacity and the schedule that moves the capacity."""

import jax.numpy as jnp
import pytest

from moe_jax.distributed.capacity import (
    CapacitySchedule,
    CapacityState,
    DispatchStatistics,
    buffer_rows,
    capacity_ladder,
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


def test_capacity_off_the_ladder_is_refused():
    schedule = CapacitySchedule.for_ep(8)
    with pytest.raises(ValueError, match=r"capacity=2.5 is not on the dispatch capacity ladder \[1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0\]"):
        schedule.check(2.5)
    with pytest.raises(ValueError, match="patience=0 must be >= 1"):
        CapacitySchedule((1.25, 2.0), patience=0)
