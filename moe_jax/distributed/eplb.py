"""Expert placement as data: which logical expert each physical expert slot holds, and where to put them.

With expert parallelism each of the `ep_size` ranks holds `(E + R) / ep_size` consecutive physical slots (slot
s on rank s // slots_per_rank); R redundant slots hold extra replicas of the busiest experts, so a hot expert's
tokens are shared among its replicas. An `ExpertPlacement` says, per sparse layer:

    physical_to_logical [L, E + R]          the logical expert slot s holds
    logical_to_physical [L, E, R + 1]       the slots holding expert e, -1 after its replica_count[l, e] of them
    replica_count       [L, E]              how many slots hold expert e (>= 1)

All three are int32 arrays and the placement is a pytree of them only (no static fields), so it can be an
argument of a jitted step or a shard_map and changes without recompiling: the shapes depend on (L, E, R) alone
(the last axis of `logical_to_physical` is R + 1, the most replicas any expert can have).

    placement = balanced_placement(expert_load, num_redundant_experts=R, ep_size=8)   # host, numpy
    placement = better_placement(current, placement, expert_load, ep_size=8)   # per layer, never worse
    layer = placement.layer(i)                       # or jax.tree.map(lambda a: a[i], placement), or a scan
    slots = choose_replica(layer, expert_ids, token_positions)                # traceable, deterministic
    slots = spread_replicas(layer, expert_ids, blocks=8)                      # each replica an even share

`balanced_placement` is DeepSeek's expert-parallelism load balancer (EPLB), written from its description:
replicate the experts with the highest load per replica, then pack the replicas onto ranks so that the ranks'
loads are as even as greedy packing makes them; with expert groups and nodes, the hierarchical variant keeps
each group's experts (and their replicas) on one node.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class ExpertPlacement:
    """Where each layer's experts live: `physical_to_logical [L, E + R]`, `logical_to_physical [L, E, R + 1]`
    (padded with -1), `replica_count [L, E]`, int32 (see the module docstring). `layer(i)` (or a scan over the
    leading axis) gives one layer's arrays, which is what `choose_replica` takes."""

    physical_to_logical: np.ndarray | jax.Array
    logical_to_physical: np.ndarray | jax.Array
    replica_count: np.ndarray | jax.Array

    @property
    def num_layers(self) -> int:
        return self.replica_count.shape[0]

    @property
    def num_experts(self) -> int:
        return self.replica_count.shape[-1]

    @property
    def num_physical_experts(self) -> int:
        return self.physical_to_logical.shape[-1]

    @property
    def num_redundant_experts(self) -> int:
        return self.num_physical_experts - self.num_experts

    def layer(self, index: int) -> ExpertPlacement:
        """Layer `index`'s placement: `physical_to_logical [E + R]`, `logical_to_physical [E, R + 1]`,
        `replica_count [E]`."""
        return jax.tree.map(lambda array: array[index], self)

    def check(self, num_layers: int, num_experts: int, num_redundant_experts: int, ep_size: int) -> ExpertPlacement:
        """This placement, after checking it fits a model of `num_layers` sparse layers of `num_experts` experts
        with `num_redundant_experts` redundant slots over `ep_size` ranks; ValueError naming the bad value."""
        check_num_redundant_experts(num_experts, num_redundant_experts, ep_size)
        physical = num_experts + num_redundant_experts
        expected = {"physical_to_logical": (num_layers, physical),
                    "logical_to_physical": (num_layers, num_experts, num_redundant_experts + 1),
                    "replica_count": (num_layers, num_experts)}
        arrays = {name: np.asarray(getattr(self, name)) for name in expected}
        for name, shape in expected.items():
            if arrays[name].shape != shape:
                raise ValueError(f"ExpertPlacement.{name} has shape {arrays[name].shape}, expected {shape} for "
                                 f"{num_layers} sparse layer(s) of {num_experts} experts with "
                                 f"{num_redundant_experts} redundant slot(s).")
            if not np.issubdtype(arrays[name].dtype, np.integer):
                raise ValueError(f"ExpertPlacement.{name} must hold integers, got {arrays[name].dtype}.")
        slots, count, where = arrays["physical_to_logical"], arrays["replica_count"], arrays["logical_to_physical"]
        if (bad := np.argwhere((slots < 0) | (slots >= num_experts))).size:
            layer, slot = bad[0]
            raise ValueError(f"ExpertPlacement.physical_to_logical[{layer}, {slot}] = {slots[layer, slot]} is not an "
                             f"expert id in [0, {num_experts}).")
        held = np.stack([np.bincount(row, minlength=num_experts) for row in slots]) if num_layers else count
        if (missing := np.argwhere(held == 0)).size:
            layer, expert = missing[0]
            raise ValueError(f"logical expert {expert} of sparse layer {layer} is in no physical slot "
                             f"(ExpertPlacement.physical_to_logical[{layer}] = {slots[layer].tolist()}).")
        if (bad := np.argwhere(held != count)).size:
            layer, expert = bad[0]
            raise ValueError(f"ExpertPlacement.replica_count[{layer}, {expert}] = {count[layer, expert]}, but "
                             f"{held[layer, expert]} slot(s) of physical_to_logical[{layer}] hold expert {expert}.")
        for layer, expert in np.ndindex(num_layers, num_experts):
            listed = where[layer, expert]
            replicas = np.flatnonzero(slots[layer] == expert)
            if (sorted(listed[:count[layer, expert]].tolist()) != replicas.tolist()
                    or (listed[count[layer, expert]:] != -1).any()):
                raise ValueError(f"ExpertPlacement.logical_to_physical[{layer}, {expert}] = {listed.tolist()}, but "
                                 f"expert {expert} is in slots {replicas.tolist()} (then -1 padding).")
        return self


jax.tree_util.register_dataclass(
    ExpertPlacement, data_fields=["physical_to_logical", "logical_to_physical", "replica_count"], meta_fields=[])


def check_num_redundant_experts(num_experts: int, num_redundant_experts: int, ep_size: int) -> None:
    """ValueError unless `num_redundant_experts` >= 0 and the E + R physical slots split evenly over `ep_size`
    ranks; the message names the nearest valid values."""
    if ep_size < 1:
        raise ValueError(f"ep_size={ep_size} must be >= 1.")
    if num_experts < 1:
        raise ValueError(f"num_experts={num_experts} must be >= 1.")
    remainder = (num_experts + num_redundant_experts) % ep_size
    if num_redundant_experts >= 0 and remainder == 0:
        return
    above = num_redundant_experts + (ep_size - remainder) % ep_size
    if num_redundant_experts < 0:
        above = -num_experts % ep_size
    below = num_redundant_experts - remainder
    nearest = [value for value in (below, above) if value >= 0 and value != num_redundant_experts]
    what = "must be >= 0" if num_redundant_experts < 0 else (
        f"gives {num_experts} + {num_redundant_experts} = {num_experts + num_redundant_experts} physical slots, "
        f"which do not split evenly over ep_size={ep_size} ranks")
    raise ValueError(f"num_redundant_experts={num_redundant_experts} {what}; the nearest valid values are "
                     f"{' and '.join(map(str, sorted(set(nearest))))}.")


def identity_placement(num_layers: int, num_experts: int, *, num_redundant_experts: int = 0,
                       ep_size: int) -> ExpertPlacement:
    """Every layer: slot s holds expert s % E (experts in order, then the redundant slots cycling from expert 0).
    With R = 0 that is plain expert parallelism: rank r holds experts r * E / ep_size onwards."""
    check_num_redundant_experts(num_experts, num_redundant_experts, ep_size)
    row = np.arange(num_experts + num_redundant_experts) % num_experts
    return placement_from_slots(np.tile(row, (num_layers, 1)), num_experts)


def placement_from_slots(physical_to_logical, num_experts: int) -> ExpertPlacement:
    """The `ExpertPlacement` of `physical_to_logical [L, E + R]` (the logical expert of each slot): each expert's
    slots in increasing order, their count."""
    slots = np.asarray(physical_to_logical, np.int64)
    num_layers, physical = slots.shape
    redundant = physical - num_experts
    if redundant < 0:
        raise ValueError(f"{physical} physical slots cannot hold {num_experts} experts.")
    count = np.zeros((num_layers, num_experts), np.int64)
    where = np.full((num_layers, num_experts, redundant + 1), -1, np.int64)
    for layer in range(num_layers):
        for slot, expert in enumerate(slots[layer]):
            if not 0 <= expert < num_experts:
                raise ValueError(f"physical slot {slot} of layer {layer} holds {expert}, not an expert id in "
                                 f"[0, {num_experts}).")
            where[layer, expert, count[layer, expert]] = slot
            count[layer, expert] += 1
    return ExpertPlacement(slots.astype(np.int32), where.astype(np.int32), count.astype(np.int32))


# ---- the balancer ------------------------------------------------------------------------------------------------
def replicate(load: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """One layer: load [E] -> (slot_to_expert [slots]: experts 0..E-1, then each extra slot given to the expert
    with the highest load per replica at that point (the lowest id on a tie), replica_count [E])."""
    count = np.ones(load.shape[0], np.int64)
    extra = []
    for _ in range(slots - load.shape[0]):
        expert = int(np.argmax(load / count))
        extra.append(expert)
        count[expert] += 1
    return np.concatenate([np.arange(load.shape[0]), np.asarray(extra, np.int64)]), count


def balanced_packing(weight: np.ndarray, packs: int) -> np.ndarray:
    """One layer: weight [n] -> position [n]: item i goes to pack position[i] // (n / packs), each pack getting
    exactly n / packs items. Heaviest first (a stable sort: equal weights keep their order), each onto the
    lightest pack that still has room (the lowest pack on a tie), in the order the pack receives them. With one
    item per pack nothing can be balanced and the items keep their places."""
    size = weight.shape[0] // packs
    if size == 1:
        return np.arange(weight.shape[0])
    totals, filled = np.zeros(packs), np.zeros(packs, np.int64)
    position = np.empty(weight.shape[0], np.int64)
    for item in np.argsort(-weight, kind="stable"):
        pack = int(np.argmin(np.where(filled < size, totals, np.inf)))
        position[item] = pack * size + filled[pack]
        totals[pack] += weight[item]
        filled[pack] += 1
    return position


def _layer_placement(load: np.ndarray, physical: int, groups: int, nodes: int, ranks: int) -> np.ndarray:
    """One layer's slot_to_expert [physical] (hierarchical; groups = nodes = 1 is the global policy)."""
    experts = load.shape[0]
    group_size, per_node = experts // groups, experts // nodes
    # 1. Expert groups onto nodes: node n's experts are those of its groups, in the order the node took them.
    group_position = balanced_packing(load.reshape(groups, group_size).sum(-1), nodes)
    node_order = np.empty(experts, np.int64)   # node-major order -> expert
    for group, position in enumerate(group_position):
        node_order[position * group_size:(position + 1) * group_size] = np.arange(group * group_size,
                                                                                 (group + 1) * group_size)
    result = np.empty(physical, np.int64)
    slots_per_node, ranks_per_node = physical // nodes, ranks // nodes
    for node in range(nodes):
        members = node_order[node * per_node:(node + 1) * per_node]
        # 2. Replicate within the node; 3. pack its replicas onto the node's ranks.
        slot_to_member, count = replicate(load[members], slots_per_node)
        position = balanced_packing(load[members][slot_to_member] / count[slot_to_member], ranks_per_node)
        placed = np.empty(slots_per_node, np.int64)
        placed[position] = members[slot_to_member]
        result[node * slots_per_node:(node + 1) * slots_per_node] = placed
    return result


def balanced_placement(expert_load, *, num_redundant_experts: int, ep_size: int, num_groups: int | None = None,
                       num_nodes: int = 1) -> ExpertPlacement:
    """DeepSeek's EPLB placement of each layer's experts for `expert_load [L, E]` (tokens per expert, e.g. the
    train step's `expert_load` metric summed over steps or a moving average of it).

    Global policy (num_groups None, or num_groups not a multiple of num_nodes, as DeepSeek's): give each of the R
    redundant slots in turn to the expert with the highest load per replica, then pack the E + R replicas (each
    weighing its expert's load / replica count) onto the ep_size ranks, (E + R) / ep_size each, heaviest first
    onto the lightest rank with room. Hierarchical policy (num_groups experts groups, a multiple of num_nodes): pack
    the groups onto the nodes by their summed load (num_groups / num_nodes each), replicate within each node
    ((E + R) / num_nodes slots each) and pack each node's replicas onto its ep_size / num_nodes ranks: a group's
    experts and replicas stay on one node (DeepSeek-V3's group-limited routing then crosses fewer nodes).

    Ties go to the lower expert id, the earlier replica and the lower rank. DeepSeek's eplb.py sorts with an
    unstable sort, so where two different experts' replicas weigh exactly the same the two may swap them (the
    ranks' loads are the same), as may nearly equal weights that its float32 rounds alike (float64 here);
    otherwise the physical-to-logical maps are the same."""
    load = np.asarray(expert_load, np.float64)
    if load.ndim != 2:
        raise ValueError(f"expert_load must be [sparse layers, experts], got shape {load.shape}.")
    if not np.isfinite(load).all() or (load < 0).any():
        raise ValueError("expert_load must hold finite loads >= 0 (tokens per expert).")
    layers, experts = load.shape
    check_num_redundant_experts(experts, num_redundant_experts, ep_size)
    groups, nodes = 1, 1
    if num_nodes < 1:
        raise ValueError(f"num_nodes={num_nodes} must be >= 1.")
    if num_groups is not None:
        if num_groups < 1 or experts % num_groups:
            raise ValueError(f"num_groups={num_groups} must split the {experts} experts into equal groups.")
        if num_groups % num_nodes == 0:
            groups, nodes = num_groups, num_nodes
    if ep_size % nodes:
        raise ValueError(f"ep_size={ep_size} must be a multiple of num_nodes={nodes} (ranks per node).")
    physical = experts + num_redundant_experts
    slots = np.stack([_layer_placement(row, physical, groups, nodes, ep_size) for row in load]) if layers else \
        np.zeros((0, physical), np.int64)
    return placement_from_slots(slots, experts)


def expected_rank_load(placement: ExpertPlacement, expert_load, ep_size: int) -> np.ndarray:
    """[L, ep_size]: the tokens each rank receives under `placement` when each expert's `expert_load [L, E]` is
    split evenly among its replicas."""
    slots = np.asarray(placement.physical_to_logical)
    count = np.asarray(placement.replica_count)
    load = np.asarray(expert_load, np.float64)
    per_slot = np.take_along_axis(load / count, slots, axis=1)
    return per_slot.reshape(slots.shape[0], ep_size, -1).sum(-1)


def better_placement(current: ExpertPlacement, proposed: ExpertPlacement, expert_load, ep_size: int
                     ) -> ExpertPlacement:
    """Per layer, `proposed`'s slots where they give the busiest rank less of `expert_load [L, E]` than `current`'s
    (`expected_rank_load`), else `current`'s: a re-placement never makes a layer worse on the load it was computed
    from. `balanced_placement` packs greedily, so on some loads it is worse than a placement already in force (one
    a previous window found, or a hand-made one); a tie keeps `current` (no slot moves for nothing)."""
    load = np.asarray(expert_load, np.float64)
    old, new = (np.asarray(placement.physical_to_logical) for placement in (current, proposed))
    if old.shape != new.shape:
        raise ValueError(f"placements of shapes {old.shape} and {new.shape} cannot be compared.")
    busiest = [expected_rank_load(placement, load, ep_size).max(1) for placement in (current, proposed)]
    takes = busiest[1] < busiest[0] * (1 - 1e-9)
    return placement_from_slots(np.where(takes[:, None], new, old), load.shape[1])


def choose_replica(placement_layer: ExpertPlacement, expert_ids, token_positions):
    """The physical slot each (token, expert) pair goes to: expert_ids [N, K] (logical), token_positions [N]
    (any integer per token that every rank sees alike, e.g. its index in the global batch) -> [N, K] int32.

    Replica `position % replica_count[e]` of expert e: a pure function of its inputs (no randomness, the same
    on every rank), which spreads a hot expert's tokens at consecutive positions evenly over its replicas.
    placement_layer: one layer's placement (`ExpertPlacement.layer`, or a scan's slice)."""
    where = jnp.asarray(placement_layer.logical_to_physical)
    count = jnp.asarray(placement_layer.replica_count)
    if where.ndim != 2:
        raise ValueError(f"choose_replica takes one layer's placement (logical_to_physical [E, R + 1]), got shape "
                         f"{where.shape}: pass placement.layer(i).")
    ids = jnp.asarray(expert_ids, jnp.int32)
    positions = jnp.asarray(token_positions, jnp.int32)
    replica = jnp.remainder(positions[:, None], count[ids])
    return where[ids, replica].astype(jnp.int32)


def spread_replicas(placement_layer: ExpertPlacement, expert_ids, *, blocks: int = 1, real=None):
    """The physical slot of each (token, expert) pair, every replica getting an even share of its expert's pairs:
    expert_ids [N, K] (logical) -> [N, K] int32. Within each of `blocks` contiguous blocks of N / blocks tokens,
    the pairs of expert e take its replicas in turn in row-major order (the j-th pair of e in block b goes to
    replica (j + b) % replica_count[e]), so each replica gets its expert's pairs to within one per block wherever
    the pairs sit (`choose_replica`'s split by position leaves a hot expert's replicas uneven by chance). real: [N],
    1 for tokens that count (padding's pairs take their turns after the real ones). A sort within each block:
    with the blocks the token shards of the experts' inputs, no device reads another's pairs."""
    where = jnp.asarray(placement_layer.logical_to_physical)
    count = jnp.asarray(placement_layer.replica_count)
    ids = jnp.asarray(expert_ids, jnp.int32)
    tokens, k = ids.shape
    if blocks < 1 or tokens % blocks:
        raise ValueError(f"{tokens} tokens cannot be cut into {blocks} equal blocks.")
    padding = 0 if real is None else 1 - jnp.asarray(real, jnp.int32)[:, None]
    key = (ids * 2 + padding).reshape(blocks, -1)                              # [blocks, N / blocks * K]
    order = jnp.argsort(key, axis=1, stable=True)                             # the block's one sort
    ranked = jnp.take_along_axis(ids.reshape(blocks, -1), order, axis=1)      # each block's ids, sorted
    position = jnp.broadcast_to(jnp.arange(key.shape[1], dtype=jnp.int32), key.shape)
    starts = jnp.concatenate([jnp.ones_like(ranked[:, :1], bool), ranked[:, 1:] != ranked[:, :-1]], axis=1)
    first = jax.lax.cummax(jnp.where(starts, position, 0), axis=1)             # where each expert's run starts
    rows = jnp.arange(blocks)[:, None]
    turn = jnp.zeros_like(position).at[rows, order].set(position - first).reshape(tokens, k)   # back in place
    block = (jnp.arange(tokens, dtype=jnp.int32) // (tokens // blocks))[:, None]
    return where[ids, jnp.remainder(turn + block, count[ids])].astype(jnp.int32)
