"""TrainLoop's records against its replay count, on a host-only stand-in step (`fake_steps`): `replayed` marks the
batches that overflowed, not the step queued behind one (run again too), so the records agree with `replays` and the
summary line's count."""

from __future__ import annotations

from moe_jax.distributed.capacity import CapacityState
from moe_jax.training.loop import TrainLoop

from .fake_steps import FakeBatches, FakeState, FakeStep


def test_only_the_batch_that_overflowed_is_marked_replayed():
    step = FakeStep(needs={0: 2.0})              # the first batch needs the second rung; the run starts on the first
    records = []
    loop = TrainLoop(step, FakeBatches(), on_step=records.append)
    state, capacity = loop.run(FakeState(capacity=1.0), until_step=4, capacity_state=CapacityState(1.0))
    # Batch 0 overflowed and batch 1, queued behind it, returned its input state: both run again, at 2.0.
    assert step.dispatched == [0, 1, 0, 1, 2, 3]
    assert [(r["step"], r["replayed"], r["replays"], r["capacity"]) for r in records] == [
        (1, True, 1, 2.0), (2, False, 1, 2.0), (3, False, 1, 2.0), (4, False, 1, 2.0)]
    assert loop.replays == 1 and capacity.capacity == 2.0 and state.step == 4


def test_an_overflow_mid_run_marks_that_step_only():
    step = FakeStep(needs={2: 2.0})
    records = []
    loop = TrainLoop(step, FakeBatches(), on_step=records.append)
    loop.run(FakeState(capacity=1.0), until_step=4, capacity_state=CapacityState(1.0))
    assert [r["step"] for r in records if r["replayed"]] == [3]
    assert [r["replays"] for r in records] == [0, 0, 1, 1] and loop.replays == 1
