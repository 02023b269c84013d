"""The router-collapse warning (`RouterCollapseWatch`): once, after the stated steps above the stated share, naming
the layer and the ways to balance it; never for an even router or a short spike."""

from __future__ import annotations

import warnings

import pytest

from moe_jax.training.loop import TrainLoop
from moe_jax.training.router_health import COLLAPSE_SHARE, COLLAPSE_STEPS, RouterCollapseWatch

from .fake_steps import FakeBatches, FakeState, FakeStep


def record(step: int, loads: list[list[int]]) -> dict:
    return {"step": step, "expert_load": loads, "expert_load_layers": [1, 3]}


def test_a_layer_above_the_share_for_the_steps_warns_once_naming_it_and_the_flags():
    watch = RouterCollapseWatch()
    even, collapsed = [8, 8, 8, 8], [30, 2, 0, 0]                 # busiest / mean: 1.0 and 3.75
    assert 30 / 8 > COLLAPSE_SHARE
    for step in range(1, COLLAPSE_STEPS):
        assert watch(record(step, [even, collapsed])) is None
    with pytest.warns(RuntimeWarning, match=r"router of layer 3 .* more than 2.5x .* for 20 steps \(now 3.8x, step 20\)"):
        message = watch(record(COLLAPSE_STEPS, [even, collapsed]))
    assert "--router-z-loss-coef" in message and "--router-bias-update-rate" in message and "aux loss" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert watch(record(COLLAPSE_STEPS + 1, [even, collapsed])) is None   # once


def test_a_spike_shorter_than_the_steps_and_an_even_router_say_nothing():
    watch = RouterCollapseWatch(share=2.0, steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step, hot in enumerate([True, True, False, True, True, False, False], start=1):
            load = [9, 1, 1, 1] if hot else [3, 3, 3, 3]
            assert watch(record(step, [load, [3, 3, 3, 3]])) is None
        assert watch({"step": 8, "loss": 1.0}) is None                 # no expert_load: nothing to watch


def test_a_given_remedy_and_reporter_make_the_one_line_a_command_prints():
    lines = []
    watch = RouterCollapseWatch(share=2.0, steps=2, remedy="--router-aux-loss-coef C (e.g. 1e-3)",
                                report=lines.append)
    for step in (1, 2, 3):
        watch(record(step, [[8, 0, 0, 0], [2, 2, 2, 2]]))                # layer 1: 4.0x the mean
    assert lines == ["the router of layer 1 has sent its busiest expert more than 2x the mean tokens per expert for 2 "
                     "steps (now 4.0x, step 2): it is collapsing onto a few experts. Balance it with "
                     "--router-aux-loss-coef C (e.g. 1e-3)."]


def test_the_train_loop_hands_each_record_to_its_router_watch():
    lines, records = [], []
    watch = RouterCollapseWatch(steps=3, report=lines.append)
    TrainLoop(FakeStep(), FakeBatches(), on_step=records.append, router_watch=watch).run(FakeState(), until_step=5)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert len(lines) == 1 and "layer 1" in lines[0] and "(now 4.0x, step 3)" in lines[0]
    with pytest.warns(RuntimeWarning, match=r"router of layer 1 .* for 20 steps \(now 4.0x, step 20\)"):
        TrainLoop(FakeStep(), FakeBatches()).run(FakeState(), until_step=20)    # the default watch
