"""A placement search that does better than EPLB's greedy where a few experts take most of the tokens, and serves
several loads at once where the load moves.

    placement = searched_placement(expert_load, num_redundant_experts=R, ep_size=8)      # host, numpy
    placement = replacement(current, expert_load, num_redundant_experts=R, ep_size=8)   # never worse than current
    placement = searched_placement(np.stack([window, next_batch]), ...)                # [S, L, E]: serve each load

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

Several loads (`expert_load [S, L, E]`, e.g. a training window and the next batch's routing): a router that
trains moves its hot tokens between experts from one step to the next, and a placement made for one load can
put 3x the mean on a rank under the other. Each load is then measured by its busiest rank over its own mean rank
(`worst_share`), and the search keeps, per layer, the placement whose worst load's share is least: replica
counts come from the loads' per-expert maximum and from each load, and a rank's weight is a vector of its
tokens under each load, so two experts that are never hot together can share a rank. One load is the case above.
"""

from __future__ import annotations

import numpy as np

from .eplb import ExpertPlacement, balanced_placement, expected_rank_load, placement_from_slots

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
    return _thinned(candidates)


def _thinned(candidates: list[np.ndarray]) -> list[np.ndarray]:
    """At most `PACKED_CANDIDATES`, evenly spread (host time: a few dozen packings per layer are enough)."""
    if len(candidates) <= PACKED_CANDIDATES:
        return candidates
    keep = np.unique(np.linspace(0, len(candidates) - 1, PACKED_CANDIDATES).round().astype(int))
    return [candidates[index] for index in keep]


def greedy_packing(weight: np.ndarray, ranks: int) -> np.ndarray:
    """weight [n, S] (an item's tokens under each of S loads) -> rank [n], n / ranks items each: heaviest (under
    its heaviest load) first, each onto the rank whose heaviest load it raises least, among those with room (the
    lowest on a tie). With S = 1: EPLB's packing (`eplb.balanced_packing`), onto the lightest rank."""
    size = weight.shape[0] // ranks
    totals = np.zeros((weight.shape[1], ranks))          # [S, ranks]: one row per load (1-D ufuncs: host time)
    full, filled = np.zeros(ranks), np.zeros(ranks, np.int64)    # full: +inf once a rank has its n / ranks items
    rank = np.empty(weight.shape[0], np.int64)
    for item in np.argsort(-weight.max(1), kind="stable"):
        peak = totals[0] + weight[item, 0]
        for load in range(1, weight.shape[1]):
            np.maximum(peak, totals[load] + weight[item, load], out=peak)
        chosen = int((peak + full).argmin())
        rank[item] = chosen
        totals[:, chosen] += weight[item]
        filled[chosen] += 1
        if filled[chosen] == size:
            full[chosen] = np.inf
    return rank


def swapped_packing(weight: np.ndarray, rank: np.ndarray, ranks: int) -> np.ndarray:
    """`rank` improved by swaps (weight [n, S]): while swapping one item of the busiest rank (under any load) with
    an item elsewhere lowers the larger of the two ranks' heaviest loads, make the swap that lowers it most."""
    rank = rank.copy()
    totals = np.stack([np.bincount(rank, column, minlength=ranks) for column in weight.T], axis=1)   # [ranks, S]
    for _ in range(4 * weight.shape[0]):
        peaks = totals.max(1)
        busiest = int(np.argmax(peaks))
        mine, others = np.flatnonzero(rank == busiest), np.flatnonzero(rank != busiest)
        moved = weight[mine][:, None, :] - weight[others][None, :, :]          # [m, o, S]: what the busiest sheds
        after = np.maximum((totals[busiest] - moved).max(-1), (totals[rank[others]][None] + moved).max(-1))
        gain = peaks[busiest] - after
        i, j = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if gain[i, j] <= 1e-12 * max(peaks[busiest], 1.0):
            break
        a, b = mine[i], others[j]
        totals[busiest] -= moved[i, j]
        totals[rank[b]] += moved[i, j]
        rank[a], rank[b] = rank[b], busiest
    return rank


def _slots(experts: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Each replica's expert in rank-major slot order (a rank's replicas in the order they were listed)."""
    return experts[np.lexsort((np.arange(rank.shape[0]), rank))]


def _packed(loads: np.ndarray, count: np.ndarray, ranks: int, *, swaps: bool = True) -> tuple[float, np.ndarray]:
    """(busiest rank under the heaviest load, slot_to_expert [sum(count)]) of replica counts `count` [E] packed
    greedily, then swapped; loads [S, E]."""
    experts = np.repeat(np.arange(loads.shape[1]), count)
    weight = (loads[:, experts] / count[experts]).T                     # [replicas, S]
    rank = greedy_packing(weight, ranks)
    if swaps:
        rank = swapped_packing(weight, rank, ranks)
    totals = np.stack([np.bincount(rank, column, minlength=ranks) for column in weight.T])
    return float(totals.max()), _slots(experts, rank)


def moved_replicas(loads: np.ndarray, count: np.ndarray, ranks: int, busiest: float, slots: np.ndarray
                   ) -> tuple[float, np.ndarray]:
    """Hill-climb from `count`: move one replica from an expert that has replicas to spare (the least load per
    replica, under its heaviest load) to one of the busiest per replica, re-pack, keep the best move while it
    helps (`MOVE_ROUNDS` at most; `MOVE_EXPERTS` donors x receivers per round)."""
    heaviest = loads.max(0)
    for _ in range(MOVE_ROUNDS):
        per_replica = heaviest / count
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
                candidate = _packed(loads, moved, ranks)
                if candidate[0] < busiest * (1 - 1e-9) and (found is None or candidate[0] < found[1][0]):
                    found = (moved, candidate)
        if found is None:
            break
        count, (busiest, slots) = found
    return busiest, slots


def searched_layer(loads: np.ndarray, physical: int, ranks: int, eplb_slots: np.ndarray, eplb_busiest: float
                   ) -> np.ndarray:
    """One layer's slot_to_expert [physical] for loads [S, E], each scaled to a mean rank of 1: the least busy
    busiest rank (under the heaviest load) of the searched candidates and EPLB's (`eplb_slots`, whose busiest rank
    gets `eplb_busiest`), EPLB's on a tie, and EPLB's without a search where it is within `GOOD_ENOUGH`."""
    if eplb_busiest <= GOOD_ENOUGH:
        return eplb_slots
    counts, seen = [], set()
    for base in (loads.max(0), *loads):        # one load: the same counts twice, kept once
        for count in replica_counts(base, physical):
            if (key := tuple(count)) not in seen:
                seen.add(key)
                counts.append(count)
    greedy = sorted(((_packed(loads, count, ranks, swaps=False)[0], index, count)
                     for index, count in enumerate(_thinned(counts))), key=lambda item: item[:2])
    refined = [(*_packed(loads, count, ranks), count) for _, _, count in greedy[:REFINED_CANDIDATES]]
    busiest, slots, count = min(refined, key=lambda item: item[0])
    busiest, slots = moved_replicas(loads, count, ranks, busiest, slots)
    return slots if busiest < eplb_busiest * (1 - 1e-9) else eplb_slots


def _scenarios(expert_load) -> np.ndarray:
    """expert_load [L, E] or [S, L, E] -> [S, L, E] float64."""
    load = np.asarray(expert_load, np.float64)
    if load.ndim not in (2, 3):
        raise ValueError(f"expert_load must be [sparse layers, experts] or [loads, sparse layers, experts], got "
                         f"shape {load.shape}.")
    return load[None] if load.ndim == 2 else load


def _scaled(loads: np.ndarray, ranks: int) -> np.ndarray:
    """loads [S, L, E] scaled so that each load's mean rank gets 1 per layer (a layer with no tokens: 0)."""
    total = loads.sum(-1, keepdims=True)
    return loads * ranks / np.where(total > 0, total, 1.0)


def worst_share(placement: ExpertPlacement, expert_load, ep_size: int) -> np.ndarray:
    """[L]: per layer, the busiest rank's tokens over the mean rank's under `placement`, the most over the loads
    of `expert_load` ([L, E], or [S, L, E]; a layer without tokens: 0)."""
    loads = _scaled(_scenarios(expert_load), ep_size)
    return np.stack([expected_rank_load(placement, load, ep_size).max(1) for load in loads]).max(0)


def searched_placement(expert_load, *, num_redundant_experts: int, ep_size: int) -> ExpertPlacement:
    """Per layer, the placement whose busiest rank gets the fewest tokens among EPLB's (`eplb.balanced_placement`,
    global policy, of the loads' sum) and the searched ones (module docstring). expert_load: [L, E], or [S, L, E]
    for a placement that serves each of S loads: the least `worst_share`."""
    loads = _scenarios(expert_load)
    _, layers, experts = loads.shape
    scaled = _scaled(loads, ep_size)
    eplb = balanced_placement(scaled.sum(0) if len(loads) > 1 else loads[0],      # checks the sizes
                              num_redundant_experts=num_redundant_experts, ep_size=ep_size)
    if layers == 0 or experts + num_redundant_experts == ep_size:
        return eplb     # one slot per rank: every packing is the same
    physical = experts + num_redundant_experts
    eplb_slots = np.asarray(eplb.physical_to_logical, np.int64)
    eplb_busiest = worst_share(eplb, loads, ep_size)
    slots = np.stack([searched_layer(scaled[:, layer], physical, ep_size, eplb_slots[layer], float(eplb_busiest[layer]))
                      for layer in range(layers)])
    return placement_from_slots(slots, experts)


def replacement(current: ExpertPlacement, expert_load, *, num_redundant_experts: int, ep_size: int
                ) -> ExpertPlacement:
    """The re-placement for `expert_load` ([L, E], or [S, L, E]: loads to serve each): per layer, the searched
    placement where its `worst_share` is less than `current`'s (host numpy arrays), else `current`'s (a tie keeps
    it: no slot moves for nothing). What training (`TrainLoop(rebalance_every=)`: the window and the next batch)
    and serving (`ContinuousBatchingConfig(rebalance_every=)`: the window) apply."""
    proposed = searched_placement(expert_load, num_redundant_experts=num_redundant_experts, ep_size=ep_size)
    old, new = (np.asarray(placement.physical_to_logical) for placement in (current, proposed))
    if old.shape != new.shape:
        raise ValueError(f"placements of shapes {old.shape} and {new.shape} cannot be compared.")
    takes = worst_share(proposed, expert_load, ep_size) < worst_share(current, expert_load, ep_size) * (1 - 1e-9)
    return placement_from_slots(np.where(takes[:, None], new, old), old.shape[1] - num_redundant_experts)
