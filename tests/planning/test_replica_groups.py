"""The device groups of a collective in each form XLA prints them."""

from moe_jax.planning.replica_groups import crosses_nodes, device_groups


def test_explicit_groups_and_permute_pairs():
    assert device_groups("channel_id=1, replica_groups={{0,1},{2,3}}, use_global_device_ids=true", 4) == [[0, 1], [2, 3]]
    assert device_groups("source_target_pairs={{0,1},{1,0}}", 2) == [[0, 1], [1, 0]]


def test_iota_groups_with_and_without_a_transpose():
    assert device_groups("replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}", 8) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert device_groups("replica_groups=[4,2]<=[8], to_apply=%add", 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_mesh_groups_over_named_axes_and_device_ids():
    assert device_groups("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dim", 8) == [[0, 2, 4, 6],
                                                                                             [1, 3, 5, 7]]
    assert device_groups("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}", 8) == [[0, 1], [2, 3], [4, 5],
                                                                                        [6, 7]]
    permuted = "replica_groups=mesh['axis_0'=8,'axis_1'=1], device_ids=([2,4]T(1,0)) {'axis_0'}, x"
    assert device_groups(permuted, 8) == [[0, 4, 1, 5, 2, 6, 3, 7]]


def test_no_groups_is_every_device():
    assert device_groups("replica_groups={}, to_apply=%add", 4) == [[0, 1, 2, 3]]


def test_a_group_crosses_nodes_when_its_devices_do():
    assert not crosses_nodes([[0, 1], [2, 3]], devices_per_node=2)
    assert crosses_nodes([[0, 2], [1, 3]], devices_per_node=2)
