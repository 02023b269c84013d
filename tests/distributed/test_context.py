"""Context parallelism's layout: the config's fields and checks, the cp mesh axes, and the zig-zag order."""

import numpy as np
import pytest

from moe_jax import DistributedConfig
from moe_jax.distributed.context import zigzag_order
from moe_jax.distributed.mesh import DeviceLayout


def test_cp_adds_devices_and_an_axis_that_splits_the_sequence_and_the_tokens():
    config = DistributedConfig(cp_size=4, fsdp_size=2)
    assert config.num_devices == 8 and config.dp_size == 2
    layout = DeviceLayout.from_config(config)
    assert layout.cp_axes == ("cp",) and layout.batch_axes == ("efsdp",)
    assert layout.token_axes == ("efsdp", "cp") and layout.fsdp_axes == ("efsdp",)   # parameters: not over cp
    assert layout.device_groups("cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [layout.batch_index(rank) for rank in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize("sizes, ep_groups, cp_axes", [
    (dict(cp_size=4, fsdp_size=2, ep_size=4), [[0, 1, 2, 3], [4, 5, 6, 7]], ("ep_cp",)),       # ep inside cp
    (dict(cp_size=2, fsdp_size=4, ep_size=8), [list(range(8))], ("ep_cp",)),                  # ep spans cp and fsdp
    (dict(cp_size=4, fsdp_size=2, ep_size=2), [[0, 1], [2, 3], [4, 5], [6, 7]], ("cp", "ep_cp")),
    (dict(tp_size=2, cp_size=2, fsdp_size=2, ep_size=4), [[0, 1, 2, 3], [4, 5, 6, 7]], ("ep_cp",)),
])
def test_expert_groups_take_cp_ranks_as_more_tokens_of_the_batch(sizes, ep_groups, cp_axes):
    layout = DeviceLayout.from_config(DistributedConfig(**sizes))
    assert layout.device_groups("ep") == ep_groups      # consecutive ranks, as the reference's ep groups
    assert layout.cp_axes == cp_axes and layout.num_devices == 8


@pytest.mark.parametrize("kwargs, message", [
    (dict(cp_size=0), "Parallelism sizes must be >= 1, got 0."),
    (dict(cp_size=2, cp_strategy="ulysses"), "`cp_strategy` must be one of 'all_gather', 'ring', got 'ulysses'."),
    (dict(cp_size=4, fsdp_size=3, ep_size=8),
     "`ep_size` (8) must divide `fsdp_size * cp_size * tp_size` (12) with expert groups that nest in cp"),
    (dict(cp_size=3, fsdp_size=2, ep_size=2), "`ep_size / tp_size` (2) must divide `cp_size` (3)"),
])
def test_bad_context_parallel_configs_are_refused_with_the_fix(kwargs, message):
    with pytest.raises(ValueError) as error:
        DistributedConfig(**kwargs)
    assert message in str(error.value)


def test_a_config_without_cp_writes_the_references_json():
    assert "cp_size" not in DistributedConfig(tp_size=2).to_dict()
    assert DistributedConfig.from_dict(DistributedConfig(cp_size=2, cp_strategy="ring").to_dict()).cp_size == 2


def test_zigzag_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    np.testing.assert_array_equal(zigzag_order(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
    order = zigzag_order(64, 4)
    assert sorted(order) == list(range(64))
    with pytest.raises(ValueError, match=r"sequence length 12 cannot be split over cp_size=4.*multiple of 8"):
        zigzag_order(12, 4)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_causal_work_per_rank_is_balanced_in_the_zigzag_order_and_not_in_contiguous_slices(cp):
    """The causal attention work of a rank: the (query, key) pairs its queries see, sum over its queries of
    index + 1. Zig-zag: every rank within 10% of the others (the ring does each step's visible half only)."""
    length = 1024 * cp

    def work(order):
        per_rank = order.reshape(cp, -1) + 1
        return per_rank.sum(axis=1)

    balanced, contiguous = work(zigzag_order(length, cp)), work(np.arange(length))
    assert balanced.max() / balanced.min() < 1.10
    assert contiguous.max() / contiguous.min() > 2.0
