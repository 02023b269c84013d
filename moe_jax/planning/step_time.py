"""A step's predicted time on a hardware profile, from what the compiled program does (`hlo_costs`).

    time = predict_step_time(costs, profile, compute_dtype="bfloat16", bubble_fraction=0.2, padding_fraction=0.2)
    time.seconds, time.parts     # parts add up to seconds

Each kernel takes the longer of its dots' FLOPs at the peak rate and its bytes at HBM bandwidth (a roofline),
plus the profile's launch overhead: `compute` is the FLOP time, `memory` what memory-bound kernels take beyond
it, `launch overhead` the launches. Each collective takes latency x steps + bytes x (ring factor) / link
bandwidth (alpha-beta), on the intra-node link when each group's devices share a node (rank // devices_per_node)
and on the inter-node one otherwise; its part is named by kind and link. Nothing overlaps: a schedule that hides
collectives behind compute runs faster than this, by at most the collectives' share.

Two parts are carved out of the others, so the parts still add up: `pipeline bubble`, the share
(pp - 1) / (M x repeats + pp - 1) of everything the pipeline loop does (its bubble iterations compute on zeros),
and `dispatch padding`, the share of the all-to-all time spent moving the rows of the dispatch buffers that
carry nothing when routing is balanced (1 - 1 / capacity).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .hardware import HardwareProfile
from .hlo_costs import Collective, ProgramCosts
from .replica_groups import crosses_nodes


def _ring(n: int) -> float:
    return (n - 1) / n


# kind -> (bytes factor, latency steps) of the ring algorithm over n devices, applied to `payload_bytes`.
COLLECTIVE_ALGORITHMS = {
    "all-reduce": lambda n: (2 * _ring(n), 2 * (n - 1)),
    "all-gather": lambda n: (_ring(n), n - 1),
    "reduce-scatter": lambda n: (_ring(n), n - 1),
    "all-to-all": lambda n: (_ring(n), n - 1),
    "collective-permute": lambda n: (1.0, 1),
}
LINK_NAMES = {False: "within a node", True: "across nodes"}


@dataclass(frozen=True)
class StepTime:
    seconds: float
    parts: dict[str, float]
    flops: float                       # per device per step
    hbm_bytes: float
    collective_bytes: dict[str, float]  # payload bytes per part name


def collective_seconds(collective: Collective, profile: HardwareProfile, devices_per_node: int) -> tuple[str, float]:
    """(part name, seconds per step) of one collective."""
    crosses = crosses_nodes([list(group) for group in collective.groups], devices_per_node)
    link = profile.link(crosses)
    factor, steps = COLLECTIVE_ALGORITHMS[collective.kind](collective.group_size)
    seconds = steps * link.latency_seconds + factor * collective.payload_bytes / link.bytes_per_second
    return f"{collective.kind} ({LINK_NAMES[crosses]})", seconds * collective.runs


def predict_step_time(costs: ProgramCosts, profile: HardwareProfile, *, compute_dtype: str,
                      devices_per_node: int | None = None, bubble_fraction: float = 0.0,
                      padding_fraction: float = 0.0) -> StepTime:
    """The step's seconds and their parts on `profile` (see the module docstring)."""
    devices_per_node = devices_per_node or profile.devices_per_node
    rate = profile.flops_per_second(compute_dtype)
    outside: dict[str, float] = defaultdict(float)
    inside: dict[str, float] = defaultdict(float)      # in the pipeline loop: bubble share carved out below
    for kernel in costs.kernels:
        compute = kernel.flops / rate
        memory = kernel.bytes / profile.hbm_bytes_per_second
        parts = inside if kernel.in_pipeline else outside
        parts["compute"] += compute * kernel.runs
        parts["memory"] += max(0.0, memory - compute) * kernel.runs
        parts["launch overhead"] += profile.kernel_overhead_seconds * kernel.runs
    moved: dict[str, float] = defaultdict(float)
    for collective in costs.collectives:
        name, seconds = collective_seconds(collective, profile, devices_per_node)
        (inside if collective.in_pipeline else outside)[name] += seconds
        moved[name] += collective.payload_bytes * collective.runs
    parts = dict(outside)
    parts["pipeline bubble"] = bubble_fraction * sum(inside.values())
    for name, seconds in inside.items():
        parts[name] = parts.get(name, 0.0) + seconds * (1.0 - bubble_fraction)
    padding = 0.0
    for name in [name for name in parts if name.startswith("all-to-all")]:
        padding += parts[name] * padding_fraction
        parts[name] *= 1.0 - padding_fraction
    parts["dispatch padding"] = padding
    parts = {name: seconds for name, seconds in parts.items() if seconds > 0 or name in ("compute", "memory")}
    return StepTime(sum(parts.values()), parts, costs.flops, costs.bytes, dict(moved))
