"""A placement search that does better than EPLB's greedy where a few experts take most of the tokens.

    placement = searched_placement(expert_load, num_redundant_experts=R, ep_size=8)      # host, numpy
    placement = replacement(current, expert_load, num_redundant_experts=R, ep_size=8)   # never worse than current

EPLB (`eplb.balanced_placement`) gives each redundant slot in turn to the expert with the highest load per
replica, then packs the replicas heaviest first. Where two experts take most of a layer's tokens that can hand
them more heavy replicas than there are ranks, and two heavy replicas then share a rank: with 8 + 8 slots on 8
ranks and two experts at 49% and 48%, it makes 5 replicas of each (~10% of the tokens apiece) and two ranks
get two of them (1.54x the mean rank), where 4 replicas each and the spare slots on idle experts give every rank
one heavy replica (1.01x).

The search tries, per layer, every replica count that a load level T gives (`ceil(load / T)` replicas each,
the spare slots then to the busiest experts per replica, or to the idlest ones), packs each candidate's replicas
heaviest first onto the lightest rank with room, improves the best packings by swapping replicas off the
busiest rank, then moves single replicas from idle experts to busy ones while that helps, and keeps the
candidate whose busiest rank (`eplb.expected_rank_load`) is least, EPLB's own placement among them (so it is
never worse than EPLB on the load it was given; a tie keeps EPLB's). Layers where EPLB's busiest rank is within
2% of the mean keep EPLB's without a search (DeepSeek-V3's 58 layers of 256 + 32 experts: well under a second).
Not optimal: on 4-expert layers it finds the brute-force optimum about two times in three, within 13% always.
"""

from __future__ import annotations

import numpy as np

from .eplb import (
    ExpertPlacement,
    balanced_packing,
    balanced_placement,
    better_placement,
    expected_rank_load,
    placement_from_slots,
)

PACKED_CANDIDATES = 24      # replica counts packed per layer (evenly spread over the levels where there are more)
GOOD_ENOUGH = 1.02          # EPLB's busiest rank within 2% of the mean: no search
REFINED_CANDIDATES = 4      # packings improved by swaps (the rest are ranked by their greedy packing alone)
MOVE_ROUNDS = 8             # then single replica moves from the best, a round at a time while one helps
MOVE_EXPERTS = 3            # donors and receivers tried per round


def replica_counts(load: np.ndarray, physical: int) -> list[np.ndarray]:
    """One layer: load [E] -> distinct replica counts [E] (each >= 1, summing to `physical`): for each load level
    T, ceil(load / T) replicas per expert, the spare slots given to the experts with the highest load per replica,
    or else to those with the least."""
    experts = load.shape[0]
    levels = np.unique((load[:, None] / np.arange(1, physical - experts + 2)[None, :]).ravel())
    candidates, seen = [], set()
    for level in levels[::-1]:                  # descending: each level needs at least as many replicas
        if level <= 0:
            break
        base = np.maximum(1, np.ceil(load / level - 1e-9)).astype(np.int64)
        if base.sum() > physical:
            break
        for spares_to_busiest in (True, False):
            count = base.copy()
            for _ in range(physical - int(count.sum())):
                count[int(np.argmax(load / count)) if spares_to_busiest else int(np.argmin(load * count))] += 1
            if (key := tuple(count)) not in seen:
                seen.add(key)
                candidates.append(count)
    if len(candidates) > PACKED_CANDIDATES:    # host time: a few dozen packings per layer are enough
        keep = np.unique(np.linspace(0, len(candidates) - 1, PACKED_CANDIDATES).round().astype(int))
        candidates = [candidates[index] for index in keep]
    return candidates


def swapped_packing(weight: np.ndarray, rank: np.ndarray, ranks: int) -> np.ndarray:
    """`rank` improved by swaps: while swapping one item of the busiest rank with an item elsewhere lowers the
    larger of the two ranks' totals, make the swap that lowers it most."""
    rank = rank.copy()
    totals = np.bincount(rank, weight, minlength=ranks)
    for _ in range(4 * weight.shape[0]):
        busiest = int(np.argmax(totals))
        mine, others = np.flatnonzero(rank == busiest), np.flatnonzero(rank != busiest)
        moved = weight[mine][:, None] - weight[others][None, :]          # what the busiest rank sheds
        after = np.maximum(totals[busiest] - moved, totals[rank[others]][None, :] + moved)
        gain = totals[busiest] - after
        i, j = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if gain[i, j] <= 1e-12 * max(totals[busiest], 1.0):
            break
        a, b = mine[i], others[j]
        totals[busiest] -= moved[i, j]
        totals[rank[b]] += moved[i, j]
        rank[a], rank[b] = rank[b], busiest
    return rank


def _slots(experts: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Each replica's expert in rank-major slot order (a rank's replicas in the order they were listed)."""
    return experts[np.lexsort((np.arange(rank.shape[0]), rank))]


def _packed(load: np.ndarray, count: np.ndarray, ranks: int, *, swaps: bool = True) -> tuple[float, np.ndarray]:
    """(busiest rank, slot_to_expert [sum(count)]) of replica counts `count` [E] packed greedily, then swapped."""
    experts = np.repeat(np.arange(load.shape[0]), count)
    weight = load[experts] / count[experts]
    rank = balanced_packing(weight, ranks) // (weight.shape[0] // ranks)   # EPLB's greedy packing, as ranks
    if swaps:
        rank = swapped_packing(weight, rank, ranks)
    return float(np.bincount(rank, weight, minlength=ranks).max()), _slots(experts, rank)


def moved_replicas(load: np.ndarray, count: np.ndarray, ranks: int, busiest: float, slots: np.ndarray
                   ) -> tuple[float, np.ndarray]:
    """Hill-climb from `count`: move one replica from an expert that has replicas to spare (the least load per
    replica) to one of the busiest per replica, re-pack, keep the best move while it helps
    (`MOVE_ROUNDS` at most; `MOVE_EXPERTS` donors x receivers per round)."""
    for _ in range(MOVE_ROUNDS):
        per_replica = load / count
        donors = [e for e in np.argsort(per_replica, kind="stable") if count[e] > 1][:MOVE_EXPERTS]
        receivers = np.argsort(-per_replica, kind="stable")[:MOVE_EXPERTS]
        found = None
        for donor in donors:
            for receiver in receivers:
                if donor == receiver:
                    continue
                moved = count.copy()
                moved[donor] -= 1
                moved[receiver] += 1
                candidate = _packed(load, moved, ranks)
                if candidate[0] < busiest * (1 - 1e-9) and (found is None or candidate[0] < found[1][0]):
                    found = (moved, candidate)
        if found is None:
            break
        count, (busiest, slots) = found
    return busiest, slots


def searched_layer(load: np.ndarray, physical: int, ranks: int, eplb_slots: np.ndarray, eplb_busiest: float
                   ) -> np.ndarray:
    """One layer's slot_to_expert [physical]: the least busy busiest rank of the searched candidates and EPLB's
    (`eplb_slots`, whose busiest rank gets `eplb_busiest`), EPLB's on a tie, and EPLB's without a search where
    its busiest rank is within `GOOD_ENOUGH` of the mean."""
    if eplb_busiest <= GOOD_ENOUGH * load.sum() / ranks:
        return eplb_slots
    greedy = sorted(((_packed(load, count, ranks, swaps=False)[0], index, count)
                     for index, count in enumerate(replica_counts(load, physical))), key=lambda item: item[:2])
    refined = [(*_packed(load, count, ranks), count) for _, _, count in greedy[:REFINED_CANDIDATES]]
    busiest, slots, count = min(refined, key=lambda item: item[0])
    busiest, slots = moved_replicas(load, count, ranks, busiest, slots)
    return slots if busiest < eplb_busiest * (1 - 1e-9) else eplb_slots


def searched_placement(expert_load, *, num_redundant_experts: int, ep_size: int) -> ExpertPlacement:
    """Per layer of `expert_load [L, E]`, the placement whose busiest rank gets the fewest tokens among EPLB's
    (`eplb.balanced_placement`, global policy) and the searched ones (module docstring)."""
    load = np.asarray(expert_load, np.float64)
    eplb = balanced_placement(load, num_redundant_experts=num_redundant_experts, ep_size=ep_size)  # checks the sizes
    layers, experts = load.shape
    if layers == 0 or experts + num_redundant_experts == ep_size:
        return eplb     # one slot per rank: every packing is the same
    physical = experts + num_redundant_experts
    eplb_slots = np.asarray(eplb.physical_to_logical, np.int64)
    eplb_busiest = expected_rank_load(eplb, load, ep_size).max(1)
    slots = np.stack([searched_layer(load[layer], physical, ep_size, eplb_slots[layer], float(eplb_busiest[layer]))
                      for layer in range(layers)])
    return placement_from_slots(slots, experts)


def replacement(current: ExpertPlacement, expert_load, *, num_redundant_experts: int, ep_size: int
                ) -> ExpertPlacement:
    """The re-placement for a window's `expert_load [L, E]`: per layer, the searched placement where it gives the
    busiest rank less than `current` (host numpy arrays) does, else `current`'s (`eplb.better_placement`). What
    training (`TrainLoop(rebalance_every=)`) and serving (`ContinuousBatchingConfig(rebalance_every=)`) apply."""
    proposed = searched_placement(expert_load, num_redundant_experts=num_redundant_experts, ep_size=ep_size)
    return better_placement(current, proposed, expert_load, ep_size)
