"""What one device holds of a train state's parameters and optimizer state, read from the arrays' shardings.

    state = abstract_train_state(model, build_optimizer("adamw", 1e-3))   # allocates nothing
    memory = train_state_memory(state)
    memory.per_device["total"], memory.unsharded["total"]                 # bytes
    print(memory_table(memory))

Each leaf's bytes per device are its `sharding.shard_shape(shape)` times its dtype's itemsize, on every
device of its sharding (JAX shards evenly: an indivisible sharding is refused), so the numbers follow
whatever the plans lay out; a device's bytes are summed over the leaves it holds. The step counter, rng
and the other scalars are left out: a few bytes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import jax
import numpy as np

from .optimizers import EXPERT_MARKER

PARTS = ("expert parameters", "dense parameters", "optimizer state")
TOTAL = "total"


@dataclass(frozen=True)
class TrainStateMemory:
    """Bytes per part (`PARTS`, plus `TOTAL`): `per_device` on the busiest device (its own breakdown, so
    the parts add up to its total), `unsharded` with everything on one device."""

    per_device: dict[str, int]
    unsharded: dict[str, int]
    num_devices: int


def leaf_bytes_by_device(leaf: jax.ShapeDtypeStruct) -> dict:
    """Device -> bytes of `leaf` it holds: its shard (a replicated leaf: all of it) on each of its devices."""
    shard = math.prod(leaf.sharding.shard_shape(tuple(leaf.shape))) * np.dtype(leaf.dtype).itemsize
    return dict.fromkeys(leaf.sharding.device_set, shard)


def leaf_bytes(leaf: jax.ShapeDtypeStruct) -> int:
    """Bytes of the whole `leaf` (what one device holds with no sharding)."""
    return math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize


def _parts(state) -> dict[str, list[jax.ShapeDtypeStruct]]:
    """Part name -> the state's leaves in it."""
    experts = [leaf for name, leaf in state.params.items() if EXPERT_MARKER in name]
    dense = [leaf for name, leaf in state.params.items() if EXPERT_MARKER not in name]
    return dict(zip(PARTS, (experts, dense, jax.tree.leaves(state.opt_state))))


def train_state_memory(state) -> TrainStateMemory:
    """state: a `TrainState` of sharded `jax.ShapeDtypeStruct`s (`abstract_train_state`) or arrays."""
    by_device: dict = defaultdict(lambda: dict.fromkeys(PARTS, 0))
    unsharded = dict.fromkeys(PARTS, 0)
    for part, leaves in _parts(state).items():
        for leaf in leaves:
            unsharded[part] += leaf_bytes(leaf)
            for device, size in leaf_bytes_by_device(leaf).items():
                by_device[device][part] += size
    busiest = max(by_device.values(), key=lambda parts: sum(parts.values()), default=dict.fromkeys(PARTS, 0))
    return TrainStateMemory(per_device={**busiest, TOTAL: sum(busiest.values())},
                            unsharded={**unsharded, TOTAL: sum(unsharded.values())},
                            num_devices=len(by_device))


def human_bytes(size: int) -> str:
    """1536 -> '1.5 KiB'."""
    if size < 1024:
        return f"{size} B"
    value = float(size)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} TiB"


def _ratio_text(part: int, whole: int) -> str:
    """part / whole as '0.125 = 1/8'; '-' when either is 0."""
    if part == 0 or whole == 0:
        return "-"
    ratio = part / whole
    return f"{ratio:.3f} = 1/{1 / ratio:.3g}"


def offload_split(memory: TrainStateMemory, offload: str | None) -> tuple[int, int]:
    """(device bytes, host bytes) of the busiest device's train state between steps under an `offload` choice
    ("optimizer", "parameters", "all" or None: `make_train_step(offload=)`). Within a step the offloaded state is
    moved onto the device; what that costs at the step's peak only a compile for the device, run on it, shows."""
    from .step_options import offload_memory_kinds

    kinds = offload_memory_kinds(offload) or (None, None)
    parameters = memory.per_device["expert parameters"] + memory.per_device["dense parameters"]
    host = (parameters if kinds[0] else 0) + (memory.per_device["optimizer state"] if kinds[1] else 0)
    return memory.per_device[TOTAL] - host, host


def memory_table(memory: TrainStateMemory, title: str = "train state", offload: str | None = None) -> str:
    """The per-device bytes of each part next to the one-device bytes and their ratio; with `offload`, where they
    sit between steps (`offload_split`)."""
    rows = [("", "per device", "1 device", "ratio")]
    for part in (*PARTS, TOTAL):
        per_device, whole = memory.per_device[part], memory.unsharded[part]
        rows.append((part, human_bytes(per_device), human_bytes(whole), _ratio_text(per_device, whole)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"{title}: bytes on the busiest of {memory.num_devices} device(s) vs all on 1 device"]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        lines.append("  " + "  ".join(cells).rstrip())
    if offload is not None:
        device, host = offload_split(memory, offload)
        lines.append(f"  between steps, offloading {offload}: {human_bytes(device)} on the device, {human_bytes(host)} "
                     "in pinned host memory (per device)")
    return "\n".join(lines)
