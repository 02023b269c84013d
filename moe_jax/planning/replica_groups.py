"""The device groups of a collective, read from its HLO attributes in any of XLA's printed forms.

    device_groups("replica_groups={{0,1},{2,3}}", 4)                        # [[0, 1], [2, 3]]
    device_groups("replica_groups=[2,4]<=[4,2]T(1,0)", 8)                   # iota form: [[0, 2, 4, 6], [1, 3, 5, 7]]
    device_groups("replica_groups=mesh['a'=4,'b'=2] {'a'}", 8)              # mesh form: [[0, 2, 4, 6], [1, 3, 5, 7]]
    device_groups("source_target_pairs={{0,1},{1,0}}", 2)                  # a permute's pairs

Device numbers are positions in the program's device assignment (`use_global_device_ids`), which for the
planner's meshes are the ranks, so rank // devices_per_node is a device's node.
"""

from __future__ import annotations

import re

import numpy as np

_EXPLICIT = re.compile(r"(?:replica_groups|source_target_pairs)=\{(?P<groups>(?:\{[0-9,]*\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[(?P<shape>[0-9,]+)\]<=\[(?P<dims>[0-9,]+)\](?:T\((?P<perm>[0-9,]+)\))?")
_MESH = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\](?:, device_ids=\(\[(?P<dims>[0-9,]+)\]"
                   r"(?:T\((?P<perm>[0-9,]+)\))?\))?(?: \{(?P<over>[^}]*)\})?")
_AXIS = re.compile(r"'(?P<name>[^']+)'=(?P<size>\d+)")


def _ints(text: str) -> list[int]:
    return [int(value) for value in text.split(",") if value]


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    devices = np.arange(int(np.prod(dims))).reshape(dims)
    return (devices.transpose(perm) if perm else devices).reshape(-1)


def _mesh_groups(match: re.Match, device_count: int) -> list[list[int]]:
    axes = [(axis["name"], int(axis["size"])) for axis in _AXIS.finditer(match["axes"])]
    sizes = [size for _, size in axes]
    ids = (_iota(_ints(match["dims"]), _ints(match["perm"]) if match["perm"] else None) if match["dims"]
           else np.arange(int(np.prod(sizes))))
    grid = ids.reshape(sizes)
    over = {name.strip().strip("'") for name in (match["over"] or "").split(",") if name.strip()}
    if not over:
        over = {name for name, _ in axes}
    inside = [index for index, (name, _) in enumerate(axes) if name in over]
    outside = [index for index in range(len(axes)) if index not in inside]
    group_size = int(np.prod([sizes[index] for index in inside]))
    return grid.transpose(outside + inside).reshape(-1, group_size).tolist()


def device_groups(attributes: str, device_count: int) -> list[list[int]]:
    """The groups of devices a collective runs over (one group of all devices when none is printed)."""
    if (match := _MESH.search(attributes)) is not None:
        return _mesh_groups(match, device_count)
    if (match := _IOTA.search(attributes)) is not None:
        rows, columns = _ints(match["shape"])
        perm = _ints(match["perm"]) if match["perm"] else None
        return _iota(_ints(match["dims"]), perm).reshape(rows, columns).tolist()
    if (match := _EXPLICIT.search(attributes)) is not None:
        groups = [_ints(group) for group in re.findall(r"\{([0-9,]*)\}", match["groups"])]
        groups = [group for group in groups if group]
        if groups:
            return groups
    return [list(range(device_count))]


def crosses_nodes(groups: list[list[int]], devices_per_node: int) -> bool:
    """Whether any group holds devices of more than one node (rank // devices_per_node)."""
    return any(len({device // devices_per_node for device in group}) > 1 for group in groups)
