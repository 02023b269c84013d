"""The mesh reproduces the reference's rank layout (SPEC §2) for every legal layout on 8 devices."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from moe_jax import DistributedConfig
from moe_jax.distributed.mesh import DeviceLayout, build_mesh


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def legal_layouts(world=8):
    """Every (tp, fsdp, ep, dp_replicate) with tp * fsdp * dp_replicate == world and a legal ep."""
    layouts = []
    for tp, fsdp, replicate in itertools.product(_divisors(world), repeat=3):
        if tp * fsdp * replicate != world:
            continue
        for ep in _divisors(fsdp * tp):
            if ep == 1 or ep % tp == 0:
                layouts.append((tp, fsdp, ep, replicate))
    return layouts


LAYOUTS = legal_layouts()


def reference_groups(tp, fsdp, ep, replicate):
    """Device groups by the reference's formulas (SPEC §2), independently of the mesh code."""
    world = tp * fsdp * replicate
    block = fsdp * tp

    def group_by(key):
        groups = {}
        for rank in range(world):
            groups.setdefault(key(rank), []).append(rank)
        return sorted(groups.values())

    def within(rank):
        return rank % block

    return {
        "tp": group_by(lambda r: (r // block, within(r) // tp)),
        "fsdp": group_by(lambda r: (r // block, within(r) % tp)),
        "ep": group_by(lambda r: (r // block, within(r) // ep)),
        "efsdp": group_by(lambda r: (r // block, within(r) % ep)),
        "dp_replicate": group_by(lambda r: within(r)),
        "batch": group_by(lambda r: r // tp),
    }


def test_legal_layouts_cover_the_8_device_space():
    assert (2, 4, 4, 1) in LAYOUTS and (1, 8, 8, 1) in LAYOUTS and (2, 2, 2, 2) in LAYOUTS
    assert all(ep == 1 or (ep % tp == 0 and (fsdp * tp) % ep == 0) for tp, fsdp, ep, _ in LAYOUTS)
    # 10 (tp, fsdp, dp_replicate) triples; ep choices per triple: 1,2,3,4,2,3,4,2,3,2.
    assert len(LAYOUTS) == 26


@pytest.mark.parametrize("tp, fsdp, ep, replicate", LAYOUTS)
def test_device_groups_follow_reference_formulas(tp, fsdp, ep, replicate):
    config = DistributedConfig(tp_size=tp, fsdp_size=fsdp, ep_size=ep, dp_replicate_size=replicate)
    layout = DeviceLayout.from_config(config)
    expected = reference_groups(tp, fsdp, ep, replicate)
    for name, groups in expected.items():
        if name == "batch":
            # Batch index = rank // tp: the groups are the TP groups, and the index is the group's position.
            assert [layout.batch_index(r) for r in range(8)] == [r // tp for r in range(8)]
            continue
        assert layout.device_groups(name) == groups, name
    assert layout.num_devices == 8
    assert layout.group_size("efsdp") == (config.efsdp_size if ep > 1 else fsdp * tp)


@pytest.mark.parametrize("tp, fsdp, ep, replicate", LAYOUTS)
def test_mesh_collectives_run_over_reference_groups(tp, fsdp, ep, replicate):
    """A psum over a logical group's mesh axes adds exactly the devices of the reference's group."""
    config = DistributedConfig(tp_size=tp, fsdp_size=fsdp, ep_size=ep, dp_replicate_size=replicate)
    layout = DeviceLayout.from_config(config)
    mesh = build_mesh(config)
    assert [d.id for d in mesh.devices.flat] == [d.id for d in jax.devices()]
    all_axes = tuple(mesh.axis_names)
    ranks = jnp.arange(8, dtype=jnp.int32)
    expected = reference_groups(tp, fsdp, ep, replicate)

    names = ("tp", "fsdp", "ep", "efsdp", "dp_replicate")

    def bitmasks_of_groups(rank):
        # Each device contributes 2**rank; the psum over a group is the group's membership bitmask.
        bit = jnp.left_shift(jnp.ones_like(rank), rank)
        axes_of = [layout.axes(name) for name in names]
        return jnp.stack([jax.lax.psum(bit, axes) if axes else bit for axes in axes_of], axis=-1)

    masks = jax.jit(
        jax.shard_map(bitmasks_of_groups, mesh=mesh, in_specs=P(all_axes), out_specs=P(all_axes))
    )(ranks)
    for column, name in enumerate(names):
        members = [[r for r in range(8) if (int(mask) >> r) & 1] for mask in np.asarray(masks[:, column])]
        for rank in range(8):
            group = next(g for g in expected[name] if rank in g)
            assert members[rank] == group, (name, rank)


def test_mesh_needs_matching_device_count():
    """Devices passed explicitly must be exactly the layout's: the reference's world-size error."""
    config = DistributedConfig(tp_size=2, fsdp_size=2)
    with pytest.raises(RuntimeError, match="The parallel mesh requires 4 devices, but world_size is 8"):
        build_mesh(config, jax.devices())
    assert build_mesh(config, jax.devices()[:4]).devices.size == 4


def test_a_mesh_takes_the_first_devices_it_needs_by_default():
    """A 4-device layout on 8 devices (one process): `build_mesh` picks the first 4, as `jax.devices()[:4]`."""
    mesh = build_mesh(DistributedConfig(fsdp_size=4))
    assert list(mesh.devices.flat) == jax.devices()[:4]
    with pytest.raises(RuntimeError, match="requires 16 devices, but world_size is 8"):
        build_mesh(DistributedConfig(fsdp_size=16))


def test_a_model_takes_the_first_devices_it_needs_by_default():
    """A model's default devices are the job's first N (`model_devices`, `build_mesh`'s default too)."""
    from moe_jax.distributed.mesh import model_devices

    config = DistributedConfig(tp_size=2, fsdp_size=2)
    assert model_devices(config) == jax.devices()[:4]
    assert [d.id for d in build_mesh(config, model_devices(config)).devices.flat] == [0, 1, 2, 3]
    assert model_devices(config, jax.devices()[4:]) == jax.devices()[4:]
    with pytest.raises(RuntimeError, match="requires 16 devices, but world_size is 8"):
        build_mesh(DistributedConfig(fsdp_size=16), model_devices(DistributedConfig(fsdp_size=16)))


def test_trivial_config_uses_one_device():
    assert build_mesh(DistributedConfig()).devices.size == 1


def test_spec_example_tp2_fsdp4_ep4():
    layout = DeviceLayout.from_config(DistributedConfig(tp_size=2, fsdp_size=4, ep_size=4))
    assert layout.axis_sizes == {"pp": 1, "dp_replicate": 1, "efsdp": 2, "ep_fsdp": 2, "cp": 1, "ep_cp": 1, "tp": 2}
    assert layout.device_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.device_groups("fsdp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.device_groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.device_groups("efsdp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [list(layout.experts_of(r, 8)) for r in range(8)] == [[2 * (r % 4), 2 * (r % 4) + 1] for r in range(8)]


def test_hsdp_example():
    layout = DeviceLayout.from_config(DistributedConfig(dp_replicate_size=2, fsdp_size=2, tp_size=2, ep_size=2))
    assert layout.device_groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.device_groups("fsdp") == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_unknown_group_names_the_choices():
    layout = DeviceLayout.from_config(DistributedConfig())
    with pytest.raises(KeyError, match="use one of batch, fsdp, tp, ep, efsdp"):
        layout.axes("expert")


def test_experts_must_divide_over_ep():
    layout = DeviceLayout.from_config(DistributedConfig(fsdp_size=8, ep_size=8))
    with pytest.raises(ValueError, match="Cannot evenly shard 12 experts across 8 expert-parallel ranks."):
        layout.experts_of(0, 12)
