"""The loop's dropless replay: a batch routed to one expert in the middle of a run overflows, is replayed at
a larger capacity, and the curve stays the one-device curve; the capacity comes back down afterwards."""

import numpy as np

from moe_jax.distributed.capacity import CapacitySchedule

from .conftest import FixtureBatches
from .test_loss_curves import train_curve

ADVERSARIAL_STEP = 5
ADVERSARIAL_TOKEN = 7


def adversarial_batches() -> FixtureBatches:
    # Every token is id 7: identical hidden states, so every token picks the same two experts and the
    # batch needs more than the rung it is dispatched at.
    return FixtureBatches(replace={ADVERSARIAL_STEP - 1: np.full((8, 12), ADVERSARIAL_TOKEN, np.int32)})


def test_an_adversarial_batch_is_replayed_at_a_larger_capacity_and_the_curve_is_the_one_device_curve(trainers):
    _, single_step = trainers("one_device")
    expected = train_curve(single_step, adversarial_batches(), until_step=9)
    model, train_step = trainers("tp2_fsdp4_ep4")
    schedule = CapacitySchedule(model.capacity_schedule.ladder, patience=2)
    records = train_curve(train_step, adversarial_batches(), until_step=9, schedule=schedule)

    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in expected], rtol=1e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in records], [r["grad_norm"] for r in expected], rtol=1e-4)
    assert [r["step"] for r in records] == list(range(1, 10))       # every batch applied once, in order
    adversarial = records[ADVERSARIAL_STEP - 1]
    # Only a batch that overflowed is marked (the step queued behind it was run again too, but did not overflow):
    # exactly the records whose replays count went up.
    counted = [r["step"] for r, before in zip(records, [{"replays": 0}, *records]) if r["replays"] > before["replays"]]
    assert [r["step"] for r in records if r["replayed"]] == counted and ADVERSARIAL_STEP in counted
    assert adversarial["replays"] > records[ADVERSARIAL_STEP - 2]["replays"]    # it overflowed and was rerun
    assert adversarial["capacity"] >= adversarial["required_capacity"] > schedule.ladder[0]
