"""The step-time model on a known program: a roofline per kernel, alpha-beta per collective and link, and the
bubble and padding carved out so the parts still add up."""

import pytest

from moe_jax.planning.hardware import HardwareProfile, Link, load_hardware
from moe_jax.planning.hlo_costs import Collective, Kernel, ProgramCosts
from moe_jax.planning.step_time import predict_step_time

PROFILE = HardwareProfile(name="test", peak_flops={"bfloat16": 1e12, "float32": 5e11}, hbm_bytes_per_second=1e11,
                          memory_bytes=1e10, devices_per_node=4, intra_node=Link(1e10, 1e-6),
                          inter_node=Link(1e9, 1e-5), kernel_overhead_seconds=1e-6)


def test_a_kernel_takes_the_longer_of_its_flops_and_its_bytes():
    costs = ProgramCosts(kernels=[Kernel(2e9, 1e8, 3, False), Kernel(1e6, 1e9, 1, False)])
    time = predict_step_time(costs, PROFILE, compute_dtype="bfloat16")
    assert time.parts["compute"] == pytest.approx(3 * 2e-3 + 1e-6)
    assert time.parts["memory"] == pytest.approx(1e-2 - 1e-6)                  # the second is memory-bound
    assert time.parts["launch overhead"] == pytest.approx(4e-6)
    assert time.seconds == pytest.approx(sum(time.parts.values()))
    assert predict_step_time(costs, PROFILE, compute_dtype="float32").parts["compute"] == pytest.approx(
        2 * time.parts["compute"], rel=1e-3)


def test_a_collective_uses_the_link_its_groups_need():
    within = Collective("all-reduce", 1e8, ((0, 1, 2, 3), (4, 5, 6, 7)), 1, False)
    across = Collective("all-reduce", 1e8, ((0, 4), (1, 5), (2, 6), (3, 7)), 1, False)
    time = predict_step_time(ProgramCosts(collectives=[within, across]), PROFILE, compute_dtype="bfloat16")
    assert time.parts["all-reduce (within a node)"] == pytest.approx(6 * 1e-6 + 1.5 * 1e8 / 1e10)
    assert time.parts["all-reduce (across nodes)"] == pytest.approx(2 * 1e-5 + 1.0 * 1e8 / 1e9)
    one_node = predict_step_time(ProgramCosts(collectives=[across]), PROFILE, compute_dtype="bfloat16",
                                 devices_per_node=8)
    assert set(one_node.parts) >= {"all-reduce (within a node)"}


def test_the_bubble_and_the_padding_are_parts_of_their_own():
    costs = ProgramCosts(kernels=[Kernel(1e9, 0, 10, True), Kernel(1e9, 0, 10, False)],
                         collectives=[Collective("all-to-all", 1e8, ((0, 1, 2, 3),), 1, True)])
    plain = predict_step_time(costs, PROFILE, compute_dtype="bfloat16")
    carved = predict_step_time(costs, PROFILE, compute_dtype="bfloat16", bubble_fraction=0.25,
                               padding_fraction=0.2)
    assert carved.seconds == pytest.approx(plain.seconds)
    inside = 10e-3 + 10e-6 + plain.parts["all-to-all (within a node)"]
    assert carved.parts["pipeline bubble"] == pytest.approx(0.25 * inside)
    assert carved.parts["dispatch padding"] == pytest.approx(0.2 * 0.75 * plain.parts["all-to-all (within a node)"])


def test_every_named_profile_names_its_source():
    for name in ("h100", "h200", "b200", "a100", "tpu-v5p"):
        profile = load_hardware(name)
        assert profile.source and profile.peak_flops["bfloat16"] > 1e14 and profile.memory_bytes > 5e10
