"""A printable picture of a layout: which batch, part of each sequence (context parallelism), TP position and
experts every device holds."""

from __future__ import annotations

from ..distributed.config import DistributedConfig
from ..distributed.mesh import DeviceLayout, check_experts_divisible


def check_num_experts(num_experts: int) -> None:
    # 0 divides every ep_size, so without this check the picture shows an empty experts column.
    if num_experts < 1:
        raise ValueError(
            f"num_experts={num_experts}: a MoE layer needs at least one expert; pass the model's experts per "
            "layer (e.g. 8)."
        )


def _format_experts(experts: range) -> str:
    if len(experts) <= 4:
        return " ".join(f"E{e}" for e in experts)
    return f"E{experts.start}-E{experts.stop - 1}"


def _format_group(members: list[int]) -> str:
    return "{" + ",".join(str(m) for m in members) + "}"


def cp_rank(layout: DeviceLayout, rank: int) -> int:
    """A device's position along its context-parallel group (0 .. cp_size - 1): the rank r that holds zig-zag
    chunks r and 2 cp - 1 - r of each sequence (`moe_jax.distributed.context.zigzag_order`)."""
    coordinates = layout.coordinates(rank)
    return coordinates["cp"] * layout.ep_cp_size + coordinates["ep_cp"]


def sequence_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks of 2 cp that cp rank `rank` holds: (rank, 2 cp - 1 - rank)."""
    return rank, 2 * cp - 1 - rank


def layout_rows(config: DistributedConfig, num_experts: int) -> list[dict[str, object]]:
    """One row per device: `device, pp, batch, cp, chunks, cp_group, tp, experts, ep_group, efsdp_group`.

    `cp` is the device's rank along context parallelism and `chunks` the two of the sequence's 2 cp_size chunks
    it holds (with cp_size 1: rank 0, the whole sequence, (0, 1)).

    `experts` are the global ids the device owns whole (with `efsdp_size > 1` it stores a 1/efsdp slice of
    each and gathers them for compute).
    """
    check_num_experts(num_experts)
    check_experts_divisible(num_experts, config.ep_size)
    layout = DeviceLayout.from_config(config)
    ep_groups = layout.device_groups("ep")
    efsdp_groups = layout.device_groups("efsdp")
    group_of = {}
    for name, groups in (("ep", ep_groups), ("efsdp", efsdp_groups), ("cp", layout.device_groups("cp"))):
        for members in groups:
            for rank in members:
                group_of[name, rank] = members
    rows = []
    for rank in range(layout.num_devices):
        rows.append(
            {
                "device": rank,
                "pp": layout.coordinates(rank)["pp"],
                "batch": layout.batch_index(rank),
                "cp": cp_rank(layout, rank),
                "chunks": sequence_chunks(layout.cp_size, cp_rank(layout, rank)),
                "cp_group": group_of["cp", rank],
                "tp": rank % layout.tp_size,
                "experts": layout.experts_of(rank, num_experts),
                "ep_group": group_of["ep", rank],
                "efsdp_group": group_of["efsdp", rank],
            }
        )
    return rows


def count_text(count: int, noun: str) -> str:
    """"1 device", "8 devices": a count with its noun in the right number."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def experts_per_device(config: DistributedConfig, num_experts: int) -> str:
    """How many experts a device runs (the table's column) and, with efsdp_size > 1, how many it stores: the
    parameter table's per-device shape, the rest gathered over its efsdp group to run."""
    runs = num_experts // config.ep_size
    if config.efsdp_size == 1:
        return f"{runs} per device"
    stored = f"{runs // config.efsdp_size}" if runs % config.efsdp_size == 0 else f"1/{config.efsdp_size} of them"
    return f"{runs} run per device; each stores {stored}, gathered over its efsdp group"


def layout_picture(config: DistributedConfig, num_experts: int) -> str:
    """The reference doc's picture of a layout as a table, one line per device."""
    layout = DeviceLayout.from_config(config)
    rows = layout_rows(config, num_experts)
    context = layout.cp_size > 1
    header = (
        f"{count_text(layout.num_devices, 'device')}: tp_size={config.tp_size}, "
        f"fsdp_size={config.fsdp_size}, "
        f"ep_size={config.ep_size}, dp_replicate_size={config.dp_replicate_size}, pp_size={config.pp_size}"
        + (f", cp_size={layout.cp_size} ({config.cp_strategy})" if context else "")
        + f" -> efsdp_size={config.efsdp_size}, dp_size={config.dp_size}, {num_experts} experts "
        f"({experts_per_device(config, num_experts)})"
    )
    columns = (["device"] + (["pp"] if config.pp_size > 1 else []) + ["batch"]
               + (["cp", "sequence chunks", "cp group"] if context else [])
               + ["tp", "experts", "ep group", "efsdp group"])
    table = [columns]
    for row in rows:
        cells = [str(row["device"])]
        if config.pp_size > 1:
            cells.append(str(row["pp"]))
        cells.append(f"B{row['batch']}")
        if context:
            first, last = row["chunks"]
            cells += [str(row["cp"]), f"S{first} S{last}", _format_group(row["cp_group"])]
        cells += [
            str(row["tp"]),
            _format_experts(row["experts"]),
            _format_group(row["ep_group"]),
            _format_group(row["efsdp_group"]),
        ]
        table.append(cells)
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    lines = [header, ""]
    for line in table:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    # Without cp its two axes (both of size 1) are left out: the pictures of layouts without cp read as before.
    mesh_shape = ", ".join(f"{name}={size}" for name, size in layout.axis_sizes.items()
                           if context or name not in ("cp", "ep_cp"))
    lines += ["", f"mesh axes: ({mesh_shape})"]
    lines += context_notes(layout, config)
    return "\n".join(lines)


def context_notes(layout: DeviceLayout, config: DistributedConfig) -> list[str]:
    """What the cp columns mean, and sequence parallelism's split, as lines under the table ([] without either)."""
    notes = []
    if layout.cp_size > 1:
        cp = layout.cp_size
        spanning = (f"; expert groups span {layout.ep_cp_size} cp ranks (their tokens are more tokens of one batch)"
                    if layout.ep_cp_size > 1 else "")
        notes.append(f"sequences: each cut into 2 x cp_size = {2 * cp} chunks S0-S{2 * cp - 1}; cp rank r holds S(r) "
                     f"and S({2 * cp - 1}-r) (zig-zag: every rank the same causal attention work); the sequence "
                     f"length must be a multiple of {2 * cp}; attention by {config.cp_strategy}; parameters "
                     f"replicated over each cp group{spanning}")
    if layout.sequence_parallel and layout.tp_size > 1:
        notes.append(f"sequence parallel: the residual stream, norms and router inputs split over each tp group "
                     f"along the sequence ({layout.tp_size} parts of each device's tokens)")
    return [""] + notes if notes else []
