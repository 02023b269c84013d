"""The loop's dropless replay: a batch routed to one expert in the middle of a run overflows, is replayed at
a larger capacity, and the curve stays the one-device curve; the capacity comes back down afterwards."""

import numpy as np

from moe_jax.distributed.capacity import CapacitySchedule

from .conftest import FixtureBatches
from .test_loss_curves import train_curve

ADVERSARIAL_STEP = 5
ADVERSARIAL_TOKEN = 7


def adversarial_batches() -> FixtureBatches:
    # Every token is id 7: identical hidden states, so every token picks the same two experts, which for id 7
    # (after 4 steps) are experts 4 and 5 in the first sparse layer: one EP device (ep=2: 4 experts each,
    # ep=4: 2 each).
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
    assert adversarial["replayed"] and adversarial["capacity"] == schedule.largest
    assert adversarial["required_capacity"] == schedule.largest
    assert max(r["capacity"] for r in records[: ADVERSARIAL_STEP - 1]) < schedule.largest
    # Down again by the hysteresis rule: `patience` calm steps at the top, then one rung lower (the step
    # after them was already queued at the top rung: the loop confirms one step late).
    assert records[-1]["capacity"] < schedule.largest
    assert records[-1]["replays"] >= 1
