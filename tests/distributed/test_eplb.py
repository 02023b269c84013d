"""Expert placement (`moe_jax.distributed.eplb`): DeepSeek's EPLB worked example, an independent straight-line
version of the algorithm on random loads, the balance it buys, the identity placement, replica choice and the
errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.distributed.eplb import (
    ExpertPlacement,
    balanced_placement,
    better_placement,
    check_num_redundant_experts,
    choose_replica,
    expected_rank_load,
    identity_placement,
    placement_from_slots,
    spread_replicas,
)

# DeepSeek's EPLB README: two layers of 12 experts, 16 physical slots, 4 groups, 2 nodes, 8 GPUs, and the
# physical-to-logical map it prints for them (the hierarchical policy).
README_LOAD = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
README_PHYSICAL_TO_LOGICAL = np.array([[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                       [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]])


# ---- a straight-line version, from the algorithm's description --------------------------------------------------
def straight_replicate(loads: list[float], slots: int) -> tuple[list[int], list[int]]:
    """Indices 0..n-1, then each extra slot to the index with the highest load per copy (lowest index on a tie)."""
    copies = [1] * len(loads)
    placed = list(range(len(loads)))
    while len(placed) < slots:
        best = 0
        for index in range(1, len(loads)):
            if loads[index] / copies[index] > loads[best] / copies[best]:
                best = index
        placed.append(best)
        copies[best] += 1
    return placed, copies


def straight_pack(weights: list[float], packs: int) -> list[list[int]]:
    """Item indices per pack, in the order each pack took them: heaviest item first (earlier item on a tie) onto
    the lightest pack with room (lower pack on a tie); with one item per pack, item i stays in pack i."""
    size = len(weights) // packs
    if size == 1:
        return [[index] for index in range(len(weights))]
    contents = [[] for _ in range(packs)]
    totals = [0.0] * packs
    for index in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        open_packs = [pack for pack in range(packs) if len(contents[pack]) < size]
        pack = min(open_packs, key=lambda p: (totals[p], p))
        contents[pack].append(index)
        totals[pack] += weights[index]
    return contents


def straight_layer(loads: list[float], redundant: int, ranks: int, groups: int, nodes: int) -> list[int]:
    experts = len(loads)
    group_size = experts // groups
    group_loads = [sum(loads[g * group_size:(g + 1) * group_size]) for g in range(groups)]
    slots = []
    for node_groups in straight_pack(group_loads, nodes):
        members = [e for g in node_groups for e in range(g * group_size, (g + 1) * group_size)]
        member_loads = [loads[e] for e in members]
        placed, copies = straight_replicate(member_loads, (experts + redundant) // nodes)
        weights = [member_loads[m] / copies[m] for m in placed]
        for rank in straight_pack(weights, ranks // nodes):
            slots += [members[placed[item]] for item in rank]
    return slots


def straight_placement(load: np.ndarray, redundant: int, ranks: int, groups: int | None, nodes: int) -> np.ndarray:
    if groups is None or groups % nodes:
        groups, nodes = 1, 1
    return np.array([straight_layer([float(x) for x in row], redundant, ranks, groups, nodes) for row in load])


# ---- the worked example and the straight-line version --------------------------------------------------------
def test_deepseeks_worked_example_is_reproduced_exactly():
    placement = balanced_placement(README_LOAD, num_redundant_experts=4, ep_size=8, num_groups=4, num_nodes=2)
    np.testing.assert_array_equal(placement.physical_to_logical, README_PHYSICAL_TO_LOGICAL)
    placement.check(num_layers=2, num_experts=12, num_redundant_experts=4, ep_size=8)
    jax.tree.map(np.testing.assert_array_equal, placement_from_slots(README_PHYSICAL_TO_LOGICAL, 12), placement)
    # The four hottest per-replica experts got the extra slots: layer 0's 10, 5, 1, 4; layer 1's 5, 6, 8, 1.
    np.testing.assert_array_equal(placement.replica_count,
                                  [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]])
    # Hierarchical: node 0 (slots 0-7) holds whole groups of 3 experts, as does node 1.
    for layer in range(2):
        for node in range(2):
            groups = {int(e) // 3 for e in placement.physical_to_logical[layer, node * 8:(node + 1) * 8]}
            assert len(groups) == 2, (layer, node, groups)


CASES = [  # (layers, experts, redundant, ranks, groups, nodes)
    (3, 16, 0, 4, None, 1), (3, 16, 4, 4, None, 1), (2, 12, 4, 8, 4, 2), (2, 32, 8, 8, 4, 2), (2, 64, 16, 16, 8, 4),
    (2, 8, 8, 4, None, 1), (2, 16, 0, 16, None, 1), (2, 24, 8, 8, 6, 4), (2, 32, 32, 4, 8, 2), (1, 60, 4, 8, 6, 2),
]


@pytest.mark.parametrize("integer_loads", [False, True], ids=["continuous", "ties"])
@pytest.mark.parametrize(("layers", "experts", "redundant", "ranks", "groups", "nodes"), CASES)
def test_the_placement_equals_a_straight_line_version(layers, experts, redundant, ranks, groups, nodes,
                                                      integer_loads):
    rng = np.random.default_rng(experts * 31 + redundant + ranks)
    load = rng.integers(0, 6, (layers, experts)) if integer_loads else rng.exponential(100.0, (layers, experts))
    placement = balanced_placement(load, num_redundant_experts=redundant, ep_size=ranks, num_groups=groups,
                                   num_nodes=nodes)
    np.testing.assert_array_equal(placement.physical_to_logical,
                                  straight_placement(load, redundant, ranks, groups, nodes))
    placement.check(layers, experts, redundant, ranks)


def test_the_placement_is_a_pytree_of_int32_arrays_that_fits_a_jit():
    placement = balanced_placement(README_LOAD, num_redundant_experts=4, ep_size=8)
    leaves = jax.tree.leaves(placement)
    assert [leaf.shape for leaf in leaves] == [(2, 16), (2, 12, 5), (2, 12)]
    assert all(leaf.dtype == np.int32 for leaf in leaves)
    other = balanced_placement(README_LOAD[::-1], num_redundant_experts=4, ep_size=8)
    assert jax.tree.structure(other) == jax.tree.structure(placement)   # a new placement: the same program

    traces = []

    @jax.jit
    def total(placement: ExpertPlacement):
        traces.append(1)
        return placement.replica_count.sum() + placement.physical_to_logical.sum()

    assert int(total(placement)) == 16 * 2 + int(placement.physical_to_logical.sum())
    total(other)
    assert len(traces) == 1


# ---- what it buys -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("groups", "nodes"), [(None, 1), (8, 2)])
def test_a_skewed_load_is_spread_far_more_evenly_than_by_the_identity_placement(groups, nodes):
    rng = np.random.default_rng(0)
    experts, redundant, ranks = 64, 16, 16
    # Zipf-like: a few experts take most tokens, in a different order per layer.
    load = np.stack([rng.permutation(1000.0 / np.arange(1, experts + 1) ** 1.2) for _ in range(4)])
    balanced = expected_rank_load(
        balanced_placement(load, num_redundant_experts=redundant, ep_size=ranks, num_groups=groups,
                           num_nodes=nodes), load, ranks)
    identity = expected_rank_load(identity_placement(4, experts, num_redundant_experts=redundant, ep_size=ranks),
                                  load, ranks)
    np.testing.assert_allclose(balanced.sum(1), load.sum(1))    # every token still goes somewhere
    imbalance = lambda rank_load: (rank_load.max(1) / rank_load.mean(1)).max()  # noqa: E731
    assert imbalance(identity) > 2.0
    assert imbalance(balanced) < 1.3 if groups else imbalance(balanced) < 1.1
    assert imbalance(balanced) < imbalance(identity) / 2


def test_replicas_go_to_the_busiest_experts():
    load = np.array([[1.0, 100.0, 2.0, 40.0, 3.0, 4.0, 5.0, 6.0]])
    placement = balanced_placement(load, num_redundant_experts=4, ep_size=4)
    # 100 -> 50 (2 copies), 40 vs 50 -> 100 gets a third (33.3), then 40 -> 20, then 33.3 -> a fourth (25).
    np.testing.assert_array_equal(placement.replica_count[0], [1, 4, 1, 2, 1, 1, 1, 1])
    ranks = expected_rank_load(placement, load, 4)[0]
    assert ranks.max() - ranks.min() < 25.0 + 1e-9   # greedy packing: within one replica's weight


def test_a_re_placement_never_makes_a_layer_worse_on_its_load():
    """Greedy packing is not optimal: on [10, 10, 1, 1] (4 + 4 slots, 4 ranks of 2) it gives both hot experts 3
    replicas (busiest rank 6.67), where 4 + 2 replicas hold every rank to 6. A layer already running that keeps
    it; a layer the proposal improves takes it; per layer, in one placement."""
    load = np.array([[10.0, 10, 1, 1], [10, 10, 1, 1]])
    good = [1, 2, 1, 3, 0, 0, 0, 0]                       # rank loads 6, 6, 5, 5
    current = placement_from_slots([good, [0, 1, 2, 3, 0, 1, 2, 3]], 4)      # layer 1: the identity
    proposed = balanced_placement(load, num_redundant_experts=4, ep_size=4)
    assert expected_rank_load(proposed, load, 4).max(1).round(2).tolist() == [6.67, 6.67]
    chosen = better_placement(current, proposed, load, ep_size=4).check(2, 4, 4, 4)
    np.testing.assert_array_equal(chosen.physical_to_logical, [good, proposed.physical_to_logical[1]])
    assert expected_rank_load(chosen, load, 4).max(1).round(2).tolist() == [6.0, 6.67]
    # On device arrays too (a train state's placement), and a tie keeps the placement in force.
    on_device = jax.tree.map(jnp.asarray, proposed)
    np.testing.assert_array_equal(better_placement(on_device, current, load, 4).physical_to_logical,
                                  [good, proposed.physical_to_logical[1]])
    same = better_placement(current, placement_from_slots(np.roll(current.physical_to_logical, 2, 1), 4), load, 4)
    np.testing.assert_array_equal(same.physical_to_logical, current.physical_to_logical)


def test_the_identity_placement():
    plain = identity_placement(3, 8, ep_size=4)
    np.testing.assert_array_equal(plain.physical_to_logical, np.tile(np.arange(8), (3, 1)))
    np.testing.assert_array_equal(plain.logical_to_physical[..., 0], np.tile(np.arange(8), (3, 1)))
    np.testing.assert_array_equal(plain.replica_count, np.ones((3, 8)))
    plain.check(3, 8, 0, 4)
    redundant = identity_placement(2, 6, num_redundant_experts=2, ep_size=4).check(2, 6, 2, 4)
    np.testing.assert_array_equal(redundant.physical_to_logical[0], [0, 1, 2, 3, 4, 5, 0, 1])
    np.testing.assert_array_equal(redundant.logical_to_physical[1, :2], [[0, 6, -1], [1, 7, -1]])
    np.testing.assert_array_equal(redundant.replica_count[0], [2, 2, 1, 1, 1, 1])


# ---- choosing a replica -----------------------------------------------------------------------------------------
def test_a_hot_experts_tokens_are_spread_evenly_over_its_replicas():
    load = np.array([[900.0, 10, 10, 10, 10, 10, 10, 10], [10, 10, 10, 10, 10, 10, 10, 900.0]])
    placement = balanced_placement(load, num_redundant_experts=4, ep_size=4)
    assert placement.replica_count[0, 0] == 5 and placement.replica_count[1, 7] == 5
    tokens = 1000
    ids = np.stack([np.zeros(tokens), np.arange(tokens) % 8], axis=1).astype(np.int32)   # [N, 2]: expert 0 and one
    chosen = jax.jit(choose_replica)(placement.layer(0), ids, jnp.arange(tokens))
    chosen = np.asarray(chosen)
    assert chosen.shape == (tokens, 2) and chosen.dtype == np.int32
    np.testing.assert_array_equal(placement.physical_to_logical[0][chosen], ids)   # every slot holds its expert
    slots, counts = np.unique(chosen[:, 0], return_counts=True)
    np.testing.assert_array_equal(slots, np.sort(placement.logical_to_physical[0, 0]))
    np.testing.assert_array_equal(counts, [200] * 5)
    # A pure function of the position: the same answer every call and for any order of the tokens.
    order = np.random.default_rng(0).permutation(tokens)
    again = np.asarray(choose_replica(placement.layer(0), ids[order], jnp.arange(tokens)[order]))
    np.testing.assert_array_equal(again, chosen[order])


def test_spread_replicas_gives_each_replica_its_share_to_within_one_per_block_wherever_the_pairs_sit():
    """A hot expert 0 with 5 replicas on 3 in 4 of 1000 random positions: by position (`choose_replica`) its
    replicas get uneven shares; taken in turn within each of 8 blocks, within one pair per block of 1/5 each, and
    the padding rows' pairs come after the real ones (the real pairs alone are even)."""
    load = np.array([[900.0, 10, 10, 10, 10, 10, 10, 10]])
    placement = balanced_placement(load, num_redundant_experts=4, ep_size=4)
    rng = np.random.default_rng(0)
    tokens = 1000
    ids = np.stack([np.where(rng.random(tokens) < 0.75, 0, rng.integers(1, 8, tokens)),
                    rng.integers(1, 8, tokens)], axis=1).astype(np.int32)
    real = (rng.random(tokens) < 0.9).astype(np.int32)
    spread = np.asarray(jax.jit(spread_replicas, static_argnames="blocks")(placement.layer(0), ids, blocks=8,
                                                                            real=jnp.asarray(real)))
    by_position = np.asarray(choose_replica(placement.layer(0), ids, jnp.arange(tokens)))
    np.testing.assert_array_equal(placement.physical_to_logical[0][spread], ids)    # every slot holds its expert
    hot = ids[:, 0] == 0
    share = {name: np.unique(chosen[hot & (real == 1), 0], return_counts=True)[1]
             for name, chosen in (("spread", spread), ("position", by_position))}
    mean = (hot & (real == 1)).sum() / 5
    assert np.abs(share["spread"] - mean).max() <= 8 and np.abs(share["position"] - mean).max() > 8, share
    for block in range(8):                   # within each block of 125 tokens: at most one apart
        rows = slice(125 * block, 125 * (block + 1))
        counts = np.unique(spread[rows, 0][hot[rows] & (real[rows] == 1)], return_counts=True)[1]
        assert len(counts) == 5 and counts.max() - counts.min() <= 1, (block, counts)
    with pytest.raises(ValueError, match="1000 tokens cannot be cut into 3 equal blocks"):
        spread_replicas(placement.layer(0), ids, blocks=3)


def test_replicas_are_chosen_per_layer_inside_a_scan():
    load = np.array([[900.0, 10, 10, 10, 10, 10, 10, 10], [10, 10, 10, 10, 10, 10, 10, 900.0]])
    placement = balanced_placement(load, num_redundant_experts=4, ep_size=4)
    ids = jnp.full((40, 1), 7, jnp.int32)

    def body(_, layer):
        return None, choose_replica(layer, ids, jnp.arange(40))

    _, chosen = jax.lax.scan(body, None, placement)
    chosen = np.asarray(chosen)
    assert len(np.unique(chosen[0])) == 1 and len(np.unique(chosen[1])) == 5   # layer 1's 7 is the hot one
    np.testing.assert_array_equal(placement.physical_to_logical[1][chosen[1]], 7)


# ---- errors -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("experts", "redundant", "ranks", "message"), [
    (16, 5, 4, "num_redundant_experts=5 gives 16 + 5 = 21 physical slots, which do not split evenly over "
               "ep_size=4 ranks; the nearest valid values are 4 and 8."),
    (12, 3, 8, "the nearest valid values are 4."),
    (12, -1, 8, "num_redundant_experts=-1 must be >= 0; the nearest valid values are 4."),
    (16, -2, 4, "must be >= 0; the nearest valid values are 0."),
])
def test_a_redundant_count_that_does_not_fit_names_the_nearest_valid_ones(experts, redundant, ranks, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("+", r"\+")):
        check_num_redundant_experts(experts, redundant, ranks)
    with pytest.raises(ValueError, match="num_redundant_experts"):
        balanced_placement(np.ones((1, experts)), num_redundant_experts=redundant, ep_size=ranks)
    check_num_redundant_experts(16, 0, 4)
    check_num_redundant_experts(16, 8, 4)


def test_a_wrong_placement_is_refused_naming_the_bad_value():
    good = balanced_placement(README_LOAD, num_redundant_experts=4, ep_size=8)
    with pytest.raises(ValueError, match=r"physical_to_logical has shape \(2, 16\), expected \(3, 16\)"):
        good.check(3, 12, 4, 8)
    with pytest.raises(ValueError, match=r"logical_to_physical has shape \(2, 12, 5\), expected \(2, 12, 9\)"):
        ExpertPlacement(np.tile(np.arange(20) % 12, (2, 1)), good.logical_to_physical,
                        good.replica_count).check(2, 12, 8, 4)
    slots = good.physical_to_logical.copy()
    slots[1, slots[1] == 3] = 5   # expert 3 of layer 1 lost its only slot
    with pytest.raises(ValueError, match="logical expert 3 of sparse layer 1 is in no physical slot"):
        ExpertPlacement(slots, good.logical_to_physical, good.replica_count).check(2, 12, 4, 8)
    slots = good.physical_to_logical.copy()
    slots[0, 0] = 12
    with pytest.raises(ValueError, match=r"physical_to_logical\[0, 0\] = 12 is not an expert id in \[0, 12\)"):
        ExpertPlacement(slots, good.logical_to_physical, good.replica_count).check(2, 12, 4, 8)
    count = good.replica_count.copy()
    count[0, 1] += 1
    with pytest.raises(ValueError, match=r"replica_count\[0, 1\]"):
        ExpertPlacement(good.physical_to_logical, good.logical_to_physical, count).check(2, 12, 4, 8)
    where = good.logical_to_physical.copy()
    where[1, 0, 0] = (where[1, 0, 0] + 1) % 16
    with pytest.raises(ValueError, match=r"logical_to_physical\[1, 0\]"):
        ExpertPlacement(good.physical_to_logical, where, good.replica_count).check(2, 12, 4, 8)
    with pytest.raises(ValueError, match="num_redundant_experts=3"):
        good.check(2, 12, 3, 8)


def test_bad_loads_and_groups_are_refused():
    with pytest.raises(ValueError, match=r"expert_load must be \[sparse layers, experts\], got shape \(12,\)"):
        balanced_placement(README_LOAD[0], num_redundant_experts=4, ep_size=8)
    with pytest.raises(ValueError, match="finite loads >= 0"):
        balanced_placement(-README_LOAD, num_redundant_experts=4, ep_size=8)
    with pytest.raises(ValueError, match="num_groups=5 must split the 12 experts"):
        balanced_placement(README_LOAD, num_redundant_experts=4, ep_size=8, num_groups=5)
    with pytest.raises(ValueError, match="ep_size=2 must be a multiple of num_nodes=4"):
        balanced_placement(README_LOAD, num_redundant_experts=4, ep_size=2, num_groups=4, num_nodes=4)
    with pytest.raises(ValueError, match="pass placement.layer"):
        choose_replica(identity_placement(1, 4, ep_size=2), jnp.zeros((3, 1), jnp.int32), jnp.arange(3))
    # Groups that do not split over the nodes: the global policy, as DeepSeek's.
    np.testing.assert_array_equal(
        balanced_placement(README_LOAD, num_redundant_experts=4, ep_size=8, num_groups=3, num_nodes=2)
        .physical_to_logical,
        balanced_placement(README_LOAD, num_redundant_experts=4, ep_size=8).physical_to_logical)
